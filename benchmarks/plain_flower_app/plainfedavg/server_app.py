"""Flower's FedAvg, sampling ``fraction-train`` of the nodes each round; no evaluation. Its
``evaluate_fn`` only appends the round to ``round-log`` (when set) as the round ends: the
benchmark's clock (benchmarks/ray_path.py)."""

from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from plainfedavg.task import workload

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    model = workload(cfg).new_model()
    log = Path(str(cfg["round-log"])) if cfg.get("round-log") else None

    def round_ended(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if log is not None:
            with log.open("a") as fh:
                fh.write(f"{server_round}\n")
        return None

    strategy = FedAvg(fraction_train=float(cfg["fraction-train"]), fraction_evaluate=0.0)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                   num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=round_ended)
