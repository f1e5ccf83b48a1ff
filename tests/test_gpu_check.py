"""The prepared GPU check (benchmarks/gpu_check.py) on a CPU: every section yields its figures on a
tiny workload, the budget skips what does not fit, and a broken run is a row, not the end of the
check (a lent GPU's minutes must not be lost to one failure)."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_check


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    assert gpu_check.main(["--quick", "--device", "cpu", "--rules", "fedawe", "fedau", "--profile-rules", "fedau",
                           "--sizes", "15", "--rounds", "4", "--budget", "1e6", "--out", str(out)]) == 0  # no skip at any load
    return json.loads((out / "gpu_check.json").read_text()), out


def test_every_section_measures_on_a_cpu(quick, capsys):
    result, out = quick
    paper = {row["rule"]: row for row in result["paper"]}
    assert set(paper) == {"fedawe", "fedau"}
    for row in paper.values():
        assert row["round_s"] > 0 and row["eval_round_s"] > 0 and row["rounds"] == 4 and row["participants"] > 0
        assert row["train_tflop"] > 0  # the model's own layers counted
    (profiled,) = result["profile"]
    assert profiled["rule"] == "fedau" and len(profiled["round_s"]) == 4
    assert any(name.startswith("aten::") for name, _, _ in profiled["top_cpu_ops"])
    assert any("run_inprocess" in name for name, _, _ in profiled["top_python"])  # the project's own functions
    assert (out / "trace-fedau.json.gz").stat().st_size > 0
    (engines,) = result["engines"]
    assert all(isinstance(engines[e], float) and engines[e] > 0 for e in ("raw", "per-client", "cohort"))


def test_a_spent_budget_skips_each_unit_and_still_prints_the_table(tmp_path, capsys):
    assert gpu_check.main(["--quick", "--device", "cpu", "--rules", "fedau", "--sizes", "15",
                           "--budget", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["paper"] == [{"rule": "fedau", "skipped": "budget"}]
    assert result["profile"] == [{"rule": "fedawe", "skipped": "budget"}, {"rule": "fedau", "skipped": "budget"}]
    assert result["engines"][0]["cohort"] == "skipped: budget"
    printed = capsys.readouterr().out
    assert "skipped paper fedau" in printed and "paper round per rule" in printed


def test_a_failing_run_is_a_row_and_the_check_goes_on(tmp_path):
    assert gpu_check.main(["--device", "cpu", "--rules", "fedau", "fedavg-active", "--sections", "paper",
                           "--data-dir", str(tmp_path / "no-data"), "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["paper"]
    assert [row["rule"] for row in rows] == ["fedau", "fedavg-active"]
    assert all("cifar10" in row["error"].lower() for row in rows)  # the missing dataset, named


def test_cuda_asked_for_where_there_is_none_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cuda"])
    assert "no CUDA device" in capsys.readouterr().err
