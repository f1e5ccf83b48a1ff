"""Moved to :mod:`runconfig` (errors and parsing) and :mod:`runconfig.sections` (the sections).

Kept only so that ``deploy/churn.py``'s lazy import keeps working until it builds its schedule
with :func:`availability.schedule_for`; new code imports :mod:`runconfig`.
"""

from runconfig import AvailabilityConfig, ConfigError, WorkloadConfig, from_run_config

__all__ = ["AvailabilityConfig", "ConfigError", "WorkloadConfig", "from_run_config"]
