"""What a checkpoint of the asynchronous loop on the virtual clock holds besides the model and the rule.

The loop (:class:`server_app.asynchronous.VirtualLoop`) writes one every ``checkpoint-every``
aggregations, in the middle of a virtual instant: right after the aggregation (its row is
recorded), before the instant's other events and before its dispatch. A resumed run continues at
exactly that point, so its rows and final model equal the uninterrupted run's bit for bit
(``tests/test_async_resume.py``). The model, the rule's state (its buffer of pending arrivals,
empty right after FedBuff aggregates, and the versions that jobs in flight train from), the norm
bounds' histories, the client binding, the rule's generator and the RNG states are the checkpoint's usual entries
(:mod:`server_app.checkpoint`); this module declares the rest, :class:`LoopState`:

- the virtual time and the event queue: each event's time and sequence number (ties leave in push
  order) and the queue's next sequence number; a wake event's client; an arrival's job
  (:class:`SavedJob`: its client, the version it trains from, its ``server-round``, whether its
  client goes offline before it ends, and the reply the simulation already computed: the grid
  trains a job when it is dispatched and the loop holds the reply until its virtual arrival);
- the idle clients, each client's job count (its next job's ``server-round``: the client keys its
  data order and learning rate by it), the jobs in flight, the arrivals lost or rejected in a row;
- the node of each client, so that a run resumed on nodes with other ids (a new Flower
  simulation draws new ones) rebinds the rule's client ids to them.

A deployment's loop on real time (:mod:`server_app.async_realtime`) does not resume: its jobs run on
real nodes, and their replies cannot be taken by another run (:func:`server_app.checkpoint.check_loop`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from flwr.app import Error, Message

from flowerlink import recorddict_from_bytes, recorddict_to_bytes
from runconfig import ConfigError

from .checkpoint import VIRTUAL


@dataclass
class SavedJob:
    """A job in flight: everything its arrival depends on."""

    client: int
    version: int  # τ, the model version it trains from (the rule's state keeps that model)
    job_round: int  # its message's server-round
    lost: bool  # its client goes offline before it ends
    reply: dict[str, Any] | None  # :func:`saved_reply`; None: no reply came


@dataclass
class LoopState:
    """The asynchronous loop's state at a checkpoint (the module docstring)."""

    now: float
    next_seq: int
    events: list[dict[str, Any]]  # {"time", "seq", "kind", "client"} (+ "job": a SavedJob's fields, arrivals)
    idle: list[int]
    jobs_of: list[int]  # client -> jobs dispatched to it so far
    in_flight: int
    failed_in_a_row: int
    node_of: dict[int, int]  # client -> node id when the checkpoint was written

    def saved(self) -> dict[str, Any]:
        """The checkpoint's ``"loop"`` entry: plain values only (no class of ours is pickled)."""
        return {"kind": VIRTUAL, **asdict(self)}

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any], path: str | Path) -> LoopState:
        """The state in a checkpoint's ``"loop"`` entry; ConfigError naming what is missing."""
        missing = [f.name for f in fields(cls) if f.name not in saved]
        if saved.get("kind") != VIRTUAL or missing:
            raise ConfigError(f"checkpoint {str(path)!r}: its 'loop' entry is not the state of an asynchronous loop "
                              f"on the virtual clock (kind {saved.get('kind')!r}, missing {missing})")
        return cls(**{f.name: saved[f.name] for f in fields(cls)})


def saved_reply(reply: Message | None) -> dict[str, Any] | None:
    """A reply as plain values: its content as Flower's wire format (bytes), or its error."""
    if reply is None:
        return None
    if reply.has_error():
        return {"error": [int(reply.error.code), str(reply.error.reason)]}
    return {"content": recorddict_to_bytes(reply.content)}


def restored_reply(saved: Mapping[str, Any] | None, sent: Message) -> Message | None:
    """The reply :func:`saved_reply` saved, as the answer of ``sent`` (a restored job's message)."""
    if saved is None:
        return None
    if "error" in saved:
        code, reason = saved["error"]
        return Message(Error(code=int(code), reason=str(reason)), reply_to=sent)
    return Message(recorddict_from_bytes(saved["content"]), reply_to=sent)
