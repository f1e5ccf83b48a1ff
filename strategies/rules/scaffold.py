"""SCAFFOLD and Amplified SCAFFOLD: control variates against client drift, the clients' c_i with them.

SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, "SCAFFOLD: Stochastic Controlled
Averaging for Federated Learning", ICML 2020, Alg. 1). Server state: x and c (zero at start);
client i keeps c_i (``client_app.scaffold``). In round t each client of A_t runs K local steps
y ← y − η_l (g_i(y) − c_i + c) from x, replies Δy_i = y_i − x and Δc_i = c_i^+ − c_i (option II),
and the server applies

    x ← x + η_g (1/|A_t|) Σ_{i∈A_t} Δy_i,        c ← c + (1/N) Σ_{i∈A_t} Δc_i.

Amplified SCAFFOLD (Crawshaw and Liu, "Federated Learning under Periodic Client Participation and
Heterogeneous Data: A New Communication-Efficient Algorithm and Analysis", NeurIPS 2024, Alg. 1;
code MingruiLiu-ML-Lab/FL-under-Periodic-Participation, ``synthetic/train.py``): SCAFFOLD with
local steps η_l/γ, and within a participation period of P rounds starting at x_r

    x ← (1/|A_t|) Σ_{i∈A_t} y_i each round;  at the period's end x_{r+1} = x_r + γ (x − x_r),

and the control variates refreshed once per period (c_i = the mean raw local gradient of the
client's steps in the period; c ← c + (1/N) Σ_i Δc_i at the period's end, the sum of the changes
the clients replied during the period). Paper vs. code: the paper's Alg. 1 samples the period's
control-variate gradients at x_r separately; the code (and this module) uses the local steps'
own gradients of the period (no extra gradient evaluations), which is what its experiments ran.

The train message carries c next to the model (keys ``scaffold.c.<key>``); the reply carries
Δc_i (``scaffold.dc.<key>``), checked like the model's arrays and bounded by the same sanity
bounds (``max-update-norm``, ``max-norm-ratio``) with its own per-node reference. And c_i itself
is bounded (docs/threat-model.md, "SCAFFOLD's control variates"): honestly c_i^+ is a mean
gradient of client i, so ‖c_i^+‖ ≤ ``max-norm-ratio`` × the lower median over nodes of their
first ‖c_j^+‖ × the model reference's growth min(latest / first, ``max-reference-growth``)
(:meth:`strategies.bounds.NormBounds.growth`: honest gradients scale with honest updates; not
the nodes' latest ‖c_j^+‖: c drags every honest step, so the honest gradients grow until they
cancel an attacker's share c_i/N, and a reference that follows them uncapped follows the
attacker; no widening by work or absence: a mean gradient grows with neither). The server does not hold c_i (O(N d)); it holds a
secret CountSketch S c_i of k = :data:`SKETCH_SIZE` numbers per client (Charikar, Chen and
Farach-Colton, "Finding frequent items in data streams", ICALP 2002: E‖S v‖² = ‖v‖², a relative
standard deviation ≤ √(2/k) of ‖S v‖² for any v not chosen knowing S), the sum of the client's
applied Δc_i, and judges ‖S (c_i + Δc_i)‖. Without it an attacker's c_i, and with it c = (1/N)
Σ c_i, grows by its Δc bound every round (an adaptive attacker, 1 of 8: 2.4e4 m over 30 rounds,
``tests/test_scaffold_channel.py``); with it, its share of c stays ≤ R G/N × the nodes' first
‖c_j^+‖ (46.1 m over 30 rounds).
Server memory: x, c (and for Amplified SCAFFOLD x_r and the period's sum of Δc): O(d), plus k
numbers per client and the sketch's hash (O(d) integers, from ``sketch-seed``: keep it private).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import scipy.sparse

from ..base import AvailabilityStrategy, ClientReport
from ..bounds import NormBounds
from ..protocol import (
    ACCEPTED_ROUND,
    AMPLIFIED_SCAFFOLD_RULE,
    FEDAWE_RUN_KEY_PATTERN as RUN_KEY_PATTERN,
    SCAFFOLD_C_PREFIX,
    SCAFFOLD_DC_PREFIX,
    SCAFFOLD_GAMMA,
    SCAFFOLD_META_PREFIX,
    SCAFFOLD_PERIOD,
    SCAFFOLD_RULE,
    SCAFFOLD_RUN_KEY,
)
from ..rule import Payload
from ..state import kept_as
from ..streaming import Fold, RunningSum, example_weight, step

SKETCH_SIZE = 256  # k: numbers kept per client for ‖c_i‖ (‖S v‖² within ≈ 9 % of ‖v‖², one s.d.)


def amplify(x: np.ndarray, anchor: np.ndarray, gamma: float) -> np.ndarray:
    """Amplified SCAFFOLD's period end: x_r + γ (x − x_r), float64."""
    anchor = np.asarray(anchor, np.float64)
    return anchor + gamma * (np.asarray(x, np.float64) - anchor)


