"""Rule state and the one checkpoint layout.

Every rule declares its state as a small dataclass (as optax declares ``ScaleByAdamState``), the
class attribute ``State`` of the rule; its fields name the rule's attributes that a resumed run
needs. The base reads and writes them (:func:`capture`, :func:`restore`), and checkpoints every
rule under one layout (:func:`pack`):

    {"format": 2, "rule": <rule name>, "rng": <the strategy generator's state>,
     "identity": {"client_of_node": ..., "node_of_client": ...},
     "bounds": {"history": [recently accepted update norms]}, "state": {<State field>: value}}

Reports read a checkpoint through the rule (``STRATEGIES["fl-fdms"].read_state(ckpt["strategy"])``
-> ``FLFDMSState``), never through raw keys. Checkpoints written before this layout (format 1:
the base's keys at the top, a rule's keys at the top or in a dict under ``legacy_key``) are read
as well (:func:`unpack`).
"""

from __future__ import annotations

import copy
from dataclasses import MISSING, dataclass, fields
from typing import Any

FORMAT = 2
BASE_KEYS = ("rng", "client_of_node", "node_of_client")  # format 1: the base's own keys


@dataclass
class NoState:
    """The state of a rule that keeps none beyond the base's (FedAvg, FedExP)."""


def capture(obj: Any, state_cls: type, **given: Any) -> Any:
    """A ``state_cls`` holding copies of ``obj``'s same-named attributes (``given`` overrides)."""
    values = {f.name: given[f.name] if f.name in given else copy.deepcopy(getattr(obj, f.name))
              for f in fields(state_cls)}
    return state_cls(**values)


def restore(obj: Any, state: Any, skip: tuple[str, ...] = ()) -> None:
    """Set ``obj``'s attributes from copies of ``state``'s fields (except ``skip``)."""
    for f in fields(state):
        if f.name not in skip:
            setattr(obj, f.name, copy.deepcopy(getattr(state, f.name)))


def pack(rule: str, rng: dict[str, Any], identity: dict[str, Any], bounds: dict[str, Any],
         state: Any) -> dict[str, Any]:
    """The checkpoint of a strategy (format 2)."""
    return {"format": FORMAT, "rule": rule, "rng": rng, "identity": identity, "bounds": bounds,
            "state": {f.name: getattr(state, f.name) for f in fields(state)}}


def unpack(saved: dict[str, Any], rule: str, state_cls: type,
           legacy_key: str | None = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], Any]:
    """(rng state, identity state, bounds state, rule state) of a checkpoint of ``rule``, or
    ValueError saying why it is not one. Checkpoints without the bounds' history start it empty."""
    if not isinstance(saved, dict):
        raise ValueError(f"a strategy checkpoint is a dict, got {type(saved).__name__}")
    fmt = saved.get("format", 1)
    if fmt == FORMAT:
        if saved.get("rule") != rule:
            raise ValueError(f"the checkpoint holds the state of strategy {saved.get('rule')!r}, not {rule!r}")
        own, rng, identity = saved["state"], saved["rng"], saved["identity"]
        bounds = saved.get("bounds") or {}
    elif fmt == 1:
        own = {k: v for k, v in saved.items() if k not in BASE_KEYS}
        if legacy_key is not None:
            if legacy_key not in own:
                raise ValueError(f"the checkpoint has no '{legacy_key}' entry: it was not written by "
                                 f"strategy {rule!r} (keys: {sorted(saved)[:8]})")
            own = dict(own.pop(legacy_key) or {})  # FedAU wrote None before its first round
        rng, identity, bounds = saved["rng"], {k: saved.get(k) for k in BASE_KEYS[1:]}, {}
    else:
        raise ValueError(f"unknown strategy checkpoint format {fmt!r} (this code writes {FORMAT})")
    return rng, identity, bounds, build(state_cls, own, rule)


def build(state_cls: type, values: dict[str, Any], rule: str) -> Any:
    """``state_cls(**values)`` with the fields it knows; a missing field without a default is an
    error naming it."""
    known = {f.name: f for f in fields(state_cls)}
    missing = [n for n, f in known.items() if n not in values
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"the checkpoint lacks {missing} of strategy {rule!r}'s state ({state_cls.__name__})")
    return state_cls(**{k: v for k, v in values.items() if k in known})
