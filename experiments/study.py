"""What a sweep (a study) is: a base config, axes and seeds (``Sweep``), and, for a paper's
reproduction, the claims about its table (``Claim``). Presets and the user's study files
(``experiments.studyfile``) declare them; ``experiments.sweep`` runs them; ``experiments.report``
reads their folders."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Claim:
    """A paper's claim about two rows of a sweep's table, checked by the report in every listed column.

    ``rule`` beats each of ``others`` (``within`` is None), or stays no more than ``within`` points
    behind each of them. ``columns`` empty: every column of the table.
    """

    text: str
    rule: str
    others: tuple[str, ...]
    columns: tuple[str, ...] = ()
    within: float | None = None
    why: str = ""  # what we found when it did not reproduce; printed only under a verdict short of reproduced


@dataclass(frozen=True)
class Sweep:
    """A base config plus axes; the product of the axes' values gives the runs."""

    name: str
    base: Mapping[str, Any]
    axes: Mapping[str, Mapping[str, Mapping[str, Any]]]  # axis -> label -> overrides
    seeds: tuple[int, ...] = (0, 1, 2)
    notes: str = ""  # fixed report text: the citation and the paper's setup, never a result
    paper: Mapping[str, Any] = field(default_factory=dict)  # "<col labels> / <row label>" -> paper's number
    paper_setup: Mapping[str, Any] = field(default_factory=dict)  # run config key -> the paper's value
    figures: tuple[str, ...] = ()  # extra figures the report draws (see experiments.report.FIGURES)
    claims: tuple[Claim, ...] = ()  # the paper's claims the report gives a verdict on
    python_path: tuple[str, ...] = ()  # folders the runs import the user's modules from (a study file's)

    def runs(self, seeds: Iterable[int] | None = None) -> list[tuple[str, dict[str, Any]]]:
        """(run name, run config overrides) for every combination and seed, seed by seed.

        Seed-major order: a sweep stopped early holds whole seeds, not whole cells.
        """
        out = []
        labels = [list(values.items()) for values in self.axes.values()]
        for seed in self.seeds if seeds is None else seeds:
            for combo in itertools.product(*labels):
                overrides: dict[str, Any] = dict(self.base)
                for _, values in combo:
                    overrides.update(values)
                overrides.update({"train-seed": seed, "data-seed": seed, "schedule-seed": seed})
                name = "__".join([*(label for label, _ in combo), f"s{seed}"])
                out.append((name, overrides))
        return out
