"""What a SecAgg+ round needs from the clients online, said before its rounds halt, and why one halted.

A round of Flower's ``SecAggPlusWorkflow`` over a legacy strategy completes only when enough clients
are online for both of its minimums:

- **the strategy's sample**: Flower's legacy ``FedAvg`` asks for ``max(int(online x fraction_fit),
  min_fit_clients)`` nodes and, with fewer online, samples none (``Sampling failed``): the round is
  not started;
- **SecAgg+'s reconstruction threshold**: every sampled node needs at least ``threshold`` active
  neighbours (``reconstruction_threshold``: a count, or a fraction of the shares, never below 2),
  and at least 2 nodes are sampled; with fewer the round halts after its key exchange.

So the advice is both numbers at once: ``min_fit_clients`` = the reconstruction threshold (a
smaller one starts rounds that halt at the key exchange; a larger one starts fewer rounds), and
both at most the clients the schedule has online in a typical round. :func:`secure_advice` compares
them with the schedule (online per round on average, at most, and the rounds that cannot complete)
and :func:`check_secure` says so on Flower's logger at WARNING; the drop-in's grid runs the same
check once by itself, with the numbers it sees (SecAgg+'s setup message carries the threshold,
Flower's ``Sampling failed`` line the sample size asked for). :func:`halt_reason` turns Flower's
log lines of a round that halted before its first stage into the recorded reason.
"""

from __future__ import annotations

import logging
from typing import Any

from flwr.app import Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

from availability import Schedule
from strategies.secagg import DROPPED_NODE

flwr_log = logging.getLogger("flwr")
HORIZON = 100  # rounds of the schedule the check looks at when the run's length is not given
SAMPLING_FAILED = ("Sampling failed: number of available clients (%s) is less than number of "
                   "requested clients (%s).")  # flwr.server.client_manager.SimpleClientManager.sample
TOO_FEW = "The number of samples should be greater than 1."  # SecAggPlusWorkflow.setup_stage
NONE_SELECTED = "configure_fit: no clients selected, cancel"  # SecAggPlusWorkflow.setup_stage
SETUP_NOTES = (SAMPLING_FAILED, TOO_FEW, NONE_SELECTED)  # what Flower says when a round is not started


def _shares(sampled: int, num_shares: int | float) -> int:
    """SecAgg+'s number of shares for a round of ``sampled`` nodes, before its odd adjustment
    (``SecAggPlusWorkflow.setup_stage``; an integer 1 means 1.0, as Flower reads it)."""
    if isinstance(num_shares, int) and num_shares != 1:
        return num_shares
    shares = round(float(num_shares) * sampled)
    shares += 1 if shares < sampled and shares % 2 == 0 else 0
    return sampled if shares <= 2 else shares


def secure_threshold(sampled: int, reconstruction_threshold: int | float, num_shares: int | float = 1.0) -> int:
    """SecAgg+'s threshold for a round of ``sampled`` nodes (``SecAggPlusWorkflow.setup_stage``)."""
    if isinstance(reconstruction_threshold, int) and reconstruction_threshold != 1:
        return reconstruction_threshold
    return max(2, round(float(reconstruction_threshold) * _shares(sampled, num_shares)))


def round_halts(online: int, *, min_fit_clients: int = 0, reconstruction_threshold: int | float | None = None,
                num_shares: int | float = 1.0, fraction_fit: float = 1.0) -> str | None:
    """Why a round with ``online`` clients cannot complete (None: it can, if nobody leaves mid-round)."""
    sampled = max(int(online * fraction_fit), min_fit_clients)
    if sampled > online:
        return f"{online} online, fewer than the {sampled} the strategy samples (min_fit_clients={min_fit_clients})"
    if sampled < 2:
        return f"{sampled} node(s) sampled, SecAgg+ needs 2 or more"
    if reconstruction_threshold is not None:
        shares = _shares(sampled, num_shares)
        shares += 1 if shares != sampled and shares % 2 == 0 else 0
        neighbours = min(sampled, 2 * (shares >> 1) + 1)  # each node's ring of neighbours, itself included
        threshold = secure_threshold(sampled, reconstruction_threshold, num_shares)
        if neighbours < threshold:
            return (f"{sampled} node(s) sampled, each with {neighbours} neighbour(s), fewer than SecAgg+'s "
                    f"reconstruction threshold {threshold}")
    return None


