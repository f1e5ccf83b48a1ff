"""FedAWE's client side: the client's own model copy x_i and τ_i, the echo, the adoption.

Xiang et al., "Efficient Federated Learning against Heterogeneous and Non-stationary Client
Unavailability", NeurIPS 2024, Alg. 1 (the server side and the message protocol:
``strategies.rules.fedawe``). In round t an available client

1. starts local training from ITS OWN copy x_i (its first message's model when it has none:
   the server sends the initial model x^0 there, so every copy starts at x^0, τ_i = −1);
2. replies the echo x_i^† = x_i^{t,0} + η_g (t − τ_i) Δ_i, with Δ_i = x_i^{t,end} − x_i^{t,0},
   the echo factor t − τ_i and u_i = (t − τ_i) Δ_i (when the config asks, which the server always
   does: it needs u_i for its clip and to track the mean of all copies), and sets τ_i ← t;
3. when the server's round-end broadcast (``train.adopt``) arrives, sets x_i ← x^{t+1} and τ_i ← t.
   The broadcast goes to the clients whose replies the server applied, and only then does τ_i
   move: a client whose reply was rejected or lost keeps its copy and its τ_i (the reply's round
   waits as ``pending_tau`` and is dropped at the next message, unless that message's
   ``accepted-round`` says the server applied it and only the broadcast was lost), so its next
   echo factor counts the rounds the server did not see and stays within the server's cap.

Where the state lives: :class:`client_app.client_state.StateStore`, in ``context.state`` and,
with a state dir, in ``<state-dir>/client-<pid>/fedawe-<run key>.pt`` (survives the client process
restarting). The run key comes from the server (``fedawe-run-key``: new for every run, kept by the
server's checkpoints), falling back to ``run<run id>``: a new run never picks up an old run's copy.

A train message for a round ≤ τ_i (a replay, or a run resumed from a checkpoint older than the
clients' state) is refused with an error rather than counted twice.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from flwr.app import Context

from strategies.protocol import (
    ACCEPTED_ROUND,
    FEDAWE_ECHO as ECHO,
    FEDAWE_ECHO_FACTOR as ECHO_FACTOR,
    FEDAWE_RULE as RULE,
    FEDAWE_SEND_UPDATE as SEND_UPDATE,
    FEDAWE_SERVER_LR as SERVER_LR,
    FEDAWE_UPDATE_PREFIX as UPDATE_PREFIX,
    FEDPBC_CATCH_UP as CATCH_UP,
)

from .client_rule import PlainRule
from .client_state import (  # noqa: F401  (re-exported: FedAWE's client state, its tests' imports)
    FILE_FORMAT,
    ClientState,
    FedAWEStateError,
    StateDict,
    StateStore,
    _clone,
    run_key,
    state_dir,
)

log = logging.getLogger(__name__)



def accepted_round(config: Any) -> int:
    """The round of this client's last reply the server applied, as its train message says (−1: none)."""
    return int(config.get(ACCEPTED_ROUND, -1))


def echo(start: StateDict, trained: StateDict, factor: float) -> StateDict:
    """start + factor · (trained − start) for floating tensors; others (counters) as trained."""
    out = {}
    for k, s in start.items():
        e = trained[k]
        if s.is_floating_point():
            out[k] = (s.double() + factor * (e.double() - s.double())).to(s.dtype)
        else:
            out[k] = e.clone()
    return out


def echoed_update(start: torch.Tensor, trained: torch.Tensor, factor: float) -> torch.Tensor:
    """factor · (trained − start) as float32 (zeros for non-floating tensors)."""
    if not start.is_floating_point():
        return torch.zeros(start.shape, dtype=torch.float32)
    return (factor * (trained.double() - start.double())).float()


class FedAWERule(PlainRule):
    """Client rule ``fedawe`` (:class:`client_app.client_rule.ClientRule`): the kept copy, the
    echo, the adoption; FedPBC's catch-up (``rounds``)."""

    name = RULE

    def start(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> StateDict:
        store = StateStore(context, client, config)
        state = store.load()
        if state is None:  # first message of this run: its model (x^0) becomes the copy
            state = ClientState(_clone(received), -1)
            store.save(state)
        elif t <= state.last_round:
            raise FedAWEStateError(
                f"client {client} was already available in round {state.last_round}; a train message for "
                f"round {t} is a replay (or the run was resumed from an older checkpoint)")
        elif state.pending_tau >= 0:  # its last reply got no broadcast
            # applied (the broadcast was lost): τ_i moves, the copy stays; rejected or lost: τ_i stays
            state = ClientState(state.copy, state.pending_tau if accepted_round(config) == state.pending_tau else state.tau)
            store.save(state)
        if set(state.copy) != set(received) or any(state.copy[k].shape != received[k].shape for k in received):
            raise FedAWEStateError(f"client {client}'s FedAWE copy does not fit the model of this run")
        return _clone(state.copy)

    def rounds(self, context: Context, client: int, t: int, config: Any) -> list[int]:
        """The rounds whose local steps this message runs, in order: [t], or with FedPBC's
        ``catch-up`` also the rounds τ_i + 1 .. t − 1 the client was away (the official code has an
        unlinked client keep training its own copy every round)."""
        if not config.get(CATCH_UP, False):
            return [t]
        state = StateStore(context, client, config).load()
        return list(range((state.tau if state is not None else -1) + 1, t + 1))

    def reply(self, start: StateDict, trained: StateDict, context: Context, client: int, t: int,
              config: Any) -> StateDict:
        store = StateStore(context, client, config)
        state = store.load()
        if state is None or t <= state.tau:
            raise FedAWEStateError(f"client {client}: reply for round {t} without a matching start")
        factor = t - state.tau if config.get(ECHO, True) else 1  # FedPBC: no echo
        eta_g = float(config.get(SERVER_LR, 1.0))
        out = echo(start, trained, eta_g * factor)
        out[ECHO_FACTOR] = torch.tensor([float(factor)], dtype=torch.float64)
        if config.get(SEND_UPDATE, False):  # u_i = (t − τ_i) Δ_i, for the server's clip and x̄
            out.update({UPDATE_PREFIX + k: echoed_update(start[k], trained[k], factor) for k in start})
        store.save(ClientState(state.copy, state.tau, pending_tau=t))  # τ_i ← t once the server applies it (adopt)
        return out

    def adopt(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> None:
        store = StateStore(context, client, config)
        state = store.load()
        if state is not None and state.last_round > t:
            log.warning("client %d: ignoring round %d's broadcast, it was available in round %d since",
                        client, t, state.last_round)
            return
        store.save(ClientState(_clone(received), t))
