"""Parametric availability models (spec name in brackets; parameters with their defaults).

Every model is a pure function of (spec, seed, label_dists/clusters, client, round); see base.py
for the counter-based randomness and the meaning of ``prob(t)``.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, cast

import numpy as np

from .base import (
    DROPOUT,
    MARKOV,
    PARAMS,
    PHASE,
    BernoulliSchedule,
    Schedule,
    ScheduleError,
    check_label_dists,
)


class Always(BernoulliSchedule):
    """[always] Every client in every round (full participation)."""

    name = "always"

    def _setup(self, **_):
        self.base = np.ones(self.num_clients)

    def _prob(self, t):
        return self.base


class Bernoulli(BernoulliSchedule):
    """[bernoulli:p=0.5] Homogeneous, stationary A(i, t) ~ Bernoulli(p)."""

    name = "bernoulli"
    defaults: ClassVar[dict[str, Any]] = {"p": 0.5}

    def _setup(self, **_):
        self.base = np.full(self.num_clients, self._check("p", 0.0, 1.0))

    def _prob(self, t):
        return self.base


# ------------------------------------------------------------------------------------------------
# FedAWE family (Xiang et al., "Efficient Federated Learning against Heterogeneous and
# Non-stationary Client Unavailability", NeurIPS 2024, Sec. 5 and App. on the unavailability
# dynamics; official code util/util.py `data_participation_each_node(_per_round)`).
# ------------------------------------------------------------------------------------------------
class _FedAWE(BernoulliSchedule):
    """p_i = <nu_i, phi>, phi_c ~ U(0, 1) for the first C//2 classes and U(0, 0.5) for the other
    C - C//2 (the official code draws C//2 of each, i.e. assumes C even), drawn once per seed.
    A(i, t) ~ Bernoulli(clip(p_i f(t), 0, 1)); subclasses define the modulation f(t)."""

    inputs: ClassVar[frozenset[str]] = frozenset({"label_dists"})

    def _setup(self, *, label_dists, **_):
        nu = check_label_dists(self.name, label_dists, self.num_clients)
        c = nu.shape[1]
        rng = self._rng(PARAMS)
        phi = np.concatenate([rng.uniform(0.0, 1.0, c // 2), rng.uniform(0.0, 0.5, c - c // 2)])
        self.phi = phi
        self.base = nu @ phi
        self._validate()

    def _validate(self) -> None:
        """Check the modulation's parameters."""

    def f(self, t: int) -> float:
        return 1.0

    def _prob(self, t):
        return np.clip(self.base * self.f(t), 0.0, 1.0)


class Stationary(_FedAWE):
    """[stationary] FedAWE's stationary dynamics: f(t) = 1."""

    name = "stationary"


class Staircase(_FedAWE):
    """[staircase:period=20,low=0.4] FedAWE's staircase: f(t) = 1 for t mod P < P/2, else `low`
    (the paper's code: 0.4 on odd blocks of 10 rounds)."""

    name = "staircase"
    defaults: ClassVar[dict[str, Any]] = {"period": 20, "low": 0.4}

    def _validate(self):
        self._check("period", 1)
        self._check("low", 0.0, 1.0)

    def f(self, t):
        p = self.params["period"]
        return 1.0 if t % p < p / 2 else self.params["low"]


class Sine(_FedAWE):
    """[sine:gamma=0.3,period=20] FedAWE's sine: f(t) = gamma sin(2 pi t / P) + 1 - gamma
    (gamma = 0.3 in the main table, 0.2 and 0.1 in the ablations)."""

    name = "sine"
    defaults: ClassVar[dict[str, Any]] = {"gamma": 0.3, "period": 20}

    def _validate(self):
        self._check("gamma", 0.0, 1.0)
        self._check("period", 1)

    def f(self, t):
        g = self.params["gamma"]
        return g * math.sin(2 * math.pi * t / self.params["period"]) + 1.0 - g


class InterleavedSine(Sine):
    """[interleaved-sine:gamma=0.3,period=20,floor=0.1] FedAWE's interleaved sine:
    p_i(t) = p_i g(t) if p_i g(t) >= floor else 0, g the sine modulation above, so clients with a
    small p_i drop out entirely in the troughs."""

    name = "interleaved-sine"
    defaults: ClassVar[dict[str, Any]] = {"gamma": 0.3, "period": 20, "floor": 0.1}

    def _validate(self):
        super()._validate()
        self._check("floor", 0.0, 1.0)

    def _prob(self, t):
        p = super()._prob(t)
        return np.where(p >= self.params["floor"], p, 0.0)


