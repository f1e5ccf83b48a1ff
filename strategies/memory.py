"""Server-side per-client memory: one float32 N × d table, in RAM or disk-backed.

MIFA (Gu et al., NeurIPS 2021) and FedVARP (Jhunjhunwala et al., UAI 2022) keep the latest update
of every client: N model-size vectors. :class:`ClientTable` stores them as ONE float32 matrix,
row i for client id i, zero at start, and keeps a running float64 sum of the rows so that the
mean over all rows costs O(d) per changed row instead of O(N d) per round.

``directory=""`` keeps the matrix in RAM; any other value puts it in an ``np.memmap`` file in that
folder (for large N·d: the OS pages rows in and out). The file is private to the table and removed
when the table is closed or garbage-collected; a checkpoint (:meth:`state_dict`) holds a COPY of
the matrix, so it stays restorable after the file is gone.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from .base import log
from .contract import Finished, Needs, RoundContext, Rule
from .replies import ClientReport
from .rule import Rule as HookRule
from .state import kept_as

COLUMN_BLOCK = 1 << 17  # columns per block of set_rows: few Python steps, the blocks of the sums in cache


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


class ClientTable:
    """A float32 (num_rows, dim) matrix with a running row sum and a "seen" mask.

    Parameters
    ----------
    num_rows : N, one row per client id 0..N-1 (or per cluster).
    dim : d, the flat model size.
    directory : "" for RAM; otherwise a folder for the disk-backed ``np.memmap`` file.
    name : prefix of the memmap file name (readability only).
    """

    def __init__(self, num_rows: int, dim: int, directory: str | Path = "", name: str = "table") -> None:
        if num_rows < 1 or dim < 0:
            raise ValueError(f"ClientTable needs num_rows >= 1 and dim >= 0; got {num_rows}, {dim}")
        self.num_rows, self.dim = int(num_rows), int(dim)
        self.directory = str(directory)
        self.path: str | None = None
        if self.directory and self.dim > 0:
            folder = Path(self.directory).expanduser()
            folder.mkdir(parents=True, exist_ok=True)
            fd, self.path = tempfile.mkstemp(prefix=f"{name}-", suffix=".f32", dir=folder)
            os.close(fd)
            self._finalizer = weakref.finalize(self, _remove, self.path)
            # mode "w+" creates a zero-filled (sparse) file of the right size
            self._rows: np.ndarray = np.memmap(self.path, np.float32, mode="w+", shape=(self.num_rows, self.dim))
        else:
            self._rows = np.zeros((self.num_rows, self.dim), np.float32)
        self._sum = np.zeros(self.dim, np.float64)
        self.seen = np.zeros(self.num_rows, bool)
        self.silent = np.zeros(self.num_rows, np.int64)  # rounds since the row was last set
        self.longest = np.zeros(self.num_rows, np.int64)  # the longest absence the row came back from

    # ------------------------------------------------------------------ access
    @property
    def disk_backed(self) -> bool:
        return self.path is not None

    @property
    def rows(self) -> np.ndarray:
        """The whole matrix (a view: do not write into it; use :meth:`set_row`)."""
        return self._rows

    def row(self, i: int) -> np.ndarray:
        return self._rows[i]

    def set_row(self, i: int, values: np.ndarray, cols: slice | None = None) -> None:
        """Row i ← values (cast to float32); the running sum follows in O(d). ``cols``: only
        these columns of the row (``values`` holds them)."""
        new = np.asarray(values, np.float32)
        span = slice(0, self.dim) if cols is None else cols
        width = len(range(*span.indices(self.dim)))
        if new.shape != (width,):
            raise ValueError(f"row of shape {new.shape} for a table of dim {self.dim}"
                             + ("" if cols is None else f", columns {span.start}:{span.stop}"))
        total = self._sum[span]
        total += new
        total -= self._rows[i, span]
        self._rows[i, span] = new
        self._mark_set([i])

    def _mark_set(self, ids: Sequence[int]) -> None:
        """Rows ``ids`` were just set: seen, silent 0, and the absence they came back from kept."""
        rows = np.asarray(ids, np.int64)
        back = rows[self.seen[rows]]
        self.longest[back] = np.maximum(self.longest[back], self.silent[back])
        self.seen[rows] = True
        self.silent[rows] = 0

    def clear_row(self, i: int) -> None:
        """Row i ← 0 and not seen (an expired row: as if the client had never replied)."""
        self._sum -= self._rows[i]
        self._rows[i] = 0.0
        self.seen[i] = False
        self.silent[i] = self.longest[i] = 0

    def age(self, present: list[int], max_silent: int, factor: float = 2.0) -> list[int]:
        """One more round: every row not in ``present`` has been silent one more round. Returns
        the seen rows silent for more than max(``max_silent``, ``factor`` × the longest absence
        the row came back from), which the caller clears; ``max_silent = 0``: none (no expiry)."""
        absent = np.ones(self.num_rows, bool)
        absent[np.asarray(present, np.int64)] = False
        self.silent[absent] += 1
        if not max_silent:
            return []
        limit = np.maximum(max_silent, factor * self.longest)
        return np.flatnonzero(self.seen & absent & (self.silent > limit)).tolist()

    def set_rows(self, ids: Sequence[int], vectors: Sequence[np.ndarray], scales: Sequence[float] | None = None,
                 weights: Sequence[float] | None = None, fresh: np.ndarray | None = None,
                 stale: np.ndarray | None = None) -> None:
        """Row ids[k] ← vectors[k] (× float32(scales[k]) when given), in order, ids distinct; in one
        pass over blocks of columns, every row's block while the block's sums stay in cache.
        ``fresh`` and ``stale`` (float64, d), when given, get Σ_k w_k of the new rows and of the
        rows they replace added (w = ``weights``, else 1: FedVARP's, FedStale's and
        ClusterFedVARP's sums). A block's sums over the rows are float32 (no float64 conversion
        per row: that conversion costs twice the rest), added to the float64 running sum (and
        to ``fresh``, ``stale``) once per block and round: the running sum then differs from
        Σ rows in float64 by the float32 rounding of each round's change, not by a drift that
        grows with its size (:meth:`recompute_sum` makes it exact)."""
        news = [np.asarray(v, np.float32) for v in vectors]
        if len(news) != len(ids) or any(len(z) != len(ids) for z in (scales, weights) if z is not None):
            raise ValueError(f"set_rows: {len(ids)} ids, {len(news)} rows, scales and weights of other lengths")
        if len(set(ids)) != len(ids):
            raise ValueError("set_rows: the ids must be distinct")
        for v in news:
            if v.shape != (self.dim,):
                raise ValueError(f"row of shape {v.shape} for a table of dim {self.dim}")
        factors = [None if scales is None or scales[k] == 1.0 else np.float32(scales[k]) for k in range(len(ids))]
        w32 = [None] * len(ids) if weights is None else [np.float32(w) for w in weights]
        split = weights is None and fresh is not None and stale is not None  # the change is fresh − stale
        width = min(COLUMN_BLOCK, self.dim)
        change, scaled, term = (np.empty(width, np.float32) for _ in range(3))
        new_sum = np.empty(width, np.float32) if fresh is not None else None
        old_sum = np.empty(width, np.float32) if stale is not None else None
        for lo in range(0, self.dim, COLUMN_BLOCK):
            cols = slice(lo, min(lo + COLUMN_BLOCK, self.dim))
            k = cols.stop - lo
            dc, buf, tb = change[:k], scaled[:k], term[:k]
            fs = None if new_sum is None else new_sum[:k]
            ss = None if old_sum is None else old_sum[:k]
            for z in (dc, fs, ss):
                if z is not None:
                    z[...] = 0
            for i, v, factor, w in zip(ids, news, factors, w32, strict=True):
                new = v[cols] if factor is None else np.multiply(v[cols], factor, out=buf)
                old = self._rows[i, cols]
                if fs is not None:
                    fs += new if w is None else np.multiply(new, w, out=tb)
                if ss is not None:
                    ss += old if w is None else np.multiply(old, w, out=tb)
                if not split:
                    dc += new
                    dc -= old
                old[...] = new
            if split:
                assert fs is not None and ss is not None
                np.subtract(fs, ss, out=dc)
            self._sum[cols] += dc
            if fresh is not None and fs is not None:
                fresh[cols] += fs
            if stale is not None and ss is not None:
                stale[cols] += ss
        self._mark_set(ids)

    def sum(self) -> np.ndarray:
        """Σ_i row_i in float64 (a copy)."""
        return self._sum.copy()

    def mean(self) -> np.ndarray:
        """(1/num_rows) Σ_i row_i in float64, O(d)."""
        return self._sum / self.num_rows

    def recompute_sum(self) -> None:
        """Rebuild the running sum from the rows (O(N d); drift is at float64 round-off anyway)."""
        self._sum = self._rows.sum(axis=0, dtype=np.float64)

    @property
    def num_seen(self) -> int:
        return int(self.seen.sum())

    @property
    def nbytes(self) -> int:
        """Bytes of the table's state: the matrix (on disk or in RAM), the sum and the mask."""
        return int(self.num_rows * self.dim * 4 + self._sum.nbytes + self.seen.nbytes)

    def flush(self) -> None:
        if isinstance(self._rows, np.memmap):
            self._rows.flush()

    def close(self) -> None:
        """Drop the matrix; a disk-backed table removes its file."""
        self._rows = np.zeros((0, self.dim), np.float32)
        if self.path is not None:
            self._finalizer()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """A self-contained copy (the matrix is copied even when disk-backed)."""
        return {"rows": np.array(self._rows, np.float32, copy=True), "sum": self._sum.copy(),
                "seen": self.seen.copy(), "silent": self.silent.copy(), "longest": self.longest.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = np.asarray(state["rows"], np.float32)
        if rows.shape != (self.num_rows, self.dim):
            raise ValueError(f"table state has shape {rows.shape}, expected {(self.num_rows, self.dim)}")
        self._rows[...] = rows
        self._sum = np.array(state["sum"], np.float64, copy=True)
        self.seen = np.array(state["seen"], bool, copy=True)
        zeros = np.zeros(self.num_rows, np.int64)  # a checkpoint from before expiry: no absence yet
        self.silent = np.array(state.get("silent", zeros), np.int64, copy=True)
        self.longest = np.array(state.get("longest", zeros), np.int64, copy=True)

    @classmethod
    def from_state(cls, state: dict[str, Any], directory: str | Path = "", name: str = "table") -> ClientTable:
        """A new table (RAM or disk, as ``directory`` says) holding ``state``."""
        num_rows, dim = np.shape(state["rows"])
        table = cls(num_rows, dim, directory, name)
        table.load_state_dict(state)
        return table

    def __repr__(self) -> str:
        where = f"memmap {self.path}" if self.path else "RAM"
        return f"ClientTable({self.num_rows} x {self.dim} float32, {where}, {self.num_seen} rows set)"


MAX_SILENT_ROUNDS = 50  # FedAU's default cutoff K: an absence this long is "long" (docs/threat-model.md)


@dataclass(frozen=True)
class StoredParams:
    """The parameters of every rule that stores one update per client.

    memory_dir : "" keeps the table in RAM, a folder puts it in a disk-backed memmap there.
    max_silent_rounds : a stored row expires (is cleared, as if the client had never replied)
        once its client has been silent for more than max(``max_silent_rounds``, 2 × the longest
        absence that client came back from); 0 keeps every row for the run, the papers' rule. So
        a node that replies once (a sybil on a free id) stays in the mean for at most 50 silent
        rounds, and a client whose absences are long but regular keeps its row as in the paper.
    """

    memory_dir: str = ""
    max_silent_rounds: int = MAX_SILENT_ROUNDS

    def __post_init__(self) -> None:
        n = self.max_silent_rounds
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"max_silent_rounds (spec key max-silent-rounds) must be an integer >= 0 "
                             f"(0 = rows never expire, the paper's rule), got {n!r}")
        object.__setattr__(self, "memory_dir", str(self.memory_dir))


@dataclass
class StoredState:
    """The stored updates (a :class:`ClientTable`, None before the first round; a checkpoint
    holds a copy of it, restored into RAM or a new memmap as ``memory_dir`` says)."""

    table: ClientTable | None = field(default=None, metadata=kept_as(
        lambda table: None if table is None else table.state_dict(),
        lambda saved, rule: None if saved is None else ClientTable.from_state(saved, rule.params.memory_dir,
                                                                              name=rule.name)))


class StoredRule(Rule):
    """Base of the rule values that store one update per client (MIFA, FedVARP, Stale, FedStale,
    ClusterFedVARP): equal weights, client ids as rows, the table built at the first round, rows
    of clients silent too long expired (``max_silent_rounds``; metric ``num-expired``, logged).

    A subclass writes :meth:`step`: the round's model, state and metrics from the table (its
    rows already aged, the round's rows not yet set) and the round's reports. The table is the
    state's and is changed in place by its round (N × d: a copy per round would cost O(N d));
    a checkpoint copies it.
    """

    Params: ClassVar[type] = StoredParams
    State: ClassVar[type] = StoredState
    needs = Needs(client_ids=True, equal_weights_only=True, holds=HookRule.holds_replies)

    def fold(self, state: Any, ctx: RoundContext) -> StoredFold:
        return StoredFold(self, self.prepared(state, ctx), ctx)

    def prepared(self, state: Any, ctx: RoundContext) -> Any:
        """The state at the round's start (hook: ClusterFedVARP fixes its clusters)."""
        return state

    def num_rows(self, state: Any, ctx: RoundContext) -> int:
        return ctx.require_num_clients()

    def rows_of(self, state: Any, reports: list[ClientReport]) -> list[int]:
        """The table rows the round's reports set (hook: ClusterFedVARP's clusters)."""
        return [r.client_id for r in reports]

    def forget(self, state: Any, table: ClientTable, row: int) -> None:
        """Clear an expired row (hook: ClusterFedVARP also corrects its running mean)."""
        table.clear_row(row)

    def step(self, state: Any, table: ClientTable, ctx: RoundContext, reports: list[ClientReport]) -> Finished:
        raise NotImplementedError


class StoredFold:
    """A stored-updates round: the reports held, the table aged and the rule's step at the end."""

    def __init__(self, rule: StoredRule, state: Any, ctx: RoundContext) -> None:
        self.rule, self.state, self.ctx = rule, state, ctx
        self.reports: list[ClientReport] = []

    def add(self, report: ClientReport) -> None:
        self.reports.append(report)

    def finish(self) -> Finished:
        rule, state, dim = self.rule, self.state, self.ctx.x.size
        if state.table is None or state.table.dim != dim:
            state = replace(state, table=ClientTable(rule.num_rows(state, self.ctx), dim, rule.params.memory_dir,
                                                     name=rule.name))
        table = state.table
        expired = table.age(rule.rows_of(state, self.reports), rule.params.max_silent_rounds)
        for row in expired:
            rule.forget(state, table, row)
        if expired:
            log.info("%s: stored row(s) %s expired after more than max-silent-rounds=%d silent rounds "
                     "(or twice their longest absence)", rule.name, expired[:10], rule.params.max_silent_rounds)
        done = rule.step(state, table, self.ctx, self.reports)
        if expired:
            done.metrics["num-expired"] = len(expired)
        return done
