"""Recipe: an availability model. A Schedule subclass with a name, its defaults and its citation;
its own random streams use the tags reserved for extensions (availability.base.EXTENSION_TAGS)."""

import math
from typing import Any, ClassVar

import numpy as np

from availability import BernoulliSchedule
from availability.base import EXTENSION_TAGS

PHASES = EXTENSION_TAGS[0]  # this package's one random stream


class Diurnal(BernoulliSchedule):
    """[diurnal:p=0.8,period=24,depth=0.6] Day and night: p_i(t) = p (1 - depth (1 + cos(2 pi (t /
    period + phi_i))) / 2), a random phase phi_i ~ U(0, 1) per client (its time zone)."""

    name = "diurnal"
    defaults: ClassVar[dict[str, Any]] = {"p": 0.8, "period": 24, "depth": 0.6}

    def _setup(self, **_):
        self._check("p", 0.0, 1.0)
        self._check("period", 1)
        self._check("depth", 0.0, 1.0)
        self.phase = self._rng(PHASES).random(self.num_clients)
        self.base = np.full(self.num_clients, self.params["p"])

    def _prob(self, t):
        wave = (1 + np.cos(2 * math.pi * (t / self.params["period"] + self.phase))) / 2
        return self.base * (1 - self.params["depth"] * wave)