# ------------------------------------------------------------------------------------------------
# FedAU family (Wang & Ji, "A Lightweight Method for Tackling Unknown Participation Statistics in
# Federated Averaging", ICML 2024, experiments and appendix on participation patterns; official
# code util/util.py `WorkerSampler`, `data_participation_each_node`).
# ------------------------------------------------------------------------------------------------
class _FedAU(Schedule):
    """p_i = min(1, max(pmin, pbar C <nu_i, phi>)), phi ~ Dirichlet(0.1 1_C) drawn once per seed
    (the cap at 1 is ours; with C = 10 and pbar = 0.1 it never binds)."""

    defaults: ClassVar[dict[str, Any]] = {"pbar": 0.1, "pmin": 0.02}

    inputs: ClassVar[frozenset[str]] = frozenset({"label_dists"})

    def _setup(self, *, label_dists, **_):
        nu = check_label_dists(self.name, label_dists, self.num_clients)
        pbar = self._check("pbar", 0.0, 1.0, lo_open=True)
        pmin = self._check("pmin", 0.0, 1.0)
        self.phi = self._rng(PARAMS).dirichlet(np.full(nu.shape[1], 0.1))
        self.base = np.clip(pbar * nu.shape[1] * (nu @ self.phi), pmin, 1.0)

    def _prob(self, t):
        return self.base


class FedAUBernoulli(_FedAU, BernoulliSchedule):
    """[fedau-bernoulli:pbar=0.1,pmin=0.02] FedAU's Bernoulli pattern: A(i, t) ~ Bernoulli(p_i)."""

    name = "fedau-bernoulli"


class Markov(_FedAU):
    """[markov:q=0.05,pbar=0.1,pmin=0.02] FedAU's Markov pattern: a two-state chain per client with
    P(off -> on) = q, P(on -> off) = q (1/p_i - 1), both divided by the larger when it exceeds 1
    (which keeps the stationary law p_i); A(i, 0) ~ Bernoulli(p_i). As the chain starts in its
    stationary law, prob(t) = p_i exactly for every t. Rows come from a cached, sequentially
    computed chain driven by the uniforms of generator [seed, MARKOV, t]."""

    name = "markov"
    defaults: ClassVar[dict[str, Any]] = {"q": 0.05, **_FedAU.defaults}

    def _setup(self, **kw):
        super()._setup(**kw)
        q = self._check("q", 0.0, 1.0, lo_open=True)
        off = q * (1.0 / np.maximum(self.base, 1e-300) - 1.0)
        scale = np.maximum(1.0, off)  # q <= 1, so only P(on -> off) can exceed 1
        self.p_on, self.p_off = q / scale, off / scale
        self._rows = np.zeros((0, self.num_clients), dtype=bool)

    def _extend(self, n: int) -> None:
        have = len(self._rows)
        if n <= have:
            return
        rows = np.zeros((max(n, 2 * have, 64), self.num_clients), dtype=bool)
        rows[:have] = self._rows
        for t in range(have, len(rows)):
            u = self._rng(MARKOV, t).random(self.num_clients)
            rows[t] = u < cast(np.ndarray, self.base) if t == 0 else np.where(rows[t - 1], u >= self.p_off, u < self.p_on)
        self._rows = rows

    def _available(self, t):
        self._extend(t + 1)
        return self._rows[t]

    def matrix(self, num_rounds):
        self._extend(int(num_rounds))
        return super().matrix(num_rounds)


class Cyclic(_FedAU):
    """[cyclic:c=100,pbar=0.1,pmin=0.02] FedAU's cyclic pattern: client i is on for
    k_i = max(1, round(c p_i)) consecutive rounds, then off for max(1, c - k_i) (as the official
    code; the cycle is c long unless k_i = c), with a uniformly random phase per client drawn once
    per seed. round() is numpy's (half to even), as the official code. prob(t) = k_i / cycle_i, the
    marginal over the random phase (the fraction of rounds the client is on), not the 0/1 indicator."""

    name = "cyclic"
    defaults: ClassVar[dict[str, Any]] = {"c": 100, **_FedAU.defaults}

    def _setup(self, **kw):
        super()._setup(**kw)
        c = self._check("c", 2)
        self.on_rounds = np.maximum(1, np.round(c * self.base)).astype(np.int64)
        self.cycle = self.on_rounds + np.maximum(1, c - self.on_rounds)
        self.phase = self._rng(PHASE).integers(0, self.cycle)

    def _prob(self, t):
        return self.on_rounds / self.cycle

    def _available(self, t):
        return (t + self.phase) % self.cycle < self.on_rounds

    def describe(self):
        return {**super().describe(), "on_rounds": self.on_rounds.tolist(),
                "cycle": self.cycle.tolist(), "phase": self.phase.tolist()}


