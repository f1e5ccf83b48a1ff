"""SCAFFOLD's and Amplified SCAFFOLD's client side: the control variate c_i and the corrected steps.

SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, Alg. 1): client i keeps its control variate c_i (zero at start), receives
x and the server's c, and runs K local steps

    y ← y − η_l (g_i(y) − c_i + c),

then c_i^+ = c_i − c + (x − y_i)/(K η_l) (option II), which for plain SGD at a constant η_l is
exactly the mean of the K raw local gradients g_i(y) (sum the steps). This client computes that
mean (as the official Amplified SCAFFOLD code does, ``avg_local_grads``), replies y_i and
Δc_i = c_i^+ − c_i, and keeps c_i^+ pending: the server's next train message names the round of
this client's last applied reply (``accepted-round``), and the client commits c_i^+ only
when it is this reply's, else drops it (the reply was rejected or lost), so the server's c stays
the mean of the clients' c_i (issue 39 item 5).

Amplified SCAFFOLD (Crawshaw and Liu, "Federated Learning under Periodic Client Participation and
Heterogeneous Data", NeurIPS 2024, Alg. 1; code MingruiLiu-ML-Lab/FL-under-Periodic-Participation,
``synthetic/train.py`` with ``correction="period"``): local steps use η_l/γ, and c_i is refreshed
once per participation period of P rounds: the raw gradients of all of the period's local steps
are averaged, and that mean becomes c_i when the period ends. The client does this lazily: it
replies the change of its running mean in every round it takes part (the server sums these over
the period and updates c at the period's end, as the code does), and takes the mean as its c_i
at its first round of a later period.

The correction needs the train function's help, since it changes every local step: the
project's ClientApp applies it itself; any other ClientApp calls
``client_app.dropin.correct_gradients(model, context)`` on its model before training (gradient
hooks; a train reply without it is refused with that fix). State: c_i (and, for Amplified
SCAFFOLD, the period's gradient sum and step count), kept like FedAWE's copy
(:class:`client_app.client_state.StateStore`: ``context.state`` plus a file under ``state-dir``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import Context
from torch import nn

from strategies.protocol import (
    ACCEPTED_ROUND,
    AMPLIFIED_SCAFFOLD_RULE,
    SCAFFOLD_C_PREFIX,
    SCAFFOLD_DC_PREFIX,
    SCAFFOLD_GAMMA,
    SCAFFOLD_META_PREFIX,
    SCAFFOLD_PERIOD,
    SCAFFOLD_RULE,
    SCAFFOLD_RUN_KEY,
)

from .client_rule import PlainRule, activate, deactivate
from .client_state import ClientState, FedAWEStateError, StateStore

StateDict = dict[str, torch.Tensor]
COUNT = "count"  # Amplified SCAFFOLD: local steps summed in the current period (a 0-d tensor)


class ScaffoldStateError(FedAWEStateError):
    """The client's SCAFFOLD state or the train function does not fit the message."""


@dataclass
class Correction:
    """One round's drift correction: adds ``shift`` = c − c_i to each parameter's gradient, scales
    by ``scale`` (1/γ), and sums the raw gradients (for c_i^+)."""

    round: int
    shift: StateDict
    scale: float = 1.0
    sums: StateDict = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    state: ClientState | None = None  # the client's state this round's steps use
    attached: bool = False
    _handles: list[Any] = field(default_factory=list)

    def attach(self, model: nn.Module) -> None:
        missing = [n for n, p in model.named_parameters() if p.requires_grad and n not in self.shift]
        if missing:
            raise ScaffoldStateError(f"the server's control variate has no entry for parameter(s) {missing[:3]}")
        for name, p in model.named_parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._hook(name)))
        self.attached = True

    def _hook(self, name: str):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            raw = grad.detach().to(torch.float64)
            self.sums[name] = raw.clone() if name not in self.sums else self.sums[name].add_(raw)
            self.counts[name] = self.counts.get(name, 0) + 1
            shift = self.shift[name].to(grad.device, grad.dtype)
            return (grad + shift) * self.scale if self.scale != 1.0 else grad + shift
        return hook

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def steps(self) -> int:
        return max(self.counts.values(), default=0)


def split_received(received: StateDict) -> tuple[StateDict, StateDict]:
    """(the model, the server's c by model key) of a train message's arrays."""
    model = {k: v for k, v in received.items() if not k.startswith(SCAFFOLD_META_PREFIX)}
    c = {k[len(SCAFFOLD_C_PREFIX):]: v for k, v in received.items() if k.startswith(SCAFFOLD_C_PREFIX)}
    floating = {k for k, v in model.items() if v.is_floating_point()}
    if set(c) != floating or any(c[k].shape != model[k].shape for k in c):
        raise ScaffoldStateError("the train message's control variate does not match its model "
                                 f"(entries for {sorted(c)[:3]}..., floating arrays {sorted(floating)[:3]}...)")
    return model, c


def _zeros(like: StateDict) -> StateDict:
    return {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in like.items()}


