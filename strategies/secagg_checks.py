"""What the server checks in a SecAgg+ round it cannot see into: each stage reply's form, and the
unmasked sum's weight element and integer range (issue 47, item 4).

A SecAgg+ client knows its own unmasked integers, so it can edit the sum through its masked
vector; and Flower's stage code reads each reply's fields without checking them (a masked vector
one entry short, a stage-2 reply without ``masked_params``, a stage-3 reply with one share fewer
than node ids raise inside the stage). Two checks close both:

- :func:`reply_problem`, before Flower's stage reads a reply: the fields that stage reads, with
  their types, lengths and shapes (the masked vector: Flower's weight element and one entry per
  floating entry of the model; the shares: one per node id, each of a node the stage asked
  about). A malformed reply names its node; the secure round drops it and fails closed.
- :func:`sum_problem`, on the unmasked integers (before Flower divides by its weight element):
  each honest client sends the weight element ``quantization_range`` (weight 1 = max weight) and
  entries in [0, ``quantization_range``] (Flower's quantiser, ``flwr.common.secure_aggregation.
  quantization.quantize``), so the survivors' sum must have element 0 = n × ``quantization_range``
  exactly and every entry in [0, n × ``quantization_range``]. Setting one's weight element to 0
  (Flower divides by the sum: inf, the round silently dropped) or 1 (the round scaled by 2²² n),
  or shifting one's entries by 2³¹ quanta, breaks one of them.

:func:`capture_sum` reads the unmasked integers where Flower's ``unmask_stage`` splits off the
weight element (``factor_extract``, looked up in the workflow module): the one touch of Flower's
internals here, and a completed round without it fails closed (so a Flower that changes it is
caught by every secure test).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.ndarrays_arithmetic import factor_extract
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.server.workflow.secure_aggregation import secaggplus_workflow


def model_entries(content: Any) -> int:
    """The length of a client's masked update for a train message content: its floating entries
    (``client_app.secure.weighted_update``'s layout)."""
    arrays = content.array_records["arrays"].to_numpy_ndarrays()
    return int(sum(a.size for a in arrays if a.dtype.kind == "f"))


# what a ClientApp that lacks the client's half of secure=secagg+ does with SecAgg+'s setup message
# (its train handler runs on it: an exception, or a plain reply), and what to change
SECURE_CLIENT_HINT = ("the ClientApp lacks the secure client half: add client_app.secure.secure_mod to its "
                      "mods (ClientApp(mods=[secure_mod, ...]); docs/secure-aggregation.md)")


def reply_problem(stage: str, reply: Message, sent: Message | None, entries: int) -> str:
    """Why ``reply`` (to ``sent``, stage ``stage``) is not a well-formed SecAgg+ reply ("" when it is)."""
    try:
        record = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        if record is None:
            return (f"no '{RECORD_KEY_CONFIGS}' record" if stage != Stage.SETUP else
                    f"no '{RECORD_KEY_CONFIGS}' record in its setup reply: {SECURE_CLIENT_HINT}")
        if stage == Stage.SETUP:
            return _bytes_fields(record, (Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2))
        if stage == Stage.SHARE_KEYS:
            return _pairs(record, Key.DESTINATION_LIST, Key.CIPHERTEXT_LIST, int, bytes)
        if stage == Stage.COLLECT_MASKED_VECTORS:
            return _masked_vector(reply, record, entries)
        if stage == Stage.UNMASK:
            why = _pairs(record, Key.NODE_ID_LIST, Key.SHARE_LIST, int, bytes)
            asked_of: Any = sent.content.config_records[RECORD_KEY_CONFIGS] if sent else {}
            asked = {int(n) for key in (Key.ACTIVE_NODE_ID_LIST, Key.DEAD_NODE_ID_LIST) for n in asked_of.get(key) or []}
            listed: Any = record[Key.NODE_ID_LIST] if not why else []
            ids = [int(n) for n in listed]
            if not why and (len(set(ids)) != len(ids) or not set(ids) <= asked):
                why = f"its {Key.NODE_ID_LIST} {sorted(ids)[:8]} are not distinct nodes of those asked about {sorted(asked)[:8]}"
            return why
    except Exception as err:  # noqa: BLE001  # anything a hostile reply can make a read raise
        return f"unreadable ({type(err).__name__}: {str(err)[:120]})"
    return ""


def _bytes_fields(record: Any, keys: tuple[str, ...]) -> str:
    missing = [k for k in keys if not isinstance(record.get(k), bytes)]
    return f"no bytes field(s) {missing}" if missing else ""


def _pairs(record: Any, first: str, second: str, kind_a: type, kind_b: type) -> str:
    a, b = record.get(first), record.get(second)
    if not isinstance(a, list) or not isinstance(b, list):
        return f"fields {first!r} and {second!r} are not both lists"
    if len(a) != len(b):
        return f"{len(a)} {first} but {len(b)} {second}"
    if not all(isinstance(v, kind_a) and not isinstance(v, bool) for v in a) or not all(isinstance(v, kind_b) for v in b):
        return f"{first} / {second} of the wrong types"
    return ""


def _masked_vector(reply: Message, record: Any, entries: int) -> str:
    blobs = record.get(Key.MASKED_PARAMETERS)
    if not isinstance(blobs, list) or not all(isinstance(b, bytes) for b in blobs):
        return f"no '{Key.MASKED_PARAMETERS}' (a list of arrays)"
    arrays = [bytes_to_ndarray(b) for b in blobs]
    shapes = [tuple(a.shape) for a in arrays]
    if shapes != [(1,), (entries,)] or any(a.dtype.kind not in "iu" for a in arrays):
        return (f"its masked vector has arrays {shapes} of {[a.dtype.str for a in arrays]}, expected integers of "
                f"shapes {[(1,), (entries,)]} (the weight element, then one entry per model entry)")
    compat.recorddict_to_fitres(reply.content, keep_input=True)  # what Flower reads next (metrics)
    return ""


def sum_problem(q_total: int, integers: list[np.ndarray], survivors: int, quantization_range: int) -> str:
    """Why the unmasked integer sum of ``survivors`` honest vectors cannot be this one ("" when it can)."""
    need = survivors * quantization_range
    if int(q_total) != need:
        return (f"its weight element (Flower's q_total_ratio) is {int(q_total)}, but {survivors} survivor(s) of "
                f"weight 1 sum to {survivors} × {quantization_range} = {need}")
    low = min((int(a.min()) for a in integers if a.size), default=0)
    high = max((int(a.max()) for a in integers if a.size), default=0)
    if low < 0 or high > need:
        return (f"its entries span [{low}, {high}] quanta, beyond [0, {need}] (each of {survivors} survivor(s) "
                f"quantises into [0, {quantization_range}]): a vector was shifted")
    return ""


@contextlib.contextmanager
def capture_sum(into: dict[str, Any]) -> Iterator[None]:
    """While active, Flower's ``unmask_stage`` hands its unmasked integers to ``into``
    (``q_total``, ``integers``) where it splits off the weight element."""
    original = secaggplus_workflow.factor_extract

    def extract(parameters: list[np.ndarray]) -> tuple[int, list[np.ndarray]]:
        q_total, rest = factor_extract(parameters)
        into["q_total"], into["integers"] = int(q_total), [np.asarray(a) for a in rest]
        return q_total, rest

    secaggplus_workflow.factor_extract = extract
    try:
        yield
    finally:
        secaggplus_workflow.factor_extract = original


FAILS_CLOSED = "the round fails closed (no update applied)"  # an attack's consequence
DROPPED = "its node dropped, the round run again without it"  # a named node's, before the stage that trains


def attack_reason(node: int | None, stage: str, why: str, who: str = "", then: str = FAILS_CLOSED) -> str:
    """One attack's line for the round's record (``who``: the culprit when no node can be named;
    ``then``: what the round does about it)."""
    who = f"node {node}" if node is not None else who or "a survivor (not attributable: the sum is masked)"
    return f"SecAgg+ attack at stage {stage}: {who}: {why}: {then}"


def problems_of(replies: list[Message], sent: Mapping[int, Message], node_of: Mapping[str, int], stage: str,
                entries: int) -> list[tuple[int, str]]:
    """(node, why) for every malformed non-error reply of one stage."""
    out = []
    for m in replies:
        if m.has_error():
            continue
        node = node_of.get(m.metadata.reply_to_message_id, m.metadata.src_node_id)
        if why := reply_problem(stage, m, sent.get(node), entries):
            out.append((node, why))
    return out
