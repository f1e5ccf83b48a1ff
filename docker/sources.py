"""The one source list of every image: the files a build of the project needs (``pyproject.toml``,
``README.md``) and the packages of ``pyproject.toml``'s ``[tool.hatch.build.targets.wheel]``
``packages``, the very list hatchling builds the wheel from. The Dockerfiles, build-local.sh and
build-arm64.sh all read it from here, so a package added to pyproject.toml is in every image (a
package missing from the list is missing from the wheel too, and the CI test
tests/test_images.py, which builds the wheel from this list, fails on its import).

    python3 docker/sources.py                  # the list, one path a line (build scripts: tar)
    python3 docker/sources.py --copy SRC DST   # copy them from SRC to DST (the Dockerfiles)

Standard library only (python3 >= 3.11 for tomllib): it runs on the host and in a bare base image.
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

FILES = ("pyproject.toml", "README.md")  # hatchling reads both (README.md is the project's readme)
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc")


def packages(root: str | Path) -> list[str]:
    """The wheel's packages, as pyproject.toml lists them for hatchling."""
    with (Path(root) / "pyproject.toml").open("rb") as fh:
        doc = tomllib.load(fh)
    try:
        found = doc["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    except KeyError:
        raise SystemExit("pyproject.toml has no [tool.hatch.build.targets.wheel] packages") from None
    return [str(p) for p in found]


def sources(root: str | Path) -> list[str]:
    """Every path (relative to ``root``) that a build of the project's image needs."""
    return [*FILES, *packages(root)]


def copy(src: str | Path, dst: str | Path) -> list[str]:
    """Copy :func:`sources` from ``src`` to ``dst`` (created); a missing one is an error."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    paths = sources(src)
    missing = [p for p in paths if not (src / p).exists()]
    if missing:
        raise SystemExit(f"sources.py: {missing} listed (pyproject.toml) but not in {src}")
    for p in paths:
        if (src / p).is_dir():
            shutil.copytree(src / p, dst / p, ignore=SKIP, dirs_exist_ok=True)
        else:
            shutil.copy2(src / p, dst / p)
    return paths


def main(argv: list[str]) -> int:
    if argv[:1] == ["--copy"] and len(argv) == 3:
        copy(argv[1], argv[2])
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    print(*sources(Path(__file__).resolve().parent.parent), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
