"""A user's own local solver and learning-rate schedule, named in the run config (docs/extending.md).

``solver = "mypkg.solvers:Adam:beta2=0.99"`` (or an entry point of group ``flchurn.solvers``) names a
:class:`LocalSolver`; ``lr-schedule = "mypkg.lr:warmup:rounds=5"`` (or ``flchurn.lr_schedules``) a
function ``schedule(t, base_lr, **params) -> float`` of the 0-based round t. Built-in names
(``workloads.solvers``) win over modules and entry points of the same name. Both are resolved once
per process and spec (:data:`RESOLVED`): a solver holds no per-run state of its own.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, ClassVar, cast

import torch

from availability.spec import SpecError
from runconfig.extensions import ExtensionError, resolve

from .extensions import spec_params


class LocalSolver:
    """A local solver of the user's own: the update of one local step, written once for both engines.

    Every tensor has a leading client dimension: the per-client engine passes one client's
    parameters as views of shape ``(1, *shape)``, the cohort engine a cohort's stacked parameters
    ``(C, *shape)``; clients never mix. Subclass it (or write any class with these methods), give
    it keyword parameters with defaults (the spec's, ``mypkg.solvers:Adam:beta2=0.99``) and keep
    no per-run state on ``self``: one instance serves every client.

    - :meth:`init` is called at the start of each client's local training with the start
      parameters (not to be modified) and returns the solver's state: tensors with the same leading
      client dimension (moments, a step counter of shape ``(C,)``, a copy of the start), or [].
    - :meth:`step` updates ``params`` in place from ``grads`` (the mini-batch loss gradient, after
      ``max-grad-norm`` clipping and plus ``weight-decay`` x) with learning rate ``lr`` (the
      schedule's, for this round), updating ``state`` in place.
    - :meth:`a_norm` is FedNova's ‖a_i‖_1 after ``steps`` steps (default: ``steps``, plain SGD's).
    - ``batched = False`` says :meth:`step` handles one client at a time (a leading dimension
      of 1): the cohort engine then calls it per client on views of the stack (same numbers,
      no speed-up).
    """

    batched: ClassVar[bool] = True

    def init(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return []

    def step(self, params: list[torch.Tensor], grads: list[torch.Tensor], state: list[torch.Tensor],
             lr: float) -> None:
        raise NotImplementedError

    def a_norm(self, steps: int, lr: float) -> float:
        return float(steps)


#: (point, spec) -> what it resolved to, once per process (a test that installs a package swaps it)
RESOLVED: dict[tuple[str, str], Any] = {}


def _once(point: str, spec: str, build: Callable[[], Any]) -> Any:
    if (point, spec) not in RESOLVED:
        RESOLVED[point, spec] = build()
    return RESOLVED[point, spec]


def user_solver(spec: str, builtins: tuple[str, ...]) -> LocalSolver | None:
    """The user's solver a ``solver`` spec names (``module:Class[:k=v]`` or an entry point of
    ``flchurn.solvers``), built with its parameters; None for a built-in (or unknown) name."""
    return cast("LocalSolver | None", _once("solver", spec, lambda: _solver(spec, builtins)))


def _solver(spec: str, builtins: tuple[str, ...]) -> LocalSolver | None:
    ref = resolve(spec, "solver", builtin=lambda name: name in builtins)
    if ref is None:
        return None
    obj = ref.obj
    if inspect.isclass(obj):
        obj = obj(**spec_params(ref, obj, (), "solver"))
    elif ref.params:
        raise SpecError(f"solver {ref.name!r} is an instance: it takes no parameters ({ref.params!r})")
    if not callable(getattr(obj, "step", None)):
        raise ExtensionError(f"solver {ref.name!r} is a {type(obj).__name__} without a step(params, grads, state, "
                             "lr) method: write a workloads.solvers.LocalSolver (docs/extending.md)")
    return cast(LocalSolver, obj)


def user_schedule(spec: str, builtins: tuple[str, ...]) -> Callable[[int, float], float] | None:
    """The user's schedule an ``lr-schedule`` spec names, as ``f(t, base_lr)``: a function
    ``schedule(t, base_lr, **params)`` or a class whose instance (built with the spec's
    parameters) is called so; None for a built-in (or unknown) name."""
    return cast("Callable[[int, float], float] | None", _once("lr-schedule", spec, lambda: _schedule(spec, builtins)))


def _schedule(spec: str, builtins: tuple[str, ...]) -> Callable[[int, float], float] | None:
    ref = resolve(spec, "lr-schedule", builtin=lambda name: name in builtins)
    if ref is None:
        return None
    obj: Any = ref.obj
    if inspect.isclass(obj):
        made: Any = obj(**spec_params(ref, obj, (), "lr schedule"))
        return lambda t, base_lr: made(t, base_lr)
    if not callable(obj):
        raise ExtensionError(f"lr schedule {ref.name!r} is a {type(obj).__name__}, not a function "
                             "schedule(t, base_lr, **params) -> float")
    params = spec_params(ref, obj, ("t", "base_lr"), "lr schedule")
    return lambda t, base_lr: obj(t, base_lr, **params)
