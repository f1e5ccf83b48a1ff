"""A study from wherever the user keeps it: a preset's name, a TOML file, ``module:attr``, or an
installed entry point (group ``flchurn.studies``). ``experiments.sweep`` and ``experiments.report``
take any of them.

A study file (TOML) holds what :class:`~experiments.study.Sweep` holds::

    name = "my-compare"                 # default: the file's stem
    notes = "What is compared, and why."
    seeds = [0, 1]                      # each seed s: data-seed = schedule-seed = train-seed = s
    python-path = ["."]                 # folders (relative to the file) the runs import from
    [base]                              # run config shared by every run
    dataset = "mypkg.data:load:n=500"
    [axes.rule]                         # axes in order; the last gives the table's rows
    fedavg = { strategy = "fedavg-active" }
    mifa = { strategy = "mifa" }
    [[claims]]                          # optional: only a study that declares claims gets verdicts
    text = "MIFA beats FedAvg"
    rule = "mifa"
    others = ["fedavg"]

Every run config key is checked against the app's keys before anything runs.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from experiments.presets import PRESETS
from experiments.study import Claim, Sweep
from runconfig.extensions import ExtensionError, resolve

KEYS = {"name", "notes", "seeds", "base", "axes", "claims", "paper", "paper-setup", "figures", "python-path"}
CLAIM_KEYS = {"text", "rule", "others", "columns", "within", "why"}
#: what a study's ``seeds`` sets, all three to the seed (experiments.study.Sweep.runs)
SEED_KEYS = {"data-seed", "schedule-seed", "train-seed"}


class StudyError(ValueError):
    """A study that cannot be found or does not have the shape of a sweep."""


def _check_keys(where: str, keys: Any, allowed: set[str]) -> None:
    unknown = sorted(set(keys) - allowed)
    if unknown:
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(k, allowed, 1)) else repr(k)
                 for k in unknown]
        raise StudyError(f"{where}: unknown key(s) {', '.join(hints)}; allowed: {sorted(allowed)}")


def check_run_config_keys(sweep: Sweep) -> None:
    """Every key the study sets is a run config key of the app (names the closest one if not)."""
    from experiments.inprocess import default_run_config

    known = set(default_run_config()) | {"results-dir", "run-name", "progress", "resume-from"}
    sets = [("base", sweep.base)] + [(f"axes.{axis}.{label}", over) for axis, values in sweep.axes.items()
                                     for label, over in values.items()]
    for where, overrides in sets:
        _check_keys(f"study '{sweep.name}', {where}", overrides, known)
        if seeded := sorted(set(overrides) & SEED_KEYS):
            raise StudyError(f"study '{sweep.name}', {where}: sets {seeded}, which the study's seeds set: each "
                             "seed s of `seeds` runs with data-seed = schedule-seed = train-seed = s; list the "
                             "seeds in `seeds` instead")


def from_mapping(data: Mapping[str, Any], name: str, folder: Path | None = None) -> Sweep:
    """A Sweep from a study file's tables (see the module docstring)."""
    _check_keys(f"study '{name}'", data, KEYS)
    name = str(data.get("name", name))
    axes = data.get("axes")
    if not isinstance(axes, Mapping) or not axes:
        raise StudyError(f"study '{name}': needs at least one axis ([axes.<name>] with label = {{ key = value }})")
    for axis, values in axes.items():
        if not isinstance(values, Mapping) or not values or not all(isinstance(v, Mapping) for v in values.values()):
            raise StudyError(f"study '{name}': axis {axis!r} must map labels to run config tables, "
                             f"e.g. fedavg = {{ strategy = \"fedavg-active\" }}")
    claims = []
    for i, c in enumerate(data.get("claims", [])):
        _check_keys(f"study '{name}', claim {i + 1}", c, CLAIM_KEYS)
        if not {"text", "rule", "others"} <= set(c):
            raise StudyError(f"study '{name}', claim {i + 1}: needs text, rule and others")
        claims.append(Claim(text=c["text"], rule=c["rule"], others=tuple(c["others"]),
                            columns=tuple(c.get("columns", ())), within=c.get("within"), why=c.get("why", "")))
    seeds = data.get("seeds", [0, 1, 2])
    if not isinstance(seeds, list) or not all(isinstance(s, int) and s >= 0 for s in seeds) or not seeds:
        raise StudyError(f"study '{name}': seeds must be a non-empty list of integers >= 0; got {seeds!r}")
    base = folder or Path.cwd()
    return Sweep(name=name, base=dict(data.get("base", {})), axes={a: dict(v) for a, v in axes.items()},
                 seeds=tuple(seeds), notes=str(data.get("notes", "")), paper=dict(data.get("paper", {})),
                 paper_setup=dict(data.get("paper-setup", {})), figures=tuple(data.get("figures", ())),
                 claims=tuple(claims),
                 python_path=tuple(str((base / p).resolve()) for p in data.get("python-path", [])))


def load_study(ref: str) -> Sweep:
    """The study ``ref`` names: a preset, a ``.toml`` file, ``module:attr`` or an entry point."""
    if ref in PRESETS:
        return PRESETS[ref]
    path = Path(ref)
    if ref.endswith(".toml") or path.is_file():
        if not path.is_file():
            raise StudyError(f"study file {ref!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise StudyError(f"study file {ref!r}: not valid TOML: {exc}") from exc
        sweep = from_mapping(data, path.stem, path.resolve().parent)
    else:
        try:
            found = resolve(ref, "study")
        except ExtensionError as exc:
            raise StudyError(str(exc)) from exc
        if found is None:
            raise StudyError(f"unknown study {ref!r}: not a preset ({', '.join(sorted(PRESETS))}), a .toml "
                             "file, 'module:attr', or an installed flchurn.studies entry point")
        obj = found.obj() if callable(found.obj) and not isinstance(found.obj, Sweep) else found.obj
        if isinstance(obj, Mapping):
            obj = from_mapping(obj, found.name.rpartition(":")[2])
        if not isinstance(obj, Sweep):
            raise StudyError(f"study {ref!r} is a {type(obj).__name__}; expected experiments.study.Sweep "
                             "or a mapping shaped like a study file")
        sweep = obj
    check_run_config_keys(sweep)
    return sweep
