"""docs/run-config.md's key table is the run config of ``pyproject.toml``: every key of
``[tool.flwr.app.config]`` has one row with its exact default (value and TOML type: ``1.0`` is not
``1``), and no row documents a key that pyproject lacks."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADER = "| key | default | meaning |"


def pyproject_defaults(text: str) -> dict[str, Any]:
    return tomllib.loads(text)["tool"]["flwr"]["app"]["config"]


def code(cell: str, where: str) -> str:
    cell = cell.strip()
    if not (len(cell) >= 2 and cell.startswith("`") and cell.endswith("`")):
        raise ValueError(f"{where}: expected one `code` cell, got {cell!r}")
    return cell[1:-1]


def documented_defaults(markdown: str) -> dict[str, Any]:
    """key -> default (parsed as a TOML value) from the table under ``HEADER``."""
    lines = markdown.splitlines()
    if HEADER not in lines:
        raise ValueError(f"no table with the header {HEADER!r}")
    out: dict[str, Any] = {}
    for n, line in enumerate(lines[lines.index(HEADER) + 2:], start=lines.index(HEADER) + 3):
        if not line.startswith("|"):
            break
        cells = line.split(" | ")
        if len(cells) < 3:
            raise ValueError(f"line {n}: a row needs key, default and meaning: {line!r}")
        key = code(cells[0].removeprefix("|"), f"line {n}, key")
        if key in out:
            raise ValueError(f"line {n}: key {key!r} documented twice")
        raw = code(cells[1], f"line {n}, default of {key!r}")
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"line {n}: the default of {key!r} is not a TOML value: {raw!r} ({e})") from e
    return out


def differences(documented: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    out = [f"{k}: in pyproject.toml ({actual[k]!r}), not in the docs" for k in sorted(actual.keys() - documented.keys())]
    out += [f"{k}: documented, but pyproject.toml has no such key" for k in sorted(documented.keys() - actual.keys())]
    out += [f"{k}: documented default {documented[k]!r}, pyproject.toml says {actual[k]!r}"
            for k in sorted(documented.keys() & actual.keys())
            if documented[k] != actual[k] or type(documented[k]) is not type(actual[k])]
    return out


def test_the_parser_reads_a_table_and_finds_every_kind_of_difference():
    md = (f"text\n\n{HEADER}\n|---|---|---|\n| `a` | `1` | an int |\n| `b` | `\"x\"` | a string, "
          "with | inside |\n| `c` | `1` | should be a float |\n| `d` | `true` | gone |\n\nafter | x |\n")
    doc = documented_defaults(md)
    assert doc == {"a": 1, "b": "x", "c": 1, "d": True}
    actual = {"a": 1, "b": "x", "c": 1.0, "e": 0}
    assert differences(doc, actual) == [
        "e: in pyproject.toml (0), not in the docs",
        "d: documented, but pyproject.toml has no such key",
        "c: documented default 1, pyproject.toml says 1.0",
    ]


@pytest.mark.parametrize("row, problem", [
    ("| a | `1` | no backticks |", "expected one `code` cell"),
    ("| `a` | `[1` | bad |", "not a TOML value"),
    ("| `a` | `1` |", "a row needs key, default and meaning"),
])
def test_a_malformed_row_names_its_line(row, problem):
    with pytest.raises(ValueError, match=problem):
        documented_defaults(f"{HEADER}\n|---|---|---|\n{row}\n")


def test_run_config_reference_matches_pyproject():
    doc = documented_defaults((ROOT / "docs" / "run-config.md").read_text())
    actual = pyproject_defaults((ROOT / "pyproject.toml").read_text())
    diff = differences(doc, actual)
    assert not diff, "docs/run-config.md and [tool.flwr.app.config] differ:\n" + "\n".join(diff)
