"""Sweeps: strategy × schedule × workload × seed, each run a Ray task, resumable.

Every run is an in-process run (the real ServerApp loop and ClientApp; ``engine`` as the preset or
``--set engine=cohort`` says) in a Ray task with its own resources (``--cpus-per-run``,
``--gpus-per-run``: fractions let several runs share one GPU) and a fresh worker process (one task
per worker). Ray starts locally by default; ``--address`` joins an existing cluster (then the
results folder must be on a file system every node sees, and the project is shipped to the
workers as Ray's ``working_dir``). A run whose folder already holds ``final_model.pt`` is skipped,
and a run interrupted after a checkpoint resumes from its newest one, so an interrupted sweep
continues where it stopped; every invocation appends one line to ``sweep-log.jsonl``. Reports read only the folders.

    python -m experiments.sweep fedawe-table2 --out results/fedawe-table2 --cpus-per-run 1
    python -m experiments.sweep fedawe-table2-cifar --gpus-per-run 0.25 --set engine=cohort
    python -m experiments.sweep fedawe-table2 --address ray://head:10001 --out /shared/results/fedawe-table2
    python -m experiments.sweep fedawe-table2 --set num-server-rounds=50 --seeds 0 1 2 --dry-run
    python -m experiments.sweep --study my_study.toml --out results/my-study      # the user's own study
    python -m experiments.sweep --study mypkg.studies:COMPARE                     # or module:attr

A study is a preset's name, a TOML study file, ``module:attr`` or an installed entry point
(``experiments.studyfile``). Every invocation's log line records the exact command and each run's
seconds (what the report states).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from availability.spec import parse_value
from experiments.study import Sweep

ROOT = Path(__file__).resolve().parent.parent
SWEEP_LOG = "sweep-log.jsonl"  # one line per sweep invocation: when, how long, with what resources, how many runs
SHIP_EXCLUDES = [".git", ".venv", "results", "reports", "**/__pycache__", "*.pt"]  # not sent to a cluster


def run_one(name: str, overrides: dict[str, Any], out: str, threads: int) -> tuple[str, float, str]:
    """One run of a sweep (the body of its Ray task): (name, seconds, error or "")."""
    import torch

    torch.set_num_threads(threads)
    from experiments.inprocess import run_inprocess
    from server_app import checkpoint

    t0 = time.time()
    try:
        if list((Path(out) / name / checkpoint.FOLDER).glob("round-*.pt")):  # interrupted: go on from there
            overrides = {**overrides, "resume-from": str(checkpoint.latest(Path(out) / name))}
        run_inprocess({**overrides, "results-dir": out, "run-name": name, "progress": False})
    except Exception as exc:  # one failed run must not stop the sweep; it is reported
        return name, time.time() - t0, f"{type(exc).__name__}: {exc}"
    return name, time.time() - t0, ""


def start_ray(address: str | None, num_cpus: int | None = None, python_path: Iterable[str] = ()):
    """Connect to ``address`` (a running cluster) or start a local Ray; returns the ray module.

    ``python_path``: extra folders the runs import the user's modules from (a study's)."""
    import ray

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), *python_path, os.environ.get("PYTHONPATH")])),
           "FLWR_TELEMETRY_ENABLED": "0"}
    runtime_env: dict[str, Any] = {"env_vars": env}
    if address:
        runtime_env = {"working_dir": str(ROOT), "excludes": SHIP_EXCLUDES,
                       "env_vars": {"FLWR_TELEMETRY_ENABLED": "0"}}
    ray.init(address=address, num_cpus=None if address else num_cpus, include_dashboard=False,
             runtime_env=runtime_env, log_to_driver=False, configure_logging=False)
    return ray


def run_sweep(sweep: Sweep, out: str | Path, *, cpus_per_run: float = 1.0, gpus_per_run: float = 0.0,
              address: str | None = None, num_cpus: int | None = None, seeds: Iterable[int] | None = None,
              overrides: Mapping[str, Any] | None = None, dry_run: bool = False,
              command: str = "") -> list[tuple[str, float, str]]:
    """Run the sweep's unfinished runs as Ray tasks; returns (name, seconds, error) per run done.

    ``num_cpus`` caps a local Ray (default: every CPU); it is ignored with ``address``.
    ``command``: the command line that asked for it, recorded in the sweep log.
    """
    if cpus_per_run <= 0 or gpus_per_run < 0:
        raise ValueError(f"--cpus-per-run must be > 0 and --gpus-per-run >= 0; got {cpus_per_run}, {gpus_per_run}")
    out = Path(out).resolve()
    todo = [(name, {**cfg, **(overrides or {})}) for name, cfg in sweep.runs(seeds)
            if not (out / name / "final_model.pt").exists()]
    print(f"sweep {sweep.name}: {len(todo)} run(s) to do in {out}")
    if dry_run:
        for name, cfg in todo:
            print(" ", name, cfg)
        return []
    if not todo:
        return []
    out.mkdir(parents=True, exist_ok=True)
    for folder in sweep.python_path:  # the user's modules, importable here (checks) and in the tasks
        if folder not in sys.path:
            sys.path.insert(0, folder)
    ray = start_ray(address, num_cpus, sweep.python_path)
    done: list[tuple[str, float, str]] = []
    started = time.time()
    resources = ray.cluster_resources()
    try:
        task = ray.remote(num_cpus=cpus_per_run, num_gpus=gpus_per_run, max_calls=1, max_retries=0)(run_one)
        pending = [task.remote(name, cfg, str(out), max(1, int(cpus_per_run))) for name, cfg in todo]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            name, seconds, error = ray.get(ready[0])
            print(f"  {name}: {'FAILED ' + error if error else 'done'} in {seconds:.0f} s", flush=True)
            done.append((name, seconds, error))
    finally:  # an interrupted sweep (Ctrl-C) still logs the time it spent and the runs it finished
        slots = resources.get("CPU", 1) / cpus_per_run
        if gpus_per_run:
            slots = min(slots, resources.get("GPU", 0) / gpus_per_run)
        log_invocation(out, started, {"workers": max(1, int(slots)), "cpus": int(resources.get("CPU", 0)),
                                      "gpus": resources.get("GPU", 0), "cpus-per-run": cpus_per_run,
                                      "gpus-per-run": gpus_per_run, "ray-address": address or "local",
                                      **({"command": command} if command else {})}, done)
        ray.shutdown()
    return done


def log_invocation(out: Path, started: float, resources: dict[str, Any], done: list[tuple[str, float, str]]) -> None:
    entry = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
             "wall-seconds": round(time.time() - started, 1), **resources,
             "runs-done": sum(not error for _, _, error in done), "runs-failed": sum(bool(error) for _, _, error in done),
             "run-seconds": {name: round(seconds, 1) for name, seconds, error in done if not error}}
    with (out / SWEEP_LOG).open("a") as fh:
        fh.write(json.dumps(entry) + "\n")


def parse_sets(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = parse_value(value)
    return out


def sweep_command(study: str, out: str, argv: list[str]) -> str:
    """The command line that reruns this sweep exactly: the study, ``--out`` and every other option."""
    rest, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("--out", "--study"):
            skip = True
            continue
        if arg.startswith(("--out=", "--study=")) or (arg == study and not any(a == "--study" for a in argv[:i])):
            continue
        rest.append(arg)
    return shlex.join(["python", "-m", "experiments.sweep", "--study", study, "--out", out, *rest])


def study_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("study", nargs="?", default=None,
                        help="a preset's name, a study file (.toml), module:attr or an installed study's name")
    parser.add_argument("--study", dest="study_option", default=None, metavar="STUDY", help="the same, as an option")


def study_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, Sweep]:
    from experiments.studyfile import StudyError, load_study

    ref = args.study_option or args.study
    if ref is None or (args.study_option and args.study):
        parser.error("name one study: a preset, a .toml file or module:attr (positional or --study)")
    try:
        return ref, load_study(ref)
    except (StudyError, ValueError) as exc:
        parser.error(str(exc))
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    study_argument(parser)
    parser.add_argument("--out", default=None, help="results folder (default results/<study name>)")
    parser.add_argument("--cpus-per-run", type=float, default=1.0, help="CPUs a run reserves (and its torch threads)")
    parser.add_argument("--gpus-per-run", type=float, default=0.0, help="GPUs a run reserves; 0.25: four runs share one")
    parser.add_argument("--address", default=None, help="an existing Ray cluster (default: start Ray locally)")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    parser.add_argument("--seeds", type=int, nargs="*", default=None)
    parser.add_argument("--set", nargs="*", default=[], help="run config overrides key=value")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    ref, sweep = study_of(parser, args)
    out = args.out or f"results/{sweep.name}"
    done = run_sweep(sweep, out, cpus_per_run=args.cpus_per_run,
                     gpus_per_run=args.gpus_per_run, address=args.address, num_cpus=args.num_cpus,
                     seeds=args.seeds, overrides=parse_sets(args.set), dry_run=args.dry_run,
                     command=sweep_command(ref, out, argv))
    return 1 if any(error for _, _, error in done) else 0


if __name__ == "__main__":
    raise SystemExit(main())
