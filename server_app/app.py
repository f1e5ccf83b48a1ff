"""The ServerApp: run config -> workload + schedule + strategy -> rounds -> results folder."""

from __future__ import annotations

from logging import ERROR

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from .config import RunConfig
from .experiment import run
from .network import NodesMissing
from .raylost import watch_ray_workers

app = ServerApp()
FAILED = "flchurn run failed:"  # the one-paragraph error a user reads (experiments/run.py finds it)


@app.main()
def main(grid: Grid, context: Context) -> None:
    if type(grid).__name__ == "InMemoryGrid":  # Flower's simulation: its Ray actors may be lost
        watch_ray_workers()
    try:
        run(grid, RunConfig.from_run_config(context.run_config))  # every key checked before training
    except (ValueError, NodesMissing) as err:  # a user's mistake: ConfigError, SpecError, DatasetError, ...
        log(ERROR, "%s %s: %s", FAILED, type(err).__name__, err)
        raise  # Flower marks the run finished:failed (and logs the traceback after this paragraph)
