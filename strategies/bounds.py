"""Sanity bounds on what a reply may change before it is rejected (or, for data sizes, cut).

Defaults drawn from honest variation (``python benchmarks/honest_variation.py``: 17 honest
in-process runs of 15 rounds, 3172 replies, over digits MLP and CNN with Dirichlet 0.2 and 0.5
partitions, 1-5 local epochs, local momentum 0.9, and the lognormal-size synthetic data with 2-5
epochs; FedAvg, MIFA, FedVARP, FedExP, FedNova, FedAWE). Honest maxima, against the default:

- ‖Δ_i‖ / the lower median of recent and this round's norms: 4.97 (FedAWE's ‖u_i‖/(t − τ_i),
  a client back from a stale copy: 13.2), against ``max_norm_ratio`` 10 (FedAWE 30);
- ‖Δ_i‖ / ‖x^t‖: 1.8 (round 1: 1.02); ``max_model_ratio`` is off by default (a model initialised
  near zero, ‖x^0‖ = 2e-10 in tests/test_engine_property.py, gives it no scale), 10 when set;
- num-examples / the round's median: 10.4, against ``max_examples_ratio`` 30 (a cut);
- FedNova's num-steps / the round's median: 12.9, against ``max_steps_ratio`` 30.

None of the 3172 honest replies is beyond a default bound, so an honest run is the run without
the bounds, bit for bit. ``max_update_norm = 1e6`` rejects what breaks float32 rules (norms ≳ 1e19
overflow a float32 sum of squares or Gram matrix). FedAWE's raw ‖x_i^† − x^t‖ (its stale copy and
the echo factor) legitimately reaches 157 times its median: it keeps its own ratio (1e3). What the
bounds guarantee per rule: ``docs/threat-model.md``.
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

R = TypeVar("R")

MAX_UPDATE_NORM = 1e6  # absolute: what breaks float32 rules is far beyond (the docstring)
MAX_NORM_RATIO = 10.0  # x the lower median of recent norms (benchmarks/honest_variation.py)
MAX_MODEL_RATIO = 0.0  # x ‖x^t‖: off by default (a model near zero has no scale); opt-in, e.g. 10
MAX_EXAMPLES_RATIO = 30.0  # num-examples clipped to this x the lower median of recent ones
MAX_STEPS_RATIO = 30.0  # FedNova: num-steps above this x the lower median of recent ones is rejected


HISTORY = 64  # accepted values the running median remembers (across rounds)
MIN_POOL = 3  # values below which a median says nothing about which one is wrong
# this round's values that join the reference: those of the first REFERENCE_WINDOW replies that pass
# the per-reply checks (arrival order); the later replies are judged against that reference as they
# arrive, so a round's replies need not all be held (strategies.intake: streaming)
REFERENCE_WINDOW = 64


def lower_median(values: list[float]) -> float:
    """The lower median (the ⌈n/2⌉-th smallest): with half the values hostile and huge, it is
    still an honest one."""
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


@dataclass
class RatioBound:
    """``value <= ratio x reference`` for one reply quantity (a norm, num-steps, num-examples),
    the reference being the lower median of the last ``HISTORY`` accepted values and this round's
    (at least ``MIN_POOL`` of them, else no reference). ``ratio = 0``: off.

    In a round begun with ``new_round(fix=True)`` (the reply intake's, :mod:`strategies.intake`)
    the reference is computed once, from the values of the round's first call (its reference
    window: :data:`REFERENCE_WINDOW` replies), and kept until :meth:`commit`: the replies judged
    later in the round meet the same reference."""

    ratio: float
    history: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY), compare=False, repr=False)
    fixed: float | None = field(default=None, compare=False, repr=False)  # this round's reference
    fix: bool = field(default=False, compare=False, repr=False)  # the round's first call fixes it

    def reference(self, values: list[float]) -> float:
        """The reference for this round's ``values`` (0.0: none)."""
        if self.fixed is not None:
            return self.fixed
        pool = [*self.history, *values]
        ref = lower_median(pool) if len(pool) >= MIN_POOL else 0.0
        if self.fix:
            self.fixed = ref
        return ref

    def new_round(self, fix: bool = False) -> None:
        """Forget the last round's reference; ``fix``: this round's first call fixes it."""
        self.fixed, self.fix = None, fix

    def limit(self, values: list[float]) -> float:
        """The bound this round (inf: none)."""
        ref = self.reference(values)
        return self.ratio * ref if self.ratio and ref > 0 else math.inf

    def commit(self, values: list[float]) -> None:
        self.history.extend(values)
        self.new_round()

    def restored(self, history: list[float]) -> RatioBound:
        """This bound with ``history`` (a checkpoint's) as its recent values."""
        return RatioBound(self.ratio, deque(history, maxlen=HISTORY))


