"""Everything a lent GPU should measure, in one call of at most 8 minutes, printed as one table
(issue 49 item 4; prints figures, never asserts).

Sections, in the order of what a short lease must not miss (each one starts only while the budget
allows its estimate, and a section that fails prints its error and the next one runs):

1. ``paper``: one paper-scale round per rule of FedAWE Table 2's CIFAR-10 row (its sine column:
   100 clients, the FedAU/FedAWE CNN with the official init, 10 local steps of 128, the cohort
   engine), the 7 rules, each run for ``--rounds`` rounds: the median round without evaluation
   (rounds 2..R-1 but the ones that evaluate), the round that evaluates, and the peak GPU memory;
   beside each, the issue's target (0.05 s) and the round's float32 work at the device's peak.
2. ``profile``: where one rule's rounds go (``--profile-rules``): ``torch.profiler`` over 3
   rounds: the GPU's busy share of the wall time (kernels' summed time / wall), kernel launches
   and host-device copies per round, and the top operators by GPU and by CPU time; ``cProfile``'s
   top functions of this project (cumulative) over the same rounds. A gzipped chrome trace per rule goes
   to ``--out``.
3. ``engines``: the raw PyTorch loop, the per-client engine and the cohort engine at 15 and 100
   participants (``benchmarks.engine_speed``'s workload on CIFAR-10), seconds a round.

Everything printed is also written to ``--out``/gpu_check.json. On a CPU the same code runs small
(``--quick``), which is how CI keeps this path tested (tests/test_gpu_check.py).

    python -m benchmarks.gpu_check --device cuda --data-dir .gpu-data --out "$OUT"   # on the GPU
    python -m benchmarks.gpu_check --quick --device cpu --rules fedawe fedau       # here

On the device machine (the ``device`` tool) run it through ``benchmarks/gpu_check.sh``, which
installs Flower's wheels first (two calls; see that file).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import engine_speed
from experiments.inprocess import default_run_config, run_inprocess
from experiments.presets import FEDAWE_CIFAR_BASE, FEDAWE_DYNAMICS, FEDAWE_RULES

TARGET_S = 0.05  # issue 49 item 2: a paper round of every rule within this, on one GPU
PEAK_FP32 = {"H200": 67e12, "H100": 67e12, "A100": 19.5e12, "L4": 30e12}  # dense float32 FLOP/s, by name
QUICK = {"dataset": "digits", "model": "cnn", "num-clients": 12, "local-steps": "steps:n=2", "batch-size": 16}
PROJECT = str(Path(__file__).resolve().parent.parent)


def paper_config(rule: str, rounds: int, device: str, quick: bool, data_dir: str | None) -> dict[str, Any]:
    """FedAWE Table 2's CIFAR-10 sine run of ``rule`` (``experiments.presets``), cut to ``rounds``."""
    cfg = {**default_run_config(), **FEDAWE_CIFAR_BASE, **FEDAWE_DYNAMICS["sine"], **FEDAWE_RULES[rule],
           "num-server-rounds": rounds, "checkpoint-every": 0, "progress": False, "device": device}
    if quick:
        cfg.update({**QUICK, "eval-every": 2})
    if data_dir:
        cfg["data-dir"] = data_dir
    return cfg


