"""The drop-in's grid (:func:`server_app.dropin.with_availability`): churn any Flower app can trust.

- **Offline is not connected** (:class:`~server_app.network.AvailabilityGrid`): ``get_node_ids()``
  lists the nodes online in the round about to be addressed (the clock, below); a message to an
  offline (or never identified) node gets at once Flower's unavailable-node reply.
- **Every message is dated, or refused.** A message's round is its ``server-round`` (Flower's
  Message-API strategies and the project's rules), else its numeric ``group_id`` (Flower's legacy
  workflows, ``DefaultWorkflow`` and ``SecAggPlusWorkflow``: every stage), else, with
  ``count_rounds=True``, the grid's own count (each send of undated TRAIN messages starts the next
  round; other undated messages belong to the current one). Anything else is refused
  (:class:`RoundUnknown`, naming the fixes) before any message is sent.
- **The clock.** Listed: the nodes online in ``max(latest dated round, last trained round + 1)``:
  an evaluation of round r, sent after its training, reaches round r + 1's nodes, as deployed
  (``deploy launch --app`` starts them once round r's training is in).
- **Participation counts the stage that trains**: plain TRAIN, of SecAgg+ ``collect_masked_vectors``
  only. A SecAgg+ round is closed by the workflow's log line (``Secure aggregation completed.`` /
  ``halted.``: no participants, where it stopped). One ``rounds.jsonl`` line per round.
- **Leaving between stages.** ``departures`` {(round, client): stage}, or the virtual clock's
  sessions (:class:`~server_app.sessionstages.SessionStages`): the client's node is gone from that
  SecAgg+ stage of that round on (its messages get the unavailable reply; gone from ``setup``: not
  listed; a plain TRAIN message is withheld from a node gone by the training stage); SecAgg+
  recovers its masks from the shares.
- **No success without work.** When ``max_idle_rounds`` rounds with clients scheduled online have
  passed and no round ever had a participant, the run fails (:class:`NoWorkDone`) with the reasons
  (what the nodes' identity answers raised, the training replies' errors, a halted SecAgg+); a
  shorter run fails so when its loop ends (:meth:`ChurnGrid.finish`: Flower's loops say so on their
  logger, ``[SUMMARY]`` / ``Strategy execution finished``; a loop of your own calls it last).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Message, MessageType
from flwr.serverapp import Grid

from availability import Schedule
from runconfig import did_you_mean
from strategies.failures import quoted_error
from strategies.secagg import DROPPED_NODE, FAILED_CLOSED

from .flowerlog import FlowerLogWatch
from .messages import (
    STAGES,
    TRAINING_STAGE,
    RoundUnknown,
    dated_round,
    is_training,
    stage_of,
    unavailable_reply,
)
from .network import AvailabilityGrid
from .results import PARTICIPATION, write_matrix
from .securecheck import SecureMinimums
from .sessionstages import SessionStages

flwr_log = logging.getLogger("flwr")
AVAILABILITY = "availability.csv"
ROUNDS = "rounds.jsonl"
LISTING_WARN = 30  # listings of one round, with no message sent, after which the wait is explained once


class NoWorkDone(RuntimeError):
    """No client's update was applied in any round: the run must not end as a success."""


