"""Client-side behaviours around local training, chosen by the strategy (config ``client-rule``).

Most rules only need the client to train from the model it receives and send the result back
(``plain``). Some need more from the client: FedAWE starts from the client's own kept copy and
echoes its update (see its module). A rule is three small steps around local training:

- ``start``: the weights local training starts from (given the received ones);
- ``reply``: the weights sent back (given the start and the trained ones);
- ``adopt``: what to do with a model the server broadcasts after aggregation.

Two optional parts reach into local training itself: ``rounds(context, client, t, config)``, the
rounds whose local steps one message runs (FedPBC's ``catch-up``: the missed rounds first), and a
drift correction that ``start`` registers and the train function applies with
``client_app.scaffold.correct_gradients(model, context)`` (SCAFFOLD's g − c_i + c; see
``client_app.scaffold``). The project's ClientApp (``client_app.app.local_training``) and the
drop-in mod (``client_app.dropin``) honour both.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import Context

StateDict = dict[str, torch.Tensor]


class ClientRule:
    name = "plain"

    def start(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> StateDict:
        return received

    def reply(self, start: StateDict, trained: StateDict, context: Context, client: int, t: int,
              config: Any) -> StateDict:
        return trained

    def adopt(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> None:
        return None


CLIENT_RULES: dict[str, ClientRule] = {"plain": ClientRule()}


def client_rule(name: str) -> ClientRule:
    if name not in CLIENT_RULES:
        raise ValueError(f"unknown client rule {name!r}; this ClientApp knows {sorted(CLIENT_RULES)}")
    return CLIENT_RULES[name]


# FedAWE's rule lives in its own module (it keeps client-held state); it implements this
# interface without importing this module, so either can be imported first.
from .fedawe import FedAWERule  # noqa: E402

CLIENT_RULES[FedAWERule.name] = FedAWERule()  # type: ignore[assignment]

from .scaffold import AmplifiedScaffoldRule, ScaffoldRule  # noqa: E402

CLIENT_RULES[ScaffoldRule.name] = ScaffoldRule()  # type: ignore[assignment]
CLIENT_RULES[AmplifiedScaffoldRule.name] = AmplifiedScaffoldRule()  # type: ignore[assignment]
