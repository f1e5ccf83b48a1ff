"""A run's results folder: what a researcher reads, and what sweeps and reports consume.

Layout of ``<results-dir>/<run-name>/``:

- ``config.json``: the resolved run config, the three seeds, versions, the schedule's description;
- ``metrics.jsonl``: one JSON object per round: ``round``, ``participants`` (client ids),
  ``unavailable-nodes`` (count), ``rejected`` ([node, reason] pairs), the strategy's metrics
  (``num-participants``, ``update-norm``, ``train-loss``, ...), ``test-accuracy`` and
  ``test-loss`` when evaluated, ``round-time`` and ``wall-time`` in seconds;
- ``participation.csv``: the realised 0/1 matrix, one row per round, one column per client;
- ``availability.csv``: the schedule's A(i, t) over the same rounds, for comparison;
- ``final_model.pt``: the final global model (a torch state dict);
- ``accuracy.png`` (test metric and participants per round) and ``participation.png`` (the
  schedule's A(i, t) next to who replied); ``evaluation.png`` (the other ``test-*`` metrics, such as
  a run config ``evaluation``'s, when there are any); ``checkpoints/round-XXXX.pt`` (only with
  ``checkpoint-every`` >= 1).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np

from runconfig.extensions import ExtensionError, split_reference

METRICS = "metrics.jsonl"
PARTICIPATION = "participation.csv"


def default_run_name(strategy: str, dataset: str, seed: int) -> str:
    """``<time>-<strategy>-<dataset>-s<seed>``; a user's object named ``module:attr[:k=v]`` by its
    ``attr`` (``mypkg.rules:MomentumAvg:beta=0.5`` -> ``MomentumAvg``): a folder name without the
    module path."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{_short(strategy)}-{_short(dataset)}-s{seed}"


def _short(spec: str) -> str:
    try:
        reference = split_reference(spec)
    except ExtensionError:
        return spec
    return spec if reference is None else reference[0].rpartition(":")[2].rsplit(".", 1)[-1]


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_matrix(path: Path, matrix: np.ndarray) -> None:
    n = matrix.shape[1] if matrix.ndim == 2 else 0
    header = "round," + ",".join(f"client_{i}" for i in range(n))
    rows = [f"{t + 1}," + ",".join(str(int(v)) for v in row) for t, row in enumerate(matrix)]
    path.write_text("\n".join([header, *rows]) + "\n")


def read_matrix(path: str | Path) -> np.ndarray:
    """Read a matrix written by :func:`write_matrix`: (rounds, clients) of 0/1."""
    data = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.int64, ndmin=2)
    return data[:, 1:].astype(bool)


