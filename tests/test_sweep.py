"""Sweeps run every combination once, resume by skipping finished runs, and reports read them."""

import json

import torch

from experiments.inprocess import run_inprocess
from experiments.presets import PRESETS
from experiments.report import write_report
from experiments.sweep import SWEEP_LOG, run_sweep
from server_app.results import read_metrics


def test_a_sweep_runs_what_in_process_runs_write_resumes_an_interrupted_run_skips_finished_ones_and_reports(tmp_path):
    """One sweep of the smoke preset (two Ray sessions in all: CI's budget): every combination
    runs once as a Ray task, a folder without a final model runs again, a task's run equals the
    in-process run (cohort engine in the task, per-client here), a run stopped after a checkpoint
    resumes from it bit for bit, a finished sweep reruns nothing, and the report reads the log."""
    sweep = PRESETS["smoke"]
    (name, cfg), (unfinished, _) = sweep.runs(seeds=[1])
    (tmp_path / unfinished).mkdir(parents=True)  # a folder without a final model is run again
    over = {"engine": "cohort", "checkpoint-every": 1}
    done = run_sweep(sweep, tmp_path, num_cpus=2, overrides=over)  # a local Ray with 2 CPUs, 1 CPU per run
    assert sorted(n for n, _, error in done if not error) == sorted(n for n, _ in sweep.runs())
    assert all(len(read_metrics(tmp_path / n)) == 3 for n, _ in sweep.runs())
    assert json.loads((tmp_path / name / "config.json").read_text())["engine-used"] in ("cohort", "per-client")

    direct = run_inprocess({**cfg, "engine": "per-client", "results-dir": str(tmp_path / "direct"),
                            "run-name": name, "progress": False})
    ours, ref = torch.load(tmp_path / name / "final_model.pt"), torch.load(direct / "final_model.pt")
    for k, v in ref.items():
        assert torch.allclose(ours[k], v, rtol=1e-4, atol=1e-6), k

    stopped = sweep.runs(seeds=[0])[0][0]
    first = torch.load(tmp_path / stopped / "final_model.pt")
    (tmp_path / stopped / "final_model.pt").unlink()  # as if stopped after round 2's checkpoint
    (tmp_path / stopped / "checkpoints" / "round-0003.pt").unlink()
    (again,) = run_sweep(sweep, tmp_path, num_cpus=2, overrides=over)
    assert again[0] == stopped and not again[2]
    assert [r["round"] for r in read_metrics(tmp_path / stopped)] == [1, 2, 3]
    for k, v in first.items():
        assert torch.equal(torch.load(tmp_path / stopped / "final_model.pt")[k], v)

    assert run_sweep(sweep, tmp_path, num_cpus=1) == []  # everything finished: nothing to redo (no line logged)
    logs = [json.loads(line) for line in (tmp_path / SWEEP_LOG).read_text().splitlines()]
    assert [log["runs-done"] for log in logs] == [4, 1] and not any(log["runs-failed"] for log in logs)
    assert logs[0]["workers"] == 2 and logs[0]["cpus-per-run"] == 1.0 and logs[0]["ray-address"] == "local"
    report = write_report(sweep, tmp_path, tmp_path / "report" / "smoke").read_text()
    assert "| fedavg-active |" in report and "| fedavg-all |" in report
    assert report.count("(n=2)") == 2
    wall = sum(log["wall-seconds"] for log in logs) / 60
    assert f"Sweep wall time: {wall:.1f} min for 5 runs in 2 invocation(s)" in report
    assert (tmp_path / "report" / "smoke-curves.png").stat().st_size > 0


def test_seeds_are_separate_per_run_and_recorded():
    runs = dict(PRESETS["smoke"].runs(seeds=[3]))
    cfg = runs["sine__fedavg-all__s3"]
    assert cfg["train-seed"] == cfg["data-seed"] == cfg["schedule-seed"] == 3
    assert cfg["strategy"] == "fedavg-all"


def test_runs_come_seed_by_seed_so_a_stopped_sweep_holds_whole_seeds():
    names = [name for name, _ in PRESETS["smoke"].runs(seeds=[0, 1])]
    assert [name.rsplit("__", 1)[1] for name in names] == ["s0", "s0", "s1", "s1"]
