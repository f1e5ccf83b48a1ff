"""Per-round time of the engines that train a round's clients, side by side (prints; never asserts).

For each model (the FedAWE/FedAU MLP and CNN on Fashion-MNIST, 100 clients, batch 128, 10 local
steps) and each cohort size (``bernoulli:p=0.15``: about 15 participants a round; ``always``: 100):

- ``raw``: a minimal sequential PyTorch loop over the same clients and local steps (load the
  start weights, SGD on the same mini-batches): the raw-compute reference;
- ``per-client``: the in-process engine (the real ServerApp loop and ClientApp, one client after
  the other);
- ``cohort``: the cohort engine (the same loop; local training of the cohort at once: on a CPU
  each client's pass with the per-client kernels, on a GPU one vmapped pass);
- ``cohort-vmapped``: the cohort engine with the vmapped pass on a CPU too (the code before issue
  49, whose numbers differ from the per-client engine's);
- ``flwr``: Flower's Ray simulation through ``experiments.run`` (``--flwr``; slow to start).

Each figure is the best of ``--repeats`` repetitions (interleaved across engines, so that a load
spike hits them alike) of the median round time over rounds 2..R-1: round 1 warms caches up, and
round R also evaluates centrally (``eval-every = 0``). ``--clock cpu`` (default) times this
process's CPU time (the engines run in process; Flower's Ray simulation does not, so ``flwr`` is
always wall time), which on a shared machine measures the work without the waiting; ``--clock
wall`` times elapsed seconds. The load average is printed with the figures.

    python -m benchmarks.engine_speed                       # CPU, MLP and CNN, 15 and 100
    python -m benchmarks.engine_speed --models mlp --sizes 15 --repeats 5 --flwr
    python -m benchmarks.engine_speed --device cuda --clock wall --dataset cifar10   # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from availability import schedule_for
from experiments.inprocess import default_run_config, run_inprocess
from experiments.presets import DATA_DIR
from runconfig import WorkloadConfig, from_run_config
from server_app import experiment
from workloads import vmapped
from workloads.workload import get_workload

ROOT = Path(__file__).resolve().parent.parent
SIZES = {15: "bernoulli:p=0.15", 100: "always"}
MODELS = {"mlp": "mlp", "cnn": "cnn:init=official"}


def run_config(model: str, size: int, rounds: int, device: str, dataset: str = "fashion-mnist") -> dict:
    return {**default_run_config(), "dataset": dataset, "data-dir": DATA_DIR, "model": MODELS[model],
            "num-clients": 100, "partition": "client-dirichlet:alpha=0.1", "local-steps": "steps:n=10",
            "batch-size": 128, "lr": 0.05, "strategy": "fedavg-active", "availability": SIZES[size],
            "num-server-rounds": rounds, "eval-every": 0, "checkpoint-every": 0, "progress": False,
            "device": device}


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def use_clock(name: str) -> None:
    """Time rounds with ``name``'s clock, the ServerApp loop's ``round-time`` included: ``cpu`` (this
    process's CPU time: on a machine shared with other work, the overhead without the waiting) or
    ``wall``."""
    global clock
    clock = CLOCKS[name]
    experiment.time = SimpleNamespace(monotonic=clock, sleep=time.sleep)  # the loop's round-time


clock = time.process_time


def raw_round_times(cfg: dict) -> list[float]:
    """The raw loop: for each round, each available client, its local steps from the global model."""
    wl = get_workload(from_run_config(WorkloadConfig, cfg))
    schedule = schedule_for(cfg, wl)
    model = wl.new_model().to(wl.device)
    x, y = wl.train.x.to(wl.device), wl.train.y.to(wl.device)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    times = []
    for t in range(cfg["num-server-rounds"]):
        t0 = clock()
        for c in map(int, schedule.available(t).nonzero()[0]):
            model.load_state_dict(start)
            opt = torch.optim.SGD(model.parameters(), lr=wl.lr_at(t))
            batches = wl.batch_indices(c, t)
            for _ in range(wl.steps_for(c, t)):
                idx = next(batches)
                loss = F.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        if x.is_cuda:  # the GPU's queued work is part of the round
            torch.cuda.synchronize()
        times.append(clock() - t0)
    return times


def engine_round_times(cfg: dict, engine: str, out: Path) -> list[float]:
    if engine == "cohort-vmapped":
        with vmapped_kernels():
            return engine_round_times(cfg, "cohort", out)
    run_dir = run_inprocess({**cfg, "engine": engine, "results-dir": str(out), "run-name": f"{engine}-{time.time_ns()}"})
    return [json.loads(line)["round-time"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@contextlib.contextmanager
def vmapped_kernels() -> Iterator[None]:
    """The cohort engine's vmapped pass on every device (before issue 49: also on a CPU)."""
    saved = vmapped.batched_kernels
    vmapped.batched_kernels = lambda device: True
    try:
        yield
    finally:
        vmapped.batched_kernels = saved


def flwr_round_times(cfg: dict, out: Path) -> list[float]:
    keys = ("dataset", "data-dir", "model", "num-clients", "partition", "local-steps", "batch-size", "lr",
            "strategy", "availability", "num-server-rounds", "eval-every", "checkpoint-every", "device")
    overrides = " ".join(f"{k}={json.dumps(cfg[k])}" for k in keys)
    run_name = f"flwr-{time.time_ns()}"
    cmd = [sys.executable, "-m", "experiments.run", "--run-config",
           f"{overrides} results-dir=\"{out}\" run-name=\"{run_name}\" progress=false"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line)["round-time"] for line in (out / run_name / "metrics.jsonl").read_text().splitlines()]


