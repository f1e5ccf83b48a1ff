"""benchmarks/flow_reading.py: its reading lists name code that exists (so they cannot rot), and it
reports both figures per flow and the new rule's lines (issue 48 item 7)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("flow_reading", ROOT / "benchmarks" / "flow_reading.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_listed_name_resolves(bench):
    """Each (file, qualified name) of every stop is a class or function of that file (read by ast)."""
    missing = [f"{flow}: {label}: {path}:{name}" for flow, stops in bench.FLOWS.items()
               for label, names in stops for path, name in names if bench.find(ROOT, path, name) is None]
    assert not missing, "names the reading lists give that the code no longer has:\n" + "\n".join(missing)


def test_no_name_is_listed_twice_in_a_flow(bench):
    for flow, stops in bench.FLOWS.items():
        names = bench.flat(stops)
        twice = sorted({n for n in names if names.count(n) > 1})
        assert not twice, f"{flow}: listed more than once: {twice}"


def test_a_name_that_does_not_exist_is_reported_not_counted(bench):
    m = bench.measure(ROOT, [("strategies/contract.py", "Rule.fold"), ("strategies/contract.py", "Rule.no_such"),
                             ("no/such.py", "f")])
    assert m["missing"] == ["strategies/contract.py:Rule.no_such", "no/such.py:f"]
    assert m["files"] == 1 and m["lines"] > 0
    assert m["own"] == pytest.approx(m["lines"] / 40 + 0.5)
    assert m["human"] == pytest.approx(m["lines"] / 25 + 0.75)


def test_a_method_inside_a_listed_class_is_read_once(bench):
    whole = bench.measure(ROOT, [("strategies/rules/fedavg.py", "MeanFold")])
    both = bench.measure(ROOT, [("strategies/rules/fedavg.py", "MeanFold"), ("strategies/rules/fedavg.py", "MeanFold.add")])
    assert both["lines"] == whole["lines"] and both["files"] == 1


def test_the_report_gives_both_figures_per_flow_and_the_new_rule(bench):
    text = bench.report(ROOT)
    for flow in bench.FLOWS:
        assert flow in text
    assert "not found" not in text and "total" in text
    rule = bench.new_rule(ROOT)
    assert rule is not None and rule["adapter_free"], rule  # docs/extending.md's FedAvgM knows no adapter
    assert rule["imports"] == ["strategies.contract"]
    assert 0 < rule["own"] <= rule["code"] <= 40  # issue 48 item 7: a new rule in at most 40 lines
