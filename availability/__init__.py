"""Availability schedules: who is online in which round, as a pure function of a spec string and
a seed (numpy only; knows nothing of Flower). ``build_schedule(spec, num_clients, seed, ...)``
returns a Schedule with ``prob(t)``, ``available(t)``, ``is_available(i, t)``, ``matrix(R)`` and
``describe()``; ``SCHEDULES`` lists the models by spec name. ``schedule_for(run_config, workload)``
is the schedule of a run (what the ServerApp, the ClientApp's gate and the churn driver build)."""

from .base import BernoulliSchedule, Schedule, ScheduleError
from .registry import SCHEDULES, build_schedule, model_help, schedule_for, schedule_needs
from .spec import Spec, SpecError, parse_spec
from .traces import read_trace_intervals, read_trace_matrix

__all__ = ["SCHEDULES", "BernoulliSchedule", "Schedule", "ScheduleError", "Spec", "SpecError",
           "build_schedule", "model_help", "parse_spec", "read_trace_intervals",
           "read_trace_matrix", "schedule_for", "schedule_needs"]
