"""A deployed run's config: what is submitted, the folder it writes, its schedule, and resuming
it from a checkpoint. Pure functions of the run config (and of the files a run leaves)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.common.config import parse_config_args

from availability import Schedule, schedule_for
from runconfig import ConfigError, WorkloadConfig, from_run_config
from runconfig.defaults import ROOT, default_run_config
from server_app import checkpoint
from server_app.config import RunConfig
from server_app.results import RunRecorder, default_run_name
from server_app.setup import check_resume, run_folder
from strategies.registry import is_asynchronous_spec
from workloads.workload import get_workload

from .errors import DeployError


def parse_run_config(text: str | None) -> dict[str, Any]:
    """``"k=v k2='s'"`` (what ``flwr run --run-config`` takes) -> dict, with Flower's own parser."""
    if not text:
        return {}
    return dict(parse_config_args([text]))


def build_run_config(num_nodes: int, user: Mapping[str, Any], *, grace: float = 0.0,
                     project: str | Path = ROOT) -> dict[str, Any]:
    """The run config actually submitted to ``num_nodes`` SuperNodes: the project's defaults,
    the user's keys, and what a deployment must force. Call it once per run: it decides the
    run name.

    Forced: ``num-clients`` = number of SuperNodes (a user value that differs is an error),
    ``availability-gate="none"`` (the churn driver, not the server, decides who is there), an
    absolute ``results-dir`` (the ServerApp's cwd is the SuperLink's), a ``run-name`` (default
    ``deploy-<time>-<strategy>-<dataset>-s<seed>``, made unique in ``results-dir``),
    ``min-nodes`` = N (the caller lowers it to the round-1 count under churn) and
    ``round-start-delay`` = the churn grace when > 0.
    """
    n = int(num_nodes)
    if "num-clients" in user and int(user["num-clients"]) != n:
        raise DeployError(f"run config num-clients={user['num-clients']} but {n} SuperNodes were asked for: "
                          f"num-clients follows --num-nodes, so drop it from the run config "
                          f"(or pass --num-nodes {user['num-clients']})")
    cfg = {**default_run_config(project), **user, "num-clients": n, "availability-gate": "none"}
    results = Path(str(cfg.get("results-dir") or "results")).expanduser()
    cfg["results-dir"] = str(results if results.is_absolute() else (Path.cwd() / results).resolve())
    if cfg.get("resume-from"):
        ckpt = Path(str(cfg["resume-from"])).expanduser().resolve()
        if not ckpt.is_file():
            raise DeployError(f"resume-from {ckpt}: no such checkpoint file (see <run>/checkpoints/)")
        cfg["resume-from"] = str(ckpt)
    if not cfg.get("run-name"):
        base = "deploy-" + default_run_name(str(cfg["strategy"]), str(cfg["dataset"]), int(cfg["train-seed"]))
        name, k = base, 1
        while (Path(cfg["results-dir"]) / name).exists():
            k += 1
            name = f"{base}-{k}"
        cfg["run-name"] = name
    elif not cfg.get("resume-from") and (Path(cfg["results-dir"]) / str(cfg["run-name"])).exists():
        raise DeployError(f"run-name {cfg['run-name']!r}: {cfg['results-dir']}/{cfg['run-name']} holds a run "
                          f"already; pick another run-name (or leave it out for a fresh one), or continue "
                          f"that run with --resume-from")
    cfg["min-nodes"] = n
    if grace > 0:
        cfg["round-start-delay"] = float(grace)
    return cfg


def check_run_config(cfg: Mapping[str, Any]) -> None:
    """Every key checked, as the ServerApp will, before any process trains; an asynchronous
    deployment's ``resume-from`` refused here, before its run folder is cut back."""
    run_config = RunConfig.from_run_config(dict(cfg))
    if run_config.server.resume_from and is_asynchronous_spec(run_config.server.strategy):
        try:
            check_resume(run_config, run_config.server.resume_from)
        except ConfigError as err:
            raise DeployError(str(err)) from None


def run_dir_of(run_config: Mapping[str, Any]) -> Path:
    """The folder the ServerApp writes for ``run_config``, by the server's own rule
    (:func:`server_app.setup.run_folder`: a resumed run continues in its checkpoint's folder)."""
    return run_folder(RunConfig.from_run_config(dict(run_config)))


def build_run_schedule(run_config: Mapping[str, Any]) -> Schedule:
    """The schedule the server builds for ``run_config`` (same spec, seed, label distributions):
    :func:`availability.schedule_for`, loading the workload only when the model needs it."""
    return schedule_for(run_config, lambda: get_workload(from_run_config(WorkloadConfig, run_config)))


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest readable checkpoint of a run folder (:func:`server_app.checkpoint.latest`)."""
    try:
        return checkpoint.latest(run_dir)
    except ConfigError as err:
        raise DeployError(str(err)) from None


def prepare_resume(cfg: Mapping[str, Any]) -> int:
    """Cut the run folder's ``metrics.jsonl`` back to the checkpoint's round (what the ServerApp
    does on resume, done first so that nothing follows stale rounds); return that round."""
    ckpt = checkpoint.load(str(cfg["resume-from"]))
    RunRecorder(run_dir_of(cfg), int(cfg["num-clients"])).resume_at(int(ckpt["round"]))
    return int(ckpt["round"])
