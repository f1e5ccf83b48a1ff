"""The participation report (pure): the realised participation of a deployed run
(``metrics.jsonl``'s ``participants``) against the schedule, round by round, with a reason for
every difference and a verdict on whether it lies within the documented timing slack."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class RoundReport:
    """One round: who the schedule has on, who took part, and why they differ."""

    round: int
    expected: list[int]
    got: list[int]
    why: dict[int, str]  # client -> why its participation differs from the schedule
    failed: list[int]  # the clients whose difference is beyond the documented timing slack


@dataclass
class ParticipationReport:
    """Realised participation (``metrics.jsonl``) against the schedule, round by round."""

    rounds: list[RoundReport]

    @property
    def differences(self) -> list[RoundReport]:
        return [r for r in self.rounds if r.why]

    @property
    def failures(self) -> list[RoundReport]:
        return [r for r in self.rounds if r.failed]

    def summary(self) -> str:
        diff = self.differences
        lines = [f"participation vs schedule: {len(diff)} of {len(self.rounds)} rounds differ, "
                 f"{len(self.failures)} beyond the timing slack"]
        for r in diff:
            lines.append(f"  round {r.round}: expected {r.expected}, got {r.got}; " + "; ".join(
                f"client {c}: {why}" + (" [FAIL]" if c in r.failed else "") for c, why in sorted(r.why.items())))
        return "\n".join(lines)

    def failure_text(self) -> str:
        return "; ".join(f"round {r.round}: " + ", ".join(f"client {c} ({r.why[c]})" for c in r.failed)
                         for r in self.failures)


def participation_report(
    expected: np.ndarray,
    rows: Sequence[Mapping[str, Any]],
    *,
    explained: Mapping[tuple[int, int], str] | None = None,
    client_of_node: Mapping[int, int] | None = None,
    diagnose: Callable[[int, int], str | None] | None = None,
) -> ParticipationReport:
    """Compare each recorded round's ``participants`` with row ``round - 1`` of ``expected``
    (rounds x clients, the schedule the server uses; all ones when nothing churns).

    Within the documented timing slack (reported, not failed): a miss listed in ``explained``
    (a late node, a node taken down on purpose: :meth:`deploy.churn.RoundChurn.explained`) and a reply the
    strategy rejected (the round's ``rejected`` list, node ids mapped by ``client_of_node``).
    Beyond it (failed): a client on in the schedule with no valid reply and no such reason (a
    node that stopped out of schedule, a client slower than round-timeout, or a driver that
    followed another schedule), and a client that took part while the schedule has it off.
    ``diagnose(round, client)`` (:meth:`deploy.churn.RoundChurn.diagnose`) may say more about such a miss.
    """
    explained = explained or {}
    client_of_node = client_of_node or {}
    out = []
    for row in rows:
        r = int(row["round"])
        want = {int(c) for c in np.flatnonzero(expected[r - 1])}
        got = {int(c) for c in row["participants"]}
        rejected = {client_of_node[int(node)]: reason for node, reason in row.get("rejected", [])
                    if int(node) in client_of_node}
        why, failed = {}, []
        for c in sorted(want - got):
            if (r, c) in explained:
                why[c] = explained[r, c]
            elif c in rejected:
                why[c] = f"reply rejected: {rejected[c]}"
            else:
                why[c] = "on in the schedule but no valid reply: " + (
                    (diagnose and diagnose(r, c))
                    or "its node stopped out of schedule, was not addressed, or replied after round-timeout")
                failed.append(c)
        for c in sorted(got - want):
            why[c] = "took part while the schedule has it offline"
            failed.append(c)
        out.append(RoundReport(r, sorted(want), sorted(got), why, sorted(failed)))
    return ParticipationReport(out)
