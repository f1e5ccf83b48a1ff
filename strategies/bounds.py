"""Sanity bounds on what a reply may change before it is rejected or cut.

**Cut, don't drop.** A reply beyond the ratio bound from an identity without an entry (a newcomer,
every client of the first round: the server cannot judge it yet) is scaled to the bound as one
vector and kept, reported as cut (``num-clipped``, the round's ``cut``, a WARNING); its entry is
its norm, as a rejected reply's (the limit would let 64 replies sent first in round 1 set every
honest first entry, so the reference, for good). A known identity beyond it is rejected
(``robust=clip``: cut), as is anything beyond ``max-update-norm``, not finite or beyond the model
cap. Only Δ_i is cut (:meth:`strategies.intake.ReplyIntake.check_norms`): a payload the client
keeps in full cannot be scaled with it (SCAFFOLD's Δc_i, c_i^+: c is the mean of the c_i), nor an
echo (FedAWE's, FedPBC's u_i and x_i^†, tied by the echo check): beyond a Δc_i or c_i^+ bound a
reply is still rejected, and under FedAWE and FedPBC a newcomer's beyond any bound.

**One reference per identity.** References hold at most one entry per client identity (its
latest judged value: accepted, or beyond the ratio bound), never one per arrival or node id: the
client id the reply's node is bound to (:mod:`strategies.client_binding`; under SuperNode
authentication a node id is its key's). A node back with a fresh node id, claiming its id, is the
same entry: minting node ids buys none (docs/threat-model.md). A reference is the lower median over
the identities' entries, so a minority cannot move it far whatever it sends, however often or in
whatever order (a client making 80 % of asynchronous arrivals is one entry). Once :data:`MIN_POOL` have one,
a round's reference comes from earlier rounds' entries alone, independent of arrival order, and
each reply is judged at once; before that (the first round) the round's own values join (its
reference window, :data:`REFERENCE_WINDOW` replies, held until judged: the only place arrival
order matters; a rejected reply's norm becomes its node's entry). A zero reference is a
reference: it never switches the test off.

**Bounds that scale with what makes honest updates differ** (docs/threat-model.md, "The model of
honest variation"): the norm reference is the larger of the lower medians over nodes of each
node's first judged norm and of each node's latest one, capped at ``max_reference_growth`` (G) x
the first (honest updates do not converge together: a newcomer with a label no other client has
reached 53.5 x the median of the latest norms under FedAdam, 3.2 x the larger; and they grow, but
so does an attacker's bound when it displaces the model and the honest updates answer it: without
the cap, geometric growth); a reply's limit is ``max_norm_ratio`` x the reference x √(its declared
``num-steps`` / the nodes' median), at most ``WORK_RATIO``, x (for rules whose client keeps state across rounds,
SCAFFOLD's c_i or FedAWE's copy) 1 + the rounds since its identity was last judged (1 the first
time), at most ``GAP_RATIO``; the product of the two at most ``WIDEN_RATIO`` (honest replies use one or the
other: an attacker that declared 100 x the median work and stayed silent 49 rounds got both, 500
x, and moved SCAFFOLD's model 1,256 m in one reply, 126 with the cap; ``tests/test_widening.py``).

Defaults drawn from the honest-heterogeneity matrix (``python benchmarks/honest_matrix.py``, its
cases in docs/threat-model.md): honest replies reach 7.3 x the widened reference (``max_norm_ratio``
20, FedAWE 30) and 10.9 x the first norms' (R G = 100); data sizes uncut by default (1 to 10,000
cannot be told from a claim); FedNova's num-steps within 300 x the median (honest 1-250);
``max_model_ratio`` off (a model near zero has no scale); ``max_update_norm = 1e6`` rejects what
breaks float32 rules (norms ≳ 1e19 overflow a float32 sum of squares). Per rule: the threat model.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

R = TypeVar("R")

MAX_UPDATE_NORM = 1e6  # absolute: what breaks float32 rules is far beyond (the docstring)
MAX_NORM_RATIO = 20.0  # x the reference: honest replies reach 7.3 x it (benchmarks/honest_matrix.py)
MAX_MODEL_RATIO = 0.0  # x ‖x^t‖: off by default (a model near zero has no scale); opt-in, e.g. 10
MAX_EXAMPLES_RATIO = 0.0  # off: honest data sizes span 1 to 10,000 (opt-in: cut to this x the reference)
MAX_STEPS_RATIO = 300.0  # FedNova: num-steps (a-norm) above this x the reference of num-steps is rejected
MAX_REFERENCE_GROWTH = 5.0  # the norm reference follows the nodes' latest norms up to this x their first ones
WORK_RATIO = 10.0  # declared num-steps widen a norm bound by √(num-steps / the nodes' reference), at most this
GAP_RATIO = 50.0  # rounds since a stateful client was last judged widen it by at most this
WIDEN_RATIO = GAP_RATIO  # the product of the two widenings, at most this (they do not compound)

NODES = 10_000  # identities whose latest value a reference remembers (the most recently heard)
MIN_POOL = 3  # nodes below which a median says nothing about which one is wrong
# the first round's values joining its reference (before MIN_POOL have an entry): its first replies
# passing the per-reply checks, this many, so a streaming rule need not hold a round (strategies.intake)
REFERENCE_WINDOW = 64


def lower_median(values: Iterable[float]) -> float:
    """The lower median (the ⌈n/2⌉-th smallest): with half the values hostile and huge, it is
    still an honest one."""
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


@dataclass
class RatioBound:
    """``value <= ratio x reference`` for one reply quantity (a norm, num-steps, num-examples).

    ``entries``: node -> its latest judged value (at most :data:`NODES` nodes, the most recently
    heard). The reference is the lower median of the entries once :data:`MIN_POOL` nodes have one
    (the entries of this round's nodes are replaced only at :meth:`commit`), else of the entries
    with this round's values (none: fewer than :data:`MIN_POOL` nodes in all). ``ratio = 0``: off.

    In a round begun with ``new_round(fix=True)`` (the reply intake's) the reference is computed
    once, at the round's first call, and kept until :meth:`commit`.
    """

    ratio: float
    entries: OrderedDict[int, float] = field(default_factory=OrderedDict, compare=False, repr=False)
    fixed: float | None = field(default=None, compare=False, repr=False)  # this round's reference
    fix: bool = field(default=False, compare=False, repr=False)  # the round's first call fixes it

    @property
    def settled(self) -> bool:
        """The reference comes from the entries alone (does not depend on this round's replies)."""
        return len(self.entries) >= MIN_POOL

    def reference(self, values: Mapping[int, float] | Iterable[float]) -> float | None:
        """The reference for this round (``values``: node -> this round's value; a plain list of
        values: one node each, new ones); None: none."""
        if self.fixed is not None:
            return self.fixed
        if not isinstance(values, Mapping):
            values = {-(i + 1) - len(self.entries): v for i, v in enumerate(values)}
        pool = self.entries if self.settled else {**self.entries, **values}
        ref = lower_median(pool.values()) if len(pool) >= MIN_POOL else None
        if self.fix and ref is not None:
            self.fixed = ref
        return ref

    def new_round(self, fix: bool = False) -> None:  # fix: this round's first call fixes the reference
        self.fixed, self.fix = None, fix

    def limit(self, values: Mapping[int, float] | Iterable[float]) -> float:
        """The bound this round (inf: none or off)."""
        ref = self.reference(values)
        return self.ratio * ref if self.ratio and ref is not None else math.inf

    def commit(self, values: Mapping[int, float]) -> None:
        """Each identity's value of this round becomes its entry (one per identity)."""
        for node, value in values.items():
            self.entries.pop(node, None)
            self.entries[node] = float(value)
        while len(self.entries) > NODES:
            self.entries.popitem(last=False)
        self.new_round()

    def state_dict(self) -> dict[str, list[Any]]:
        return {"nodes": list(self.entries), "values": list(self.entries.values())}

    def load_state_dict(self, state: Mapping[str, Any] | list[float] | None) -> None:
        """Entries from :meth:`state_dict` (an older checkpoint's list of values: one identity each)."""
        if isinstance(state, Mapping):
            pairs = list(zip(state.get("nodes", ()), state.get("values", ()), strict=True))
        else:
            pairs = [(-(i + 1), v) for i, v in enumerate(state or ())]
        self.entries = OrderedDict((int(n), float(v)) for n, v in pairs)
        self.new_round()


@dataclass
class NormBounds:
    """The absolute cap, the ratio test and the model-relative cap on update norms.

    max_update_norm : a reply whose update norm exceeds this is rejected; 0 = no absolute cap.
        Spec key ``max-update-norm``.
    max_norm_ratio : a reply whose update norm exceeds this multiple of the reference (× its work
        and gap factors, the module docstring) is rejected (a newcomer's cut); 0 = off. Spec key ``max-norm-ratio``
        (e.g. ``mifa:max-norm-ratio=50``). The reference is the lower median over nodes of each
        node's latest judged norm (:class:`RatioBound`).
    max_model_ratio : when there is no reference (fewer than 3 nodes in the entries and this
        round together: the first round with 1-2 replies), a reply whose update norm exceeds this
        multiple of ‖x^t‖ (the ``scale`` passed to :meth:`check`, when > 0) is rejected; 0 = off.
        Spec key ``max-model-ratio``.
    max_examples_ratio : num-examples above this multiple of the data sizes' reference are cut.
    widens : declared num-steps and the rounds away widen the ratio bound (the model's change
        grows with both); False for a quantity that does not grow with them (SCAFFOLD's c_i, a
        mean gradient).
    max_reference_growth : G, the reference follows the nodes' latest norms up to G x their first
        ones: max(first, min(latest, G x first)) (lower medians over nodes); 0 = uncapped. Spec key
        ``max-reference-growth``. Honest updates that answer the model's displacement grow with
        it, so an attacker that displaces the model raises the honest norms, the reference and its
        own bound: geometric growth while f R > n − f, without the cap; with it the displacement
        settles (docs/threat-model.md, "The model of honest variation").
    first_only : the reference is the lower median over nodes of their first judged norms (times
        ``follows``' growth factor), not the larger of that and their latest ones: for a quantity
        that honestly stays at its first scale and that an attacker could otherwise raise through
        the honest replies (SCAFFOLD's c_i: c drags every honest step, so the honest c_j grow with
        the attacker's).
    follows : for ``first_only``, the bound whose capped growth (:meth:`growth`) scales the first
        norms (SCAFFOLD's c_i follows the model's: honest gradients scale with honest updates).
    """

    max_update_norm: float = MAX_UPDATE_NORM
    max_norm_ratio: float = MAX_NORM_RATIO
    max_model_ratio: float = MAX_MODEL_RATIO
    max_examples_ratio: float = MAX_EXAMPLES_RATIO
    max_reference_growth: float = MAX_REFERENCE_GROWTH
    widens: bool = True
    first_only: bool = False
    follows: NormBounds | None = field(default=None, compare=False, repr=False)
    what: str = "update norm"  # in reasons
    ratio: RatioBound = field(init=False, compare=False, repr=False)
    examples: RatioBound = field(init=False, compare=False, repr=False)
    work: RatioBound = field(init=False, compare=False, repr=False)  # declared num-steps, per identity
    fresh: RatioBound = field(init=False, compare=False, repr=False)  # each identity's first judged norm
    last_reference: float | None = field(default=None, compare=False, repr=False)  # the last check's
    last_seen: dict[int, int] = field(default_factory=dict, compare=False, repr=False)  # identity -> round judged
    rounds: int = field(default=0, compare=False, repr=False)  # rounds committed
    _pending: dict[int, float] = field(default_factory=dict, compare=False, repr=False)  # node -> norm
    _steps: dict[int, float] = field(default_factory=dict, compare=False, repr=False)  # node -> num-steps
    _no_reference: bool | None = field(default=None, compare=False, repr=False)  # fixed per round

    def __post_init__(self) -> None:
        for key, low, strict, allowed in (
                ("max_update_norm", 0, False, ">= 0 (0 = no cap)"), ("max_norm_ratio", 1, True, "> 1 (0 = off)"),
                ("max_model_ratio", 0, False, "> 0 (0 = off)"), ("max_examples_ratio", 1, False, ">= 1 (0 = off)"),
                ("max_reference_growth", 1, False, ">= 1 (0 = uncapped)")):
            value = getattr(self, key)
            if not (math.isfinite(value) and (value == 0 or value > low or (value == low and not strict))):
                raise ValueError(f"{key} (spec key {key.replace('_', '-')}) must be a finite number {allowed}, got {value}")
        self.ratio = RatioBound(self.max_norm_ratio)
        self.examples = RatioBound(self.max_examples_ratio)
        self.work = RatioBound(WORK_RATIO)
        self.fresh = RatioBound(self.max_norm_ratio)

    @property
    def history(self) -> list[float]:
        """The identities' latest judged norms (the reference's entries), the most recent last."""
        return list(self.ratio.entries.values())

    @staticmethod
    def work_factor(steps: float | None, reference: float | None) -> float:
        """√(a reply's declared ``num-steps`` / the nodes' reference), in [1, WORK_RATIO] (1: none):
        SGD's change grows as √steps once its gradients are noisy (measured: 21.7 x the median
        steps, 5.1 x the median norm) and at most linearly, which the ratio's margin covers."""
        if steps is None or not reference or reference <= 0:
            return 1.0
        return min(math.sqrt(max(1.0, steps / reference)), WORK_RATIO)

    @staticmethod
    def widening(work: float, gap: float) -> float:
        """The work factor x the gap factor, at most ``WIDEN_RATIO``: honest replies use one or the
        other (the honest matrix: docs/threat-model.md), an attacker would use both (10 x 50)."""
        return min(work * gap, WIDEN_RATIO)

    def gap_factor(self, identity: int) -> float:
        """1 + the rounds since ``identity`` was last judged, at most GAP_RATIO (a client keeping
        state returns with a change grown with its absence); 1 for one never judged (new state)."""
        seen = self.last_seen.get(identity)
        return 1.0 if seen is None else min(1.0 + self.rounds - seen, GAP_RATIO)

    def check(self, reports: list[R], norm_of: Callable[[R], float], node_of: Callable[[R], int],
              reject: Callable[[int, str], None], scale: float = 0.0,
              clip: Callable[[R, float, float, str], None] | None = None,
              steps_of: Callable[[R], float | None] | None = None, stateful: bool = False,
              identity_of: Callable[[R], int] | None = None, clip_known: bool = False) -> list[R]:
        """The reports within the bounds; the others go to ``reject`` (``node_of``'s node, the
        reason). ``identity_of``: whose entry a report's values are (default ``node_of``).

        First the absolute cap ``max_update_norm`` (and a norm that is not a finite number, or
        whose computation raised), and without a reference ``max_model_ratio`` × ``scale``
        (‖x^t‖; 0: no model cap); then ``max_norm_ratio`` × the reference (:class:`RatioBound`)
        × the work factor (``steps_of``: the declared num-steps) × the gap factor (``stateful``).
        Every norm that reaches the ratio test becomes its node's entry at :meth:`commit`.
        In a round begun with ``new_round(fix=True)`` the first call fixes the references.
        Beyond the ratio bound a report is cut (the module docstring), not rejected, when ``clip``
        is given and its identity has no entry or ``clip_known`` (``robust=clip``): kept, scaled by
        ``clip(report, norm, limit, reason)``, its entry ``limit`` under ``clip_known``, else its norm.
        """
        if not self.widens:
            steps_of, stateful = None, False
        who = identity_of or node_of
        no_reference = self._no_reference
        if no_reference is None:
            no_reference = len(set(self.ratio.entries) | {who(r) for r in reports}) < MIN_POOL
            if self.ratio.fix:  # fixed by the round's first call (its reference window)
                self._no_reference = no_reference
        model_cap = self.max_model_ratio * scale if no_reference and self.max_model_ratio and scale > 0 else math.inf
        under = []
        for r in reports:
            try:
                norm = float(norm_of(r))
            except Exception as exc:  # noqa: BLE001 (one reply, one verdict)
                reject(node_of(r), f"{self.what} cannot be computed: {type(exc).__name__}: {exc}")
                continue
            if self.max_update_norm and norm > self.max_update_norm:  # inf included
                reject(node_of(r), f"{self.what} {norm:.2g} > max-update-norm {self.max_update_norm:.2g}")
            elif not math.isfinite(norm):
                reject(node_of(r), f"{self.what} {norm} is not finite")
            elif norm > model_cap:
                reject(node_of(r), f"{self.what} {norm:.2g} > max-model-ratio {self.max_model_ratio:g} x the "
                                   f"model's norm {scale:.2g}")
            else:
                under.append((r, norm))
        steps = {who(r): s for r, _ in under if steps_of is not None and (s := steps_of(r)) is not None}
        work = self.work.reference(steps)
        reference = self.reference({who(r): norm for r, norm in under})
        kept = []
        for r, norm in under:
            identity = who(r)
            self._pending[identity] = norm
            if identity in steps:
                self._steps[identity] = float(steps[identity])
            if not self.max_norm_ratio or reference is None:
                kept.append(r)
                continue
            widen = self.widening(self.work_factor(steps.get(identity), work),
                                  self.gap_factor(identity) if stateful else 1.0)
            limit = self.max_norm_ratio * reference * widen
            if norm <= limit:
                kept.append(r)
                continue
            why = (f"{self.what} {norm:.2g} > max-norm-ratio {self.max_norm_ratio:g}{f' x work {widen:.3g}' * (widen > 1)}"
                   f" x the median of {'first' if self.first_only else 'recent'} norms"
                   f"{' x their growth' if self.follows else ''} {reference:.2g} (one per client)")
            if clip is not None and (clip_known or identity not in self.ratio.entries):
                clip(r, norm, limit, why if clip_known else f"{why}, a newcomer: cut to the bound")
                kept.append(r)
                self._pending[identity] = limit if clip_known else norm  # a newcomer's: as if rejected
            else:
                reject(node_of(r), why)
        return kept

    def reference(self, norms: Mapping[int, float]) -> float | None:
        """max(first, min(latest, G x first)), the lower medians over nodes of each node's first and
        latest judged norm (G = ``max_reference_growth``; 0: max(first, latest)): honest updates
        shrink as training converges, not together (a client with unrelated labels or a newcomer
        keeps its scale while the others' go to 0), and they grow (a learning-rate warm-up, a
        distribution shift, a displaced model), but an attacker that displaces the model makes the
        honest norms grow too, so the reference follows them at most G x. ``first_only``: first x
        ``follows``' :meth:`growth`."""
        latest, fresh = self.ratio.reference(norms), self.fresh.reference(norms)
        if latest is None:
            self.last_reference = None
        elif self.first_only and fresh is not None:
            self.last_reference = fresh * (self.follows.growth() if self.follows is not None else 1.0)
        elif fresh is None:
            self.last_reference = latest
        else:
            capped = min(latest, self.max_reference_growth * fresh) if self.max_reference_growth else latest
            self.last_reference = max(fresh, capped)
        return self.last_reference

    def growth(self) -> float:
        """The reference's growth factor: min(latest / first, G), at least 1 (1 before the
        entries of earlier rounds give both: the first round), from the entries alone."""
        if not (self.ratio.settled and self.fresh.settled):
            return 1.0
        latest, fresh = self.ratio.reference({}), self.fresh.reference({})
        if latest is None or fresh is None or latest <= fresh:
            return 1.0
        if fresh <= 0:
            return self.max_reference_growth or 1.0
        return min(latest / fresh, self.max_reference_growth) if self.max_reference_growth else latest / fresh

    def settled_for(self, steps: float | None) -> bool:
        """Whether the verdict on a reply declaring ``steps`` (None: none) reads only references
        earlier rounds fix (norms; data sizes, cut; steps, widening): no other reply changes it."""
        return (self.ratio.settled and self.fresh.settled
                and (not self.max_examples_ratio or self.examples.settled)
                and (steps is None or not self.widens or self.work.settled))

    def clip_examples(self, reports: list[Any], node_of: Callable[[Any], int] | None = None) -> int:
        """Cut ``num_examples`` above ``max_examples_ratio`` × the data sizes' reference to that
        bound (a data-size weight, not a verdict: the reply's work is kept); returns how many were
        cut. Runs after the verdicts, on the reports to be accepted."""
        nodes = [node_of(r) if node_of is not None else getattr(r, "client_id", -(i + 1)) for i, r in enumerate(reports)]
        limit = self.examples.limit({n: float(r.num_examples) for n, r in zip(nodes, reports, strict=True)})
        cut = 0
        for r in reports:
            if r.num_examples > limit:
                r.num_examples, cut = max(1, int(limit)), cut + 1
        return cut

    def commit(self, accepted: list[Any]) -> None:
        """End the round: every node judged by the ratio test this round gets its norm (and
        declared num-steps) as its entry; the accepted reports' data sizes join theirs."""
        self.ratio.commit(self._pending)
        self.fresh.commit({n: v for n, v in self._pending.items() if n not in self.fresh.entries})
        self.work.commit(self._steps)
        self.examples.commit({r.client_id: float(r.num_examples) for r in accepted if hasattr(r, "num_examples")})
        self.rounds += 1
        for identity in self._pending:
            self.last_seen.pop(identity, None)
            self.last_seen[identity] = self.rounds
        while len(self.last_seen) > NODES:  # the least recently judged go first, as the entries'
            del self.last_seen[next(iter(self.last_seen))]
        self.new_round()

    def new_round(self, fix: bool = False) -> None:
        """Forget the last round's references and pending norms; ``fix``: the first check fixes them."""
        self._pending, self._steps = {}, {}
        self._no_reference = None
        for bound in (self.ratio, self.examples, self.work, self.fresh):
            bound.new_round(fix)

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "nodes": list(self.ratio.entries),
                "examples": self.examples.state_dict(), "work": self.work.state_dict(),
                "fresh": self.fresh.state_dict(),
                "last_seen": [[n, r] for n, r in self.last_seen.items()], "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        history = state.get("history", [])
        self.ratio.load_state_dict({"nodes": state["nodes"], "values": history} if "nodes" in state else history)
        self.examples.load_state_dict(state.get("examples"))
        self.work.load_state_dict(state.get("work"))
        self.fresh.load_state_dict(state.get("fresh"))
        self.last_seen = {int(n): int(r) for n, r in state.get("last_seen", [])}
        self.rounds = int(state.get("rounds", 0))
