"""The run config's shared part: its errors, its parsing, and the sections client and server share.

Flower hands every app the same flat run config (``[tool.flwr.app.config]`` + ``--run-config``).
The ClientApp, the ServerApp and the deployment tools all read parts of it; this package is the
one place that knows how, and it imports nothing of the project (no torch, no Flower), so the thin
ClientApp and the churn driver can read the run config without loading a workload.
"""

from .fields import (
           ConfigError,
           as_run_config,
           check,
           closest,
           config_key,
           did_you_mean,
           from_run_config,
           key_error,
           key_of,
           known_keys,
)
from .sections import AVAILABILITY_GATES, AvailabilityConfig, WorkloadConfig
from .stragglers import STRAGGLER_POLICIES, StragglerConfig

__all__ = ["AVAILABILITY_GATES", "STRAGGLER_POLICIES", "AvailabilityConfig", "ConfigError", "StragglerConfig",
           "WorkloadConfig", "as_run_config", "check", "closest", "config_key", "did_you_mean",
           "from_run_config", "key_error",
           "key_of", "known_keys"]
