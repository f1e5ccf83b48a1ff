"""Time in the simulation: device profiles, a virtual clock and an event queue (NumPy + stdlib).

- ``profiles``: the device-class file (TOML, the same file ``python -m deploy launch --devices``
  reads): :class:`DeviceProfile` per class, :class:`ProfilePlan` (every client's class),
  :func:`read_profiles` / :func:`parse_profiles`;
- ``traces``: FedScale-style device traces (:func:`read_trace`) bucketed into classes
  (:func:`classes_from_trace`); ``fedscale``: FedScale's own pickled traces, read with an
  unpickler that refuses every global, their text form and their mapping onto devices files and
  ``trace-intervals`` (``python -m virtualtime convert``);
- ``sessions``: on/off sessions in seconds, per client, keyed by (seed, client, session index):
  O(1) state per client, the same answer whatever order it is asked in;
- ``clock``: :class:`VirtualClock` (a client's :class:`JobTime`, who is online when), the one
  clock of every simulated run (``VirtualClock.steps_only`` without device profiles);
- ``jobs``: :func:`~.jobs.job_fate`, what becomes of one job (off, lost, its arrival, the steps
  that fit), the one place both the synchronous and the asynchronous loop ask;
- ``events``: :class:`EventQueue`, a deterministic (time, sequence) priority queue.

See docs/virtual-time.md.
"""

from .clock import STEP_SECONDS, JobTime, VirtualClock
from .errors import ProfileError
from .events import Event, EventQueue
from .profiles import DeviceProfile, ProfilePlan, parse_profiles, read_profiles
from .traces import classes_from_trace, read_trace

__all__ = ["STEP_SECONDS", "DeviceProfile", "Event", "EventQueue", "JobTime", "ProfileError", "ProfilePlan", "VirtualClock",
           "classes_from_trace", "parse_profiles", "read_profiles", "read_trace"]