class ScaffoldRule(PlainRule):
    """Client rule ``scaffold`` (:class:`client_app.client_rule.ClientRule`): its ``start``
    registers the round's :class:`Correction`, which the train function applies."""

    name = SCAFFOLD_RULE

    def _store(self, context: Context, client: int, config: Any) -> StateStore:
        return StateStore(context, client, config, rule=self.name, key_name=SCAFFOLD_RUN_KEY)

    def _load(self, context: Context, client: int, t: int, config: Any, c: StateDict) -> ClientState:
        """The state the server has applied: the last reply's pending c_i committed when the
        message's ``ACCEPTED_ROUND`` round is that reply's, else dropped (rejected or lost)."""
        store = self._store(context, client, config)
        state = store.load()
        if state is None:
            return ClientState({f"c.{k}": v for k, v in _zeros(c).items()}, -1)
        if t <= state.last_round:
            raise ScaffoldStateError(f"client {client} already trained in round {state.last_round}; a train message "
                                     f"for round {t} is a replay (or the run was resumed from an older checkpoint)")
        resolved = state.resolve(int(config.get(ACCEPTED_ROUND, -1)))
        if resolved is not state:
            store.save(resolved)
            state = resolved
        if any(state.copy.get(f"c.{k}", torch.empty(0)).shape != v.shape for k, v in c.items()):
            raise ScaffoldStateError(f"client {client}'s control variate does not fit the model of this run")
        return state

    def variate(self, state: ClientState, t: int, config: Any) -> ClientState:
        """The state whose c_i this round's steps use (Amplified SCAFFOLD: a finished period's mean)."""
        return state

    def start(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> StateDict:
        model, c = split_received(received)
        state = self.variate(self._load(context, client, t, config, c), t, config)
        shift = {k: (c[k].double() - state.copy[f"c.{k}"]).float() for k in c}
        gamma = float(config.get(SCAFFOLD_GAMMA, 1.0))
        if not (gamma > 0):
            raise ScaffoldStateError(f"'{SCAFFOLD_GAMMA}' must be > 0, got {gamma}")
        activate(context, Correction(t, shift, 1.0 / gamma, state=state))
        return model

    def new_state(self, state: ClientState, correction: Correction, t: int, config: Any) -> tuple[ClientState, StateDict]:
        """(the state to keep, Δc_i by key): SCAFFOLD's c_i^+ = the mean raw gradient."""
        old = {k[2:]: v for k, v in state.copy.items() if k.startswith("c.")}
        new = {k: correction.sums[k] / correction.counts[k] if k in correction.sums else torch.zeros_like(v)
               for k, v in old.items()}
        return ClientState({f"c.{k}": v for k, v in new.items()}, t), {k: new[k] - old[k] for k in old}

    def reply(self, start: StateDict, trained: StateDict, context: Context, client: int, t: int,
              config: Any) -> StateDict:
        correction = deactivate(context)
        if correction is not None:
            correction.detach()
        if not isinstance(correction, Correction) or correction.round != t:
            raise ScaffoldStateError(f"client {client}: reply for round {t} without a matching start")
        if not correction.attached or correction.steps == 0:
            raise ScaffoldStateError(
                f"the train function did not apply {self.name}'s drift correction (no corrected local step): "
                "call client_app.dropin.correct_gradients(model, context) on the model before training")
        assert correction.state is not None
        applied = correction.state
        kept, dc = self.new_state(applied, correction, t, config)
        # c_i^+ waits until the server says it applied this reply (_load): a rejected or lost reply's is dropped
        self._store(context, client, config).save(ClientState(applied.copy, applied.tau, kept.copy, t))
        out = dict(trained)
        out.update({SCAFFOLD_DC_PREFIX + k: v.float() for k, v in dc.items()})
        return out


class AmplifiedScaffoldRule(ScaffoldRule):
    """Client rule ``amplified-scaffold``: c_i is the mean raw gradient of a finished period."""

    name = AMPLIFIED_SCAFFOLD_RULE

    def variate(self, state: ClientState, t: int, config: Any) -> ClientState:
        period = int(config.get(SCAFFOLD_PERIOD, 1))
        count = float(state.copy[COUNT]) if COUNT in state.copy else 0.0
        if state.tau < 0 or state.tau // period == t // period or count == 0:
            return state
        copy = {k: v for k, v in state.copy.items() if not k.startswith("sum.")}
        for key in [k for k in state.copy if k.startswith("sum.")]:
            copy["c." + key[4:]] = state.copy[key] / count  # the period's mean becomes c_i
        copy[COUNT] = torch.zeros((), dtype=torch.float64)
        return ClientState(copy, state.tau)

    def new_state(self, state: ClientState, correction: Correction, t: int, config: Any) -> tuple[ClientState, StateDict]:
        """Add this round's raw gradients to the period's sum; Δ = the change of the period's mean
        (from c_i at the period's first round of this client)."""
        keys = [k[2:] for k in state.copy if k.startswith("c.")]
        period = int(config.get(SCAFFOLD_PERIOD, 1))
        same = state.tau >= 0 and state.tau // period == t // period
        count = float(state.copy[COUNT]) if same and COUNT in state.copy else 0.0
        copy = {f"c.{k}": state.copy[f"c.{k}"] for k in keys}
        dc = {}
        total = count + correction.steps
        for k in keys:
            before = state.copy[f"sum.{k}"] if count > 0 else torch.zeros_like(copy[f"c.{k}"])
            after = before + correction.sums[k] if k in correction.sums else before
            previous = before / count if count > 0 else copy[f"c.{k}"]
            copy[f"sum.{k}"] = after
            dc[k] = after / total - previous
        copy[COUNT] = torch.tensor(total, dtype=torch.float64)
        return ClientState(copy, t), dc
