"""CA2FL: cache-aided asynchronous federated learning (buffered, with cached update calibration).

Wang, Cao, Wu, Chen and Chen, "Tackling the Data Heterogeneity in Asynchronous Federated Learning
with Cached Update Calibration", ICLR 2024 (OpenReview 4aywmeb97I), Alg. 2 (CA2FL; the paper's
Alg. 1 is FedBuff, the rule it analyses first). The server keeps every client's latest update
h^i (zero at the start, Alg. 2 line 1) and, per buffer S_t of M arrivals,

    v_t = h_t + (1/|S_t|) Σ_{i∈S_t} (Δ^i_{t−τ_i} − h_t^i),   h_t = (1/N) Σ_{j=1}^{N} h_t^j,
    x_{t+1} = x_t + η v_t,   then h_{t+1}^i = Δ^i_{t−τ_i} for i ∈ S_t (the others keep h_t^j),

Δ^i = x_i − x^{τ_i} the client's change from the version it was sent. h_t is the mean over ALL
N clients (never-seen clients count as zero, as in the algorithm's h_{t+1} = (1/N) Σ_{i∈[N]}
h_{t+1}^i): MIFA's table (Gu et al. 2021) and FedVARP's correction (Jhunjhunwala et al. 2022)
made asynchronous. Every term of one buffer is calibrated by the cache as of the buffer's start
(h_t^i): a fast client that arrives twice in one buffer has h_t^i subtracted twice, and its cache
becomes its later update. The paper weighs every update equally and applies no staleness scaling
(FedBuff here defaults to 1/√(1 + δ); ``fedbuff:staleness=constant`` is the paper's baseline).

Not in the paper, as every table rule of this project (``max-silent-rounds``, docs/strategies.md,
"Sanity bounds"): a client's cache expires (cleared, as if never seen) once the client has been
absent from more than max(``max_silent_rounds``, 2 × its longest absence) aggregations; 0 keeps
every entry, the paper's rule. The table is the N × d float32 :class:`ClientTable` (RAM, or a
memmap under ``memory_dir``) and is checkpointed with the buffer, so a resumed run continues bit
for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from ..asynchronous import Arrival, AsyncRule, AsyncState
from ..base import log
from ..memory import MAX_SILENT_ROUNDS, ClientTable


@dataclass
class CA2FLState(AsyncState):
    """The asynchronous state (version, buffer, kept versions) plus the cached updates h^i."""

    table: dict[str, Any] | None = None  # ClientTable.state_dict() (None before the first aggregation)


class CA2FL(AsyncRule):
    """CA2FL (Wang et al., ICLR 2024, Alg. 2): every K arrivals, x += η (h̄ + mean_B (Δ_i − h_i)), h_i ← Δ_i."""

    name = "ca2fl"
    State: ClassVar[type] = CA2FLState
    paper_weighting = "equal"  # 1/|S_t| over the buffer, 1/N over the cache
    equal_weights_only = True
    needs_client_ids = True  # h^i is row i of the table
    needs_num_clients = True  # h_t is a mean over N

    def __init__(self, *, k: int = 10, memory_dir: str = "", max_silent_rounds: int = MAX_SILENT_ROUNDS,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"strategy 'ca2fl': k={k!r} (the buffer size M) must be an integer >= 1")
        if isinstance(max_silent_rounds, bool) or not isinstance(max_silent_rounds, int) or max_silent_rounds < 0:
            raise ValueError(f"strategy 'ca2fl': max_silent_rounds (spec key max-silent-rounds) must be an integer "
                             f">= 0 (0 = entries never expire, the paper's rule), got {max_silent_rounds!r}")
        self.k = int(k)
        self.memory_dir = str(memory_dir)
        self.max_silent_rounds = max_silent_rounds
        self.table: ClientTable | None = None

    @property
    def own_share_window(self) -> int:  # type: ignore[override]
        """A node's updates in one buffer of K are bounded as one (as FedBuff's)."""
        return self.k

    @property
    def buffer_size(self) -> int:
        """K: an aggregation waits for K arrivals."""
        return self.k

    def add(self, arrival: Arrival) -> bool:
        self.pending.append(arrival)
        return len(self.pending) >= self.k

    def _cache(self, dim: int, present: list[int]) -> tuple[ClientTable, int]:
        """The table (built on first use), one more aggregation of absence for the clients not in
        ``present``, and the entries absent too long cleared; returns it and how many expired."""
        if self.table is None or self.table.dim != dim:
            self.table = ClientTable(self.require_num_clients(), dim, self.memory_dir, name=self.name)
        expired = self.table.age(present, self.max_silent_rounds)
        for row in expired:
            self.table.clear_row(row)
        if expired:
            log.info("%s: cached update(s) of client(s) %s expired after more than max-silent-rounds=%d "
                     "aggregations without them (or twice their longest absence)", self.name, expired[:10],
                     self.max_silent_rounds)
        return self.table, len(expired)

    def apply(self, x: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
        """v = h̄ + (1/|B|) Σ_B (Δ_i − h_i) with the caches as of the buffer's start, x + η_g v, then
        h_i ← the latest Δ_i of each client of the buffer (more than K after the start-up hold's
        release: one buffer of all the held arrivals)."""
        latest = {a.report.client_id: a.report.delta for a in self.pending}  # a client's later update wins
        table, expired = self._cache(x.size, list(latest))
        m = len(self.pending)
        hbar = table.mean()  # (1/N) Σ_j h_j, float64, before this buffer
        calibration = np.zeros(x.size, np.float64)
        for a in self.pending:
            calibration += a.report.delta
            calibration -= table.row(a.report.client_id)
        v = hbar + calibration / m
        new = x + (self.server_lr * v).astype(np.float32)
        table.set_rows(list(latest), list(latest.values()))
        metrics = {"num-cached": float(table.num_seen), "buffer-clients": float(len(latest)),
                   "mean-staleness": float(np.mean([a.staleness for a in self.pending]))}
        if expired:
            metrics["num-expired"] = float(expired)
        return new, metrics

    def get_state(self) -> Any:
        base = super().get_state()
        return CA2FLState(**{f.name: getattr(base, f.name) for f in fields(AsyncState)},
                          table=None if self.table is None else self.table.state_dict())

    def set_state(self, state: Any) -> None:
        super().set_state(state)
        saved = getattr(state, "table", None)
        self.table = None if saved is None else ClientTable.from_state(saved, self.memory_dir, name=self.name)