def synchronize(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return None


def rows_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def round_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The median round that does not evaluate (round 1 warms up, and is left out) and the median round
    that does, with the participants a round."""
    evaluating = [r for r in rows if "test-accuracy" in r]
    plain = [r for r in rows[1:] if "test-accuracy" not in r] or rows[1:] or rows
    return {"round_s": statistics.median(r["round-time"] for r in plain),
            "eval_round_s": statistics.median(r["round-time"] for r in evaluating) if evaluating else None,
            "first_round_s": rows[0]["round-time"],
            "participants": statistics.mean(r["num-participants"] for r in rows),
            "rounds": len(rows)}


def train_flop(cfg: dict[str, Any], participants: float) -> float | None:
    """The float32 work of a round's local training (forward and backward ≈ 3x the forward's
    multiply-adds, 2 FLOP each), from the model's own layers."""
    from runconfig import WorkloadConfig, from_run_config
    from workloads.workload import get_workload

    try:
        wl = get_workload(from_run_config(WorkloadConfig, {**cfg, "device": "cpu"}))
        model = wl.new_model()
        x = wl.train.x[: cfg["batch-size"]]
    except Exception:  # a figure beside the measurement: never the reason a section fails
        return None
    macs = 0

    def count(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        nonlocal macs
        if isinstance(module, torch.nn.Conv2d):
            macs += output.numel() * module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
        elif isinstance(module, torch.nn.Linear):
            macs += output.numel() * module.in_features

    hooks = [m.register_forward_hook(count) for m in model.modules()]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    steps = statistics.mean(wl.steps_for(c, 0) for c in range(wl.cfg.num_clients))  # the workload's own count
    return 3 * 2 * macs * steps * participants


def device_peak(device: str) -> tuple[str, float | None]:
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return name, next((flops for key, flops in PEAK_FP32.items() if key in name), None)
    return platform.processor() or platform.machine(), None


def paper_section(a: argparse.Namespace, budget: Budget, out: Path) -> list[dict[str, Any]]:
    rows = []
    name, peak = device_peak(a.device)
    for rule in a.rules:
        if not budget.allows(a.paper_estimate_s, f"paper {rule}"):
            rows.append({"rule": rule, "skipped": "budget"})
            continue
        cfg = paper_config(rule, a.rounds, a.device, a.quick, a.data_dir)
        reset_peak(a.device)
        t0 = time.perf_counter()
        try:
            run_dir = run_inprocess({**cfg, "results-dir": str(out), "run-name": f"paper-{rule}"})
        except Exception as exc:
            rows.append({"rule": rule, "error": f"{type(exc).__name__}: {exc}"})
            continue
        fig = round_figures(rows_of(run_dir))
        flop = train_flop(cfg, fig["participants"])
        rows.append({"rule": rule, **fig, "run_s": time.perf_counter() - t0, "peak_gib": peak_gib(a.device),
                     "train_tflop": flop / 1e12 if flop else None,
                     "at_peak_s": flop / peak if flop and peak else None, "device": name})
    return rows


def profile_section(a: argparse.Namespace, budget: Budget, out: Path) -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for rule in a.profile_rules:
        if not budget.allows(a.paper_estimate_s * 2, f"profile {rule}"):
            rows.append({"rule": rule, "skipped": "budget"})
            continue
        rounds = 4  # round 1 (warm-up) is profiled too, but not counted in the per-round figures
        cfg = paper_config(rule, rounds, a.device, a.quick, a.data_dir)
        cfg["eval-every"] = 0  # evaluation only in the last round
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
        python = cProfile.Profile()
        try:
            with profile(activities=activities) as prof:
                python.enable()
                t0 = time.perf_counter()
                run_dir = run_inprocess({**cfg, "results-dir": str(out), "run-name": f"profile-{rule}"})
                synchronize(a.device)
                wall = time.perf_counter() - t0
                python.disable()
        except Exception as exc:
            rows.append({"rule": rule, "error": f"{type(exc).__name__}: {exc}"})
            continue
        timed = rows_of(run_dir)
        prof.export_chrome_trace(str(out / f"trace-{rule}.json.gz"))  # gzipped: $OUT returns files <= 16 MiB
        rows.append({"rule": rule, "wall_s": wall, "rounds": len(timed),
                     "round_s": [round(r["round-time"], 4) for r in timed], **kernel_figures(prof, rounds),
                     "top_gpu_ops": top_ops(prof, "device"), "top_cpu_ops": top_ops(prof, "cpu"),
                     "top_python": top_python(python)})
    return rows


def device_time(evt: Any) -> float:
    """An averaged event's own device microseconds (torch renamed cuda → device in 2.4)."""
    return float(getattr(evt, "self_device_time_total", getattr(evt, "self_cuda_time_total", 0.0)))


def kernel_figures(prof: Any, rounds: int) -> dict[str, Any]:
    """The kernels' summed time, launches and host-device copies per round."""
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) is not None
               and e.device_type.name == "CUDA"]
    copies = [e for e in prof.events() if "Memcpy" in e.name or "memcpy" in e.name]
    busy = sum(e.device_time if hasattr(e, "device_time") else e.cuda_time for e in kernels) / 1e6
    return {"gpu_busy_s": busy, "kernels_per_round": len(kernels) / rounds,
            "copies_per_round": len(copies) / rounds}