class ChurnGrid(AvailabilityGrid):
    """:class:`AvailabilityGrid` with the drop-in's guarantees (see the module); gate ``client``:
    every message is delivered and the client declines (identities still learnt for the record);
    gate ``none`` (deployed): nothing filtered, offline nodes are really gone."""

    def __init__(self, grid: Grid, schedule: Schedule, gate: str, results_dir: Path | None,
                 identity_timeout: float, deployed: Any = None, *, count_rounds: bool = False,
                 max_idle_rounds: int = 3, departures: Mapping[tuple[int, int], str] | SessionStages | None = None
                 ) -> None:
        super().__init__(grid, schedule, {}, identity_timeout)
        self.gate = "none" if deployed is not None else gate
        self.results_dir = results_dir
        self.deployed = deployed
        self.count_rounds, self.max_idle_rounds = count_rounds, max_idle_rounds
        self.departures = departures if isinstance(departures, SessionStages) else dict(departures or {})  # (round, client) -> SecAgg+ stage gone by
        bad = {s for s in (self.departures.values() if isinstance(self.departures, dict) else []) if s not in STAGES}
        if bad:
            raise ValueError(f"departures: stages must be among {STAGES} (SecAgg+'s), got "
                             + ", ".join(f"{s!r}{did_you_mean(s, STAGES)}" for s in sorted(bad)))
        self.lock = threading.RLock()  # Flower's legacy workflows list nodes from a thread of their own
        self.senders: set[int] = set()  # threads that sent through this grid: the loop's rounds come from them
        self.rounds: dict[int, dict[str, Any]] = {}  # round -> its record
        self.latest = 0  # the latest round a message was dated with
        self.trained_through = 0  # the latest round whose training stage is over
        self.open_secure: int | None = None  # the SecAgg+ round under way
        self.worked = False  # a round had a participant
        self.idle: list[int] = []  # rounds with clients online and no participant, while none ever had one
        self.signalled = 0  # deployed: the last round whose start signal was waited for
        self.listings: Counter[int] = Counter()  # listing round -> times listed
        self.pending: dict[str, Message] = {}  # push/pull: message id -> its unavailable reply
        self._dates: dict[int, int] = {}  # id(message) -> round, for the batch being sent
        if results_dir is not None:
            results_dir.mkdir(parents=True, exist_ok=True)
            (results_dir / ROUNDS).write_text("")
        self.announced = 0  # the round Flower's loop said it starts (its log line)
        self.listed: int | None = None  # the nodes the last listing gave
        self.secure = SecureMinimums(schedule)  # SecAgg+'s minimums as Flower shows them, checked once
        self.finished = self.used = False  # finish() has judged the run; a loop listed nodes through this grid
        for old in [h for h in flwr_log.handlers if isinstance(h, FlowerLogWatch)]:
            flwr_log.removeHandler(old)  # one wrapped grid per ServerApp: the latest follows Flower's loop
        self.watch = FlowerLogWatch(self)
        flwr_log.addHandler(self.watch)

    # ------------------------------------------------------------------ listing
    def listing_round(self) -> int:
        """The round whose online nodes ``get_node_ids`` lists (see the module: the clock)."""
        return max(self.latest, self.trained_through + 1, self.announced, 1)

    def get_node_ids(self) -> Iterable[int]:
        """The connected nodes whose client is online in :meth:`listing_round` (gate ``server``);
        every connected node otherwise (deployed: after the round-start signal)."""
        with self.lock:
            upcoming, self.used = self.listing_round(), True
            if self.deployed is not None:
                if self.signalled < upcoming:
                    self.signalled = upcoming
                    self.deployed.wait_signal(upcoming)
                nodes = list(self.grid.get_node_ids())
                self.listed = len(nodes)
                return nodes
            nodes = sorted(self.grid.get_node_ids())
            self.learn(nodes, upcoming)
            if self.gate != "server":
                return nodes
            listed = self.online_nodes(nodes, upcoming)
            self.listed = len(listed)
            self.listings[upcoming] += 1
            unknown = [n for n in nodes if n not in self.client_of_node]
            if unknown and self.listings[upcoming] == 1:
                flwr_log.warning("availability, round %d: %d node(s) have not said which client they are (%s): not "
                                 "listed, they receive nothing until they do (%s)", upcoming, len(unknown),
                                 ", ".join(str(n) for n in unknown[:5]), self.why_unknown(unknown))
            if self.listings[upcoming] == LISTING_WARN:
                flwr_log.warning(
                    "availability, round %d: %d of %d clients online, and the strategy keeps listing nodes: "
                    "Flower's strategies wait for min_available_nodes / min_fit_clients, for ever, as they "
                    "would in a deployment. Lower them (or use a rule of strategies/, whose wait is bounded)",
                    upcoming, len(listed), self.schedule.num_clients)
            return listed

    # ------------------------------------------------------------------ dating
    def round_of(self, m: Message) -> int | None:  # noqa: D102
        return self._dates.get(id(m))

    def availability_round(self, rnd: int) -> int:
        """The clock's round when it is later than the message's: an evaluation of round r, sent
        after its training, reaches the nodes up in round r + 1, as in a deployment."""
        return max(rnd, self.listing_round())

    def date(self, messages: list[Message]) -> None:
        """Date every message (see the module), or refuse the whole batch with the fix."""
        dates: dict[int, int] = {}
        undated = [m for m in messages if dated_round(m) is None]
        if undated and not self.count_rounds:
            m = undated[0]
            raise RoundUnknown(
                f"availability: a '{m.metadata.message_type}' message to node {m.metadata.dst_node_id} names no "
                f"round, so the schedule cannot be applied to it (refused, not passed through). Put "
                f"'server-round' in its ConfigRecord (Flower's strategies do), or set its group_id to the "
                f"round (str(r): Flower's workflows do), or let the grid count train rounds: "
                f"with_availability(..., count_rounds=True)")
        counted = self.trained_through + 1 if any(m.metadata.message_type == MessageType.TRAIN
                                                  for m in undated) else max(self.latest, 1)
        for m in messages:
            rnd = dated_round(m)
            dates[id(m)] = counted if rnd is None else rnd
        self._dates = dates
        self.latest = max([self.latest, *dates.values()])

    def departed(self, m: Message) -> bool:
        """Whether ``m``'s node has left its round before ``m``'s SecAgg+ stage (``departures``); a
        plain message: its node is gone from its round's start, or (TRAIN) before the training stage."""
        stage, client = stage_of(m), self.client_of_node.get(m.metadata.dst_node_id)
        rnd = self._dates.get(id(m), 0) if stage is not None else self.availability_round(self._dates.get(id(m), 0))
        left = self.departures.get((rnd, client)) if client is not None else None
        if left is None or (stage is not None and stage not in STAGES):
            return False
        if stage is None:
            return left == STAGES[0] or (m.metadata.message_type == MessageType.TRAIN and left == TRAINING_STAGE)
        return STAGES.index(stage) >= STAGES.index(left)

    def online_nodes(self, nodes: Iterable[int], rnd: int) -> list[int]:
        """The schedule's online nodes, less those gone from the round's start (``departures``: a
        session that is off)."""
        return [n for n in super().online_nodes(nodes, rnd) if self.departures.get((rnd, self.client_of_node[n]))
                != STAGES[0]]

    # ------------------------------------------------------------------ sending
    def reachable(self, messages: list[Message]) -> list[Message]:  # noqa: D102
        if self.gate == "server":
            keep = super().reachable(messages)
            gone = [m for m in keep if self.departed(m)]
            self.withheld += gone
            return [m for m in keep if not any(m is g for g in gone)]
        self.withheld = []
        self.identify(messages)  # the client gates itself, or the node is gone: ids for the record only
        return messages

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        with self.lock:
            messages = list(messages)
            self.senders.add(threading.get_ident())
            if not messages:
                return []
            self.date(messages)
            self.secure.setup(messages)
            self.listings.clear()  # the loop moves on: no wait to explain
            stages = {id(m): stage_of(m) for m in messages}  # before delivery: secaggplus_mod pops it
            sent = time.time()
            keep = self.reachable(messages)
            errors = [unavailable_reply(m) for m in self.withheld]
            replies = list(self.grid.send_and_receive(keep, timeout=timeout)) if keep else []
            self.note(messages, keep, replies, stages, sent)
            return replies + errors

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        with self.lock:
            messages = list(messages)
            self.senders.add(threading.get_ident())
            self.date(messages)
            self.secure.setup(messages)
            keep = self.reachable(messages)
            for reply in map(unavailable_reply, self.withheld):
                self.pending[reply.metadata.reply_to_message_id] = reply
            return [*self.grid.push_messages(keep), *(m.metadata.message_id for m in self.withheld)]

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        ids = list(message_ids)
        mine = [i for i in ids if i in self.pending]
        rest = [i for i in ids if i not in self.pending]
        return [*(self.grid.pull_messages(rest) if rest else []), *(self.pending.pop(i) for i in mine)]

    # ------------------------------------------------------------------ recording
    def clients(self, nodes: Iterable[int]) -> list[int]:
        return sorted(self.client_of_node[n] for n in nodes if n in self.client_of_node)

    def note(self, messages: list[Message], keep: list[Message], replies: list[Message],
             stages: dict[int, str | None], sent: float) -> None:
        """Record the rounds these messages belong to: the training stage's addressed, reached and
        replied clients; a SecAgg+ round's stages."""
        kept = {id(m) for m in keep}
        by_round: dict[int, list[Message]] = {}
        for m in messages:
            by_round.setdefault(self._dates[id(m)], []).append(m)
        for rnd, batch in sorted(by_round.items()):
            secure = {s for m in batch if (s := stages[id(m)]) is not None}
            training = [m for m in batch if is_training(m, stages[id(m)])]
            if not secure and not training:
                continue
            row = self.rounds.setdefault(rnd, {"round": rnd, "sent": sent, "addressed": [], "reached": [],
                                               "replied": [], "problems": []})
            reached = {m.metadata.dst_node_id for m in batch if id(m) in kept}
            answered = [r for r in replies if r.metadata.src_node_id in reached]
            ok = self.clients(r.metadata.src_node_id for r in answered if not r.has_error())
            if secure:
                self.open_secure = rnd
                stage = sorted(secure)[0]
                info = row.setdefault("secure", {"status": "running", "stages": {}})
                info["stages"][stage] = ok
                info["last-stage"] = stage
                if stage == STAGES[0]:
                    row["addressed"] = self.clients(m.metadata.dst_node_id for m in batch)
            if training:
                row["sent"] = sent
                if not secure:
                    row["addressed"] = self.clients(m.metadata.dst_node_id for m in training)
                row["reached"] = self.clients(reached)
                row["replied"] = ok
            row["problems"] += [f"error reply from node {r.metadata.src_node_id}: {quoted_error(r.error.reason)}"
                                for r in answered if r.has_error()]
            row["problems"] += [f"withheld from node {m.metadata.dst_node_id}: {self.why_unknown([m.metadata.dst_node_id])}"
                                for m in batch if id(m) not in kept and m.metadata.dst_node_id not in self.client_of_node]
            if training and not secure:
                self.close(rnd, completed=True)
            else:
                self.write()

    def announce(self, rnd: int) -> None:
        """Flower's loop starts round ``rnd``: the rounds before it in which no training was sent
        (the strategy sampled nobody) are recorded, as rounds without participants."""
        with self.lock:
            for skipped in range(self.trained_through + 1, rnd):
                if skipped not in self.rounds and skipped > 0:
                    unknown = [n for n in self.grid.get_node_ids() if n not in self.client_of_node]
                    why = (f"no training sent: {len(unknown)} node(s) never said which client they are "
                           f"({self.why_unknown(unknown)})" if unknown else "the strategy sent no training message")
                    self.rounds[skipped] = {"round": skipped, "sent": time.time(), "addressed": [], "reached": [],
                                            "replied": [], "problems": [why]}
                    self.close(skipped, completed=True)
            self.announced = max(self.announced, rnd)

    def secure_ended(self, completed: bool) -> None:
        """SecAggPlusWorkflow said its round completed or halted (:class:`_SecureWatch`)."""
        with self.lock:
            rnd, self.open_secure = self.open_secure, None
            if rnd is None and not completed and self.announced > self.trained_through:
                rnd = self.announced  # halted before any message: fewer than 2 nodes to sample
                self.rounds[rnd] = {"round": rnd, "sent": time.time(), "addressed": [], "reached": [], "replied": [],
                                    "problems": [], "secure": {"status": "running", "stages": {}}}
            if rnd is None or rnd not in self.rounds:
                return
            info = self.rounds[rnd]["secure"]
            info["status"] = "completed" if completed else "halted"
            attacks = [str(args[1]) for msg, args in self.secure.notes if msg == FAILED_CLOSED and len(args) == 2]
            self.rounds[rnd]["problems"] += [str(args[1]) for msg, args in self.secure.notes  # dropped, then run again
                                             if msg == DROPPED_NODE and len(args) == 2]
            if not completed and attacks:  # the project's secure round failed closed: an attack, not churn
                info["status"] = "failed-closed"
                self.rounds[rnd]["problems"] += attacks
            elif not completed and info.get("last-stage") is None:
                self.rounds[rnd]["problems"].append(self.secure.reason(self.listed))
            elif not completed:
                threshold = self.secure.seen.get("threshold")
                self.rounds[rnd]["problems"].append(
                    f"SecAgg+ halted after its '{info.get('last-stage')}' stage (fewer than its reconstruction "
                    f"threshold{'' if threshold is None else f' of {threshold}'} clients answered: see Flower's log "
                    f"above)")
            self.secure.notes = []
            self.close(rnd, completed)

    def finish(self) -> None:
        """The loop's rounds are over (Flower's loops: their last log lines; a loop of your own calls
        this last): :class:`NoWorkDone`, naming why, when no round had a participant, however few
        rounds ran (``max_idle_rounds`` fails a long run earlier)."""
        with self.lock:
            if self.worked or self.finished or not (self.used or self.latest):
                return  # it worked, or was judged, or no loop used this grid (another one's loop ended)
            self.finished = True
            self.announce(self.announced + 1)  # a last round in which the strategy sent nothing
            if not self.rounds:
                raise NoWorkDone("availability: the run ended and no round sent any training message: no "
                                 "client's update was applied")
            last = max(self.rounds)
            scheduled = [r for r in sorted(self.rounds) if self.schedule.available(r - 1).any()]
            problems = Counter(p for row in self.rounds.values() for p in row["problems"])
            why = "; ".join(f"{p} ({n}x)" for p, n in problems.most_common(4)) or (
                f"round {last} addressed {self.rounds[last]['addressed']}, none replied" if scheduled
                else "nobody was scheduled online")
            raise NoWorkDone(f"availability: the run ended and no client's update was applied in any of its "
                             f"{len(self.rounds)} round(s) (clients scheduled online in rounds {scheduled}): {why}")

    def close(self, rnd: int, completed: bool) -> None:
        """Round ``rnd``'s training is over: its participants are fixed, its files written."""
        row = self.rounds[rnd]
        row["participants"] = row["replied"] if completed else []
        self.trained_through = max(self.trained_through, rnd)
        if self.deployed is not None:
            self.deployed.record(row)
        self.write()
        if row["participants"]:
            self.worked, self.idle = True, []
        elif not self.worked and self.schedule.available(rnd - 1).any():
            self.idle.append(rnd)
            if self.max_idle_rounds and len(self.idle) >= self.max_idle_rounds:
                problems = Counter(row["problems"])
                raise NoWorkDone(
                    f"availability: no client's update was applied in rounds {self.idle[0]}-{self.idle[-1]} "
                    f"although clients were scheduled online (max_idle_rounds={self.max_idle_rounds}; 0: never "
                    f"stops). Round {rnd}: " + ("; ".join(f"{why} ({n}x)" for why, n in problems.most_common(4))
                                                 or f"addressed {row['addressed']}, none replied"))

    def write(self) -> None:
        if self.results_dir is None:
            return
        lines = [json.dumps(self.rounds[r]) + "\n" for r in sorted(self.rounds)]
        (self.results_dir / ROUNDS).write_text("".join(lines))
        last = max(self.rounds)
        write_matrix(self.results_dir / AVAILABILITY, self.schedule.matrix(last))
        write_matrix(self.results_dir / PARTICIPATION, self.participation(last))

    def participation(self, num_rounds: int) -> np.ndarray:
        """Realised participation: (rounds, N) bool, row t = the clients whose round-(t+1) training
        reply came back without error, in a round that completed."""
        out = np.zeros((num_rounds, self.schedule.num_clients), dtype=bool)
        for rnd, row in self.rounds.items():
            if 1 <= rnd <= num_rounds:
                out[rnd - 1, [c for c in row.get("participants", []) if 0 <= c < out.shape[1]]] = True
        return out