def secure_advice(schedule: Schedule, *, min_fit_clients: int | None = None,
                  reconstruction_threshold: int | float | None = None, num_shares: int | float = 1.0,
                  fraction_fit: float = 1.0, num_rounds: int | None = None) -> str | None:
    """The warning when the strategy's ``min_fit_clients`` or SecAgg+'s reconstruction threshold
    asks for more clients than ``schedule`` has online (more than it has on average, or a minimum
    below the threshold, which starts rounds that halt), naming both numbers and the schedule; None
    when they fit. A number not known (None) is left out of the test and said to be unknown."""
    rounds = num_rounds or HORIZON
    online = schedule.matrix(rounds).sum(axis=1).astype(int)
    kw: dict[str, Any] = {"min_fit_clients": min_fit_clients or 0, "fraction_fit": fraction_fit,
                          "reconstruction_threshold": reconstruction_threshold, "num_shares": num_shares}
    halting = [r + 1 for r, n in enumerate(online) if round_halts(int(n), **kw)]
    needs = next((n for n in range(schedule.num_clients + 1) if round_halts(n, **kw) is None), None)
    mean, most = float(online.mean()), int(online.max())
    typical = round_halts(int(mean), **kw) if needs is not None else None
    below = (min_fit_clients is not None and reconstruction_threshold is not None
             and isinstance(reconstruction_threshold, int) and reconstruction_threshold != 1
             and min_fit_clients < reconstruction_threshold)
    if needs is not None and needs <= mean and not below:
        return None
    fit = "unknown to the grid" if min_fit_clients is None else str(min_fit_clients)
    thr = "unknown (no SecAgg+ setup seen yet)" if reconstruction_threshold is None else repr(reconstruction_threshold)
    whole = (f"no round can complete: even all {schedule.num_clients} online would not do" if needs is None
             else f"a round completes only with {needs} or more clients online")
    gives = f"the schedule has {mean:.1f} online per round on average and at most {most}"
    fix = ("set min_fit_clients to the reconstruction threshold (both at least 2) and both at most the clients "
           "online in a typical round, or use a schedule with more clients online")
    lower = (f"; min_fit_clients {min_fit_clients} below the threshold {reconstruction_threshold} starts rounds "
             f"that then halt at the key exchange" if below else "")
    why = f" ({typical})" if typical else ""
    return (f"SecAgg+ under churn: min_fit_clients = {fit} and SecAgg+'s reconstruction threshold = {thr}: {whole}, "
            f"and {gives} (availability {schedule.spec!r}, N={schedule.num_clients}, seed {schedule.seed}){why}: "
            f"{len(halting)} of the first {rounds} rounds will halt{lower}. {fix} (docs/dropin.md, SecAgg+)")


def check_secure(schedule: Schedule | Any, strategy: Any, fit_workflow: Any, *,
                 num_rounds: int | None = None) -> str | None:
    """:func:`secure_advice` for a legacy ``strategy`` (its ``min_fit_clients``, ``fraction_fit``;
    a wrapper's inner ``strategy``, as Flower's DP wrappers hold it) and a ``SecAggPlusWorkflow``,
    under ``schedule`` (or the drop-in's grid, which holds it): logged on Flower's logger at
    WARNING and returned; None when they fit. One line in the ServerApp, before the workflow runs."""
    schedule = getattr(schedule, "schedule", schedule)
    inner = strategy
    while not hasattr(inner, "min_fit_clients") and hasattr(inner, "strategy"):
        inner = inner.strategy
    text = secure_advice(schedule, min_fit_clients=getattr(inner, "min_fit_clients", None),
                         reconstruction_threshold=getattr(fit_workflow, "reconstruction_threshold", None),
                         num_shares=getattr(fit_workflow, "num_shares", 1.0),
                         fraction_fit=float(getattr(inner, "fraction_fit", 1.0)), num_rounds=num_rounds)
    if text:
        flwr_log.warning("%s", text)
    return text


