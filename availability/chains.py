"""Markov-chain availability: the standard heterogeneous on/off chain, and correlated group outages.

Both start in their stationary law, so ``prob(t)`` is the stationary probability for every t, and
both compute rows sequentially from counter-based uniforms (generator ``[seed, tag, t]``), cached,
so a row never depends on which rounds were asked for first.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from .base import DRAWS, GROUP_OUTAGE, ONOFF, PARAMS, Schedule, ScheduleError


class _Chain(Schedule):
    """A schedule whose state at round t follows from its state at t - 1 (rows cached)."""

    def _setup_chain(self, width: int) -> None:
        self._rows = np.zeros((0, width), dtype=bool)

    def _start(self, u: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _step(self, prev: np.ndarray, u: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _state(self, t: int) -> np.ndarray:
        have = len(self._rows)
        if t >= have:
            rows = np.zeros((max(t + 1, 2 * have, 64), self._rows.shape[1]), dtype=bool)
            rows[:have] = self._rows
            for r in range(have, len(rows)):
                u = self._rng(self.tag, r).random(rows.shape[1])
                rows[r] = self._start(u) if r == 0 else self._step(rows[r - 1], u)
            self._rows = rows
        return self._rows[t]

    tag: ClassVar[int] = 0


class OnOff(_Chain):
    """[on-off:p=0.8,q=0.2,spread=0.1] The two-state on/off Markov chain per client, heterogeneous
    across clients, as in Rodio et al., "Federated Learning under Heterogeneous and Correlated
    Client Availability" (IEEE INFOCOM 2023, arXiv:2301.04632, Sec. III: each client's
    availability is a Markov chain): P(on -> on) = p_i, P(off -> on) = q_i, so the stationary
    probability of being on is pi_i = q_i / (q_i + 1 - p_i) and the mean on-spell is 1/(1 - p_i)
    rounds. p_i ~ U(p - spread, p + spread) and q_i ~ U(q - spread, q + spread), clipped to [0, 1],
    drawn once per seed (the uniform spread is ours). A(i, 0) ~ Bernoulli(pi_i): the chain starts
    in its stationary law, so prob(t) = pi_i for every t."""

    name = "on-off"
    defaults: ClassVar[dict[str, Any]] = {"p": 0.8, "q": 0.2, "spread": 0.1}
    tag = ONOFF

    def _setup(self, **_):
        p, q = self._check("p", 0.0, 1.0), self._check("q", 0.0, 1.0)
        spread = self._check("spread", 0.0, 1.0)
        rng = self._rng(PARAMS)
        self.p_stay = np.clip(rng.uniform(p - spread, p + spread, self.num_clients), 0.0, 1.0)
        self.q_join = np.clip(rng.uniform(q - spread, q + spread, self.num_clients), 0.0, 1.0)
        stuck = np.flatnonzero(self.q_join + 1.0 - self.p_stay <= 0.0)
        if stuck.size:
            raise ScheduleError(f"availability model 'on-off': client {int(stuck[0])} has p_i = 1 and q_i = 0 "
                                "(never leaves, never joins: no stationary law); lower p or raise q")
        self.base = self.q_join / (self.q_join + 1.0 - self.p_stay)
        self._setup_chain(self.num_clients)

    def _start(self, u):
        return u < self.base

    def _step(self, prev, u):
        return np.where(prev, u < self.p_stay, u < self.q_join)

    def _prob(self, t):
        return self.base

    def _available(self, t):
        return self._state(t)

    def describe(self):
        return {**super().describe(), "p_stay": self.p_stay.tolist(), "q_join": self.q_join.tolist()}


class GroupDropout(_Chain):
    """[group-dropout:groups=5,fail=0.1,recover=0.5,p=1.0,use-clusters=false] Correlated dropout:
    clients in one group (a region, a time zone, a cell) leave and come back together. Clients
    0..N-1 form `groups` contiguous groups (sizes differ by at most one), or, with use-clusters=true,
    the workload's clusters. Each group is up or down by its own two-state chain, P(up -> down) =
    fail, P(down -> up) = recover, started in its stationary law (up with probability
    recover / (fail + recover)); a client is online when its group is up and its own coin
    (Bernoulli(p), generator [seed, DRAWS, t]) says so. prob(t) = p * recover / (fail + recover).
    Groups of clients available together follow the block-cyclic model of Eichner et al.,
    "Semi-Cyclic Stochastic Gradient Descent" (ICML 2019, Sec. 2: blocks of clients by time zone);
    the random outage chain per group is ours."""

    name = "group-dropout"
    defaults: ClassVar[dict[str, Any]] = {"groups": 5, "fail": 0.1, "recover": 0.5, "p": 1.0,
                                          "use_clusters": False}
    tag = GROUP_OUTAGE

    @classmethod
    def needs(cls, params: dict[str, Any]) -> frozenset[str]:
        return frozenset({"clusters"}) if params["use_clusters"] else frozenset()

    def _setup(self, *, clusters, **_):
        fail, recover = self._check("fail", 0.0, 1.0), self._check("recover", 0.0, 1.0)
        if fail + recover <= 0:
            raise ScheduleError("availability model 'group-dropout': fail + recover must be > 0")
        self._check("p", 0.0, 1.0)
        if self.params["use_clusters"]:
            cl = None if clusters is None else np.asarray(clusters)
            if cl is None or cl.shape != (self.num_clients,) or not np.issubdtype(cl.dtype, np.integer):
                raise ScheduleError(f"availability model 'group-dropout' with use-clusters=true needs the "
                                    f"workload's clusters, an integer array ({self.num_clients},)")
            _, self.group = np.unique(cl, return_inverse=True)
        else:
            groups = self._check("groups", 1, self.num_clients)
            self.group = np.arange(self.num_clients) * groups // self.num_clients
        self.up_prob = recover / (fail + recover)
        self.base = np.full(self.num_clients, self.params["p"] * self.up_prob)
        self._setup_chain(int(self.group.max()) + 1)

    def _start(self, u):
        return u < self.up_prob

    def _step(self, prev, u):
        return np.where(prev, u >= self.params["fail"], u < self.params["recover"])

    def _prob(self, t):
        return self.base

    def _available(self, t):
        coins = self._rng(DRAWS, t).random(self.num_clients) < self.params["p"]
        return self._state(t)[self.group] & coins

    def describe(self):
        return {**super().describe(), "group": self.group.tolist()}
