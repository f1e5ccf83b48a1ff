"""Sweeps: strategy × schedule × workload × seed, run in process, in parallel, resumable.

Every run is an in-process run (the real ServerApp loop and ClientApp, no Ray) in its own
worker process with one torch thread; a run whose folder already holds ``final_model.pt`` is
skipped, so an interrupted sweep continues where it stopped. Reports read only the folders.

    python -m experiments.sweep fedawe-table2 --out results/fedawe-table2 --workers 2
    python -m experiments.sweep fedawe-table2 --set num-server-rounds=50 --seeds 0 1 2 --dry-run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from availability.spec import parse_value
from experiments.presets import PRESETS
from experiments.study import Sweep


def _run_one(args: tuple[str, dict[str, Any], str]) -> tuple[str, float, str]:
    name, overrides, out = args
    import torch

    torch.set_num_threads(1)
    from experiments.inprocess import run_inprocess

    t0 = time.time()
    try:
        run_inprocess({**overrides, "results-dir": out, "run-name": name, "progress": False})
    except Exception as exc:  # one failed run must not stop the sweep; it is reported
        return name, time.time() - t0, f"{type(exc).__name__}: {exc}"
    return name, time.time() - t0, ""


def run_sweep(sweep: Sweep, out: str | Path, *, workers: int = 1, seeds: Iterable[int] | None = None,
              overrides: Mapping[str, Any] | None = None, dry_run: bool = False) -> list[tuple[str, float, str]]:
    out = Path(out).resolve()
    todo = [(name, {**cfg, **(overrides or {})}, str(out)) for name, cfg in sweep.runs(seeds)
            if not (out / name / "final_model.pt").exists()]
    print(f"sweep {sweep.name}: {len(todo)} run(s) to do in {out}")
    if dry_run:
        for name, cfg, _ in todo:
            print(" ", name, cfg)
        return []
    if not todo:
        return []
    out.mkdir(parents=True, exist_ok=True)
    done = []
    started = time.time()
    ctx = mp.get_context("spawn")  # a fresh interpreter per worker: no forked torch state
    try:
        with ctx.Pool(workers, maxtasksperchild=1) as pool:
            for name, seconds, error in pool.imap_unordered(_run_one, todo):
                print(f"  {name}: {'FAILED ' + error if error else 'done'} in {seconds:.0f} s", flush=True)
                done.append((name, seconds, error))
    finally:  # an interrupted sweep (Ctrl-C) still logs the time it spent and the runs it finished
        log_invocation(out, started, workers, done)
    return done


SWEEP_LOG = "sweep-log.jsonl"  # one line per sweep invocation: when, how long, how many workers and runs


def log_invocation(out: Path, started: float, workers: int, done: list[tuple[str, float, str]]) -> None:
    entry = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
             "wall-seconds": round(time.time() - started, 1), "workers": workers, "cpus": os.cpu_count(),
             "runs-done": sum(not error for _, _, error in done), "runs-failed": sum(bool(error) for _, _, error in done)}
    with (out / SWEEP_LOG).open("a") as fh:
        fh.write(json.dumps(entry) + "\n")


def parse_sets(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = parse_value(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("--out", default=None, help="results folder (default results/<preset>)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)))
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--set", nargs="*", default=[], help="run config overrides key=value")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    sweep = PRESETS[args.preset]
    done = run_sweep(sweep, args.out or f"results/{sweep.name}", workers=args.workers, seeds=args.seeds,
                     overrides=parse_sets(args.set), dry_run=args.dry_run)
    return 1 if any(error for _, _, error in done) else 0


if __name__ == "__main__":
    raise SystemExit(main())
