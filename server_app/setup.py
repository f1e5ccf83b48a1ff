"""What both server loops need, built and checked before round 1: the run's :class:`Setup`.

The round loop (:mod:`server_app.experiment`) and the asynchronous loop
(:mod:`server_app.asynchronous`) start from the same :class:`Setup` (workload, schedule, strategy,
results folder, start round, model, virtual clock), evaluate the same way
(:func:`evaluate_models`), save the same checkpoints (:func:`save_checkpoint`) and write the same
``config.json`` (:func:`config_record`); this module holds them, so neither loop imports the other.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from availability import Schedule, parse_spec, schedule_for
from privacy.rounds import RoundPrivacy
from runconfig import ConfigError, config_key
from runconfig.extensions import split_reference
from strategies import AvailabilityStrategy, build_strategy, named_arrays
from strategies.registry import is_asynchronous, is_asynchronous_spec
from strategies.secure import secure_spec
from workloads.workload import Workload, get_workload

from . import checkpoint
from .clockgrid import VirtualClock, build_clock
from .config import RunConfig, ServerConfig, known_names
from .results import default_run_name
from .versions import project_fingerprint, ray_record

log = logging.getLogger(__name__)


@dataclass
class Setup:
    """Everything a run needs, built and checked before round 1."""

    cfg: RunConfig
    workload: Workload
    schedule: Schedule
    strategy: AvailabilityStrategy
    run_dir: Path
    start_round: int
    arrays: ArrayRecord
    clock: VirtualClock | None = None  # run config devices: rounds on the virtual clock
    privacy: RoundPrivacy | None = None  # run config dp-noise-multiplier > 0: central DP (docs/privacy.md)


def prepare(cfg: RunConfig) -> Setup:
    """Build workload, schedule and strategy; load a checkpoint. Raises before any training."""
    n = cfg.workload.num_clients
    workload = get_workload(cfg.workload)
    s = cfg.server
    with config_key("availability", cfg.availability.availability, known_names("availability")):
        schedule = schedule_for(cfg.to_dict(), workload)
    with config_key("strategy", s.strategy, known_names("strategy")):
        strategy = build_strategy(
            strategy_spec(s), num_clients=n, server_lr=s.server_lr, weighting=s.weighting,
            seed=cfg.workload.train_seed, fraction_evaluate=float(s.federated_evaluation), probabilities=schedule.prob,
            min_available_nodes=0,  # run() waits for min-nodes itself (wait-for-nodes); churn leaves rounds short
        )
    if s.devices and secure_spec(s.strategy):  # strategies.secure: four stages a round, not one job per client
        raise ConfigError(f"run config 'devices' = {s.devices!r}: strategy {s.strategy!r} runs SecAgg+'s four stages "
                          "a round, which the virtual clock does not time: leave devices empty")
    arrays = ArrayRecord(workload.new_model().state_dict())
    start_round = 1
    if s.resume_from:
        ckpt = load_checkpoint(s.resume_from, cfg, asynchronous=is_asynchronous(strategy))
        arrays = named_arrays(ckpt["arrays"])
        strategy.load_state_dict(ckpt["strategy"])
        start_round = ckpt["round"] + 1
    return Setup(cfg, workload, schedule, strategy, run_folder(cfg), start_round, arrays, virtual_clock(cfg, arrays),
                 round_privacy(cfg))


def round_privacy(cfg: RunConfig) -> RoundPrivacy | None:
    """Central DP for the round loop, or None (``dp-noise-multiplier`` = 0). Its accounting holds for
    an equal-weight mean of the round's fresh updates: other rules and weightings are refused."""
    s = cfg.server
    if not s.dp_noise_multiplier:
        return None
    name = s.strategy.partition(":")[0]
    for ok, key, value, why in (
            (name == "fedavg-active" and not secure_spec(s.strategy), "strategy", s.strategy,
             "'fedavg-active' (no secure=): the accountant's per-round sensitivity C/m is that of the equal-weight "
             "mean of the round's fresh updates; rules that reuse stored updates release them again"),
            (s.weighting == "equal", "weighting", s.weighting, "'equal' (weights by num-examples raise the "
                                                                "sensitivity to C·max n_i/Σ n_i)")):
        if not ok:
            raise ConfigError(f"run config '{key}' = {value!r} with dp-noise-multiplier = {s.dp_noise_multiplier}: "
                              f"DP needs {why} (docs/privacy.md)")
    n = cfg.workload.num_clients
    return RoundPrivacy(s.dp_noise_multiplier, s.dp_clipping_norm, n, s.dp_delta or 1.0 / n ** 2, s.dp_accountant)


def virtual_clock(cfg: RunConfig, arrays: ArrayRecord) -> VirtualClock | None:
    """The run's virtual clock (run config ``devices``; None without), its sessions seeded by
    ``schedule-seed``, its transfers the model's size each way."""
    s = cfg.server
    if not s.devices:
        return None
    if cfg.availability.availability_gate == "none":
        raise ConfigError(f"run config 'devices' = {s.devices!r} times a simulation; with availability-gate "
                          "'none' (a deployment) time is real: leave devices empty")
    return build_clock(s.devices, cfg.workload.num_clients, seed=cfg.availability.schedule_seed,
                       reference_step_ms=s.reference_step_ms,
                       model_bytes=sum(int(a.nbytes) for a in arrays.to_numpy_ndarrays()))