# ------------------------------------------------------------------------------------------------
class GroupCyclic(BernoulliSchedule):
    """[group-cyclic:groups=5,window=10,sample=1.0] Cyclic client participation (Cho et al., "On the
    Convergence of Federated Averaging with Cyclic Client Participation", ICML 2023, problem setup):
    clients 0..N-1 form `groups` contiguous groups (sizes differ by at most one); group
    (t // window) mod groups is available, each of its clients with probability `sample`
    (1 = the whole group). prob(t) = sample for the current group's clients, 0 for the others.
    The defaults of groups and window are ours."""

    name = "group-cyclic"
    defaults: ClassVar[dict[str, Any]] = {"groups": 5, "window": 10, "sample": 1.0}

    def _setup(self, **_):
        groups = self._check("groups", 1, self.num_clients)
        self._check("window", 1)
        self._check("sample", 0.0, 1.0)
        self.group = np.arange(self.num_clients) * groups // self.num_clients

    def _prob(self, t):
        on = self.group == (t // self.params["window"]) % self.params["groups"]
        return on * self.params["sample"]

    def describe(self):
        return {**super().describe(), "group": self.group.tolist()}


class Dropout(Schedule):
    """[dropout:alpha=0.3,keep-per-cluster=false] Bounded dropout of FL-FDMS (Wang & Xu, "Friend
    discovery and model substitution", Sec. on experiments): each round exactly
    d = floor(alpha N + 1/2) clients drop, uniformly at random. With keep_per_cluster=true (the
    authors' sampler; needs `clusters`), one uniformly chosen client of every cluster is kept and
    the d dropped clients are drawn uniformly from the rest. prob(t) is the exact marginal:
    1 - d/N, or 1/m + (1 - 1/m)(1 - d/(N - K)) for a client of a cluster of size m, K clusters."""

    name = "dropout"
    defaults: ClassVar[dict[str, Any]] = {"alpha": 0.3, "keep_per_cluster": False}

    @classmethod
    def needs(cls, params: dict[str, Any]) -> frozenset[str]:
        return frozenset({"clusters"}) if params["keep_per_cluster"] else frozenset()

    def _setup(self, *, clusters, **_):
        n = self.num_clients
        self.num_drop = math.floor(self._check("alpha", 0.0, 1.0, hi_open=True) * n + 0.5)
        self.clusters = None
        if self.params["keep_per_cluster"]:
            if clusters is None:
                raise ScheduleError("availability model 'dropout' with keep_per_cluster=true needs "
                                    "`clusters`, an integer array (N,) of cluster ids; none given")
            cl = np.asarray(clusters)
            if cl.shape != (n,) or not np.issubdtype(cl.dtype, np.integer):
                raise ScheduleError(f"availability model 'dropout': clusters must be an integer "
                                    f"array of shape ({n},); got {cl.dtype} {cl.shape}")
            _, self.clusters, sizes = np.unique(cl, return_inverse=True, return_counts=True)
            free = n - len(sizes)
            if self.num_drop > free:
                raise ScheduleError(f"availability model 'dropout': alpha={self.params['alpha']} "
                                    f"drops {self.num_drop} clients but keeping one per cluster "
                                    f"leaves only {free} droppable; lower alpha")
            m = sizes[self.clusters].astype(np.float64)
            stay = 1.0 - self.num_drop / free if free else 1.0
            self.base = 1.0 / m + (1.0 - 1.0 / m) * stay
        else:
            self.base = np.full(n, 1.0 - self.num_drop / n)

    def _prob(self, t):
        return self.base

    def _available(self, t):
        rng = self._rng(DROPOUT, t)
        out = np.ones(self.num_clients, dtype=bool)
        if self.clusters is None:
            candidates = np.arange(self.num_clients)
        else:
            u = rng.random(self.num_clients)
            order = np.lexsort((u, self.clusters))  # by cluster, then by u
            first = np.r_[True, self.clusters[order][1:] != self.clusters[order][:-1]]
            candidates = np.sort(order[~first])  # everyone but each cluster's smallest u
        out[rng.permutation(candidates)[: self.num_drop]] = False
        return out


# ------------------------------------------------------------------------------------------------
# FLGo (Wang et al., "FLGo: A Fully Customizable Federated Learning Platform", simulator
# `lognormal_client_availability` / `sin_lognormal_client_availability`, after Ribero et al.,
# arXiv:2205.06730). FLGo's beta maps to sigma = -ln(1 - beta); the default is beta = 0.1.
# ------------------------------------------------------------------------------------------------
class LogNormal(BernoulliSchedule):
    """[ln:sigma=0.10536] LN: c_i ~ LogNormal(0, sigma), p_i = c_i / max_j c_j; Bernoulli(p_i)."""

    name = "ln"
    defaults: ClassVar[dict[str, Any]] = {"sigma": round(-math.log(0.9), 5)}

    def _setup(self, **_):
        c = self._rng(PARAMS).lognormal(0.0, self._check("sigma", 0.0), self.num_clients)
        self.base = c / c.max()
        self._validate()

    def _validate(self) -> None:
        """Extra parameters of subclasses."""

    def _prob(self, t):
        return self.base


class SineLogNormal(LogNormal):
    """[sln:sigma=0.10536,period=24] SLN: p_i(t) = p_i (0.4 sin(2 pi (t mod P)/(P - 1)) + 0.5), the
    LN rates times FLGo's sine (FLGo takes np.linspace(0, 2 pi, P), endpoint included, hence P - 1;
    its docstring's (1 + t mod P)/P form is not what the code does)."""

    name = "sln"
    defaults: ClassVar[dict[str, Any]] = {**LogNormal.defaults, "period": 24}

    def _validate(self):
        self._check("period", 2)

    def _prob(self, t):
        p = self.params["period"]
        return self.base * (0.4 * math.sin(2 * math.pi * (t % p) / (p - 1)) + 0.5)
