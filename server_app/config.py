"""The whole run config, checked before anything trains."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from availability.registry import SCHEDULES
from runconfig import (
    AvailabilityConfig,
    ConfigError,
    StragglerConfig,
    WorkloadConfig,
    as_run_config,
    check,
    from_run_config,
    known_keys,
)
from runconfig.extensions import entry_points
from strategies import STRATEGIES
from strategies.weighting import WEIGHTINGS

#: the run config's ``engine`` (in-process runs; see experiments.cohort_grid)
ENGINES = ("per-client", "cohort", "auto")
#: the run config's ``dp-accountant``: privacy.accountant.METHODS, named here so that checking the run
#: config imports no dp-accounting (tests/test_privacy_serverapp.py holds them equal)
ACCOUNTANTS = ("rdp", "pld")


@dataclass(frozen=True)
class ServerConfig:
    num_server_rounds: int = 40
    strategy: str = "fedavg-active"
    server_lr: float = 1.0
    weighting: str = "auto"  # the rule's paper weighting; or "equal", "num-examples"
    max_update_norm: float = 0.0  # replies with a larger update norm are rejected (0: the rule's default)
    max_norm_ratio: float = 0.0  # ... or a norm this many times the round's median (0: the rule's default)
    round_timeout: float = 120.0  # seconds a round waits for replies; then it goes on
    round_deadline: float = 0.0  # seconds a round waits for training replies, from round 2 (0: round-timeout)
    wait_for_nodes: float = 60.0  # seconds to wait for min-nodes nodes before round 1
    min_nodes: int = 0  # nodes that must be connected before round 1 (0: num-clients)
    round_start_delay: float = 0.0  # seconds to wait before each round (a churn driver's grace)
    round_start_signal: str = ""  # a folder: round r starts once <folder>/round-<r> exists (at most the delay)
    eval_every: int = 1  # central evaluation every k rounds (0: only after the last)
    federated_evaluation: bool = False  # also ask clients to evaluate on their own data
    checkpoint_every: int = 10  # 0: no checkpoints
    results_dir: str = "results"  # relative paths are resolved against the ServerApp's cwd
    run_name: str = ""  # "" -> <time>-<strategy>-<dataset>-s<seed>
    resume_from: str = ""  # a checkpoint file; continues that run in its own folder
    progress: bool = True
    engine: str = "per-client"  # in-process runs: "per-client", "cohort" (vmapped cohort), "auto"
    devices: str = ""  # a devices file (TOML): simulated devices on a virtual clock ("": off)
    virtual_deadline: float = 0.0  # with devices: virtual seconds a training round waits (0: no deadline)
    min_replies: int = 0  # with devices: a round closes at its k-th arrival (0: waits for all)
    reference_step_ms: float = 0.0  # with devices: ms per local step of the reference device (0: unknown)
    dp_noise_multiplier: float = 0.0  # central DP (docs/privacy.md): z of the Gaussian noise (0: off)
    dp_clipping_norm: float = 0.0  # with DP: C, each update clipped to this norm
    dp_delta: float = 0.0  # with DP: delta of the reported epsilon (0: 1/N^2)
    dp_accountant: str = "rdp"  # with DP: "rdp" or "pld" (dp-accounting)

    def validate(self) -> ServerConfig:
        check(self.num_server_rounds >= 1, "num-server-rounds", self.num_server_rounds, ">= 1")
        check(self.server_lr > 0, "server-lr", self.server_lr, "> 0")
        check(self.weighting in WEIGHTINGS, "weighting", self.weighting, f"one of {WEIGHTINGS}")
        check(self.max_update_norm >= 0, "max-update-norm", self.max_update_norm, ">= 0 (0: the rule's default)")
        check(self.max_norm_ratio == 0 or self.max_norm_ratio > 1, "max-norm-ratio", self.max_norm_ratio,
              "> 1 (0: the rule's default)")
        check(self.round_timeout > 0, "round-timeout", self.round_timeout, "> 0 seconds")
        check(0 <= self.round_deadline <= self.round_timeout, "round-deadline", self.round_deadline,
              ">= 0 and <= round-timeout seconds (0: no deadline but round-timeout)")
        check(self.wait_for_nodes >= 0, "wait-for-nodes", self.wait_for_nodes, ">= 0 seconds")
        check(self.min_nodes >= 0, "min-nodes", self.min_nodes, ">= 0")
        check(self.round_start_delay >= 0, "round-start-delay", self.round_start_delay, ">= 0 seconds")
        check(self.eval_every >= 0, "eval-every", self.eval_every, ">= 0")
        check(self.checkpoint_every >= 0, "checkpoint-every", self.checkpoint_every, ">= 0")
        check(self.engine in ENGINES, "engine", self.engine, f"one of {ENGINES}")
        check(self.virtual_deadline >= 0, "virtual-deadline", self.virtual_deadline,
              ">= 0 virtual seconds (0: no deadline)")
        check(self.min_replies >= 0, "min-replies", self.min_replies, ">= 0 (0: every addressed client)")
        check(self.reference_step_ms >= 0, "reference-step-ms", self.reference_step_ms, ">= 0 ms (0: unknown)")
        for key, value in (("virtual-deadline", self.virtual_deadline), ("min-replies", self.min_replies),
                           ("reference-step-ms", self.reference_step_ms)):
            check(not value or bool(self.devices), key, value,
                  "0 without devices (it times rounds on the virtual clock: set devices=<devices file>)")
        check(self.dp_noise_multiplier >= 0, "dp-noise-multiplier", self.dp_noise_multiplier, ">= 0 (0: no DP)")
        dp = self.dp_noise_multiplier > 0
        check(not dp or self.dp_clipping_norm > 0, "dp-clipping-norm", self.dp_clipping_norm,
              "> 0 with dp-noise-multiplier > 0 (each update is clipped to this norm)")
        check(0 <= self.dp_delta < 1, "dp-delta", self.dp_delta, "in [0, 1) (0: 1/num-clients^2)")
        check(self.dp_accountant in ACCOUNTANTS, "dp-accountant", self.dp_accountant, f"one of {ACCOUNTANTS}")
        return self


@dataclass(frozen=True)
class RunConfig:
    server: ServerConfig
    workload: WorkloadConfig
    availability: AvailabilityConfig
    stragglers: StragglerConfig = StragglerConfig()

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunConfig:
        parts = {"server": ServerConfig, "workload": WorkloadConfig, "availability": AvailabilityConfig,
                 "stragglers": StragglerConfig}
        check_known_keys(run_config, set().union(*(known_keys(c) for c in parts.values())))
        built: dict[str, Any] = {name: from_run_config(c, run_config).validate() for name, c in parts.items()}
        check_straggler_deadline(built["server"], built["stragglers"])
        return cls(**built)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            out.update(as_run_config(getattr(self, f.name)))
        return out

    @property
    def seeds(self) -> dict[str, int]:
        return {
            "data-seed": self.workload.data_seed,
            "schedule-seed": self.availability.schedule_seed,
            "train-seed": self.workload.train_seed,
        }


def check_straggler_deadline(s: ServerConfig, st: StragglerConfig) -> None:
    """``partial`` and ``wait`` act on a deadline: ``virtual-deadline`` on the virtual clock
    (``devices``), else ``round-deadline`` (a deployment's real seconds)."""
    key, deadline = ("virtual-deadline", s.virtual_deadline) if s.devices else ("round-deadline", s.round_deadline)
    check(st.straggler_policy == "drop" or deadline > 0, "straggler-policy", st.straggler_policy,
          f"'drop' while {key} = 0 (no deadline: '{st.straggler_policy}' would change nothing; set {key})")


def known_names(key: str) -> list[str]:
    """The names spec key ``key`` (``availability``, ``strategy``) knows, built-in and installed (entry
    points): a misspelling's candidates."""
    builtin = {"availability": SCHEDULES, "strategy": STRATEGIES}[key]
    return [*builtin, *entry_points(key)]


def check_known_keys(run_config: Mapping[str, Any], known: set[str]) -> None:
    """ConfigError naming each unknown key and the closest known one."""
    unknown = sorted(set(run_config) - known)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key.replace("_", "-"), sorted(known), n=1, cutoff=0.5)
        hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    raise ConfigError(f"unknown run config key(s) {', '.join(hints)}; every key is listed in "
                      "[tool.flwr.app.config] of pyproject.toml and in docs/run-config.md")