@dataclass
class NormBounds:
    """The absolute cap, the ratio test and the model-relative cap on update norms.

    max_update_norm : a reply whose update norm exceeds this is rejected; 0 = no absolute cap.
        Spec key ``max-update-norm``.
    max_norm_ratio : a reply whose update norm exceeds this multiple of the reference is rejected;
        0 = off. Spec key ``max-norm-ratio`` (e.g. ``mifa:max-norm-ratio=50``). The reference is
        the lower median of the last ``HISTORY`` accepted norms (earlier rounds) together with
        this round's norms under the caps, once there are at least 3 of them; so a round with 1
        or 2 replies is bounded by the history, and the first round by its own replies (3+).
        The lower median stays an honest norm while at most half the pool is hostile.
    max_model_ratio : when there is no median to compare with (fewer than 3 norms in the history
        and this round together: the first round with 1-2 replies), a reply whose update norm
        exceeds this multiple of ‖x^t‖ (the ``scale`` passed to :meth:`check`, when > 0) is
        rejected; 0 = off. Spec key ``max-model-ratio``. Only then: a model near zero (a
        zero-initialised one in its first rounds) makes a model-relative bound meaningless.
    """

    max_update_norm: float = MAX_UPDATE_NORM
    max_norm_ratio: float = MAX_NORM_RATIO
    max_model_ratio: float = MAX_MODEL_RATIO
    max_examples_ratio: float = MAX_EXAMPLES_RATIO
    ratio: RatioBound = field(init=False, compare=False, repr=False)
    examples: RatioBound = field(init=False, compare=False, repr=False)
    _pending: dict[int, float] = field(default_factory=dict, compare=False, repr=False)
    _no_reference: bool | None = field(default=None, compare=False, repr=False)  # fixed per round

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_update_norm) and self.max_update_norm >= 0):
            raise ValueError(f"max_update_norm (spec key max-update-norm) must be a finite number >= 0 "
                             f"(0 = no cap), got {self.max_update_norm}")
        if not (math.isfinite(self.max_norm_ratio) and (self.max_norm_ratio == 0 or self.max_norm_ratio > 1)):
            raise ValueError(f"max_norm_ratio (spec key max-norm-ratio) must be a finite number > 1 "
                             f"(0 = off), got {self.max_norm_ratio}")
        if not (math.isfinite(self.max_model_ratio) and self.max_model_ratio >= 0):
            raise ValueError(f"max_model_ratio (spec key max-model-ratio) must be a finite number > 0 "
                             f"(0 = off), got {self.max_model_ratio}")
        if not (math.isfinite(self.max_examples_ratio) and (self.max_examples_ratio == 0 or self.max_examples_ratio >= 1)):
            raise ValueError(f"max_examples_ratio (spec key max-examples-ratio) must be a finite number >= 1 "
                             f"(0 = off), got {self.max_examples_ratio}")
        self.ratio = RatioBound(self.max_norm_ratio)
        self.examples = RatioBound(self.max_examples_ratio)

    @property
    def history(self) -> deque[float]:
        return self.ratio.history

    def check(self, reports: list[R], norm_of: Callable[[R], float], node_of: Callable[[R], int],
              reject: Callable[[int, str], None], scale: float = 0.0,
              clip: Callable[[R, float, float], None] | None = None) -> list[R]:
        """The reports within the bounds; the others go to ``reject`` with the reason.

        First the absolute cap ``max_update_norm`` (and a norm that is not a finite number, or
        whose computation raised), and without a median to compare with ``max_model_ratio`` ×
        ``scale`` (‖x^t‖; 0: no model cap);
        then ``max_norm_ratio`` × the reference (:class:`RatioBound`; a zero reference gives no
        scale, so no ratio test). The accepted norms join the history at :meth:`commit`.
        In a round begun with ``new_round(fix=True)`` the first call fixes the references
        (:class:`RatioBound`): the reply intake calls it first with the round's reference window,
        then with each later reply.
        ``clip`` (``robust=clip``): a report beyond the ratio bound is kept, scaled down by
        ``clip(report, norm, limit)``, and its norm enters the history as ``limit``.
        """
        no_reference = self._no_reference
        if no_reference is None:
            no_reference = len(self.history) + len(reports) < MIN_POOL  # no median to compare with
            if self.ratio.fix:  # fixed by the round's first call (its reference window)
                self._no_reference = no_reference
        model_cap = self.max_model_ratio * scale if no_reference and self.max_model_ratio and scale > 0 else math.inf
        under = []
        for r in reports:
            try:
                norm = float(norm_of(r))
            except Exception as exc:  # noqa: BLE001 (one reply, one verdict)
                reject(node_of(r), f"update norm cannot be computed: {type(exc).__name__}: {exc}")
                continue
            if self.max_update_norm and norm > self.max_update_norm:  # inf included
                reject(node_of(r), f"update norm {norm:.2g} > max-update-norm {self.max_update_norm:.2g}")
            elif not math.isfinite(norm):
                reject(node_of(r), f"update norm {norm} is not finite")
            elif norm > model_cap:
                reject(node_of(r), f"update norm {norm:.2g} > max-model-ratio {self.max_model_ratio:g} x the "
                                   f"model's norm {scale:.2g}")
            else:
                under.append((r, norm))
        reference = self.ratio.reference([n for _, n in under])
        kept = []
        for r, norm in under:
            if self.max_norm_ratio and reference > 0 and norm > self.max_norm_ratio * reference:
                if clip is not None:
                    clip(r, norm, self.max_norm_ratio * reference)
                    kept.append(r)
                    self._pending[id(r)] = self.max_norm_ratio * reference
                    continue
                reject(node_of(r), f"update norm {norm:.2g} > max-norm-ratio {self.max_norm_ratio:g} "
                                   f"x the median of recent norms {reference:.2g}")
            else:
                kept.append(r)
                self._pending[id(r)] = norm
        return kept

    def clip_examples(self, reports: list[Any]) -> int:
        """Cut ``num_examples`` above ``max_examples_ratio`` × the lower median of recent ones to that
        bound (a data-size weight, not a verdict: the reply's work is kept); returns how many were
        cut. Runs after the verdicts, on the reports to be accepted."""
        limit = self.examples.limit([r.num_examples for r in reports])
        cut = 0
        for r in reports:
            if r.num_examples > limit:
                r.num_examples, cut = max(1, int(limit)), cut + 1
        return cut

    def commit(self, accepted: list[Any]) -> None:
        """The reports finally accepted this round (among those :meth:`check` kept): their norms
        (and data sizes) join the histories of the running medians."""
        self.ratio.commit([self._pending[id(r)] for r in accepted if id(r) in self._pending])
        self.examples.commit([float(r.num_examples) for r in accepted if hasattr(r, "num_examples")])
        self.new_round()

    def new_round(self, fix: bool = False) -> None:
        """Forget the last round's references and pending norms; ``fix``: this round's first
        :meth:`check` (and :meth:`clip_examples`) fixes its references."""
        self._pending.clear()
        self._no_reference = None
        self.ratio.new_round(fix)
        self.examples.new_round(fix)

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "examples": list(self.examples.history)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.ratio.history = deque((state or {}).get("history", ()), maxlen=HISTORY)
        self.examples.history = deque((state or {}).get("examples", ()), maxlen=HISTORY)
