"""Run the real ServerApp round loop against the real ClientApp in one process, without Ray.

:class:`InProcessGrid` is a Flower ``Grid`` whose nodes are plain contexts in this process: a
message is delivered by calling the ClientApp directly. Results are identical to a simulation
for the same config (the client's randomness is keyed by seeds, client and round), and a run
takes a fraction of the time, so tests, sweeps and debugging use it. Run config ``engine``
chooses the grid: ``per-client`` (:class:`InProcessGrid`), ``cohort`` or ``auto``
(:class:`~experiments.cohort_grid.CohortGrid`, which trains a round's cohort at once).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from runconfig.defaults import default_run_config
from server_app.config import RunConfig
from server_app.experiment import run

from .cohort_grid import CohortGrid
from .grid import NODE_ID_BASE, InProcessGrid

__all__ = ["NODE_ID_BASE", "CohortGrid", "InProcessGrid", "default_run_config", "run_inprocess"]


def run_inprocess(overrides: Mapping[str, Any] | None = None, *, console: Console | None = None,
                  **grid_kwargs: Any) -> Path:
    """One run with the default config updated by ``overrides``; returns the results folder."""
    run_config = {**default_run_config(), **(overrides or {})}
    cfg = RunConfig.from_run_config(run_config)
    if cfg.server.engine == "per-client":
        grid: InProcessGrid = InProcessGrid(cfg.workload.num_clients, run_config, **grid_kwargs)
    else:
        grid = CohortGrid(cfg.workload.num_clients, run_config, engine=cfg.server.engine, **grid_kwargs)
    grid.keep_delivered = False  # a run's messages are not kept (a grid made by a test keeps them)
    return run(grid, cfg, console=console or Console(quiet=True))
