"""The schedule contract shared by every availability model.

A schedule answers "is client i online in round t?" as a pure function of (spec, seed, client,
round) plus the static inputs it was built from (label distributions, clusters, trace files).
Randomness is counter-based: every random draw comes from ``np.random.default_rng([seed, tag,
counter])``, so a row never depends on which other rounds were queried, in which order, or in
which process. Rounds ``t`` are 0-based (Flower's ``server-round`` is ``t + 1``).

``prob(t)`` is the marginal probability P(A(i, t) = 1) over the schedule's own randomness (per-round
coins, random phases, Markov chain paths, dropout draws), given the per-client base rates drawn
once per seed. That is what the known-p oracle divides by; for deterministic models it is the 0/1
indicator itself.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from .spec import Spec, SpecError, parse_spec

# Stream tags of the counter-based generators (never reuse one for two purposes). The project's
# own models use tags below 1000; EXTENSION_TAGS is reserved for the user's models (docs/extending.md),
# so a model from outside never shares a stream with a built-in one.
DRAWS, PARAMS, PHASE, MARKOV, DROPOUT, ONOFF, GROUP_OUTAGE = 1, 2, 3, 4, 5, 6, 7
BUILTIN_TAGS = (DRAWS, PARAMS, PHASE, MARKOV, DROPOUT, ONOFF, GROUP_OUTAGE)
EXTENSION_TAGS = range(1000, 2000)


class ScheduleError(SpecError):
    """An availability spec, parameter or input that does not fit the model it names."""


def check_range(model: str, key: str, value: float, lo: float | None = None,
                hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False) -> None:
    """Raise ScheduleError naming the parameter, its value and the allowed interval."""
    bad = (not math.isfinite(value)
           or (lo is not None and (value <= lo if lo_open else value < lo))
           or (hi is not None and (value >= hi if hi_open else value > hi)))
    if bad:
        left = "-inf" if lo is None else f"{lo:g}"
        right = "inf" if hi is None else f"{hi:g}"
        interval = f"{'(' if lo_open or lo is None else '['}{left}, {right}{')' if hi_open or hi is None else ']'}"
        raise ScheduleError(f"availability model '{model}': parameter '{key}' = {value!r} is out "
                            f"of range; allowed {interval}")


def check_label_dists(model: str, label_dists: Any, num_clients: int) -> np.ndarray:
    """Validate client label distributions: shape (N, C), non-negative rows summing to 1."""
    if label_dists is None:
        raise ScheduleError(f"availability model '{model}' needs the clients' label distributions "
                            "(label_dists, an N x C array whose rows sum to 1); none were given")
    nu = np.asarray(label_dists, dtype=np.float64)
    if nu.ndim != 2 or nu.shape[0] != num_clients or nu.shape[1] < 1:
        raise ScheduleError(f"availability model '{model}': label_dists must have shape "
                            f"({num_clients}, num_classes); got {nu.shape}")
    if not np.all(np.isfinite(nu)) or np.any(nu < 0):
        raise ScheduleError(f"availability model '{model}': label_dists must be finite and >= 0")
    sums = nu.sum(axis=1)
    bad = np.flatnonzero(np.abs(sums - 1.0) > 1e-6)
    if bad.size:
        raise ScheduleError(f"availability model '{model}': label_dists rows must sum to 1; "
                            f"row {int(bad[0])} sums to {sums[bad[0]]:.6g}")
    return nu


class Schedule:
    """Base class: parses and validates the spec, checks rounds, derives rows and matrices.

    Subclasses set ``name`` and ``defaults`` (parameter -> default, whose type is enforced),
    validate in ``_setup`` and implement ``_prob(t)`` and ``_available(t)`` for a checked round.
    ``base`` holds the per-client base rate p_i where the model has one (reported by describe()).
    """

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}
    #: What the model is built from besides its spec: ``"label_dists"`` and/or ``"clusters"``.
    inputs: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def needs(cls, params: dict[str, Any]) -> frozenset[str]:
        """The inputs a schedule with these (checked) parameters needs; see ``inputs``."""
        return cls.inputs

    def __init__(self, spec: str | Spec, num_clients: int, seed: int, *,
                 label_dists: np.ndarray | None = None, clusters: np.ndarray | None = None):
        try:
            parsed = spec if isinstance(spec, Spec) else parse_spec(spec)
            if parsed.name != self.name:
                raise ScheduleError(f"spec {str(spec)!r} names '{parsed.name}', not '{self.name}'")
            self.params: dict[str, Any] = parsed.take(self.defaults, what="availability model")
        except ScheduleError:
            raise
        except SpecError as err:
            raise ScheduleError(str(err)) from err
        if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) \
                or num_clients < 1:
            raise ScheduleError(f"num_clients must be an integer >= 1; got {num_clients!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ScheduleError(f"seed must be an integer >= 0; got {seed!r}")
        self.spec = str(spec).strip() if not isinstance(spec, Spec) else str(spec)
        self.num_clients = int(num_clients)
        self.seed = int(seed)
        self.base: np.ndarray | None = None
        self._setup(label_dists=label_dists, clusters=clusters)

    # -- to override ---------------------------------------------------------------------------
    def _setup(self, *, label_dists: np.ndarray | None, clusters: np.ndarray | None) -> None:
        """Validate parameters and draw the per-seed quantities."""

    def _prob(self, t: int) -> np.ndarray:
        raise NotImplementedError

    def _available(self, t: int) -> np.ndarray:
        raise NotImplementedError

    # -- public API ------------------------------------------------------------------------------
    def prob(self, t: int) -> np.ndarray:
        """p_i(t) = P(A(i, t) = 1) for every client: float64, shape (N,), in [0, 1]."""
        return np.array(self._prob(self._round(t)), dtype=np.float64)

    def available(self, t: int) -> np.ndarray:
        """A(i, t) for every client: bool, shape (N,)."""
        return np.array(self._available(self._round(t)), dtype=bool)

    def is_available(self, client: int, t: int) -> bool:
        if not 0 <= int(client) < self.num_clients:
            raise ScheduleError(f"client {client!r} out of range [0, {self.num_clients})")
        return bool(self.available(t)[int(client)])

    def matrix(self, num_rounds: int) -> np.ndarray:
        """The realised 0/1 matrix: bool, shape (num_rounds, N), row t = available(t)."""
        if int(num_rounds) < 0:
            raise ScheduleError(f"num_rounds must be >= 0; got {num_rounds!r}")
        out = np.zeros((int(num_rounds), self.num_clients), dtype=bool)
        for t in range(int(num_rounds)):
            out[t] = self._available(t)
        return out

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: spec, resolved parameters, seed, N, per-client base p_i (or None)."""
        return {"spec": self.spec, "name": self.name, "params": dict(self.params),
                "seed": self.seed, "num_clients": self.num_clients,
                "base_prob": None if self.base is None else [float(p) for p in self.base]}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, num_clients={self.num_clients}, seed={self.seed})"

    # -- helpers -----------------------------------------------------------------------------------
    def _round(self, t: int) -> int:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
            raise ScheduleError(f"round must be an integer >= 0; got {t!r}")
        return int(t)

    def _rng(self, tag: int, *counter: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, tag, *counter])

    def _check(self, key: str, lo: float | None = None, hi: float | None = None, **kw: bool) -> Any:
        check_range(self.name, key, self.params[key], lo, hi, **kw)
        return self.params[key]


class BernoulliSchedule(Schedule):
    """Independent coins: A(i, t) ~ Bernoulli(p_i(t)) across clients and rounds.

    Subclasses define only ``_prob(t)``. The coin of (i, t) is uniform number i of the generator
    ``[seed, DRAWS, t]``, so models built on the same seed share their coins (common random
    numbers: under two such models a client is online in round t under the one with the larger
p_i(t) whenever it is under the other).
    """

    def _available(self, t: int) -> np.ndarray:
        return self._rng(DRAWS, t).random(self.num_clients) < self._prob(t)
