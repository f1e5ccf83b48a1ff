"""Rule state and the one checkpoint layout.

Every rule declares its state as a small dataclass (as optax declares ``ScaleByAdamState``), the
class attribute ``State`` of the rule; its fields name the rule's attributes that a resumed run
needs. The base reads and writes them through the declared fields (:func:`capture`,
:func:`restore`; a field that is not saved as a deep copy says how in its metadata,
:func:`kept_as`), so a rule names its state once, and checkpoints every
rule under one layout (:func:`pack`):

    {"format": 3, "rule": <rule name>, "rng": <the strategy generator's state>,
     "binding": {"client_of_node": ..., "node_of_client": ...},
     "bounds": [{"history": [recently accepted norms]}, one per norm check],
     "state": {<State field>: value}}

Reports read a checkpoint through the rule (``STRATEGIES["fl-fdms"].read_state(ckpt["strategy"])``
-> ``FLFDMSState``), never through raw keys. Other layouts are refused (:func:`unpack`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import Any

FORMAT = 3


@dataclass
class NoState:
    """The state of a rule that keeps none beyond the base's (FedAvg, FedExP)."""


def kept_as(save: Callable[[Any], Any], load: Callable[[Any, Any], Any]) -> dict[str, Any]:
    """A State field's metadata: how the rule's attribute is saved (``save(attribute)``) and
    loaded back (``load(saved value, rule)``), where a deep copy each way is not it
    (``field(metadata=kept_as(...))``; MIFA's deque of lrs, the stored-updates table)."""
    return {"save": save, "load": load}


def capture(obj: Any, state_cls: type) -> Any:
    """A ``state_cls`` holding ``obj``'s attributes named by its fields, saved (a deep copy or the
    field's :func:`kept_as`)."""
    return state_cls(**{f.name: f.metadata.get("save", copy.deepcopy)(getattr(obj, f.name))
                        for f in fields(state_cls)})


def restore(obj: Any, state: Any) -> None:
    """Set ``obj``'s attributes named by ``state``'s fields, loaded (a deep copy or the field's
    :func:`kept_as`), in field order."""
    for f in fields(state):
        setattr(obj, f.name, _load(f, getattr(state, f.name), obj))


def loaded(state: Any, owner: Any) -> Any:
    """A rule value's state taken back from a checkpoint: a new ``type(state)`` whose fields are
    loaded (a deep copy, or the field's :func:`kept_as` load, given ``owner``: the rule value)."""
    return type(state)(**{f.name: _load(f, getattr(state, f.name), owner) for f in fields(state)})


def _load(f: Any, value: Any, owner: Any) -> Any:
    load = f.metadata.get("load")
    return copy.deepcopy(value) if load is None else load(value, owner)


def pack(rule: str, rng: dict[str, Any], binding: dict[str, Any], bounds: list[dict[str, Any]],
         state: Any) -> dict[str, Any]:
    """The checkpoint of a strategy."""
    return {"format": FORMAT, "rule": rule, "rng": rng, "binding": binding, "bounds": bounds,
            "state": {f.name: getattr(state, f.name) for f in fields(state)}}


def unpack(saved: dict[str, Any], rule: str,
           state_cls: type) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]], Any]:
    """(rng state, binding state, bounds' states, rule state) of a checkpoint of ``rule``, or
    ValueError saying why it is not one."""
    if not isinstance(saved, dict):
        raise ValueError(f"a strategy checkpoint is a dict, got {type(saved).__name__}")
    if saved.get("format") != FORMAT:
        raise ValueError(f"strategy checkpoint format {saved.get('format')!r} is not the one this code "
                         f"reads and writes ({FORMAT})")
    if saved.get("rule") != rule:
        raise ValueError(f"the checkpoint holds the state of strategy {saved.get('rule')!r}, not {rule!r}")
    return saved["rng"], saved["binding"], saved["bounds"], build(state_cls, saved["state"], rule)


def build(state_cls: type, values: dict[str, Any], rule: str) -> Any:
    """``state_cls(**values)`` with the fields it knows; a missing field without a default is an
    error naming it."""
    known = {f.name: f for f in fields(state_cls)}
    missing = [n for n, f in known.items() if n not in values
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"the checkpoint lacks {missing} of strategy {rule!r}'s state ({state_cls.__name__})")
    return state_cls(**{k: v for k, v in values.items() if k in known})
