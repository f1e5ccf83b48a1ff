"""A user's study, from a TOML file or module:attr, swept and reported with the project's commands;
and one in-process run from the command line (experiments.once)."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from extension_fixtures import MYEXT, use_myext

from experiments import once, report, sweep
from experiments.studyfile import StudyError, load_study
from experiments.summary import find_runs
from server_app.results import read_metrics

STUDY = MYEXT / "study.toml"


def test_a_study_file_and_its_python_twin_are_the_same_study(monkeypatch, tmp_path):
    use_myext(monkeypatch, tmp_path)
    from_file, from_module, from_entry = (load_study(str(STUDY)), load_study("myext.study:STUDY"),
                                          load_study("myext-compare"))
    assert from_file.runs() == from_module.runs() == from_entry.runs()
    assert [name for name, _ in from_file.runs()][:3] == ["fedavg__s0", "mifa__s0", "fedau__s0"]
    assert not from_file.claims and from_file.name == "myext-compare"


@pytest.mark.parametrize("text, error", [
    ("[axes.rule]\na = { strategy = 'mifa' }\n[base]\nnum-round = 3\n", "'num-round' (did you mean 'num-server-rounds'?)"),
    ("seeds = [0]\n", "needs at least one axis"),
    ("[axes.rule]\na = 'mifa'\n", "must map labels to run config tables"),
    ("sedes = [0]\n[axes.rule]\na = { strategy = 'mifa' }\n", "'sedes' (did you mean 'seeds'?)"),
    ("[axes.rule]\na = { strategy = 'mifa' }\n[[claims]]\ntext = 'x'\n", "needs text, rule and others"),
])
def test_a_bad_study_file_is_refused_naming_the_problem(tmp_path, text, error):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(StudyError, match=re.escape(error)):
        load_study(str(path))


def test_an_unknown_study_names_the_ways_to_give_one():
    with pytest.raises(StudyError, match="not a preset"):
        load_study("no-such-study")


def test_a_users_study_file_is_swept_and_reported_as_a_plain_comparison(tmp_path):
    # nothing installed, nothing on PYTHONPATH: the study file's python-path takes the runs to myext
    out, rep = tmp_path / "results", tmp_path / "reports" / "mine"
    assert sweep.main(["--study", str(STUDY), "--out", str(out), "--num-cpus", "2"]) == 0
    study = load_study(str(STUDY))
    found = find_runs(study, out)
    assert sorted(found) == [("fedau",), ("fedavg",), ("mifa",)] and all(set(s) == {0, 1} for s in found.values())
    (log,) = [json.loads(line) for line in (out / sweep.SWEEP_LOG).read_text().splitlines()]
    assert log["command"] == shlex.join(["python", "-m", "experiments.sweep", "--study", str(STUDY), "--out",
                                         str(out), "--num-cpus", "2"])
    assert report.main([str(STUDY), "--results", str(out), "--out", str(rep)]) == 0
    text = rep.with_suffix(".md").read_text()
    summary = json.loads(rep.with_suffix(".json").read_text())
    assert "claim" not in text.lower() and "paper" not in text.lower() and "reproduc" not in text.lower()
    assert "## Per seed" in text and "95% CI" in text
    for col in summary["columns"].values():
        for e in col["entries"]:
            assert e["n"] == 2 and e["ci95"][0] <= e["mean"] <= e["ci95"][1]
            line = next(row for row in text.splitlines() if row.startswith(f"| myext-compare | {e['label']} |"))
            assert all(str(v) in line for v in e["seeds"].values())
    # Regenerate: the exact sweep command (from the log) and this report's own
    assert log["command"] in text
    assert shlex.join(["python", "-m", "experiments.report", "--study", str(STUDY), "--results", str(out),
                       "--out", str(rep)]) in text
    # the wall time per run is the sweep's own measurement of those runs
    names = [d.name for runs in found.values() for d in runs.values()]
    mean = round(sum(log["run-seconds"][n] for n in names) / len(names), 1)
    assert summary["wall-time-source"] == "sweep" and summary["wall-time-per-run"] == mean
    assert f"wall time per run {mean} s on average (as `experiments.sweep` measured it)" in text


def test_one_run_from_the_command_line(tmp_path, capsys):
    code = once.main(["num-clients=3", "num-server-rounds=2", "local-steps=steps:n=1", "model=logreg",
                      "availability=on-off:p=0.9,q=0.5", "checkpoint-every=0", f"results-dir={tmp_path}",
                      "run-name=once", "--quiet"])
    assert code == 0
    assert f"results: {tmp_path / 'once'}" in capsys.readouterr().out
    assert [r["round"] for r in read_metrics(tmp_path / "once")] == [1, 2]
    assert once.main(["num-round=2", "--quiet"]) == 2
    assert "num-round" in capsys.readouterr().err