def per_round(times: list[float]) -> float:
    """The median of rounds 2..R-1: round 1 warms caches up, round R also evaluates centrally."""
    return statistics.median(times[1:-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--sizes", nargs="*", type=int, default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--rounds", type=int, default=6, help="rounds per run (>= 3: rounds 2..R-1 are timed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", nargs="*", default=["raw", "per-client", "cohort"],
                    choices=["raw", "per-client", "cohort", "cohort-vmapped", "auto"])
    ap.add_argument("--flwr", action="store_true", help="also time Flower's Ray simulation (flwr run)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist (default) or cifar10 (the JPEG-q75 copy)")
    ap.add_argument("--clock", default="cpu", choices=list(CLOCKS),
                    help="cpu: this process's CPU time per round (robust to other load); wall: elapsed time")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.rounds < 3:
        ap.error(f"--rounds must be >= 3 (rounds 2..R-1 are timed); got {a.rounds}")
    if a.threads:
        torch.set_num_threads(a.threads)
    use_clock(a.clock)
    engines = a.engines + (["flwr"] if a.flwr else [])
    print(f"{a.clock} seconds per round; {a.dataset}; device {a.device}, torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
          f"load average at start {os.getloadavg()[0]:.2f}; best of {a.repeats} "
          f"(median over rounds 2..{a.rounds - 1})")
    print(f"{'model':5} {'parts':>5} " + " ".join(f"{e:>14}" for e in engines) + "   vs raw")
    with tempfile.TemporaryDirectory() as tmp:
        for model in a.models:
            for size in a.sizes:
                cfg = run_config(model, size, a.rounds, a.device, a.dataset)
                runs: dict[str, list[float]] = {e: [] for e in engines}
                for rep in range(a.repeats):  # interleaved, so a load spike hits every engine alike
                    for engine in engines:
                        if engine == "raw":
                            runs[engine].append(per_round(raw_round_times(cfg)))
                        elif engine == "flwr":
                            if rep == 0:  # one run: Ray and the SuperLink take minutes to start
                                runs[engine].append(per_round(flwr_round_times(cfg, Path(tmp))))
                        else:
                            runs[engine].append(per_round(engine_round_times(cfg, engine, Path(tmp))))
                best = {e: min(v) for e, v in runs.items()}
                ratios = " ".join(f"{e} {best[e] / best['raw']:.2f}x" for e in engines if e != "raw" and "raw" in best)
                print(f"{model:5} {size:5d} " + " ".join(f"{best[e]:14.3f}" for e in engines) + f"   {ratios}",
                      flush=True)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