def top_ops(prof: Any, by: str, n: int = 10) -> list[tuple[str, float, int]]:
    """The ``n`` operators with the most own time on the ``device`` or the ``cpu``: (name, ms, calls)."""
    averages = prof.key_averages()
    def own(e: Any) -> float:
        return device_time(e) if by == "device" else float(e.self_cpu_time_total)
    ranked = sorted(averages, key=own, reverse=True)[:n]
    return [(e.key[:60], own(e) / 1e3, int(e.count)) for e in ranked if own(e) > 0]


def top_python(python: cProfile.Profile, n: int = 12) -> list[tuple[str, float, int]]:
    """The project's functions with the most cumulative time: (file:function, s, calls)."""
    stats = pstats.Stats(python, stream=io.StringIO())
    ours = [(f"{Path(file).name}:{fn}", cum, calls) for (file, _, fn), (_, calls, _, cum, _)
            in stats.stats.items() if file.startswith(PROJECT) and "/benchmarks/" not in file]  # type: ignore[attr-defined]
    return [(name, round(cum, 3), calls) for name, cum, calls in sorted(ours, key=lambda r: -r[1])[:n]]


def engines_section(a: argparse.Namespace, budget: Budget, out: Path) -> list[dict[str, Any]]:
    engine_speed.use_clock("wall")
    rows = []
    for size in a.sizes:
        cfg = engine_speed.run_config("cnn", size, max(a.rounds, 4), a.device, "digits" if a.quick else "cifar10")
        if a.quick:
            cfg.update(QUICK)
        if a.data_dir:
            cfg["data-dir"] = a.data_dir
        row: dict[str, Any] = {"participants": size}
        for engine in ("raw", "per-client", "cohort"):
            if not budget.allows(a.engine_estimate_s * (size / 15), f"engines {engine} at {size}"):
                row[engine] = "skipped: budget"
                continue
            reset_peak(a.device)
            try:
                times = (engine_speed.raw_round_times(cfg) if engine == "raw"
                         else engine_speed.engine_round_times(cfg, engine, out))
                row[engine] = engine_speed.per_round(times)
                row[f"{engine}_peak_gib"] = peak_gib(a.device)
            except Exception as exc:
                row[engine] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


