"""The client half of a rule: one protocol, so the generic client path names no rule.

Most rules only need the client to train from the model it receives and send the result back
(:class:`PlainRule`). Some need more (FedAWE's kept copy and echo, SCAFFOLD's control variate and
corrected steps, FedPBC's catch-up); each implements :class:`ClientRule`, whose members are what
the project's ClientApp (``client_app.app``), the cohort engine and the drop-in mod
(``client_app.dropin``) call around local training, and nothing else:

- ``start``: the weights local training starts from (given the received ones); a rule whose
  correction changes every local step registers it here (:func:`activate`);
- ``rounds``: the rounds whose local steps one message runs, in order (``[t]``; FedPBC's
  catch-up: the missed rounds first);
- ``reply``: the weights sent back (given the start and the trained ones);
- ``adopt``: what to do with a model the server broadcasts after aggregation.

The gradient correction is one more protocol (:class:`GradientCorrection`: ``attach(model)``,
``detach()``); the train function applies whatever the message's rule registered with
:func:`correct_gradients` (a no-op for every rule without one). This module imports no rule
(``client_app.rules`` is the registry), so a rule module imports it without an import circle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from flwr.app import Context

    StateDict = dict[str, Any]  # a torch state dict (name -> tensor)


class GradientCorrection(Protocol):
    """What a rule's client half changes in every local step (SCAFFOLD's g − c_i + c): hooks put
    on the model before training (``attach``) and taken off after it (``detach``)."""

    def attach(self, model: Any) -> None: ...
    def detach(self) -> None: ...


class ClientRule(Protocol):
    """The client half of a rule (the module docstring): ``client-rule`` in a train message's
    config names one of ``client_app.rules.CLIENT_RULES``."""

    name: str

    def start(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> StateDict: ...
    def rounds(self, context: Context, client: int, t: int, config: Any) -> list[int]: ...
    def reply(self, start: StateDict, trained: StateDict, context: Context, client: int, t: int,
              config: Any) -> StateDict: ...
    def adopt(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> None: ...


class PlainRule:
    """``plain``: train from the received model, reply the trained one (every member's default:
    a client rule extends it and overrides what it changes)."""

    name: str = "plain"

    def start(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> StateDict:
        return received

    def rounds(self, context: Context, client: int, t: int, config: Any) -> list[int]:
        return [t]

    def reply(self, start: StateDict, trained: StateDict, context: Context, client: int, t: int,
              config: Any) -> StateDict:
        return trained

    def adopt(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> None:
        return None


_ACTIVE: dict[tuple[int, int], GradientCorrection] = {}  # (run id, node id) -> this message's correction


def _slot(context: Context) -> tuple[int, int]:
    return (int(context.run_id), int(context.node_id))


def activate(context: Context, correction: GradientCorrection) -> None:
    """Register ``correction`` for this node's current train message (a rule's ``start``)."""
    _ACTIVE[_slot(context)] = correction


def deactivate(context: Context) -> GradientCorrection | None:
    """Take this node's registered correction off the books (a rule's ``reply``), or None."""
    return _ACTIVE.pop(_slot(context), None)


def correct_gradients(model: Any, context: Context) -> GradientCorrection | None:
    """Apply the correction the message's client rule registered to ``model``'s local steps (call
    it before training); None, changing nothing, when the rule has none. The hooks stay until the
    reply is built (or ``detach``)."""
    correction = _ACTIVE.get(_slot(context))
    if correction is None:
        return None
    correction.detach()
    correction.attach(model)
    return correction
