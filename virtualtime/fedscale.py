"""FedScale's own trace files (Lai et al., ICML 2022; ``benchmark/dataset/data/device_info`` of
SymbioticLab/FedScale), read safely, written as readable text, and mapped onto this project's
devices file and ``trace-intervals`` availability.

FedScale pickles two dicts keyed by client id (``int`` in FedScale's files):

- ``client_device_capacity``: ``{client: {"computation": ms per sample (inference),
  "communication": kbit/s}}``. FedScale times a job as ``3 x batch x steps x computation / 1000``
  s of compute (the backward pass ~2x the forward) and ``(upload + download) kbit / communication``
  s of transfer (``fedscale/cloud/internal/client_metadata.py``).
- ``client_behave_trace``: ``{client: {"active": [s, ...], "inactive": [s, ...], "finish_time": s,
  "duration": s, "model": "<device>"}}``: the client is online while ``t mod finish_time`` lies in
  some ``[active[k], inactive[k]]`` (``ClientMetadata.is_active``).

Both are read with :func:`load_plain_pickle`, an unpickler that refuses every global: a pickle of
dicts, lists, tuples, strings, bytes, numbers, booleans and None loads (those need no global),
anything else (a class, a function, a NumPy scalar) is refused with a :class:`ProfileError`
naming the global, before it is built. Nothing in the file runs.

The text form (``python -m virtualtime convert``) is JSON Lines: a header line
``{"fedscale": "client_device_capacity", "version": 1}`` (or ``"client_behave_trace"``), then one
object per client in the file's order: ``{"client": <id as in the pickle: int or str>, ...its
entry's fields...}``. Text and pickle convert into each other exactly (tuples become lists).
"""

from __future__ import annotations

import io
import json
import math
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import ProfileError

