"""The example package of docs/extending.md (examples/flchurn-myext), made importable and
"installed" for a test: its folder on sys.path (``module:attr`` specs), and a dist-info with the
entry points its pyproject.toml declares (what ``pip install`` writes), so the entry-point route
is exercised through importlib.metadata exactly as for an installed package."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MYEXT = ROOT / "examples" / "flchurn-myext"


def entry_points_txt(pyproject: Path) -> str:
    project = tomllib.loads(pyproject.read_text())["project"]
    out = []
    for group, eps in project.get("entry-points", {}).items():
        out += [f"[{group}]", *(f"{name} = {target}" for name, target in eps.items()), ""]
    return "\n".join(out)


def install(site: Path, name: str, version: str, entry_points: str) -> Path:
    """Write ``site/<name>-<version>.dist-info`` with METADATA and entry_points.txt."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(entry_points)
    importlib.invalidate_caches()
    return info


def use_myext(monkeypatch, tmp_path: Path, installed: bool = True) -> None:
    """examples/flchurn-myext importable (and, with ``installed``, its entry points registered); the
    solvers and schedules resolved meanwhile are forgotten afterwards (``adam`` is unknown again)."""
    from workloads import usersolvers

    monkeypatch.setattr(usersolvers, "RESOLVED", {})
    monkeypatch.syspath_prepend(str(MYEXT))
    if installed:
        site = tmp_path / "site"
        install(site, "flchurn-myext", "0.1.0", entry_points_txt(MYEXT / "pyproject.toml"))
        monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("PYTHONPATH", ":".join(p for p in sys.path if p))