class Budget:
    """The call's seconds: a unit of work starts only while its estimate fits in what is left."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def allows(self, estimate: float, what: str) -> bool:
        if self.left() >= estimate:
            return True
        print(f"  skipped {what}: {self.left():.0f} s left, estimate {estimate:.0f} s", flush=True)
        return False


def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {"torch": torch.__version__, "cpus": os.cpu_count(), "device": device,
                           "load": os.getloadavg()[0]}
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update({"gpu": props.name, "gpu_gib": props.total_memory / 2**30, "cuda": torch.version.cuda,
                    "capability": f"{props.major}.{props.minor}",
                    "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                    "tf32_cudnn": torch.backends.cudnn.allow_tf32})
    return env


def fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return "-" if value is None else str(value)


def print_table(result: dict[str, Any]) -> None:
    env = result["environment"]
    print("\n== GPU check ==  " + ", ".join(f"{k} {fmt(v, 1)}" for k, v in env.items()))
    print(f"\n-- paper round per rule (FedAWE Table 2, CIFAR-10 sine; target {TARGET_S} s) --")
    print(f"{'rule':14} {'round s':>8} {'eval rnd':>8} {'1st rnd':>8} {'parts':>6} {'TFLOP':>6} "
          f"{'@peak s':>8} {'x target':>8} {'GiB':>6}")
    for r in result.get("paper", []):
        if "round_s" not in r:
            print(f"{r['rule']:14} {r.get('skipped') or r.get('error')}")
            continue
        print(f"{r['rule']:14} {r['round_s']:8.3f} {fmt(r['eval_round_s']):>8} {r['first_round_s']:8.2f} "
              f"{r['participants']:6.1f} {fmt(r['train_tflop'], 2):>6} {fmt(r['at_peak_s'], 4):>8} "
              f"{r['round_s'] / TARGET_S:8.1f} {fmt(r['peak_gib'], 2):>6}")
    for r in result.get("profile", []):
        if "wall_s" not in r:
            print(f"\n-- profile {r['rule']}: {r.get('skipped') or r.get('error')}")
            continue
        print(f"\n-- profile {r['rule']}: rounds {r['round_s']} s; GPU busy {r['gpu_busy_s']:.3f} s of "
              f"{r['wall_s']:.2f} s wall; {r['kernels_per_round']:.0f} kernels and "
              f"{r['copies_per_round']:.0f} copies a round --")
        for title, key in (("GPU ms", "top_gpu_ops"), ("CPU ms", "top_cpu_ops"), ("cum s (ours)", "top_python")):
            print(f"   {title}: " + "; ".join(f"{name} {t:.1f}×{calls}" for name, t, calls in r[key][:8]))
    print("\n-- engines, CIFAR-10 CNN, seconds a round (wall) --")
    print(f"{'parts':>5} {'raw':>10} {'per-client':>10} {'cohort':>10} {'cohort/raw':>10} {'GiB':>6}")
    for r in result.get("engines", []):
        ratio = (r["cohort"] / r["raw"] if isinstance(r.get("cohort"), float) and isinstance(r.get("raw"), float)
                 else None)
        print(f"{r['participants']:5d} " + " ".join(f"{fmt(r.get(e)):>10}" for e in ("raw", "per-client", "cohort"))
              + f" {fmt(ratio, 2):>10} {fmt(r.get('cohort_peak_gib'), 2):>6}")


SECTIONS: dict[str, Callable[[argparse.Namespace, Budget, Path], list[dict[str, Any]]]] = {
    "paper": paper_section, "profile": profile_section, "engines": engines_section}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=470, help="seconds for the whole check (default 470)")
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--rules", nargs="*", default=list(FEDAWE_RULES), choices=list(FEDAWE_RULES))
    ap.add_argument("--profile-rules", nargs="*", default=["fedawe", "fedau"], choices=list(FEDAWE_RULES))
    ap.add_argument("--sizes", nargs="*", type=int, default=[15, 100], choices=list(engine_speed.SIZES))
    ap.add_argument("--rounds", type=int, default=12, help="rounds of each paper run (round 10 evaluates)")
    ap.add_argument("--paper-estimate-s", type=float, default=30, help="a paper run's seconds, set-up included")
    ap.add_argument("--engine-estimate-s", type=float, default=15, help="an engine's run at 15 participants")
    ap.add_argument("--data-dir", help="the folder holding cifar10/ (default: the project's data folder)")
    ap.add_argument("--out", help="where gpu_check.json and the traces go (default: a temporary folder)")
    ap.add_argument("--quick", action="store_true", help="a tiny workload (digits): the CPU test of this script")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: torch sees no CUDA device here (use --device cpu --quick on a CPU)")
    if a.rounds < 3:
        ap.error(f"--rounds must be >= 3 (round 1 warms up); got {a.rounds}")
    budget = Budget(a.budget)
    out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(a.device), "argv": argv}
    for section in a.sections:
        print(f"[{a.budget - budget.left():6.1f} s] {section}", flush=True)
        try:
            result[section] = SECTIONS[section](a, budget, out)
        except Exception as exc:  # one broken section must not waste the rest of a lease
            result[section] = []
            result[f"{section}-error"] = f"{type(exc).__name__}: {exc}"
            print(f"  {section} failed: {result[section + '-error']}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    result["seconds"] = a.budget - budget.left()
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)
    print(f"\n{result['seconds']:.0f} s in all; figures in {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
