"""A run's checkpoints: the one place that writes, reads and finds them.

A checkpoint is ``<run folder>/checkpoints/round-RRRR.pt``, a torch pickle of
``{"round", "arrays" (name -> numpy array), "strategy" (the rule's state_dict), "config" (the run
config, flat), "rng" (python, numpy and torch generator states), "loop" (the loop that wrote it:
``{"kind": "rounds"}``, or an asynchronous loop's state, :mod:`server_app.async_resume`)}``. The
ServerApp saves one every ``checkpoint-every`` rounds (aggregations, in an asynchronous run) and
resumes from one (``resume-from``) in the loop that wrote it (:func:`check_loop`); the deployment
launcher finds the newest with :func:`latest`; reports read a rule's state from :func:`load`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runconfig import ConfigError

FOLDER = "checkpoints"
#: run-config keys that may differ between a run and its resumption (where and how long, not what)
FREE_KEYS = frozenset({
    "num-server-rounds", "resume-from", "run-name", "results-dir", "progress",
    "checkpoint-every", "round-timeout", "wait-for-nodes", "min-nodes", "device", "state-dir",
    "round-start-delay", "round-deadline", "round-start-signal", "engine",
})


#: the loops that write checkpoints (``ckpt["loop"]["kind"]``)
ROUNDS, VIRTUAL, REALTIME = "rounds", "asynchronous", "asynchronous-realtime"
EARLIER = "asynchronous-earlier"  # an asynchronous run's checkpoint from before the loop saved its state
LOOPS = {
    ROUNDS: "a synchronous run (the round loop)",
    VIRTUAL: "an asynchronous run on the virtual clock",
    REALTIME: "an asynchronous deployment (real time, availability-gate 'none')",
    EARLIER: "an asynchronous run of an earlier version, which saved no event queue",
}


def path_of(run_dir: str | Path, rnd: int) -> Path:
    return Path(run_dir) / FOLDER / f"round-{rnd:04d}.pt"


def save(run_dir: str | Path, rnd: int, arrays: Mapping[str, np.ndarray], strategy: dict[str, Any],
         config: Mapping[str, Any], loop: Mapping[str, Any] | None = None,
         privacy: Mapping[str, Any] | None = None) -> Path:
    """Write round ``rnd``'s checkpoint with the current RNG states, ``loop`` (the loop's own
    state, ``{"kind": ...}``; None: the round loop) and ``privacy`` (central DP's accountant, the
    rounds it composed; None: no DP); never leaves a truncated file (written to ``.pt.partial``,
    then renamed)."""
    path = path_of(run_dir, rnd)
    path.parent.mkdir(parents=True, exist_ok=True)  # made by the first checkpoint: none with checkpoint-every=0
    partial = path.with_suffix(".pt.partial")
    torch.save({
        "round": rnd,
        "arrays": dict(arrays),
        "strategy": strategy,
        "config": dict(config),
        "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
        "loop": dict(loop) if loop is not None else {"kind": ROUNDS},
        **({"privacy": dict(privacy)} if privacy is not None else {}),
    }, partial)
    partial.replace(path)
    return path


def load(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents (on the CPU). ConfigError when the file is not there."""
    if not Path(path).is_file():
        raise ConfigError(f"no such checkpoint file: {str(path)!r}")
    return torch.load(path, map_location="cpu", weights_only=False)


def latest(run_dir: str | Path) -> Path:
    """The newest checkpoint of a run folder that loads (one cut short by a crash is skipped)."""
    for path in sorted((Path(run_dir) / FOLDER).glob("round-*.pt"), reverse=True):
        try:
            load(path)
            return path
        except Exception:  # noqa: BLE001 - a partial file: try the previous one
            continue
    raise ConfigError(f"no readable checkpoint in {Path(run_dir) / FOLDER}: a run can be resumed "
                      "only if it ran with checkpoint-every >= 1")


def loop_of(ckpt: Mapping[str, Any], asynchronous_rule: Callable[[str], bool]) -> str:
    """The kind of loop that wrote ``ckpt`` (a key of :data:`LOOPS`). A checkpoint without
    ``"loop"`` was written before the key existed: by the round loop, or, when its strategy
    (``asynchronous_rule(spec)``) is asynchronous, by an asynchronous loop that saved no state."""
    loop = ckpt.get("loop")
    if loop is None:
        return EARLIER if asynchronous_rule(str(ckpt.get("config", {}).get("strategy", ""))) else ROUNDS
    kind = loop.get("kind") if isinstance(loop, Mapping) else None
    if kind not in LOOPS:
        raise ConfigError(f"checkpoint's 'loop' names no loop this code knows ({kind!r}; known: {sorted(LOOPS)})")
    return str(kind)


def check_loop(ckpt: Mapping[str, Any], path: str | Path, wanted: str, strategy: str,
               asynchronous_rule: Callable[[str], bool]) -> None:
    """ConfigError unless ``ckpt`` was written by the loop ``wanted`` (a key of :data:`LOOPS`)
    that the run with strategy ``strategy`` runs: a checkpoint continues only the loop that wrote
    it (a synchronous one holds no event queue; an asynchronous one holds jobs in flight that no
    round waits for)."""
    got = loop_of(ckpt, asynchronous_rule)
    if got == wanted:
        return
    if got == REALTIME:
        why = ("its jobs ran on real nodes, and the replies they were training are gone with that run: an "
               "asynchronous deployment does not resume; start a new run")
    elif got == EARLIER:
        why = ("without its jobs in flight, virtual time and job counts the run cannot be continued exactly; "
               "start a new run")
    else:
        why = (f"this run, with strategy {strategy!r}, is {LOOPS[wanted]}: a checkpoint continues only the loop "
               "that wrote it")
    raise ConfigError(f"run config 'resume-from' = {str(path)!r}: the checkpoint was written by {LOOPS[got]}; {why}")


def check_resumable(ckpt: Mapping[str, Any], path: str | Path, config: Mapping[str, Any],
                    num_rounds: int) -> None:
    """ConfigError unless ``config`` may continue ``ckpt``: the same settings outside
    :data:`FREE_KEYS`, and rounds left to run."""
    old, new = ckpt["config"], config
    differ = sorted(k for k in set(old) | set(new) if k not in FREE_KEYS and old.get(k) != new.get(k))
    if differ:
        raise ConfigError(f"checkpoint {path} was made with other settings for {differ}: "
                          + ", ".join(f"{k}={old.get(k)!r} (now {new.get(k)!r})" for k in differ))
    if ckpt["round"] >= num_rounds:
        raise ConfigError(f"checkpoint {path} is at round {ckpt['round']}, not before "
                          f"num-server-rounds={num_rounds}")


def restore_rng(ckpt: Mapping[str, Any]) -> None:
    """Set python's, numpy's and torch's global generators to the checkpoint's states."""
    random.setstate(ckpt["rng"]["python"])
    np.random.set_state(ckpt["rng"]["numpy"])
    torch.set_rng_state(ckpt["rng"]["torch"])
