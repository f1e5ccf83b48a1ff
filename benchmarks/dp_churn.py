"""The (ε, δ) a DP run had with and without churn (a measurement, not a test; docs/privacy.md).

One small Message-API app (a linear layer, one SGD step per client, in process: Flower's own
``start``, ``server_app.dropin.with_availability``, ``client_app.dropin.availability_mod``) under
Flower's FedAvg taking every online client, inside
``privacy.DifferentialPrivacyServerSideFixedClipping`` (z, C, Flower's target n = N), for each
schedule and calibration; prints the participants per round and the run's final ε (amplified at
q_t = m_t / N, and the worst client's without amplification).

    python benchmarks/dp_churn.py                        # N = 20, 30 rounds, z = 1.0, δ = 1e-5
    python benchmarks/dp_churn.py --rounds 50 --schedules always bernoulli:p=0.3
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.supercore.run import Run

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from client_app.dropin import availability_mod, identity  # noqa: E402
from experiments.inprocess import InProcessGrid  # noqa: E402
from privacy import DifferentialPrivacyServerSideFixedClipping  # noqa: E402
from server_app.dropin import with_availability  # noqa: E402


def app() -> ClientApp:
    client = ClientApp(mods=[availability_mod])
    client.query("identity")(identity)

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(int(context.node_config["partition-id"])))
        torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()).backward()
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 16})}), reply_to=msg)

    return client


def measure(spec: str, calibration: str, n: int, rounds: int, z: float, clip: float, delta: float,
            seed: int) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="dp-churn-"))
    grid = InProcessGrid(n, {}, client_app=app())
    grid.set_run(Run.create_empty(1))
    churned = with_availability(grid, spec, num_clients=n, seed=seed, results_dir=out)
    rule = FedAvg(min_available_nodes=0, min_train_nodes=0, min_evaluate_nodes=0, fraction_evaluate=0.0)
    strategy = DifferentialPrivacyServerSideFixedClipping(rule, z, clip, n, num_clients=n, delta=delta,
                                                          calibration=calibration, results_dir=out)
    torch.manual_seed(0)
    Strategy.start(strategy, grid=churned, initial_arrays=ArrayRecord(torch.nn.Linear(4, 3).state_dict()),
                   num_rounds=rounds, timeout=60)
    return [json.loads(line) for line in (out / "privacy.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--clipping-norm", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--schedule-seed", type=int, default=0)
    p.add_argument("--schedules", nargs="+", default=["always", "bernoulli:p=0.5"])
    a = p.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    print(f"N = {a.clients}, {a.rounds} rounds, z = {a.noise_multiplier}, C = {a.clipping_norm}, "
          f"delta = {a.delta}, Flower's target n = N")
    print("| schedule | calibration | participants per round (mean, min-max) | z per round (min-max) | "
          "epsilon (Poisson at q_t = m_t/N) | epsilon, worst client (no amplification) |")
    print("|---|---|---|---|---|---|")
    for spec in a.schedules:
        for calibration in ("realised", "target"):
            lines = measure(spec, calibration, a.clients, a.rounds, a.noise_multiplier, a.clipping_norm, a.delta,
                            a.schedule_seed)
            m = [x["participants"] for x in lines]
            zs = [x["noise_multiplier"] for x in lines if x["participants"]]
            last = lines[-1]
            print(f"| `{spec}` | {calibration} | {sum(m) / len(m):.1f} ({min(m)}-{max(m)}) | "
                  f"{min(zs):.2f}-{max(zs):.2f} | {last['epsilon']:.2f} | {last['epsilon_worst_client']:.2f} |")


if __name__ == "__main__":
    main()
