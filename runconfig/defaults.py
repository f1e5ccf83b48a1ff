"""The app's default run config: ``[tool.flwr.app.config]`` of the project's ``pyproject.toml``,
what Flower starts every run from (the one definition: the launchers, the in-process engine and
the tests read it here)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent  # the Flower app's project folder


def default_run_config(project: str | Path = ROOT) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of ``project``'s pyproject.toml, as Flower would pass it."""
    doc = tomllib.loads((Path(project) / "pyproject.toml").read_text())
    return dict(doc["tool"]["flwr"]["app"]["config"])
