"""Flower's ``401 task-token authentication failed``: a ClientApp (or ServerApp) whose process
took longer to start than the task patience had its task revoked, so its reply is lost. Counted
from the processes' logs as they happen (:func:`new_auth_failures`), kept in the run's outcome
and named with the flag that prevents it (:func:`auth_failure_text`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .nodes import Site

AUTH_FAILED = "task-token authentication failed"  # Flower's 401 to a ClientApp whose token it revoked


def new_auth_failures(logs: Iterable[tuple[str, Path]], seen: dict[str, int]) -> dict[str, int]:
    """Process name -> its 401 lines since the last call (``seen``: log path -> lines reported)."""
    out: dict[str, int] = {}
    for name, path in logs:
        try:
            count = path.read_text(errors="replace").count(AUTH_FAILED)
        except OSError:
            continue
        new = count - seen.get(str(path), 0)
        if new > 0:
            seen[str(path)] = count
            out[name] = out.get(name, 0) + new
    return out


def auth_failure_text(site: Site, found: Mapping[str, int]) -> str:
    """What a 401 to a ClientApp (or the ServerApp) means, and the flag that prevents it."""
    waits = getattr(site, "waits", None)
    patience = f" ({waits.task_patience:.0f} s)" if waits is not None else ""
    where = ", ".join(f"{name}: {n}" for name, n in sorted(found.items()))
    return (f"calls answered 401 'task-token authentication failed' ({where}): Flower revoked the task of a "
            f"ClientApp (a SuperNode's; its reply is lost) or ServerApp (the SuperLink's) that did not start "
            f"within the task patience{patience} on this busy machine; lengthen it with --task-patience SECONDS")


def note_auth_failures(site: Site, counts: dict[str, int]) -> None:
    """Add the 401s the site's processes logged since the last look to ``counts`` (process -> calls)
    and name them (a site that cannot tell: none)."""
    found: Mapping[str, int] = getattr(site, "auth_failures", dict)()
    if found:
        for name, n in found.items():
            counts[name] = counts.get(name, 0) + n
        site.log(auth_failure_text(site, found))
