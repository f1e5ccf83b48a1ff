"""The registry of availability models (discovered: every Schedule subclass of this package
that declares a ``name``; the user's by ``module:attr`` or the ``flchurn.availability`` entry
point group) and the entry points: ``build_schedule`` from a spec, and
``schedule_for`` from a run config (the one the ServerApp, the ClientApp's gate and the churn
driver all build, so they agree on every client and round)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np

from runconfig import AvailabilityConfig, WorkloadConfig, did_you_mean, from_run_config
from runconfig.extensions import Reference, accepted, entry_points, keyword_defaults, resolve

from .base import Schedule, ScheduleError
from .spec import Spec, SpecError, canonical_key, parse_params, parse_spec


def _all_subclasses(cls: type) -> list[type]:
    out: list[type] = []
    subs: list[type] = cls.__subclasses__()
    for sub in subs:
        out += [sub, *_all_subclasses(sub)]
    return out


def discover(package: str) -> dict[str, type[Schedule]]:
    """Spec name -> Schedule subclass, for every class of ``package``'s modules that declares its
    own ``name``: a new model is a class in a new module, never an entry in a list."""
    pkg = importlib.import_module(package)
    for module in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{package}.{module.name}")
    found: dict[str, type[Schedule]] = {}
    for cls in _all_subclasses(Schedule):
        name = cls.__dict__.get("name")
        if name and cls.__module__.startswith(package + "."):
            if name in found and found[name] is not cls:
                raise ScheduleError(f"availability model name {name!r} is declared twice: "
                                    f"{found[name].__qualname__} and {cls.__qualname__}")
            found[name] = cls
    return dict(sorted(found.items()))


#: spec name -> Schedule subclass (its docstring cites the paper; ``defaults`` lists parameters).
SCHEDULES: dict[str, type[Schedule]] = discover(__package__)


def _reference(spec: str) -> Reference | None:
    """The user's model a spec names (``module:attr`` or an entry point of ``flchurn.availability``)."""
    return resolve(spec, "availability", builtin=lambda name: name in SCHEDULES)


def _unknown(name: str) -> ScheduleError:
    hint = did_you_mean(name, [*SCHEDULES, *entry_points("availability")])
    return ScheduleError(f"unknown availability model '{name}'{hint}; known: {', '.join(sorted(SCHEDULES))}, "
                         "or the user's 'module:attr' (docs/extending.md)")


def _user_model(ref: Reference) -> tuple[Any, dict[str, Any], frozenset[str]]:
    """(class or factory, checked parameters, inputs it needs) of the user's model."""
    given = parse_params(ref.params, what=f"availability model {ref.name!r}")
    obj = ref.obj
    if isinstance(obj, type) and issubclass(obj, Schedule):
        params = Spec(obj.name or ref.name, given).take(obj.defaults, what="availability model")
        return obj, params, obj.needs(params)
    if not callable(obj):
        raise ScheduleError(f"availability model {ref.name!r} is a {type(obj).__name__}: expected a Schedule "
                            "subclass or a factory(num_clients, seed, **params) -> Schedule")
    allowed, _ = keyword_defaults(obj, ("num_clients", "seed", "label_dists", "clusters"))
    named = {canonical_key(k) for k in given}
    params = {k: v for k, v in Spec(ref.name, given).take(allowed, what="availability model").items()
              if canonical_key(k) in named}  # the factory's own defaults fill the rest
    inputs, _ = keyword_defaults(obj)
    return obj, params, frozenset(inputs) & {"label_dists", "clusters"}


def build_schedule(spec: str, num_clients: int, seed: int, label_dists: np.ndarray | None = None,
                   clusters: np.ndarray | None = None) -> Schedule:
    """Build the schedule a spec string names, e.g. ``build_schedule("sine:gamma=0.3", 100, 0,
    label_dists)``, or the user's (``module:attr`` or entry point: a Schedule subclass, or a
    factory called with ``num_clients``, ``seed``, the inputs it takes and its parameters).
    Raises ScheduleError (a SpecError, a ValueError) naming what is wrong."""
    try:
        ref = _reference(spec)
        if ref is not None:
            obj, params, _ = _user_model(ref)
            if isinstance(obj, type) and issubclass(obj, Schedule):
                schedule = obj(Spec(obj.name, params), num_clients, seed, label_dists=label_dists,
                               clusters=clusters)
            else:
                offered = {"num_clients": num_clients, "seed": seed, "label_dists": label_dists,
                           "clusters": clusters}
                schedule = obj(**accepted(obj, offered), **params)
                if not isinstance(schedule, Schedule):
                    raise ScheduleError(f"availability model {ref.name!r} returned a "
                                        f"{type(schedule).__name__}, not a Schedule")
            schedule.spec = spec.strip()
            return schedule
        parsed = parse_spec(spec)
    except ScheduleError:
        raise
    except (SpecError, ValueError) as err:
        raise ScheduleError(str(err)) from err
    if parsed.name not in SCHEDULES:
        raise _unknown(parsed.name)
    return SCHEDULES[parsed.name](spec, num_clients, seed, label_dists=label_dists,
                                  clusters=clusters)


def schedule_needs(spec: str) -> frozenset[str]:
    """What the schedule ``spec`` names is built from besides the spec and seed: a subset of
    ``{"label_dists", "clusters"}`` (the workload's), e.g. ``sine`` needs the label distributions,
    ``dropout:keep_per_cluster=true`` the clusters, ``bernoulli`` nothing."""
    try:
        ref = _reference(spec)
        if ref is not None:
            return _user_model(ref)[2]
        parsed = parse_spec(spec)
        if parsed.name not in SCHEDULES:
            raise _unknown(parsed.name)
        cls = SCHEDULES[parsed.name]
        return cls.needs(parsed.take(cls.defaults, what="availability model"))
    except ScheduleError:
        raise
    except (SpecError, ValueError) as err:
        raise ScheduleError(str(err)) from err


class WorkloadInputs(Protocol):
    """What a schedule may need from the workload (``workloads.workload.Workload`` has both)."""

    label_dists: np.ndarray | None
    clusters: np.ndarray | None


def schedule_for(run_config: Mapping[str, Any],
                 workload: WorkloadInputs | Callable[[], WorkloadInputs] | None = None) -> Schedule:
    """The schedule of a run config: its ``availability`` spec, ``schedule-seed`` and ``num-clients``.

    ``workload`` gives the label distributions and clusters when the model needs them: the
    workload itself, or a function that builds it, called only when needed (so the churn driver
    loads no data for ``bernoulli``). None is fine for a model that needs neither; for one that
    does it is a ScheduleError naming what is missing.
    """
    acfg = from_run_config(AvailabilityConfig, run_config).validate()
    num_clients = from_run_config(WorkloadConfig, run_config).num_clients
    needs = schedule_needs(acfg.availability)
    inputs: dict[str, Any] = {"label_dists": None, "clusters": None}
    if needs:
        if workload is None:
            raise ScheduleError(f"availability '{acfg.availability}' needs the workload's "
                                f"{' and '.join(sorted(needs))}; pass the workload to schedule_for")
        wl = workload() if callable(workload) else workload
        inputs.update({k: getattr(wl, k) for k in needs})
    return build_schedule(acfg.availability, num_clients, acfg.schedule_seed, **inputs)


def model_help() -> dict[str, dict]:
    """Name -> {parameters with defaults, first docstring line}: for CLI help and docs."""
    return {name: {"params": dict(cls.defaults),
                   "doc": (cls.__doc__ or "").strip().splitlines()[0]}
            for name, cls in sorted(SCHEDULES.items())}