def halt_reason(notes: list[tuple[str, tuple[Any, ...]]], listed: int | None) -> str:
    """The recorded reason of a SecAgg+ round that halted before its first stage, from what Flower
    said in it (``notes``: its :data:`SETUP_NOTES` lines with their arguments, in order) and the
    number of nodes the grid listed (None: not known)."""
    for msg, args in reversed(notes):
        if msg == SAMPLING_FAILED and len(args) == 2:
            return (f"SecAgg+ halted before its first stage: the strategy sampled no node, {args[0]} online being "
                    f"fewer than the {args[1]} it asks for (legacy FedAvg: max(online x fraction_fit, "
                    f"min_fit_clients)); lower min_fit_clients to at most the clients online, not below SecAgg+'s "
                    f"reconstruction threshold")
        if msg == TOO_FEW:
            return ("SecAgg+ halted before its first stage: the strategy sampled fewer than 2 nodes "
                    f"({listed if listed is not None else 'fewer than 2'} online), SecAgg+ needs 2 or more")
    online = f"{listed} node(s) online" if listed is not None else "no node sampled"
    return f"SecAgg+ halted before its first stage: the strategy sampled no node ({online})"


def setup_threshold(m: Message) -> int | None:
    """The reconstruction threshold a SecAgg+ setup message carries (None: not a setup message)."""
    record = m.content.config_records.get(RECORD_KEY_CONFIGS)
    if record is None or record.get(Key.STAGE) != "setup" or Key.THRESHOLD not in record:
        return None
    value = record[Key.THRESHOLD]
    return int(value) if isinstance(value, (int, float)) else None


class SecureMinimums:
    """One run's SecAgg+ minimums as Flower shows them to the drop-in's grid (the threshold in the
    setup messages, the sample size asked for in ``Sampling failed``), checked once against the
    schedule (:func:`secure_advice`, at WARNING on Flower's logger), and Flower's lines on the round
    under way that was not started (:meth:`reason`)."""

    def __init__(self, schedule: Schedule) -> None:
        self.schedule = schedule
        self.notes: list[tuple[str, tuple[Any, ...]]] = []  # Flower's :data:`SETUP_NOTES` of this round
        self.seen: dict[str, int] = {}  # "min_fit_clients", "threshold"
        self.warned = False

    def note(self, msg: str, args: tuple[Any, ...]) -> None:
        """A line of :data:`SETUP_NOTES`; a failed sampling's size asked for is ``min_fit_clients``
        (FedAvg asks max(int(online x fraction), min_fit_clients), and it failed: more than online)."""
        self.notes.append((msg, args))
        if msg == SAMPLING_FAILED and len(args) == 2 and "min_fit_clients" not in self.seen:
            self.seen["min_fit_clients"] = int(args[1])
            self.check()

    def setup(self, messages: list[Message]) -> None:
        """Messages going out: a SecAgg+ setup among them starts a round and shows the threshold."""
        threshold = next((t for m in messages if (t := setup_threshold(m)) is not None), None)
        if threshold is not None:  # a round's setup, or the same round run again without dropped nodes
            self.notes = [note for note in self.notes if note[0] == DROPPED_NODE]
            if "threshold" not in self.seen:
                self.seen["threshold"] = threshold
                self.check()

    def check(self) -> None:
        text = None if self.warned else secure_advice(self.schedule, min_fit_clients=self.seen.get("min_fit_clients"),
                                                      reconstruction_threshold=self.seen.get("threshold"))
        if text:
            self.warned = True
            flwr_log.warning("availability: %s", text)

    def reason(self, listed: int | None) -> str:
        """The recorded reason of the round under way, halted before its first stage."""
        return halt_reason(self.notes, listed)