class VariateSketch:
    """A CountSketch S of each client's c_i (the sum of its applied Δc_i): k numbers per client,
    ‖S c_i‖ ≈ ‖c_i‖ (the module docstring). S maps coordinate j to bucket h(j) with sign s(j),
    both drawn from ``seed`` (the strategy's ``sketch-seed``; None, the default: a fresh secret one
    from :mod:`secrets`, since a client that knew S could hide c_i in its kernel); S v = Σ_j s(j) v_j
    e_{h(j)}, O(d)."""

    def __init__(self, seed: int | None = None, rows: dict[int, np.ndarray] | None = None) -> None:
        self.seed = secrets.randbits(63) if seed is None else int(seed)
        self.rows: dict[int, np.ndarray] = dict(rows or {})
        self._matrix: scipy.sparse.csc_matrix | None = None
        self._judged: dict[Any, np.ndarray] = {}  # S Δc_i of this round's judged replies

    def project(self, v: np.ndarray) -> np.ndarray:
        """S v (float64, k numbers). S is held as a sparse k × d matrix in column form (one ±1 per
        coordinate, in the row of its bucket): one sequential read of v, float32 products for a
        float32 v (each bucket's sum of about d/k terms in float32: a relative error ~1e-5 on a
        norm bound), 2.8 × faster than ``np.bincount`` at d = 10^6 (1.0 against 2.8 ms)."""
        v = np.ravel(v)
        if self._matrix is None or self._matrix.shape[1] != v.size:
            rng = np.random.default_rng(self.seed)
            buckets, signs = rng.integers(0, SKETCH_SIZE, v.size), rng.integers(0, 2, v.size) * 2.0 - 1.0
            self._matrix = scipy.sparse.csc_matrix(
                (signs.astype(np.float32), buckets.astype(np.int32), np.arange(v.size + 1, dtype=np.int64)),
                shape=(SKETCH_SIZE, v.size))
        if v.dtype != np.float32:
            v = v.astype(np.float64, copy=False)
        return np.asarray(self._matrix @ v, dtype=np.float64)

    def norm_after(self, client: int, dc: np.ndarray | None, key: Any = None) -> float:
        """‖S (c_i + Δc_i)‖: the client's control variate if this Δc_i is applied; ``key``: S Δc_i
        is kept under it for :meth:`add` (one O(d) projection per reply)."""
        row = self.rows.get(client, np.zeros(SKETCH_SIZE))
        if dc is None:
            return float(np.linalg.norm(row))
        sketch = self.project(dc)
        if key is not None:
            self._judged[key] = sketch
        return float(np.linalg.norm(row + sketch))

    def add(self, client: int, dc: np.ndarray, key: Any = None) -> None:
        """Δc_i applied: S c_i ← S c_i + S Δc_i (kept under ``key`` when it was judged)."""
        sketch = self._judged.pop(key, None) if key is not None else None
        self.rows[client] = self.rows.get(client, np.zeros(SKETCH_SIZE)) + (self.project(dc) if sketch is None else sketch)

    def forget_judged(self) -> None:
        """Drop the projections of replies judged and not applied (a round's end)."""
        self._judged = {}

    def state(self) -> dict[str, Any]:
        return {"seed": self.seed, "rows": {c: r.copy() for c, r in self.rows.items()}}

    @classmethod
    def of(cls, state: dict[str, Any] | None) -> VariateSketch:
        return cls() if not state else cls(state["seed"], {int(c): np.asarray(r, np.float64) for c, r in state["rows"].items()})


@dataclass
class ScaffoldState:
    """The run key naming the clients' c_i, the server's c (flat float64), each client's round of
    its last applied reply and the sketch of its c_i. (The Δc_i and c_i bounds' references are
    checkpointed with the other norm checks, :meth:`Scaffold.norm_checks`.)"""

    run_key: str
    c: np.ndarray | None = None
    accepted: dict[int, int] = field(default_factory=dict)  # client id -> round of its last applied reply
    variates: VariateSketch | None = field(default=None, metadata=kept_as(
        lambda v: v.state(), lambda saved, rule: VariateSketch.of(saved)))

    def __post_init__(self) -> None:
        if not RUN_KEY_PATTERN.fullmatch(str(self.run_key)):
            raise ValueError(f"scaffold: bad run key in the checkpoint: {self.run_key!r}")


