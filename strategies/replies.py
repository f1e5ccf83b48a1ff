"""Training replies -> :class:`ClientReport`: parsing and validation, one reply at a time.

A reply is one ArrayRecord (the client's model x_i^{t,end}) and one MetricRecord. It becomes a
:class:`ClientReport` (Δ_i = x_i − x^t as one flat float32 vector, counts, a-norm, loss) or a
:class:`ReplyRejected` naming the problem. :class:`ReplyParser` holds a rule's requirements
(which metrics, client ids, count ranges); the metric readers (:func:`count`, :func:`finite`,
:func:`positive`) are shared with every other reader of client metrics (power-of-choice's probe,
MIFA's lr). :func:`source_node` traces a SuperLink-relayed error back to its node.
"""

from __future__ import annotations

import io
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common.constant import SType
from numpy.lib import format as npy

from .layout import Layout, as_model_integers, safe_norm
from .metrics import canonical, claimed_client_id, names
from .protocol import A_NORM, CLIENT_ID, CLIENT_RULE, NUM_EXAMPLES, NUM_STEPS, PLAIN_RULE, TRAIN_LOSS

SUPERLINK_NODE_ID = 1  # src_node_id of errors the SuperLink writes on a node's behalf


class ReplyRejected(ValueError):
    """A reply that must not reach the model; the message says why."""


@dataclass
class ClientReport:
    """One valid training reply, as the rules see it."""

    client_id: int
    node_id: int
    # Δ_i = x_i^{t,end} − x^t, flat float32 (the server ADDS it). From a reply, it lives in a
    # buffer the base reuses next round: a rule that keeps Δ_i across rounds copies it (as the
    # tables do)
    delta: np.ndarray
    num_examples: int
    num_steps: int | None = None
    a_norm: float | None = None  # FedNova's ‖a_i‖_1
    train_loss: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    integers: dict[str, np.ndarray] = field(default_factory=dict)  # the non-floating arrays, exact
    norm: float | None = None  # ‖Δ_i‖₂, computed once while parsing (None: not yet)
    # the rule's declared payloads (:class:`Payload`) by name, flat float32 (Δc_i, u_i, the echo
    # factor), and their norms; model-sized ones live in the base's reply buffers, as ``delta``
    payloads: dict[str, np.ndarray] = field(default_factory=dict)
    payload_norms: dict[str, float] = field(default_factory=dict)


@dataclass
class RoundLog:
    """Who did what in one round, for the ServerApp's per-round record."""

    sent: list[int] = field(default_factory=list)  # node ids addressed
    participants: list[int] = field(default_factory=list)  # client ids of valid replies
    unavailable: list[int] = field(default_factory=list)  # node ids: error or no reply
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (node id, reason)
    # (node id, the exception quoted) of error replies whose ClientApp failed (not churn: still
    # counted as unavailable, and recorded with the reason: strategies.failures.client_failure)
    errors: list[tuple[int, str]] = field(default_factory=list)
    cut: list[tuple[int, str]] = field(default_factory=list)  # (node id, why): kept, scaled to a bound

    def cut_record(self) -> dict[str, list[list[int | str]]]:
        """The round record's ``cut`` (absent when no reply was cut to a norm bound)."""
        return {"cut": [[node, brief(why)] for node, why in self.cut]} if self.cut else {}

    def errors_record(self) -> dict[str, list[list[int | str]]]:
        """The round record's ``client-errors`` (absent when no ClientApp failed)."""
        return {"client-errors": [[node, why] for node, why in self.errors]} if self.errors else {}


# -------------------------------------------------------------- what a reason may show
SHOWN_CHARS = 60  # of a value a reply sent, in a reason
REASON_CHARS = 300  # of one rejection reason, in logs and metrics.jsonl


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """A value a reply sent, for a reason: its repr when short, else its start and its size (a
    1e6-element list becomes ``list of 1000000 items [1, 2, 3, 4]...``). Never builds the repr
    of a whole long container or string."""
    if isinstance(value, (str, bytes)):
        if len(value) <= limit:
            return repr(value)
        return f"{type(value).__name__} of {len(value)} chars {repr(value[:limit])}..."
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        text = "[" + ", ".join(shown(v, 12) for v in itertools.islice(value, 4)) + "]"
        if len(value) <= 4 and len(text) <= limit:
            return text
        return f"{type(value).__name__} of {len(value)} items {text[:limit]}..."
    size = getattr(value, "size", None)
    if isinstance(size, int) and size > 4:  # an ndarray
        return f"{type(value).__name__} of {size} items"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def brief(reason: str, limit: int = REASON_CHARS) -> str:
    """A reason cut to ``limit`` characters (its length said), for logs and results files."""
    return reason if len(reason) <= limit else f"{reason[:limit]}... ({len(reason)} chars)"