def strategy_spec(s: ServerConfig) -> str:
    """The ``strategy`` spec with the run config's ``max-update-norm`` / ``max-norm-ratio`` added as
    the rule's spec keys; 0 (the default) leaves the rule's own default, and a spec that sets the
    same key to another value is a ConfigError. A rule of the user's own (``module:Class:k=v``)
    keeps its ``module:Class`` in front of the parameters."""
    reference = split_reference(s.strategy)
    spec = parse_spec(s.strategy if reference is None else f"rule:{reference[1]}" if reference[1] else "rule")
    for key, value in (("max-update-norm", s.max_update_norm), ("max-norm-ratio", s.max_norm_ratio)):
        if not value:
            continue
        if key in spec.params and spec.params[key] != value:
            raise ConfigError(f"run config '{key}' = {value} but strategy {s.strategy!r} sets {key}="
                              f"{spec.params[key]}: set it in one place")
        spec.params[key] = value
    return str(spec) if reference is None else reference[0] + str(spec).removeprefix("rule")


def run_folder(cfg: RunConfig) -> Path:
    """The run's results folder: ``<results-dir>/<run-name>``, or a resumed checkpoint's own."""
    s = cfg.server
    if s.resume_from:
        return Path(s.resume_from).expanduser().resolve().parent.parent
    name = s.run_name or default_run_name(s.strategy, cfg.workload.dataset, cfg.workload.train_seed)
    return (Path(s.results_dir).expanduser() / name).resolve()


def check_resume(cfg: RunConfig, path: str) -> None:
    """ConfigError when an asynchronous run with run config ``cfg`` cannot resume: a deployment."""
    if cfg.availability.availability_gate == "none":
        raise ConfigError(f"run config 'resume-from' = {path!r}: strategy {cfg.server.strategy!r} is asynchronous "
                          "and availability-gate = 'none' (a deployment, real time): its jobs in flight run on "
                          "real nodes, and a new run cannot take their replies, so an asynchronous deployment "
                          "does not resume; start a new run (asynchronous simulations, gates 'server' and "
                          "'client', resume)")


def load_checkpoint(path: str, cfg: RunConfig, asynchronous: bool = False) -> dict[str, Any]:
    """The checkpoint at ``path`` if this run may continue it (ConfigError naming why not): written
    by the loop this run runs (``asynchronous``: the strategy's), with the same settings."""
    if not Path(path).is_file():
        raise ConfigError(f"run config 'resume-from' = {path!r}: no such checkpoint file")
    s = cfg.server
    if asynchronous:
        check_resume(cfg, path)  # not a deployment
    ckpt = checkpoint.load(path)
    wanted = checkpoint.VIRTUAL if asynchronous else checkpoint.ROUNDS
    checkpoint.check_loop(ckpt, path, wanted, s.strategy, is_asynchronous_spec)
    checkpoint.check_resumable(ckpt, path, cfg.to_dict(), s.num_server_rounds)
    return ckpt


def save_checkpoint(setup: Setup, rnd: int, arrays: ArrayRecord, loop: Mapping[str, Any] | None = None) -> Path:
    """Round (or version) ``rnd``'s checkpoint; ``loop``: an asynchronous loop's state (None: the round loop)."""
    return checkpoint.save(setup.run_dir, rnd, dict(zip(arrays.keys(), arrays.to_numpy_ndarrays(), strict=True)),
                           setup.strategy.state_dict(), setup.cfg.to_dict(), loop,
                           setup.privacy.state_dict() if setup.privacy is not None else None)


def evaluate(workload: Workload, arrays: ArrayRecord) -> dict[str, float]:
    model = workload.scratch_model(arrays.to_torch_state_dict())
    return {f"test-{k}": v for k, v in workload.evaluate(model).items()}


def evaluate_models(workload: Workload, strategy: AvailabilityStrategy, arrays: ArrayRecord) -> dict[str, float]:
    """The strategy's evaluation model as ``test-<metric>``, its extra models as ``test-<metric>-<name>``
    (e.g. FedAWE's ``test-accuracy-xbar``)."""
    out = evaluate(workload, strategy.evaluation_arrays(arrays))
    for name, extra in strategy.extra_evaluation_arrays(arrays).items():
        out.update({f"{k}-{name}": v for k, v in evaluate(workload, extra).items()})
    return out


def config_record(grid: Grid, setup: Setup) -> dict[str, Any]:
    """``config.json``: the resolved run config, seeds, schedule, engine, versions."""
    cfg = setup.cfg
    why = setup.strategy.reason_held()
    return {**cfg.to_dict(), "weighting-used": setup.strategy.weighting,
            "aggregation": f"holds every reply: {why}" if why else "streaming", "seeds": cfg.seeds,
            "schedule": setup.schedule.describe(), **engine_record(grid, cfg), "versions": _versions(), **ray_record(),
            **({"devices-used": setup.clock.plan.record()} if setup.clock else {})}


def engine_record(grid: Grid, cfg: RunConfig) -> dict[str, str]:
    """The engine that trains the clients, for ``config.json``: the grid's own record (the cohort
    engine's), else per client, with the reason when another engine was asked for."""
    if (record := getattr(grid, "engine_record", None)) is not None:
        return dict(record)
    if cfg.server.engine == "per-client":
        return {"engine-used": "per-client"}
    why = (f"engine={cfg.server.engine} applies to in-process runs (experiments.inprocess, experiments.sweep); "
           "here every client trains in its own ClientApp")
    log.warning("training per client: %s", why)
    return {"engine-used": "per-client", "engine-reason": why}


def _versions() -> dict[str, str]:
    import flwr

    ray = sys.modules.get("ray")  # Flower's simulation imported it: record it (nothing imports it here)
    return {"flwr": flwr.__version__, "torch": torch.__version__, "numpy": np.__version__,
            **({"ray": ray.__version__} if ray is not None else {}), "flchurn": project_fingerprint()}
