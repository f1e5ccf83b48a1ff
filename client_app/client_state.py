"""A client rule's state on the client: ``context.state``, plus a file under the state dir.

FedAWE's and FedPBC's copy x_i (``client_app.fedawe``) and SCAFFOLD's control variate c_i
(``client_app.scaffold``) live here, one :class:`StateStore` per (client, rule, run): in
``context.state`` (Flower's per-run, per-node record dict: survives rounds, not a process restart)
and, when a state dir is configured (``node_config["state-dir"]`` first, then run config
``state-dir``), also in ``<state-dir>/client-<pid>/<rule>-<run key>.pt``, written atomically (temp
file, fsync, ``os.replace``) after every change, so the state survives the client process
restarting (a real deployment's churn). The run key comes from the server (new for every run, kept
by the server's checkpoints), falling back to ``run<run id>``: a new run never picks up an old
run's state. Old runs' files are left in place (delete the state dir to reclaim them).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context

from strategies.protocol import (
    FEDAWE_RULE as RULE,
    FEDAWE_RUN_KEY as RUN_KEY,
    FEDAWE_RUN_KEY_PATTERN as RUN_KEY_PATTERN,
)

StateDict = dict[str, torch.Tensor]
# context.state records of a rule's client state: "<rule>.copy" (FedAWE: x_i) and "<rule>.meta"
# (τ_i and the run key); :class:`StateStore`
FILE_FORMAT = 1


class FedAWEStateError(RuntimeError):
    """A client rule's state does not fit the message (replay, wrong run, wrong model)."""


@dataclass
class ClientState:
    """A client rule's state: what the server has applied (``copy``, ``tau``) and what it may yet
    apply (``pending``, ``pending_tau``): a reply's new state waits there until the server says
    the reply was accepted (SCAFFOLD: the next train message's accepted round; FedAWE: the
    round-end broadcast), else it is dropped (:meth:`resolve`), so the client never keeps a
    state the server did not count."""

    copy: StateDict  # the rule's tensors (FedAWE: x_i; SCAFFOLD: c_i, ...), as the server applied them
    tau: int  # τ_i: the last round whose reply the server applied (−1: never)
    pending: StateDict | None = None  # the state of the reply of round pending_tau, not yet applied
    pending_tau: int = -1

    @property
    def last_round(self) -> int:
        """The last round this client replied in (a train message for it or before is a replay)."""
        return max(self.tau, self.pending_tau)

    def resolve(self, accepted: int) -> ClientState:
        """The state once the server says ``accepted`` is the round of this client's last applied
        reply: the pending state committed when it is that round's, else dropped."""
        if self.pending_tau < 0:
            return self
        if accepted == self.pending_tau and self.pending is not None:
            return ClientState(self.pending, self.pending_tau)
        return ClientState(self.copy, self.tau)


def state_dir(context: Context) -> Path | None:
    """The configured state dir: node config ``state-dir``, else run config ``state-dir``."""
    value = context.node_config.get("state-dir", "") or context.run_config.get("state-dir", "")
    return Path(str(value)).expanduser() if value else None


def run_key(context: Context, config: Any, name: str = RUN_KEY) -> str:
    """The run key (config ``name``, else ``run<run id>``) naming a run's client-held state."""
    key = str(config.get(name, "") or f"run{context.run_id}")
    if not RUN_KEY_PATTERN.fullmatch(key):
        raise FedAWEStateError(f"bad run key {key!r} (letters, digits, '-', '_' only)")
    return key


def _clone(sd: StateDict) -> StateDict:
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


class StateStore:
    """One client's state of one client rule for one run: ``context.state``, plus a file with a
    state dir. ``rule`` names the records and the file (FedAWE's by default; SCAFFOLD keeps its
    control variate the same way, ``client_app.scaffold``), ``key_name`` the run key's config key."""

    def __init__(self, context: Context, client: int, config: Any, rule: str = RULE,
                 key_name: str = RUN_KEY) -> None:
        self.context = context
        self.client = client
        self.rule = rule
        self.key = run_key(context, config, key_name)
        self.copy_record, self.meta_record, self.pending_record = f"{rule}.copy", f"{rule}.meta", f"{rule}.pending"
        root = state_dir(context)
        self.path = None if root is None else root / f"client-{client}" / f"{rule}-{self.key}.pt"

    def load(self) -> ClientState | None:
        cached = self.context.state
        meta = cached.config_records.get(self.meta_record)
        copy = cached.array_records.get(self.copy_record)
        if meta is not None and meta.get("key") == self.key and copy is not None:
            pending = cached.array_records.get(self.pending_record)
            pending_tau = int(cast(int, meta.get("pending-tau", -1)))
            return ClientState(copy.to_torch_state_dict(), int(cast(int, meta["tau"])),
                               pending.to_torch_state_dict() if pending is not None and pending_tau >= 0 else None,
                               pending_tau)
        if self.path is None or not self.path.is_file():
            return None
        saved = torch.load(self.path, map_location="cpu", weights_only=True)
        if saved.get("format") != FILE_FORMAT or saved.get("client") != self.client or saved.get("key") != self.key:
            raise FedAWEStateError(f"{self.path} is not client {self.client}'s {self.rule} state for run {self.key}")
        pending = saved.get("pending")
        state = ClientState(dict(saved["copy"]), int(saved["tau"]), dict(pending) if pending is not None else None,
                            int(saved.get("pending_tau", -1)))
        self._cache(state)
        return state

    def save(self, state: ClientState) -> None:
        self._cache(state)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"format": FILE_FORMAT, "client": self.client, "key": self.key, "tau": state.tau,
                   "copy": state.copy, "pending": state.pending, "pending_tau": state.pending_tau}
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
        self.context.state[self.copy_record] = ArrayRecord(state.copy)
        if state.pending is not None:
            self.context.state[self.pending_record] = ArrayRecord(state.pending)
        elif self.pending_record in self.context.state.array_records:
            del self.context.state[self.pending_record]
        self.context.state[self.meta_record] = ConfigRecord({"tau": state.tau, "key": self.key,
                                                             "pending-tau": state.pending_tau})