CAPACITY = "client_device_capacity"
BEHAVIOUR = "client_behave_trace"
KINDS = (CAPACITY, BEHAVIOUR)
TEXT_VERSION = 1
#: FedScale's factor from inference ms per sample to a training step's (forward + backward) ms
FEDSCALE_TRAIN_FACTOR = 3.0


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what needs no global; the first global named stops the load."""

    def __init__(self, file: io.BufferedIOBase, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        raise ProfileError(
            f"{self.where}: refused: the pickle needs the global {module}.{name}; a FedScale trace holds only "
            f"dicts, lists, strings and numbers (convert NumPy values to float before pickling)")

    def persistent_load(self, pid: Any) -> Any:
        raise ProfileError(f"{self.where}: refused: the pickle holds a persistent id {pid!r}")


def is_pickle(path: str | Path) -> bool:
    """Whether the file starts like a pickle (protocol 2 or later: the PROTO opcode)."""
    with open(path, "rb") as fin:
        return fin.read(1) == b"\x80"


def load_plain_pickle(path: str | Path) -> Any:
    """The object in a pickle of plain types only (see the module docstring)."""
    where = str(path)
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ProfileError(f"{where}: {err.strerror or err}") from err
    try:
        return _PlainUnpickler(io.BytesIO(data), where).load()
    except ProfileError:
        raise
    except Exception as err:  # any malformed pickle: UnpicklingError, EOFError, ValueError, ...
        raise ProfileError(f"{where}: not a readable pickle ({type(err).__name__}: {err})") from err


def _number(where: str, client: Any, key: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (positive and not value > 0) or value < 0:
        need = "a finite number > 0" if positive else "a finite number >= 0"
        raise ProfileError(f"{where}: client {client!r}: {key!r} must be {need}, got {value!r}")
    return float(value)


def check_capacity(doc: Any, where: str) -> dict[Any, dict[str, Any]]:
    """``doc`` as a device-capacity dict, or a ProfileError naming the first bad client."""
    if not isinstance(doc, dict) or not doc:
        raise ProfileError(f"{where}: a {CAPACITY} is a non-empty dict {{client: {{'computation': ms per "
                           f"sample, 'communication': kbit/s}}}}, got {type(doc).__name__}")
    for client, entry in doc.items():
        if not isinstance(entry, dict) or not {"computation", "communication"} <= set(entry):
            raise ProfileError(f"{where}: client {client!r}: needs 'computation' (ms per sample) and "
                               f"'communication' (kbit/s), got {entry!r}")
        for key in ("computation", "communication"):
            _number(where, client, key, entry[key], positive=True)
    return doc


def check_behaviour(doc: Any, where: str) -> dict[Any, dict[str, Any]]:
    """``doc`` as a behaviour-trace dict, or a ProfileError naming the first bad client."""
    if not isinstance(doc, dict) or not doc:
        raise ProfileError(f"{where}: a {BEHAVIOUR} is a non-empty dict {{client: {{'active': [...], "
                           f"'inactive': [...], 'finish_time': s, ...}}}}, got {type(doc).__name__}")
    for client, entry in doc.items():
        if not isinstance(entry, dict) or not {"active", "inactive", "finish_time"} <= set(entry):
            raise ProfileError(f"{where}: client {client!r}: needs 'active', 'inactive' (lists of seconds) and "
                               f"'finish_time' (s), got keys {sorted(map(str, entry)) if isinstance(entry, dict) else entry!r}")
        period = _number(where, client, "finish_time", entry["finish_time"], positive=True)
        on, off = entry["active"], entry["inactive"]
        if not isinstance(on, (list, tuple)) or not isinstance(off, (list, tuple)) or len(on) != len(off):
            raise ProfileError(f"{where}: client {client!r}: 'active' and 'inactive' must be lists of the same "
                               f"length, got {len(on) if isinstance(on, (list, tuple)) else on!r} and "
                               f"{len(off) if isinstance(off, (list, tuple)) else off!r}")
        prev = -math.inf
        for k, (a, b) in enumerate(zip(on, off, strict=True)):
            a = _number(where, client, f"active[{k}]", a, positive=False)
            b = _number(where, client, f"inactive[{k}]", b, positive=False)
            if not prev <= a <= b:
                raise ProfileError(f"{where}: client {client!r}: interval {k} [{a:g}, {b:g}] must start after the "
                                   f"previous one ends and not end before it starts")
            prev = b
        if on and prev > period:
            raise ProfileError(f"{where}: client {client!r}: its last interval ends at {prev:g} s, after its "
                               f"finish_time {period:g} s")
    return doc


CHECKS = {CAPACITY: check_capacity, BEHAVIOUR: check_behaviour}


def kind_of(doc: Mapping[Any, Any]) -> str:
    """Which of FedScale's two traces a dict is, from its first entry's keys."""
    first = next(iter(doc.values()), None) if isinstance(doc, dict) else None
    if isinstance(first, dict) and "computation" in first:
        return CAPACITY
    if isinstance(first, dict) and "active" in first:
        return BEHAVIOUR
    raise ProfileError(f"neither a {CAPACITY} (entries with 'computation') nor a {BEHAVIOUR} (entries with "
                       f"'active'): first entry {first!r}")


def read_pickle(path: str | Path, kind: str | None = None) -> tuple[str, dict[Any, dict[str, Any]]]:
    """(kind, dict) of a FedScale trace pickle, checked; ``kind`` None: from its entries."""
    doc = load_plain_pickle(path)
    kind = kind or kind_of(doc)
    return kind, CHECKS[kind](doc, str(path))


def _plain(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def to_text(kind: str, doc: Mapping[Any, Mapping[str, Any]]) -> str:
    """The JSON Lines text of a trace (module docstring)."""
    lines = [json.dumps({"fedscale": kind, "version": TEXT_VERSION})]
    for client, entry in doc.items():
        if isinstance(client, bool) or not isinstance(client, (int, str)):
            raise ProfileError(f"client id {client!r}: only int or str ids have a text form")
        if "client" in entry:
            raise ProfileError(f"client {client!r}: its entry has a field 'client', the text form's id field")
        lines.append(json.dumps({"client": client, **_plain(dict(entry))}, allow_nan=False))
    return "\n".join(lines) + "\n"


def read_text(path: str | Path) -> tuple[str, dict[Any, dict[str, Any]]]:
    """(kind, dict) of a trace in the text form, checked."""
    where = str(path)
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ProfileError(f"{where}: {getattr(err, 'strerror', None) or err}") from err
    rows = [(n, line) for n, line in enumerate(lines, start=1) if line.strip()]
    try:
        header = json.loads(rows[0][1]) if rows else None
    except json.JSONDecodeError as err:
        raise ProfileError(f"{where}, line 1: not JSON ({err})") from err
    if not isinstance(header, dict) or header.get("fedscale") not in KINDS:
        raise ProfileError(f"{where}, line 1: expected the header {{\"fedscale\": one of {list(KINDS)}, "
                           f"\"version\": {TEXT_VERSION}}}, got {rows[0][1] if rows else 'an empty file'!r}")
    if header.get("version") != TEXT_VERSION:
        raise ProfileError(f"{where}, line 1: version {header.get('version')!r}; this reader knows version "
                           f"{TEXT_VERSION}")
    doc: dict[Any, dict[str, Any]] = {}
    for n, line in rows[1:]:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ProfileError(f"{where}, line {n}: not JSON ({err})") from err
        client = entry.pop("client", None) if isinstance(entry, dict) else None
        if isinstance(client, bool) or not isinstance(client, (int, str)):
            raise ProfileError(f"{where}, line {n}: expected an object with a 'client' id (int or str), got {line!r}")
        if client in doc:
            raise ProfileError(f"{where}, line {n}: client {client!r} appears twice")
        doc[client] = entry
    kind = header["fedscale"]
    return kind, CHECKS[kind](doc, where)


def read_any(path: str | Path) -> tuple[str, dict[Any, dict[str, Any]]]:
    """A FedScale trace from its pickle or its text form, whichever the file is."""
    try:
        pickled = is_pickle(path)
    except OSError as err:
        raise ProfileError(f"{path}: {err.strerror or err}") from err
    return read_pickle(path) if pickled else read_text(path)


def node_key(keys: list[Any], node: int) -> Any:
    """The trace client of SuperNode ``node`` (0-based), as FedScale maps its client ``node + 1``
    onto a behaviour trace: ``keys[(node + 1) % len(keys)]`` in the file's order
    (``ClientManager.register_client``)."""
    return keys[(node + 1) % len(keys)]


def intervals_from_behaviour(doc: Mapping[Any, Mapping[str, Any]], num_nodes: int,
                             period: float | None = None) -> tuple[dict[str, Any], list[str]]:
    """A ``trace-intervals`` document for ``num_nodes`` clients (mapped by :func:`node_key`) and
    notes on what is approximate. Its period is ``period`` or the longest ``finish_time`` of the
    mapped clients; each client's cycle repeats every ``finish_time`` within it and is cut at the
    period's end, which is exact when every ``finish_time`` divides the period."""
    if num_nodes < 1:
        raise ProfileError(f"num_nodes = {num_nodes} must be >= 1")
    keys = list(doc)
    chosen = [doc[node_key(keys, i)] for i in range(num_nodes)]
    cycles = [float(e["finish_time"]) for e in chosen]
    span = max(cycles) if period is None else float(period)
    if not (math.isfinite(span) and span > 0):
        raise ProfileError(f"period = {period!r} must be a number of seconds > 0")
    notes = []
    inexact = sorted({c for c in cycles if abs(span / c - round(span / c)) > 1e-9})
    if inexact:
        notes.append(f"{sum(c in inexact for c in cycles)} of {num_nodes} clients have a finish_time that does not "
                     f"divide the period {span:g} s (e.g. {inexact[0]:g} s): their last cycle is cut at the period's "
                     f"end, and the period then starts their cycle again")
    clients: dict[str, list[list[float]]] = {}
    for i, (entry, cycle) in enumerate(zip(chosen, cycles, strict=True)):
        rows: list[list[float]] = []
        offset = 0.0
        while offset < span:
            for a, b in zip(entry["active"], entry["inactive"], strict=True):
                start, end = offset + float(a), min(offset + float(b), span)
                if start < end:
                    rows.append([start, end])
            offset += cycle
        clients[str(i)] = rows
    return {"period": span, "clients": clients}, notes


