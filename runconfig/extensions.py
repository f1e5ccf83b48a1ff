"""The user's own objects, named in the run config: a ``module:attr`` spec or an entry point.

Every extension point (model, dataset, partitioner, availability model, study, rule, local solver,
learning-rate schedule, central evaluation) reads a spec
string. Three forms reach an object:

* a built-in name with its parameters: ``dirichlet:alpha=0.3`` (the caller's own table);
* ``module:attr`` with the same parameters after a second colon: ``mynets:resnet8:width=32``
  (``module`` is imported, ``attr`` may be dotted: ``mynets:Zoo.resnet8``);
* a name an installed package registers under the point's entry-point group
  (``[project.entry-points."flchurn.models"] resnet8 = "mynets:resnet8"``), with parameters as a
  built-in's: ``resnet8:width=32``.

A ``module:attr`` spec is told from a built-in spec by its second part: ``name:key=value`` has an
``=`` there, ``module:attr`` does not. Plain Python (importlib only), so every layer can use it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: extension point -> entry-point group an installed package registers its objects under
GROUPS: dict[str, str] = {
    "model": "flchurn.models",
    "dataset": "flchurn.datasets",
    "partitioner": "flchurn.partitioners",
    "availability": "flchurn.availability",
    "study": "flchurn.studies",
    "strategy": "flchurn.strategies",
    "solver": "flchurn.solvers",
    "lr-schedule": "flchurn.lr_schedules",
    "evaluation": "flchurn.evaluations",
}

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ATTR = _MODULE


class ExtensionError(ValueError):
    """A ``module:attr`` spec or entry point that cannot be imported or does not fit its point."""


@dataclass(frozen=True)
class Reference:
    """A resolved spec: the object, how it was named, and its parameter text (``k=v,...``)."""

    obj: Any
    name: str  # "module:attr" or the entry point's name
    params: str  # the text after the name, "" when none
    origin: str  # "module" or "entry point"


def split_reference(text: str) -> tuple[str, str] | None:
    """``'pkg.mod:attr:k=v'`` -> ``('pkg.mod:attr', 'k=v')``; None for a plain ``name[:k=v,...]``."""
    if not isinstance(text, str):
        return None
    head, sep, rest = text.strip().partition(":")
    if not sep:
        return None
    attr, _, params = rest.partition(":")
    if not attr.strip() or "=" in attr or "," in attr:
        return None
    head, attr = head.strip(), attr.strip()
    if not _MODULE.match(head) or not _ATTR.match(attr):
        raise ExtensionError(f"spec {text!r}: expected 'module:attr[:key=value,...]' with a Python "
                             f"module path and attribute name; got module {head!r}, attribute {attr!r}")
    return f"{head}:{attr}", params.strip()


def load_reference(target: str, what: str) -> Any:
    """Import ``module:attr`` (dotted attr allowed); ExtensionError naming what is missing."""
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ExtensionError(f"{what} {target!r}: cannot import module {module_name!r} ({exc}); it must be "
                             "importable where the run executes (installed with pip, or on PYTHONPATH)") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ExtensionError(f"{what} {target!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def entry_points(point: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The entry points installed packages register for ``point`` (see GROUPS), by normalised name."""
    return {_norm(ep.name): ep for ep in importlib.metadata.entry_points(group=GROUPS[point])}


def resolve(text: str, point: str, builtin: Callable[[str], bool] = lambda name: False) -> Reference | None:
    """The user's object a spec names, or None when it names a built-in (or nothing known).

    ``builtin(name)`` says whether a plain name is the project's own: built-ins win over modules
    and entry points of the same name (``sine:gamma`` is a malformed ``sine`` spec, not module
    ``sine``), so nothing installed can change what a built-in config means.
    """
    what = point if point != "availability" else "availability model"
    if not isinstance(text, str):
        return None
    name, _, params = text.strip().partition(":")
    if builtin(name.strip().lower()):
        return None
    ref = split_reference(text)
    if ref is not None:
        return Reference(load_reference(ref[0], what), ref[0], ref[1], "module")
    ep = entry_points(point).get(_norm(name))
    if ep is None:
        return None
    try:
        obj = ep.load()
    except Exception as exc:  # an installed package's import error, named
        raise ExtensionError(f"{what} {name!r}: its entry point {ep.value!r} (group {GROUPS[point]!r}) "
                             f"failed to load: {type(exc).__name__}: {exc}") from exc
    return Reference(obj, _norm(name), params.strip(), "entry point")


def keyword_defaults(fn: Callable[..., Any], skip: tuple[str, ...] = ()) -> tuple[dict[str, Any], bool]:
    """(keyword parameters -> default, accepts **kwargs) of ``fn`` beyond ``skip``: what a spec may set.

    A parameter without a default takes any value (None stands for it); spec keys are matched with
    ``-`` read as ``_``.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}, True
    out: dict[str, Any] = {}
    var_kw = False
    for name, p in sig.parameters.items():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and name not in skip:
            out[name] = None if p.default is p.empty else p.default
    return out, var_kw


def accepted(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``offered`` keyword arguments ``fn`` takes (all of them when it takes **kwargs)."""
    params, var_kw = keyword_defaults(fn)
    return dict(offered) if var_kw else {k: v for k, v in offered.items() if k in params}
