"""A rule's extra payloads: named vectors that travel beside the model, declared by the rule.

pfl-research's habit (its SCAFFOLD's control variates travel as named statistics the framework
averages): a rule declares what it sends with x^t (SCAFFOLD's c) and what each reply carries
back (Δc_i, FedAWE's u_i and echo factor) as :class:`Payload` values (``Rule.sends``,
``Rule.reads``); the base packs them (:func:`pack_payloads`), the reply intake separates them
from the model (:func:`model_part`) and decodes them (:func:`read_payloads`, checked like the
model's own arrays) into ``report.payloads``, and bounds their norms. No rule reads a message.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord

from .layout import Layout
from .replies import ReplyRejected, decode, model_sized, shown


@dataclass(frozen=True)
class Payload:
    """A named vector that travels beside the model (pfl-research's named statistics): what a
    rule sends with x^t (SCAFFOLD's c) or reads back from each reply (Δc_i, FedAWE's u_i and echo
    factor). A rule declares it (:attr:`strategies.rule.Rule.sends`, ``reads``); the base packs
    it into the train message, or decodes it from the reply (:func:`read_payloads`: checked like
    the model's arrays, a missing or non-finite one is a rejection), bounds its norm and hands it
    to the rule as ``report.payloads[name]``. The rule never sees a message.

    name : the rule's name for it (``report.payloads[name]``, the rule's ``send_payloads``).
    key : on the wire: a prefix before each floating model key (model-sized), or the array's own
        key (``scalar``: one number, shape (1,)).
    what : what it is, in reasons ("control-variate update").
    missing : why a reply lacks it, naming the fix (after "reply lacks '<key>': ").
    scalar : one number, not a model-sized vector.
    bounded : its norm goes through its own :class:`strategies.bounds.NormBounds` (the run's
        bounds, its own reference; the norm is the rule's ``payload_norm``). False where the rule
        bounds it otherwise (FedAWE's u_i: its ``update_norm`` is ‖u_i‖ / (t − τ_i)).
    """

    name: str
    key: str
    what: str
    missing: str = "the node does not run this rule's client rule"
    scalar: bool = False
    bounded: bool = True

    def wire_keys(self, layout: Layout) -> set[str]:
        """The keys it may occupy in a record of ``layout``'s model."""
        return {self.key} if self.scalar else {self.key + k for k in layout.keys}


def model_part(record: ArrayRecord, layout: Layout, namespace: str, payloads: tuple[Payload, ...],
               rule: str = "") -> dict[str, Array]:
    """The model's arrays of a reply's ``record``: keys with the rule's ``namespace`` prefix are
    payloads, never the model, and one that no declared payload occupies is a rejection."""
    keys = list(record.keys())
    known: set[str] = set().union(*(p.wire_keys(layout) for p in payloads))
    unknown = sorted(k for k in keys if k.startswith(namespace) and k not in known) if namespace else []
    if unknown:
        raise ReplyRejected(f"unknown {rule + ' ' if rule else ''}reply keys {shown(unknown[:5])} (its payloads: "
                            f"{shown(sorted(p.key for p in payloads))})")
    return {k: record[k] for k in keys if k not in known and not (namespace and k.startswith(namespace))}


def read_payloads(record: ArrayRecord, layout: Layout, payloads: tuple[Payload, ...],
                  buffer: Callable[[], np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """(the declared ``payloads`` of a reply's ``record`` by name, their norms): each model-sized
    one decoded into ``buffer()`` (:func:`model_sized`), a scalar checked to be one finite number."""
    values: dict[str, np.ndarray] = {}
    norms: dict[str, float] = {}
    for p in payloads:
        if p.scalar:
            if p.key not in record:
                raise ReplyRejected(f"reply lacks '{p.key}': {p.missing}")
            value = decode(record[p.key], p.key)
            if value.size != 1 or not np.isfinite(value).all():
                raise ReplyRejected(f"'{p.key}' ({p.what}) must be one finite number, got "
                                    f"{shown(value.ravel()[:3].tolist())}")
            values[p.name] = np.asarray(value, np.float64).reshape(1)
            norms[p.name] = abs(float(value.flat[0]))
        else:
            out = buffer()
            norms[p.name] = model_sized(record, layout, p.key, out, missing=p.missing, what=p.what)
            values[p.name] = out
    return values, norms


def pack_payloads(record: ArrayRecord, layout: Layout, payloads: tuple[Payload, ...],
                  values: dict[str, np.ndarray]) -> ArrayRecord:
    """``record`` with each declared payload's flat vector (``values[name]``) beside the model,
    under its key (prefix + each floating model key)."""
    out = {k: record[k] for k in record.keys()}
    for p in payloads:
        vector = np.asarray(values[p.name])
        if p.scalar:
            out[p.key] = Array(vector.reshape(1))
            continue
        start = 0
        for key, shape, dtype, floating in zip(layout.keys, layout.shapes, layout.dtypes, layout.floating,
                                               strict=True):
            if floating:  # in the model array's own dtype, as the model travels
                size = math.prod(shape)
                out[p.key + key] = Array(np.ascontiguousarray(vector[start:start + size], np.dtype(dtype)).reshape(shape))
                start += size
    return ArrayRecord(out)