def capacity_rows(doc: Mapping[Any, Mapping[str, Any]]) -> dict[str, tuple[float, float]]:
    """client -> (ms per sample, kbit/s), the shape :func:`virtualtime.traces.classes_from_trace` reads."""
    return {str(k): (float(v["computation"]), float(v["communication"])) for k, v in doc.items()}


def devices_per_client(doc: Mapping[Any, Mapping[str, Any]], num_nodes: int, batch_size: int) -> str:
    """A devices file (TOML text) with one class per SuperNode, node i taking FedScale's profile
    of its client ``i + 1`` (key ``(i + 1) mod len`` as the aggregator looks it up, else the
    ``(i + 1) mod len``-th in file order): ``step_ms = 3 x batch_size x computation`` (FedScale's
    training time per step) and ``up_kbps = down_kbps = communication``."""
    if num_nodes < 1 or batch_size < 1:
        raise ProfileError(f"num_nodes = {num_nodes} and batch_size = {batch_size} must be >= 1")
    keys = list(doc)
    out = [f"# {num_nodes} SuperNodes from a FedScale {CAPACITY} ({len(keys)} clients), batch size "
           f"{batch_size}: step_ms = {FEDSCALE_TRAIN_FACTOR:g} x batch x ms per sample (FedScale's job time)\n"]
    for i in range(num_nodes):
        mapped = (i + 1) % len(keys)
        key = mapped if mapped in doc else keys[mapped]
        entry = doc[key]
        kbps = max(1, int(round(float(entry["communication"]))))
        step = FEDSCALE_TRAIN_FACTOR * batch_size * float(entry["computation"])
        out.append(f"[node-{i}]\nclients = [{i}]\n# FedScale client {key!r}\nstep_ms = {step:.6g}\n"
                   f"up_kbps = {kbps}\ndown_kbps = {kbps}\n")
    return "\n".join(out)
