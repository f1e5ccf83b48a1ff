"""The ServerApp: run config -> workload + schedule + strategy -> rounds -> results folder."""

from __future__ import annotations

from logging import ERROR

from flwr.app import Context
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from .config import RunConfig
from .experiment import run
from .network import NodesMissing

app = ServerApp()
FAILED = "flchurn run failed:"  # the one-paragraph error a user reads (experiments/run.py finds it)


@app.main()
def main(grid: Grid, context: Context) -> None:
    try:
        run(grid, RunConfig.from_run_config(context.run_config))  # every key checked before training
    except (ValueError, NodesMissing) as err:  # a user's mistake: ConfigError, SpecError, DatasetError, ...
        log(ERROR, "%s %s: %s", FAILED, type(err).__name__, err)
        raise  # Flower marks the run finished:failed (and logs the traceback after this paragraph)
