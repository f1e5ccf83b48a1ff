"""No silent failure: one log line per reason and round, and a run that stops when nothing it
receives can be used.

Rejected replies are logged through Flower's logger (``flwr``, so they appear where Flower's own
lines do), once per distinct reason per round with the number of replies and a few node ids, not
once per reply. :class:`FailurePolicy` counts the rounds in which replies arrived but none could
be used (every one rejected, or the rule said it cannot run on what it got, e.g. power-of-choice's
probe without a loss) and raises :class:`StrategyFailure` after ``max_failed_rounds`` such rounds
in a row, with one message naming the reasons, so a misconfigured ClientApp fails the run instead
of "completing" with the initial model, unless the nodes rejected in those rounds are a minority
of the run's nodes: those are quarantined, so no minority can end a run. Rounds in which nobody
replied are not failures: under churn that is what unavailability looks like.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from flwr.app import Message
from flwr.common.constant import ErrorCode

from .protocol import ADOPT
from .replies import RoundLog, brief, shown

log = logging.getLogger("flwr")
SHOWN_NODES = 3  # node ids named per log line
NO_HANDLER = "No train function registered with name 'adopt'"  # Flower's ClientApp, in the error reason


_TRACEBACK_LAST = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)): ?(.*)$")
_WRAPPERS = ("ClientAppException", "RayTaskError")  # Flower's and Ray's wrappers around the real exception
_FLOWER_REASON = re.compile(r"^<class '([\w.]+)'>:<'(.*)'>$", re.S)


def quoted_error(reason: str | None) -> str:
    """The exception behind a Flower error reply, as ``Type: first line`` (Flower writes
    ``<class 'T'>:<'message'>``; in simulation the message holds Ray's traceback, whose first
    ``Type: ...`` line that is not a wrapper is the real exception); the reason's first line where
    it holds none."""
    text = (reason or "").strip()
    if not text:
        return "(no reason given)"
    found = [m for line in text.splitlines() if (m := _TRACEBACK_LAST.match(line.strip()))
             and not m.group(1).endswith(_WRAPPERS)]
    if found:  # a traceback (Ray's, in simulation): its first exception, the root of the chain
        kind, message = found[0].group(1), found[0].group(2)
        return f"{kind.rsplit('.', 1)[-1]}: {message.strip()}"[:300]
    outer = _FLOWER_REASON.match(text)
    if outer:
        first = next((line.strip() for line in outer.group(2).splitlines() if line.strip()), "")
        return f"{outer.group(1).rsplit('.', 1)[-1]}: {first}"[:300]
    return next(line.strip() for line in text.splitlines() if line.strip())[:300]


# error replies that say the ClientApp failed; the others (a message or node unavailable, a lost
# Ray worker's UNKNOWN) are what churn looks like
CLIENT_FAILURES = frozenset({ErrorCode.LOAD_CLIENT_APP_EXCEPTION, ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                             ErrorCode.CLIENT_APP_CRASHED, ErrorCode.MOD_FAILED_PRECONDITION, ErrorCode.INVALID_FAB})


def client_failure(msg: Message) -> str | None:
    """The quoted exception of an error reply whose ClientApp failed, else None (churn)."""
    return quoted_error(msg.error.reason) if msg.has_error() and msg.error.code in CLIENT_FAILURES else None


class StrategyFailure(RuntimeError):
    """The run cannot go on usefully; the message says why and what to change."""


def group(rejected: list[tuple[int, str]]) -> dict[str, list[int]]:
    """reason -> the nodes rejected for it, in first-seen order."""
    out: dict[str, list[int]] = {}
    for node, reason in rejected:
        out.setdefault(reason, []).append(node)
    return out


def log_round(rule: str, server_round: int, round_log: RoundLog) -> None:
    """One WARNING per rejection reason and per ClientApp failure, one for the replies cut to a
    norm bound (:meth:`strategies.bounds.NormBounds.check`: its first reason), and one DEBUG line
    for the unavailable nodes, with counts.

    Unavailable nodes are the normal course of a run under churn (``unavailable-nodes`` in
    metrics.jsonl records them), so they stay off a quiet console; rejections and failed
    ClientApps (counted as unavailable, but not churn) are not normal."""
    said = (("reply rejected", "replies rejected", round_log.rejected),
            ("ClientApp failed (counted as unavailable)", "ClientApps failed (counted as unavailable)", round_log.errors))
    for one, many, cases in said:
        for reason, nodes in group(cases).items():
            more = f", +{len(nodes) - SHOWN_NODES} more" if len(nodes) > SHOWN_NODES else ""
            log.warning("%s, round %d: %d %s: %s (node%s %s%s)", rule, server_round, len(nodes),
                        one if len(nodes) == 1 else many, brief(reason), "" if len(nodes) == 1 else "s",
                        ", ".join(str(n) for n in nodes[:SHOWN_NODES]), more)
    if cut := round_log.cut:  # one line a round: its first reason, its nodes
        more = f", +{len(cut) - SHOWN_NODES} more" if len(cut) > SHOWN_NODES else ""
        log.warning("%s, round %d: %d %s to the norm bound, kept: %s (node%s %s%s)", rule, server_round, len(cut),
                    "reply cut" if len(cut) == 1 else "replies cut", brief(cut[0][1]), "" if len(cut) == 1 else "s",
                    ", ".join(str(n) for n, _ in cut[:SHOWN_NODES]), more)
    if unavailable := round_log.unavailable:
        log.debug("%s, round %d: %d node(s) unavailable (error reply or no reply)", rule, server_round,
                 len(unavailable))


@dataclass
class FailurePolicy:
    """Fail the run after ``max_failed_rounds`` consecutive rounds with no usable reply (0: never),
    unless the nodes whose replies were rejected in those rounds are a minority of the federation.

    A round fails when replies arrived but none could be used, or the rule reported a problem.
    After ``max_failed_rounds`` failed rounds in a row the run fails (:class:`StrategyFailure`)
    when the rule reported a problem, or when the distinct nodes rejected in those rounds are
    more than half of the federation (every node the run has addressed or heard from, and at
    least the run's N clients when N is known: a client offline since the run began, as under
    cyclic or group availability in a deployment, where offline nodes are not even listed, is
    offline, not junk; the run waits for it): a
    misconfigured ClientApp fails the run, one node (or a minority) sending junk while everyone
    else is offline does not. Such nodes are quarantined: logged once; the streak goes on, so a
    federation that keeps producing nothing fails as soon as the nodes rejected in the streak are
    a majority.
    """

    rule: str
    max_failed_rounds: int = 3
    failed_rounds: list[int] = field(default_factory=list)  # the current run of failed rounds
    federation: set[int] = field(default_factory=set)  # nodes addressed or heard from, this run
    junk: set[int] = field(default_factory=set)  # nodes rejected in the current run of failed rounds
    quarantined: set[int] = field(default_factory=set)
    num_clients: int = 0  # the run's N when known: clients never heard from are offline, not junk

    def __post_init__(self) -> None:
        if isinstance(self.max_failed_rounds, bool) or not isinstance(self.max_failed_rounds, int) \
                or self.max_failed_rounds < 0:
            raise ValueError(f"max_failed_rounds must be an integer >= 0 (0: never fail), "
                             f"got {self.max_failed_rounds!r}")

    def end_round(self, server_round: int, received: int, accepted: int,
                  rejected: list[tuple[int, str]], problems: list[str], nodes: Iterable[int] = ()) -> None:
        """Count this round; raise StrategyFailure when the limit is reached.

        received: replies that arrived without an error; accepted: those the rule used;
        problems: reasons the rule could not run on what it got (each names what is missing);
        nodes: the nodes addressed this round or heard from (the federation grows by them).
        """
        rejected_nodes = {node for node, _ in rejected}
        self.federation |= set(nodes) | rejected_nodes
        if not problems and (received == 0 or accepted > 0):
            self.failed_rounds, self.junk = [], set()
            return
        self.failed_rounds.append(server_round)
        self.junk |= rejected_nodes
        if not self.max_failed_rounds or len(self.failed_rounds) < self.max_failed_rounds:
            return
        if not problems and 2 * len(self.junk) <= max(len(self.federation), self.num_clients):
            if new := self.junk - self.quarantined:
                log.warning("%s, round %d: node(s) %s sent only rejected replies while no usable reply "
                            "arrived for %d rounds; the %d such nodes are a minority of the %d nodes of the "
                            "run: quarantined, the run goes on (their replies are still judged one by one)",
                            self.rule, server_round, shown(sorted(new)), len(self.failed_rounds),
                            len(self.junk), max(len(self.federation), self.num_clients))
                self.quarantined |= new
            return
        reasons = [f"{brief(reason)} ({len(nodes)} {'reply' if len(nodes) == 1 else 'replies'})"
                   for reason, nodes in group(rejected).items()]
        reasons += [f"{why} ({n} {'time' if n == 1 else 'times'})" for why, n in Counter(problems).items()]
        rounds = self.failed_rounds
        raise StrategyFailure(
            f"strategy '{self.rule}' could use no reply in {len(rounds)} rounds in a row (rounds "
            f"{rounds[0]}-{rounds[-1]}; max_failed_rounds={self.max_failed_rounds}, 0 never stops). "
            f"Round {rounds[-1]}: " + "; ".join(reasons))


def check_broadcast(rule: str, server_round: int, sent: list[Message], replies: list[Message]) -> None:
    """The replies to a round-end broadcast (FedAWE's ``train.adopt``): a ClientApp without its
    handler fails the run with the fix; nodes that did not take it are logged, with their count."""
    errors = [m for m in replies if m.has_error()]
    for m in errors:
        if NO_HANDLER in (m.error.reason or ""):
            raise StrategyFailure(
                f"strategy '{rule}': node {m.metadata.src_node_id}'s ClientApp has no handler for the "
                f"round-end broadcast '{ADOPT}', so its clients never adopt the new model. Register "
                f"it: `from client_app.dropin import adopt` and `app.train(\"adopt\")(adopt)`")
    missed = len(sent) - (len(replies) - len(errors))
    if missed > 0:
        log.warning("%s, round %d: %d of %d node(s) did not take the round-end broadcast (error or no "
                    "reply); they keep their older model", rule, server_round, missed, len(sent))
