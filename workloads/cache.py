"""The project's file cache (``$XDG_CACHE_HOME/flchurn`` or ``~/.cache/flchurn``): what a pure
function of its inputs computes slowly and every node, worker or run would compute again (a
dataset's decoded arrays, a seeded split, a flwr-datasets partition). Every entry is keyed by
what it is a function of; a missing, unreadable or corrupt entry is computed again."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flchurn"


def cache_put(file: Path, save: Callable[[Any], None]) -> None:
    """Write a cache file atomically (nodes building at once never read half a file); best-effort."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp := file.with_suffix(f".{os.getpid()}.tmp"), "wb") as fh:
            save(fh)
        os.replace(tmp, file)
    except OSError:
        pass  # read-only home, full disk, ...
