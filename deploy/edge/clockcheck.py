"""The virtual clock against emulated devices, the pure part (``benchmarks/clock_vs_emulation.py``
runs the deployments): a deployed run folder as one :class:`Reply` per client and round, the
clock's profile of each class calibrated from a deployed run (``step_ms``, ``overhead_ms``), a
deadline between classes, the participation call, and the profile as a devices file. No torch,
no Flower."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOLERANCE = 0.15  # issue 29: the median per class within 15%


@dataclass
class Reply:
    """One scheduled client in one round of a deployed run (seconds; None: not measured)."""

    round: int
    client: int
    status: str  # deploy.realised: on time, late, lost, ...
    reply: float | None  # E: push of the round's messages -> the server saw this reply
    train: float | None  # the client's local training
    pre: float | None  # the server created the message -> the node's worker took it up
    work: float | None  # the worker took it up -> its reply was built (train, decode, encode)
    post: float | None  # reply built -> the server saw it (E - (at - sent-at))


def read_replies(run_dir: Path) -> list[Reply]:
    """Every (round, client) of a deployed run folder: ``clients.jsonl`` (statuses and the client's
    own timing) joined with ``metrics.jsonl``'s ``client-reply-time``."""
    rows = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[int(row["round"])] = row
    out = []
    for line in (run_dir / "clients.jsonl").read_text().splitlines():
        rec = json.loads(line)
        r = int(rec["round"])
        for c, status in rec["status"].items():
            def got(key: str, c: str = c, rec: dict = rec) -> float | None:
                return rec.get(key, {}).get(c)

            e = rows.get(r, {}).get("client-reply-time", {}).get(c)
            sent, at, work = got("sent-at"), got("at"), got("receive-to-reply")
            pre = at - work - sent if sent is not None and at is not None and work is not None else None
            post = e - (at - sent) if e is not None and sent is not None and at is not None else None
            out.append(Reply(r, int(c), status, e, got("train-time"), pre, work, post))
    return out


def class_median(replies: list[Reply], classes: Mapping[int, str], name: str, key: str,
                 first_round: int = 2) -> float | None:
    """Median of ``key`` over the class's replies of rounds >= ``first_round`` (None: none)."""
    vals = [v for r in replies if r.round >= first_round and classes[r.client] == name
            and (v := getattr(r, key)) is not None]
    return statistics.median(vals) if vals else None


def calibrate(replies: list[Reply], classes: Mapping[int, str], steps: int,
              transfers: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Class -> the clock's ``step_ms`` and ``overhead_ms`` from a deployed run of ``steps`` local
    steps (rounds 2+, every reply timed): ``step_ms`` = median train / steps; ``overhead_ms`` =
    median (E - train) - the clock's download + upload of the class (``transfers``, s), at least
    0. The overhead is what the deployment pays per message besides the transfers the clock
    times and the training: the ``flwr-clientapp`` process start under the class's CPU cap, the
    polls, (de)serialisation, and for a shaped class the protocol's round trips beyond one per
    transfer. ValueError names a class without a timed reply."""
    out = {}
    for name, transfer in transfers.items():
        timed = [(r.reply, r.train) for r in replies if r.round >= 2 and classes[r.client] == name
                 and r.reply is not None and r.train is not None]
        if not timed:
            raise ValueError(f"class [{name}] has no timed reply in rounds 2+ of the calibration run")
        train = statistics.median(t for _, t in timed)
        rest = statistics.median(e - t for e, t in timed)
        out[name] = {"step_ms": 1000.0 * train / max(1, steps), "overhead_ms": 1000.0 * max(0.0, rest - transfer),
                     "n": float(len(timed))}
    return out


def choose_deadline(predicted: Mapping[str, float]) -> float:
    """A deadline in the widest gap (by ratio) between two classes' predicted times: the geometric
    mean of its ends."""
    vals = sorted(set(predicted.values()))
    if len(vals) < 2:
        raise ValueError("a deadline that separates classes needs two classes with different predicted times")
    _, lo, hi = max((b / a, a, b) for a, b in zip(vals, vals[1:], strict=False))
    return round(math.sqrt(lo * hi), 2)


def agreement(measured: float | None, predicted: float, tolerance: float = TOLERANCE) -> tuple[float | None, bool]:
    """(measured / predicted, within the tolerance)."""
    if measured is None or predicted <= 0:
        return None, False
    ratio = measured / predicted
    return ratio, abs(ratio - 1) <= tolerance


def participation(replies: list[Reply], classes: Mapping[int, str], predicted: Mapping[str, float],
                  deadline: float) -> dict[str, dict[str, Any]]:
    """Per class: the deployment's statuses in rounds 2+ and the clock's call (on time iff
    predicted <= deadline); ``agree``: every round on time when the clock says on time, none
    when it says late."""
    out = {}
    for name, pred in predicted.items():
        counts: dict[str, int] = {}
        for r in replies:
            if r.round >= 2 and classes[r.client] == name:
                counts[r.status] = counts.get(r.status, 0) + 1
        n = sum(counts.values())
        on = counts.get("on time", 0) + counts.get("rejected", 0)
        clock_on = pred <= deadline
        out[name] = {"counts": counts, "rounds": n, "on-time-share": on / n if n else None,
                     "clock": "on time" if clock_on else "late",
                     "agree": bool(n) and (on == n if clock_on else on == 0)}
    return out


def same_matrix(a: list[Reply], b: list[Reply], first_round: int = 2) -> bool:
    """Whether two runs have the same who-answered-in-time matrix from ``first_round`` on."""
    def on(rs: list[Reply]) -> set[tuple[int, int]]:
        return {(r.round, r.client) for r in rs if r.round >= first_round and r.status in ("on time", "rejected")}

    rounds = {r.round for r in a} & {r.round for r in b}
    return {x for x in on(a) if x[0] in rounds} == {x for x in on(b) if x[0] in rounds}


def profile_text(devices: Mapping[str, Mapping[str, Any]], step_ms: Mapping[str, float],
                 overhead_ms: Mapping[str, float] | None = None) -> str:
    """The devices file with each class's ``step_ms`` (and ``overhead_ms``) added: the clock's
    profile of these devices."""
    def value(v: Any) -> str:
        return json.dumps(v) if isinstance(v, (str, list)) else repr(v)

    lines = []
    for name, table in devices.items():
        lines += [f"[{name}]", *(f"{k} = {value(v)}" for k, v in table.items() if k not in ("step_ms", "overhead_ms"))]
        if name in step_ms:
            lines.append(f"step_ms = {step_ms[name]:.4f}")
        if overhead_ms is not None and name in overhead_ms:
            lines.append(f"overhead_ms = {overhead_ms[name]:.1f}")
        lines.append("")
    return "\n".join(lines)
