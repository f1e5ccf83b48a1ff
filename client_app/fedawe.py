"""FedAWE's client side: the client's own model copy x_i and τ_i, the echo, the adoption.

Xiang et al., "Efficient Federated Learning against Heterogeneous and Non-stationary Client
Unavailability", NeurIPS 2024, Alg. 1 (the server side and the message protocol:
``strategies.rules.fedawe``). In round t an available client

1. starts local training from ITS OWN copy x_i (its first message's model when it has none:
   the server sends the initial model x^0 there, so every copy starts at x^0, τ_i = −1);
2. replies the echo x_i^† = x_i^{t,0} + η_g (t − τ_i) Δ_i, with Δ_i = x_i^{t,end} − x_i^{t,0},
   the echo factor t − τ_i and u_i = (t − τ_i) Δ_i (when the config asks, which the server always
   does: it needs u_i for its clip and to track the mean of all copies), and sets τ_i ← t;
3. when the server's round-end broadcast (``train.adopt``) arrives, sets x_i ← x^{t+1}.

Where the state lives (:class:`StateStore`): in ``context.state`` (Flower's per-run, per-node
record dict: survives rounds, not a process restart) and, when a state dir is configured
(``node_config["state-dir"]`` first, then run config ``state-dir``), also in
``<state-dir>/client-<pid>/fedawe-<run key>.pt``, written atomically (temp file, fsync,
``os.replace``) after every change, so the copy survives the client process restarting (a real
deployment's churn). The run key comes from the server (``fedawe-run-key``: new for every run, kept
by the server's checkpoints), falling back to ``run<run id>``: a new run never picks up an old
run's copy. Old runs' files are left in place (delete the state dir to reclaim them).

A train message for a round ≤ τ_i (a replay, or a run resumed from a checkpoint older than the
clients' state) is refused with an error rather than counted twice.
"""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context

from strategies.protocol import (
    FEDAWE_ECHO_FACTOR as ECHO_FACTOR,
    FEDAWE_RULE as RULE,
    FEDAWE_RUN_KEY as RUN_KEY,
    FEDAWE_RUN_KEY_PATTERN as RUN_KEY_PATTERN,
    FEDAWE_SEND_UPDATE as SEND_UPDATE,
    FEDAWE_SERVER_LR as SERVER_LR,
    FEDAWE_UPDATE_PREFIX as UPDATE_PREFIX,
)

log = logging.getLogger(__name__)

StateDict = dict[str, torch.Tensor]
COPY_RECORD = "fedawe.copy"  # context.state: x_i
META_RECORD = "fedawe.meta"  # context.state: τ_i and the run key
FILE_FORMAT = 1


class FedAWEStateError(RuntimeError):
    """The client's FedAWE state does not fit the message (replay, wrong run, wrong model)."""


@dataclass
class ClientState:
    copy: StateDict  # x_i
    tau: int  # τ_i: last round this client was available (−1: never)


def state_dir(context: Context) -> Path | None:
    """The configured state dir: node config ``state-dir``, else run config ``state-dir``."""
    value = context.node_config.get("state-dir", "") or context.run_config.get("state-dir", "")
    return Path(str(value)).expanduser() if value else None


def run_key(context: Context, config: Any) -> str:
    key = str(config.get(RUN_KEY, "") or f"run{context.run_id}")
    if not RUN_KEY_PATTERN.fullmatch(key):
        raise FedAWEStateError(f"bad FedAWE run key {key!r} (letters, digits, '-', '_' only)")
    return key


def _clone(sd: StateDict) -> StateDict:
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


class StateStore:
    """One client's FedAWE state for one run: ``context.state``, plus a file with a state dir."""

    def __init__(self, context: Context, client: int, config: Any) -> None:
        self.context = context
        self.client = client
        self.key = run_key(context, config)
        root = state_dir(context)
        self.path = None if root is None else root / f"client-{client}" / f"fedawe-{self.key}.pt"

    def load(self) -> ClientState | None:
        cached = self.context.state
        meta = cached.config_records.get(META_RECORD)
        copy = cached.array_records.get(COPY_RECORD)
        if meta is not None and meta.get("key") == self.key and copy is not None:
            return ClientState(copy.to_torch_state_dict(), int(cast(int, meta["tau"])))
        if self.path is None or not self.path.is_file():
            return None
        saved = torch.load(self.path, map_location="cpu", weights_only=True)
        if saved.get("format") != FILE_FORMAT or saved.get("client") != self.client or saved.get("key") != self.key:
            raise FedAWEStateError(f"{self.path} is not client {self.client}'s FedAWE state for run {self.key}")
        state = ClientState(dict(saved["copy"]), int(saved["tau"]))
        self._cache(state)
        return state

    def save(self, state: ClientState) -> None:
        self._cache(state)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": FILE_FORMAT, "client": self.client, "key": self.key, "tau": state.tau,
                   "copy": state.copy}
        fd, tmp = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(payload, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _cache(self, state: ClientState) -> None:
        self.context.state[COPY_RECORD] = ArrayRecord(state.copy)
        self.context.state[META_RECORD] = ConfigRecord({"tau": state.tau, "key": self.key})


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


class FedAWERule:
    """Client rule ``fedawe`` (the ``client_app.rules.ClientRule`` interface)."""

    name = RULE

    def start(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> StateDict:
        store = StateStore(context, client, config)
        state = store.load()
        if state is None:  # first message of this run: its model (x^0) becomes the copy
            state = ClientState(_clone(received), -1)
            store.save(state)
        elif t <= state.tau:
            raise FedAWEStateError(
                f"client {client} was already available in round {state.tau}; a train message for "
                f"round {t} is a replay (or the run was resumed from an older checkpoint)")
        if set(state.copy) != set(received) or any(state.copy[k].shape != received[k].shape for k in received):
            raise FedAWEStateError(f"client {client}'s FedAWE copy does not fit the model of this run")
        return _clone(state.copy)

    def reply(self, start: StateDict, trained: StateDict, context: Context, client: int, t: int,
              config: Any) -> StateDict:
        store = StateStore(context, client, config)
        state = store.load()
        if state is None or t <= state.tau:
            raise FedAWEStateError(f"client {client}: reply for round {t} without a matching start")
        factor = t - state.tau
        eta_g = float(config.get(SERVER_LR, 1.0))
        out = echo(start, trained, eta_g * factor)
        out[ECHO_FACTOR] = torch.tensor([float(factor)], dtype=torch.float64)
        if config.get(SEND_UPDATE, False):  # u_i = (t − τ_i) Δ_i, for the server's clip and x̄
            out.update({UPDATE_PREFIX + k: echoed_update(start[k], trained[k], factor) for k in start})
        store.save(ClientState(state.copy, t))
        return out

    def adopt(self, received: StateDict, context: Context, client: int, t: int, config: Any) -> None:
        store = StateStore(context, client, config)
        state = store.load()
        if state is not None and state.tau > t:
            log.warning("client %d: ignoring round %d's broadcast, it was available in round %d since",
                        client, t, state.tau)
            return
        store.save(ClientState(_clone(received), t))