class RunRecorder:
    """Appends per-round records and writes the run's files."""

    def __init__(self, run_dir: Path, num_clients: int) -> None:
        self.dir = run_dir
        self.num_clients = num_clients
        self.dir.mkdir(parents=True, exist_ok=True)  # checkpoints/ only with a checkpoint (server_app.checkpoint.save)
        self.rows: list[dict[str, Any]] = []

    def write_config(self, config: dict[str, Any]) -> None:
        (self.dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    def resume_at(self, last_round: int) -> None:
        """Keep the rounds up to ``last_round`` (a resumed run rewrites what follows)."""
        path = self.dir / METRICS
        self.rows = [r for r in read_metrics(self.dir) if r["round"] <= last_round] if path.exists() else []
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))

    def record(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        with (self.dir / METRICS).open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    def participation(self) -> np.ndarray:
        matrix = np.zeros((len(self.rows), self.num_clients), dtype=bool)
        for t, row in enumerate(self.rows):
            ids = [c for c in row["participants"] if 0 <= c < self.num_clients]
            matrix[t, ids] = True
        return matrix

    def finish(self, final_state: dict, schedule_matrix: np.ndarray) -> None:
        import torch

        torch.save(final_state, self.dir / "final_model.pt")
        realised = self.participation()
        write_matrix(self.dir / PARTICIPATION, realised)
        write_matrix(self.dir / "availability.csv", schedule_matrix)
        plot_run(self.dir, self.rows, realised, schedule_matrix)


def plot_run(run_dir: Path, rows: list[dict[str, Any]], participation: np.ndarray,
             schedule: np.ndarray | None = None) -> None:
    """accuracy.png (test metric and participants per round) and participation.png (A(i, t) next to
    who replied)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = [("accuracy.png", accuracy_figure(rows, participation.shape[1], title=run_dir.name)),
               ("participation.png", participation_figure(participation, schedule,
                                                          clock_statuses(rows, participation.shape[1])))]
    if extra := evaluation_metrics(rows):
        figures.append(("evaluation.png", evaluation_figure(rows, extra, title=run_dir.name)))
    for name, fig in figures:
        fig.savefig(run_dir / name, dpi=120)
        plt.close(fig)


def evaluation_metrics(rows: list[dict[str, Any]]) -> list[str]:
    """The ``test-*`` metrics that accuracy.png does not draw (a run config ``evaluation``'s, the
    quadratic's distance to the optimum), sorted."""
    drawn = "test-accuracy" if any("test-accuracy" in r for r in rows) else "test-loss"
    return sorted({k for r in rows for k, v in r.items() if k.startswith("test-")
                   and not k.startswith(("test-loss", drawn)) and isinstance(v, (int, float)) and not isinstance(v, bool)})


def evaluation_figure(rows: list[dict[str, Any]], metrics: list[str], title: str = ""):
    """The server's other metrics over rounds, one line each (evaluation.png)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key in metrics:
        pts = [(r["round"], r[key]) for r in rows if key in r]
        ax.plot(*zip(*pts, strict=True), marker="o" if len(pts) <= 60 else None, markersize=3, label=key)
    ax.set_xlabel("round")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=6, ncol=2 if len(metrics) > 8 else 1)
    ax.grid(alpha=0.3)
    integer_ticks(ax.xaxis)
    fig.tight_layout()
    return fig


def integer_ticks(*axes: Any, nbins: int | Literal["auto"] = "auto") -> None:
    """Only whole numbers on these axes (rounds, client ids, counts): no 2.5th round."""
    from matplotlib.ticker import MaxNLocator

    for axis in axes:
        axis.set_major_locator(MaxNLocator(integer=True, nbins=nbins))


def accuracy_figure(rows: list[dict[str, Any]], num_clients: int, title: str = ""):
    """Test accuracy (or loss; extra models such as FedAWE's ``-xbar`` dashed) over rounds, and
    below it the number of clients that took part in each round: the dips line up. A run on the
    virtual clock (rows with ``virtual-time``) gets the same two panels against virtual time
    beside them."""
    import matplotlib.pyplot as plt

    metric = "test-accuracy" if any("test-accuracy" in r for r in rows) else "test-loss"
    timed = any("virtual-time" in r for r in rows)
    fig, axes = plt.subplots(2, 2 if timed else 1, figsize=(10.5 if timed else 6, 4.5), sharex="col",
                             height_ratios=(3, 1), squeeze=False)
    curves = sorted({k for r in rows for k in r if k == metric or k.startswith(metric + "-")})
    xs = [("round", "round")] + ([("virtual-time", "virtual time (s)")] if timed else [])
    for col, (xkey, xlabel) in enumerate(xs):
        top, bottom = axes[0][col], axes[1][col]
        for key in curves:
            pts = [(r[xkey], r[key]) for r in rows if key in r and xkey in r]
            if pts:
                top.plot(*zip(*pts, strict=True), marker="o" if len(pts) <= 60 else None, markersize=3,
                         label=key, linestyle="-" if key == metric else "--")
        if len(curves) > 1:
            top.legend(fontsize=7)
        top.set_ylabel(metric)
        top.set_title(title if col == 0 else f"against virtual time; {rows[-1].get('virtual-time', 0):.0f} s in all"
                      if rows else "", fontsize=8)
        top.grid(alpha=0.3)
        pts = [(r[xkey], len(r["participants"])) for r in rows if xkey in r]
        if col == 0:
            bottom.bar([p[0] for p in pts], [p[1] for p in pts], width=0.8 if len(pts) <= 60 else 1.0,
                       linewidth=0, alpha=0.7)
            integer_ticks(top.xaxis, bottom.xaxis)
        elif pts:
            bottom.step([p[0] for p in pts], [p[1] for p in pts], where="pre", alpha=0.7)
        bottom.set_ylim(0, max(num_clients, 1) * 1.05)
        bottom.set_ylabel("participants", fontsize=8)
        bottom.set_xlabel(xlabel)
        bottom.grid(alpha=0.3)
        integer_ticks(bottom.yaxis, nbins=3)
    fig.tight_layout()
    return fig


#: a run on the virtual clock: each client's status per round, as drawn (0 = not addressed / off in the schedule)
CLOCK_STATUSES = ("off", "on time", "late", "lost", "session off")
CLOCK_COLOURS = ("white", "black", "tab:orange", "tab:red", "lightgrey")


def clock_statuses(rows: list[dict[str, Any]], num_clients: int) -> np.ndarray | None:
    """(rounds, clients) codes into :data:`CLOCK_STATUSES` from the rows' ``participants``,
    ``late``, ``lost`` and ``session-off``; None for a run without the virtual clock."""
    if not any("virtual-time" in r for r in rows):
        return None
    out = np.zeros((len(rows), num_clients), dtype=np.int8)
    for t, row in enumerate(rows):
        for code, key in ((4, "session-off"), (3, "lost"), (2, "late"), (1, "participants")):
            ids = [c for c in row.get(key, []) if 0 <= c < num_clients]
            out[t, ids] = code
    return out


def participation_figure(participation: np.ndarray, schedule: np.ndarray | None = None,
                         statuses: np.ndarray | None = None):
    """Heat maps, clients down, rounds across: the schedule's A(i, t) and who really replied (on
    the virtual clock: on time, late, lost, session off)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    panels: list[tuple[str, np.ndarray]] = (
        [("schedule A(i, t) (black = available)", schedule)] if schedule is not None else [])
    if statuses is not None:
        counts = ", ".join(f"{name} {int((statuses == k).sum())}" for k, name in enumerate(CLOCK_STATUSES) if k)
        panels.append((f"realised on the virtual clock: black on time, orange late, red lost,\ngrey session off "
                       f"({counts})", statuses))
    else:
        panels.append(("realised (black = replied)", participation))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), sharey=True, squeeze=False)
    for ax, (title, matrix) in zip(axes[0], panels, strict=True):
        rounds, clients = matrix.shape
        # one cell per (round, client) centred on integers; large matrices are averaged, not aliased
        coded = statuses is not None and matrix is statuses
        ax.imshow(matrix.T, aspect="auto", cmap=ListedColormap(CLOCK_COLOURS) if coded else "Greys", vmin=0,
                  vmax=len(CLOCK_STATUSES) - 1 if coded else 1,
                  interpolation="nearest" if max(matrix.shape) <= 200 else "antialiased",
                  extent=(0.5, rounds + 0.5, clients - 0.5, -0.5))
        ax.set_title(f"{title}; mean {matrix.mean():.2f}" if matrix.size and not coded else title, fontsize=7 if coded else 8)
        ax.set_xlabel("round")
        integer_ticks(ax.xaxis, ax.yaxis)
    axes[0][0].set_ylabel("client id")
    fig.tight_layout()
    return fig
