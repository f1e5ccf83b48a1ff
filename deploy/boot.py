"""A SuperNode booted ahead of its round: its process started, its imports done, its forker
(:mod:`deploy.prefork`) and client worker (:mod:`deploy.warmstart`) ready, but not connected to
the SuperLink until it is released.

A node's start is mostly imports (Flower; torch and the workload in its client worker): 5-6 s on
a busy 2-core machine, during which the round that waits for the node cannot start. The churn
driver boots the nodes that come back in the next two rounds as soon as they are offline and not
running (:meth:`deploy.churn.RoundChurn`), and *releases* a booted node where it would otherwise
start it: it then registers at once. A booted node is offline as far as Flower is concerned (no
registration, no heartbeat, no node id): it is a device that is switched on and not yet online.

The release is a signal (:data:`RELEASE`, SIGUSR1) that the node's process blocks from before its
exec (:func:`blocking_release`), so it can never arrive too early, and waits for once booted
(:func:`wait_for_release`, called by ``deploy.tuning supernode`` when :data:`BOOTED_VAR` is set)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable

RELEASE = signal.SIGUSR1
BOOTED_VAR = "FLCHURN_BOOTED"  # "1" in a booted node's environment: wait for RELEASE before connecting
BOOTED_LINE = "booted: waiting to be released (deploy.boot)"  # what a booted node logs once it waits


def blocking_release(preexec: Callable[[], None] | None) -> Callable[[], None]:
    """A child's first step (before exec; the mask survives it) that blocks :data:`RELEASE`, then ``preexec``."""
    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {RELEASE})
        if preexec is not None:
            preexec()

    return setup


def wait_for_release() -> bool:
    """In a booted SuperNode: return once released (True), at once when not booted (False)."""
    if os.environ.get(BOOTED_VAR) != "1":
        return False
    print(BOOTED_LINE, file=sys.stderr, flush=True)
    signal.sigwait({RELEASE})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {RELEASE})
    return True