class Scaffold(AvailabilityStrategy):
    """SCAFFOLD (Karimireddy et al., ICML 2020, Alg. 1, option II): control variates c, c_i.

    The clients keep c_i (client rule ``scaffold``); the project's ClientApp corrects its local
    steps itself, another ClientApp through ``client_app.dropin`` (the mod and
    ``correct_gradients``). Weights: equal over A_t (the paper's 1/|S|); ``num-examples`` weights
    Δy by data size (c's update stays (1/N) Σ Δc_i). Metrics: ``c-norm``, ``mean-dc-norm``.

    Parameters
    ----------
    sketch_seed : the seed of the c_i sketch's hash (spec key ``sketch-seed``); -1 (the default):
        a private one, drawn from :mod:`secrets` when the strategy is built, never derived from the
        strategy's ``seed`` (public in most configs: a client that knew the hash could hide its c_i
        in the sketch's kernel; issue 47, item 5). Kept by checkpoints (a resumed run keeps its
        sketch, bit for bit); set it only to repeat a run's verdicts exactly (tests), and keep it private.
    """

    name = "scaffold"
    State: ClassVar[type] = ScaffoldState
    needs_num_clients = True  # c ← c + (1/N) Σ Δc_i
    client_rule = SCAFFOLD_RULE  # its client half: client_app.scaffold.ScaffoldRule
    streams = True  # Δy and Δc are sums (VariateFold)
    namespace = SCAFFOLD_META_PREFIX
    sends = (Payload("c", SCAFFOLD_C_PREFIX, "control variate"),)
    reads = (Payload("dc", SCAFFOLD_DC_PREFIX, "control-variate update",
                     missing="this node does not run scaffold's client rule. A ClientApp takes part with "
                             "client_app.dropin: ClientApp(mods=[client_rule_mod]) and "
                             "correct_gradients(model, context) in its train function"),)

    def __init__(self, *, sketch_seed: int = -1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(sketch_seed, bool) or not isinstance(sketch_seed, int) or not -1 <= sketch_seed < 2**63:
            raise ValueError(f"{self.name}: sketch-seed must be an integer in [0, 2^63) (-1: a private one, "
                             f"drawn at random), got {sketch_seed!r}")
        self.run_key = secrets.token_hex(8)  # new run, new client variates; kept by checkpoints
        self.c: np.ndarray | None = None
        self.accepted: dict[int, int] = {}  # client id -> the round of its last applied reply
        # S c_i per client: the c_i bound's norms; its hash from sketch-seed, by default a private one
        # (secrets, never the public seed); kept by checkpoints
        self.variates = VariateSketch(sketch_seed if sketch_seed >= 0 else None)
        self.variate_bounds: NormBounds = self.params.bounds()  # ‖c_i^+‖ (no widening: a mean gradient)
        self.variate_bounds.widens, self.variate_bounds.first_only = False, True
        self.variate_bounds.follows = self.bounds  # first ‖c_j^+‖ x the model reference's capped growth
        self.variate_bounds.what = "control variate norm ‖c_i + Δc_i‖ (sketched)"

    def variate_norm(self, report: ClientReport) -> float:
        """‖c_i^+‖ ≈ ‖S (c_i + Δc_i)‖ (its sketch): the client's control variate once this reply
        is applied (a plain report changes no c_i)."""
        dc = report.payloads.get("dc")
        return self.variates.norm_after(report.client_id, dc if dc is not None and dc.size else None,
                                        key=(report.node_id, report.client_id, report.payload_norms.get("dc")))

    def norm_checks(self) -> list[tuple[NormBounds, Callable[[ClientReport], float]]]:
        """The model's and Δc_i's bounds (the base's), then ‖c_i^+‖'s (:meth:`variate_norm`)."""
        return [*super().norm_checks(), (self.variate_bounds, self.variate_norm)]

    # ------------------------------------------------------------------ messages out
    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        return {SCAFFOLD_RUN_KEY: self.run_key, SCAFFOLD_GAMMA: 1.0, SCAFFOLD_PERIOD: 1}

    def node_config(self, t: int, node: int) -> dict[str, Any]:
        """The round of this node's client's last applied reply (−1: none): the client commits
        that reply's c_i^+ and drops any other pending one (client_app.scaffold)."""
        return {ACCEPTED_ROUND: self.accepted.get(self.client_of_node.get(node, -1), -1)}

    def send_payloads(self, t: int) -> dict[str, np.ndarray]:
        """c, beside x^t."""
        assert self.current is not None
        if self.c is None or self.c.size != self.current.size:
            self.c = np.zeros(self.current.size, np.float64)
        return {"c": self.c}

    # ------------------------------------------------------------------------ the rule
    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        """x + η_g Σ w_i Δy_i and c + (1/N) Σ Δc_i, both sums folded in reply by reply."""
        if self.c is None or self.c.size != x.size:
            self.c = np.zeros(x.size, np.float64)
        return VariateFold(self, t, x)

    def finish_round(self, t: int, x: np.ndarray, fold: VariateFold) -> tuple[np.ndarray, dict[str, float]]:
        """SCAFFOLD's server step (Alg. 1, lines 16-17) from the round's sums."""
        assert self.c is not None
        if not fold.dys.count:
            return x, {"c-norm": float(np.linalg.norm(self.c))}
        self.c = self.c + fold.dcs.total / self.require_num_clients()
        return step(x, self.server_lr, fold.dys.total / fold.dys.weight), {
            "c-norm": float(np.linalg.norm(self.c)), "mean-dc-norm": fold.dc_norms / fold.dys.count}


class VariateFold(Fold):
    """SCAFFOLD's round as running sums (:mod:`strategies.streaming`): Σ w_i Δy_i, Σ Δc_i (a plain
    report, from a client without the rule, changes no c_i) and Σ ‖Δc_i‖; O(d) server memory.
    Each accepted report's client is recorded as applied (its client commits c_i^+)."""

    def __init__(self, rule: Scaffold, t: int, x: np.ndarray) -> None:
        self.rule, self.t, self.x = rule, t, x
        self.weight_of = example_weight(rule.weighting)
        self.dys, self.dcs = RunningSum(x.size), RunningSum(x.size)
        self.dc_norms = 0.0

    def add(self, report: ClientReport) -> None:
        self.rule.accepted[report.client_id] = self.t
        weight = self.report_weight(report, self.weight_of)
        self.dys.add(weight, report.delta)
        dc = report.payloads.get("dc")
        if dc is not None and dc.size == self.x.size:
            self.dcs.add(1.0, dc)
            self.rule.variates.add(report.client_id, dc, key=(report.node_id, report.client_id,
                                                              report.payload_norms.get("dc")))
            self.dc_norms += report.payload_norms["dc"]

    def finish(self) -> tuple[np.ndarray, dict[str, float]]:
        self.rule.variates.forget_judged()
        return self.rule.finish_round(self.t, self.x, self)


@dataclass
class AmplifiedScaffoldState(ScaffoldState):
    """SCAFFOLD's, plus x_r (the period's start, flat float64) and the period's Σ Δc_i."""

    anchor: np.ndarray | None = None
    pending: np.ndarray | None = None


class AmplifiedScaffold(Scaffold):
    """Amplified SCAFFOLD (Crawshaw & Liu, NeurIPS 2024, Alg. 1; the code's ``correction="period"``).

    Parameters
    ----------
    period : P, the participation period in rounds (the code's P; 10 in its synthetic runs).
    gamma : γ, the amplification at each period's end (the clients step with η_l/γ); γ = 1 is
        SCAFFOLD with the control variates refreshed once per period.
    """

    name = "amplified-scaffold"
    State = AmplifiedScaffoldState
    client_rule = AMPLIFIED_SCAFFOLD_RULE

    def __init__(self, *, period: int = 10, gamma: float = 1.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(period, bool) or int(period) != period or period < 1:
            raise ValueError(f"amplified-scaffold: period must be an integer >= 1, got {period}")
        if not (math.isfinite(gamma) and gamma > 0):
            raise ValueError(f"amplified-scaffold: gamma must be a finite number > 0, got {gamma}")
        self.period, self.gamma = int(period), float(gamma)
        self.anchor: np.ndarray | None = None
        self.pending: np.ndarray | None = None

    def train_config(self, t: int, node_ids: list[int]) -> dict[str, Any]:
        return {**super().train_config(t, node_ids), SCAFFOLD_GAMMA: self.gamma, SCAFFOLD_PERIOD: self.period}

    def start_fold(self, t: int, x: np.ndarray) -> Fold:
        if self.anchor is None or self.anchor.size != x.size:
            self.anchor = np.asarray(x, np.float64).copy()  # x_0: the first period's start
            self.pending = np.zeros(x.size, np.float64)
            self.c = np.zeros(x.size, np.float64)
        return VariateFold(self, t, x)

    def finish_round(self, t: int, x: np.ndarray, fold: VariateFold) -> tuple[np.ndarray, dict[str, float]]:
        """x + η_g Σ w_i Δy_i each round, Σ Δc_i kept for the period; at the period's end
        x_r + γ (x − x_r) and c + (1/N) Σ Δc_i."""
        assert self.pending is not None and self.c is not None and self.anchor is not None
        new = np.asarray(x, np.float64)
        if fold.dys.count:
            new = new + self.server_lr * (fold.dys.total / fold.dys.weight)
            self.pending += fold.dcs.total
        metrics = {"amplified": 0.0}
        if (t + 1) % self.period == 0:  # the period's end: amplify, refresh c
            new = amplify(new, self.anchor, self.gamma)
            self.anchor = new.copy()
            self.c = self.c + self.pending / self.require_num_clients()
            self.pending = np.zeros(x.size, np.float64)
            metrics["amplified"] = 1.0
        return new.astype(np.float32), {**metrics, "c-norm": float(np.linalg.norm(self.c))}
