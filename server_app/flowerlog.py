"""What Flower's loops say only on its logger, followed for the drop-in's grid
(:class:`server_app.churngrid.ChurnGrid`)."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Protocol

from strategies.secagg import DROPPED_NODE, FAILED_CLOSED

from .messages import ROUND_STARTS, RUN_ENDS, SECURE_DONE
from .securecheck import SETUP_NOTES


class FollowedGrid(Protocol):
    """What the watch calls of the grid it follows (:class:`server_app.churngrid.ChurnGrid`)."""

    senders: Any  # the threads that sent through the grid
    secure: Any  # the SecAgg+ notes of the round

    def secure_ended(self, completed: bool) -> None: ...
    def announce(self, rnd: int) -> None: ...
    def finish(self) -> None: ...


class FlowerLogWatch(logging.Handler):
    """What Flower's loops say only on its logger: the round they start (``[ROUND r]`` of
    ``DefaultWorkflow``, ``[ROUND r/R]`` of ``Strategy.start``: the clock then follows a round in
    which the strategy sent nothing), SecAgg+'s outcome (``Secure aggregation completed.`` /
    ``halted.``), why a SecAgg+ round was not started (:data:`~server_app.securecheck.SETUP_NOTES`:
    ``Sampling failed ...``, fewer than 2 sampled) and the end of their rounds (``[SUMMARY]``,
    ``Strategy execution finished``);
    ``tests/test_churn_workflows.py`` and ``tests/test_no_work.py`` run them against the pinned Flower."""

    def __init__(self, grid: FollowedGrid) -> None:
        super().__init__(logging.DEBUG)
        self.grid = weakref.ref(grid)

    def emit(self, record: logging.LogRecord) -> None:
        grid = self.grid()  # another thread's loop (a test before, a second app) is not this grid's
        other = bool(grid and grid.senders and record.thread is not None and record.thread not in grid.senders)
        if grid is None or not isinstance(record.msg, str) or other:  # thread None: logging.logThreads off
            return
        if record.msg in SECURE_DONE:
            grid.secure_ended(SECURE_DONE[record.msg])  # may raise NoWorkDone: it ends the workflow
        elif record.msg in ROUND_STARTS and isinstance(record.args, tuple) and record.args:
            grid.announce(int(str(record.args[0])))  # may raise NoWorkDone too
        elif record.msg in RUN_ENDS:
            grid.finish()  # raises NoWorkDone when no round had a participant: the run ends failed
        elif record.msg in SETUP_NOTES or record.msg in (FAILED_CLOSED, DROPPED_NODE):  # a SecAgg+ round's whys
            grid.secure.note(record.msg, tuple(record.args) if isinstance(record.args, tuple) else ())
