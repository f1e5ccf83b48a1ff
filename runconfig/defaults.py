"""The app's default run config: ``[tool.flwr.app.config]`` of the project's ``pyproject.toml``,
what Flower starts every run from (the one definition: the launchers, the in-process engine and
the tests read it here).

Where that file is: in a checkout, an editable install, an unpacked FAB or the image's ``/app``,
the project folder's own ``pyproject.toml`` (:data:`ROOT`). A non-editable install has no project
folder (:data:`ROOT` is ``site-packages``), so the wheel carries the same file as
``runconfig/_pyproject.toml`` (:data:`PACKAGED`: pyproject.toml's
``[tool.hatch.build.targets.wheel.force-include]`` copies it there at build time, so there is still
one source, never a second list of defaults).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from .fields import ConfigError

ROOT = Path(__file__).resolve().parent.parent  # the Flower app's project folder
PACKAGED = Path(__file__).resolve().parent / "_pyproject.toml"  # a wheel's copy of ROOT/pyproject.toml
FORCE_INCLUDE = '[tool.hatch.build.targets.wheel.force-include]\n"pyproject.toml" = "runconfig/_pyproject.toml"'


def project_file(project: str | Path = ROOT) -> Path:
    """The ``pyproject.toml`` that holds ``project``'s run config: ``project/pyproject.toml``, or,
    for this app installed from a wheel, the copy the wheel carries (:data:`PACKAGED`)."""
    if Path(project).resolve() == ROOT and PACKAGED.is_file():
        return PACKAGED  # an installed wheel: ROOT is site-packages, whose pyproject.toml is not ours
    path = Path(project) / "pyproject.toml"
    if path.is_file():
        return path
    if Path(project).resolve() == ROOT:
        raise FileNotFoundError(
            f"the app's default run config: neither {path} (a checkout or editable install) nor "
            f"{PACKAGED} (a wheel's copy) exists; this install came from a wheel built without "
            f"pyproject.toml's\n{FORCE_INCLUDE}\n(rebuild it from a checkout that has it, or install editable)")
    raise FileNotFoundError(f"no pyproject.toml in the Flower app's project folder {project}")


def default_run_config(project: str | Path = ROOT) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of ``project``'s pyproject.toml, as Flower would pass it."""
    path = project_file(project)
    doc = tomllib.loads(path.read_text())
    try:
        return dict(doc["tool"]["flwr"]["app"]["config"])
    except (KeyError, TypeError):
        raise ConfigError(f"{path} has no [tool.flwr.app.config] table (the Flower app's run config)") from None