# ----------------------------------------------------------------------- metric readers
def count(metrics: Mapping[str, Any], key: str, low: int, high: int, default: Any = ReplyRejected) -> Any:
    """``metrics[key]`` as an integer in [low, high] (an integral float is accepted); ``default``
    when absent (ReplyRejected when no default)."""
    if key not in metrics:
        if default is ReplyRejected:
            raise ReplyRejected(f"metric '{key}' missing")
        return default
    value = metrics[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ReplyRejected(f"metric '{key}'={shown(value)} is not an integer in [{low}, {high}]")
    return value


def finite(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a finite float (not a bool), None when absent."""
    if key not in metrics:
        return None
    value = metrics[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReplyRejected(f"metric '{key}'={shown(value)} is not a finite number")
    return float(value)


def positive(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a finite float > 0, None when absent."""
    value = finite(metrics, key)
    if value is not None and value <= 0:
        raise ReplyRejected(f"metric '{key}'={value!r} must be > 0")
    return value


# ------------------------------------------------------------------------- arrays
REAL_KINDS = "fiu"  # floating, signed and unsigned integer: the dtypes a model array may have
HEADER_READERS = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}


HEADERS: dict[bytes, tuple[tuple[int, ...], bool, np.dtype, int]] = {}  # header bytes -> what they say
MAX_HEADERS = 1024  # headers remembered (then forgotten all at once: a hostile stream cannot grow it)
MAX_CACHED_HEADER = 512  # bytes; longer headers are parsed every time


def read_header(data: bytes, key: str) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, Fortran order, dtype, data offset) of ``.npy`` bytes, read with numpy's own header
    readers; ReplyRejected when they cannot be read. The headers of a model's arrays repeat in
    every reply: the answer for the same header bytes is remembered (numpy parses the header's
    text with ``ast.literal_eval``, a fifth of a small array's decoding)."""
    try:
        end = (10 + int.from_bytes(data[8:10], "little") if data[6:8] == b"\x01\x00"
               else 12 + int.from_bytes(data[8:12], "little") if data[6:8] == b"\x02\x00" else 0)
    except Exception:  # noqa: BLE001 (not bytes: numpy's reader below says what is wrong)
        end = 0
    head = bytes(data[:end]) if 0 < end <= MAX_CACHED_HEADER else None
    known = HEADERS.get(head) if head is not None else None
    if known is not None:
        return known
    try:
        stream = io.BytesIO(data)
        version = npy.read_magic(stream)
        if version not in HEADER_READERS:
            raise ValueError(f".npy format version {version}")
        shape, fortran, dtype = HEADER_READERS[version](stream)
    except Exception as exc:  # noqa: BLE001 (any decoding error is this reply's problem)
        raise ReplyRejected(f"array '{key}' cannot be decoded: {type(exc).__name__}: {brief(str(exc), 120)}") from None
    answer = (tuple(shape), bool(fortran), dtype, stream.tell())
    if head is not None and stream.tell() == end:
        if len(HEADERS) >= MAX_HEADERS:
            HEADERS.clear()
        HEADERS[head] = answer
    return answer


def decode(array: Array, key: str, shape: tuple[int, ...] | None = None, kinds: str = REAL_KINDS) -> np.ndarray:
    """The ndarray an :class:`Array` holds, checked: Flower's ``numpy.ndarray`` serialisation
    (the ``.npy`` format, read with numpy's own header readers and no copy), a real floating or
    integer dtype (no bools, complex, datetimes, strings or objects; ``kinds`` adds ``"b"`` for a
    model's own boolean array), exactly as many bytes as its shape needs, and that shape equal to
    the declared one (and to ``shape`` when given). Anything else is a ReplyRejected naming the
    array."""
    if array.stype != SType.NUMPY:
        raise ReplyRejected(f"array '{key}' has stype {shown(array.stype)}, not {SType.NUMPY!r}")
    data = array.data
    real_shape, fortran, dtype, offset = read_header(data, key)
    if dtype.kind not in kinds or dtype.fields is not None:
        raise ReplyRejected(f"array '{key}' has dtype {shown(str(dtype))}, not a real floating or integer type")
    if tuple(real_shape) != tuple(array.shape) or (shape is not None and tuple(real_shape) != shape):
        expected = tuple(array.shape) if shape is None else shape
        raise ReplyRejected(f"array '{key}' holds shape {tuple(real_shape)}, declared {tuple(array.shape)}, "
                            f"expected {expected}")
    count = math.prod(real_shape)
    if len(data) - offset != count * dtype.itemsize:
        raise ReplyRejected(f"array '{key}' has {len(data) - offset} data bytes, its shape {tuple(real_shape)} "
                            f"of {dtype} needs {count * dtype.itemsize}")
    flat = np.frombuffer(data, dtype, count, offset)
    return flat.reshape(real_shape[::-1]).T if fortran else flat.reshape(real_shape)


def model_delta(arrays: Mapping[str, Array], layout: Layout, current: np.ndarray,
                out: np.ndarray | None = None) -> tuple[np.ndarray, float, dict[str, np.ndarray]]:
    """(Δ = the reply's floating arrays − x^t as one flat float32 vector, ‖Δ‖₂, the non-floating
    arrays in the model's dtypes), every array decoded and checked (:func:`decode`), the floating
    ones cast to float32 and subtracted in one pass (into ``out`` when given), the others
    converted exactly (:func:`strategies.layout.as_model_integers`); ReplyRejected when the keys
    differ from the model's, Δ is not finite after the cast (NaN, Inf, or beyond float32) or an
    integer array does not fit the model's dtype."""
    if tuple(arrays.keys()) != layout.keys:
        raise ReplyRejected(f"array keys {shown(list(arrays.keys()))} differ from the model's")
    delta = np.empty(layout.size, np.float32) if out is None else out
    integers: dict[str, np.ndarray] = {}
    start = 0
    with np.errstate(over="ignore", invalid="ignore"):
        for key, shape, dtype, floating, array in zip(layout.keys, layout.shapes, layout.dtypes, layout.floating,
                                                      arrays.values(), strict=True):
            if not floating:  # beside the vector, exactly (strategies.layout)
                boolean = np.dtype(dtype).kind == "b"
                values = decode(array, key, shape, REAL_KINDS + "b" if boolean else REAL_KINDS)
                try:
                    integers[key] = as_model_integers(key, values, dtype)
                except ValueError as exc:
                    raise ReplyRejected(str(exc)) from None
                continue
            values = decode(array, key, shape)
            end = start + values.size
            np.subtract(values.reshape(-1), current[start:end], out=delta[start:end], dtype=np.float32)
            start = end
    norm = safe_norm(delta)
    if not math.isfinite(norm):
        raise ReplyRejected("arrays contain NaN or Inf (after the cast to float32)")
    return delta, norm, integers


# ------------------------------------------------------------------------ messages
def model_sized(record: ArrayRecord, layout: Layout, prefix: str, out: np.ndarray, *, missing: str,
                what: str) -> float:
    """Decode the model-sized array a reply carries beside its model (``prefix + key`` for every
    floating key of ``layout``: FedAWE's echoed u_i, SCAFFOLD's Δc_i) into ``out`` as one flat
    float32 vector; its norm. ReplyRejected when a key is absent (``missing``, with the key's name
    in front) or the vector is not finite after the cast (``what`` names it)."""
    start = 0
    with np.errstate(over="ignore", invalid="ignore"):
        for key, shape, floating in zip(layout.keys, layout.shapes, layout.floating, strict=True):
            if not floating:  # integer arrays are no part of the flat model (strategies.layout)
                continue
            name = prefix + key
            if name not in record:
                raise ReplyRejected(f"reply lacks '{name}': {missing}")
            values = decode(record[name], name, shape)
            out[start : start + values.size] = values.reshape(-1)
            start += values.size
    norm = safe_norm(out)
    if not math.isfinite(norm):
        raise ReplyRejected(f"{what} contains NaN or Inf (after the cast to float32)")
    return norm


def source_node(msg: Message, node_of_message: Mapping[str, int]) -> int:
    """The node a reply speaks for: its sender, or for an error the SuperLink wrote on a node's
    behalf (``src_node_id == 1``), the node the replied-to message went to."""
    node = msg.metadata.src_node_id
    if node == SUPERLINK_NODE_ID:
        node = node_of_message.get(msg.metadata.reply_to_message_id, node)
    return node


def destinations(sent: Iterable[Message]) -> dict[str, int]:
    """message id -> destination node, for :func:`source_node`."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in sent}


def split(content: RecordDict) -> tuple[str, ArrayRecord, dict[str, Any]]:
    """A reply's (array record name, ArrayRecord, metrics), or ReplyRejected."""
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        raise ReplyRejected(
            f"expected one ArrayRecord and one MetricRecord, got "
            f"{shown(list(content.array_records))} and {shown(list(content.metric_records))}"
        )
    name, arrays = next(iter(content.array_records.items()))
    return name, arrays, dict(next(iter(content.metric_records.values())))


@dataclass(frozen=True)
class ReplyParser:
    """A rule's requirements on a training reply.

    rule : the rule's name (in reasons).
    required : metrics every reply must carry; ``hints`` gives a missing one's own reason.
    needs_client_ids : the rule keeps per-client rows 0..N-1 (informational: ``fallback`` decides).
    num_clients : N; a client id must lie in [0, N) (any id >= 0 when None).
    max_num_examples, max_num_steps : replies claiming more are absurd.
    weighted_by_key : where ``num-examples`` is read (Flower's argument of that name).
    fallback : the client id of a reply that reports none, given its node (rules with per-client
        rows: a row of their own, or ReplyRejected); None: the node id.

    Metrics are read under the project's names or Flower's (:func:`strategies.metrics.canonical`).
    """

    rule: str
    required: tuple[str, ...] = (NUM_EXAMPLES,)
    hints: Mapping[str, str] = field(default_factory=dict)
    needs_client_ids: bool = False
    num_clients: int | None = None
    max_num_examples: int = 10**9
    max_num_steps: int = 10**7
    weighted_by_key: str = NUM_EXAMPLES
    fallback: Callable[[int], int] | None = None

    def parse(self, content: RecordDict, node: int, layout: Layout, current: np.ndarray,
              out: np.ndarray | None = None) -> ClientReport:
        """One reply's content -> ClientReport, or ReplyRejected naming the problem."""
        _, arrays, metrics = split(content)
        return self.report(arrays, metrics, node, layout, current, out)

    def report(self, arrays: Mapping[str, Array], metrics: dict[str, Any], node: int, layout: Layout,
               current: np.ndarray, out: np.ndarray | None = None) -> ClientReport:
        """The model ``arrays`` and ``metrics`` of one reply -> ClientReport (or ReplyRejected);
        Δ is written into ``out`` when given."""
        metrics = canonical(metrics, self.weighted_by_key)
        for key, hint in self.hints.items():
            if key not in metrics:
                raise ReplyRejected(hint)
        missing = [k for k in self.required if k not in metrics]
        if missing:
            said = ", ".join(f"'{self.weighted_by_key}'" if k == NUM_EXAMPLES else names(k) for k in missing)
            raise ReplyRejected(f"the train reply lacks metric {said}, which strategy '{self.rule}' "
                                f"needs: add it to the ClientApp's train reply MetricRecord")
        delta, norm, integers = model_delta(arrays, layout, current, out)
        if CLIENT_ID in metrics:
            client_id = count(metrics, CLIENT_ID, 0, (self.num_clients or 2**63) - 1)
        else:
            client_id = node if self.fallback is None else self.fallback(node)
        return ClientReport(
            client_id=client_id,
            node_id=node,
            delta=delta,
            num_examples=count(metrics, NUM_EXAMPLES, 1, self.max_num_examples),
            num_steps=count(metrics, NUM_STEPS, 1, self.max_num_steps, default=None),
            a_norm=positive(metrics, A_NORM),
            train_loss=finite(metrics, TRAIN_LOSS),
            metrics=metrics,
            integers=integers,
            norm=norm,
        )


def reply_slots(replies: Sequence[Message], nodes: list[int]) -> list[int]:
    """Each reply's rank by (the client id it claims, its node): its row of the round's reply
    memory (:meth:`strategies.layout.Scratch.begin`), so that the accepted replies, sorted by
    client id, are consecutive rows in that order whatever the order they arrived in."""
    keys = [(math.inf if m.has_error() else claimed_client_id(m.content), n) for m, n in zip(replies, nodes, strict=True)]
    slot = [0] * len(replies)
    for rank, i in enumerate(sorted(range(len(replies)), key=keys.__getitem__)):
        slot[i] = rank
    return slot


def keeps_client_state(sent: Sequence[Message]) -> bool:
    """Whether the round's train messages ask the clients to run a client rule (SCAFFOLD's
    control variate, FedAWE's and FedPBC's kept copy): state a client carries across rounds, so
    that its change on return grows with its absence (:meth:`NormBounds.gap_factor`)."""
    for msg in sent[:1]:
        for record in msg.content.config_records.values():
            if CLIENT_RULE in record:
                return bool(record[CLIENT_RULE] != PLAIN_RULE)
    return False


def metric_records(content: RecordDict) -> RecordDict:
    """``content`` without its arrays: what ``train_metrics_aggr_fn`` reads, kept for the round."""
    return RecordDict({k: v for k, v in content.items() if not isinstance(v, ArrayRecord)})
