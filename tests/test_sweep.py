"""Sweeps run every combination once, resume by skipping finished runs, and reports read them."""

import json

import torch

from experiments.inprocess import run_inprocess
from experiments.presets import PRESETS
from experiments.report import write_report
from experiments.sweep import SWEEP_LOG, run_sweep
from server_app.results import read_metrics


def test_smoke_sweep_runs_every_combination_resumes_and_reports(tmp_path):
    sweep = PRESETS["smoke"]
    done = run_sweep(sweep, tmp_path, num_cpus=2)  # a local Ray with 2 CPUs, 1 CPU per run
    assert sorted(name for name, _, error in done if not error) == sorted(name for name, _ in sweep.runs())
    assert all(len(read_metrics(tmp_path / name)) == 3 for name, _ in sweep.runs())
    assert run_sweep(sweep, tmp_path, num_cpus=1) == []  # everything finished: nothing to redo
    (log,) = [json.loads(line) for line in (tmp_path / SWEEP_LOG).read_text().splitlines()]  # no line for a no-op
    assert log["runs-done"] == 4 and log["runs-failed"] == 0 and log["workers"] == 2
    assert log["cpus-per-run"] == 1.0 and log["ray-address"] == "local"

    report = write_report(sweep, tmp_path, tmp_path / "report" / "smoke").read_text()
    assert "| fedavg-active |" in report and "| fedavg-all |" in report
    assert report.count("(n=2)") == 2
    assert f"Sweep wall time: {log['wall-seconds'] / 60:.1f} min for 4 runs in 1 invocation(s)" in report
    assert (tmp_path / "report" / "smoke-curves.png").stat().st_size > 0


def test_a_ray_task_writes_what_an_in_process_run_writes_and_a_rerun_skips_it(tmp_path):
    sweep = PRESETS["smoke"]
    (name, cfg), (unfinished, _) = sweep.runs(seeds=[1])
    (tmp_path / "sweep" / unfinished).mkdir(parents=True)  # a folder without a final model is run again
    done = run_sweep(sweep, tmp_path / "sweep", seeds=[1], num_cpus=2, overrides={"engine": "cohort"})
    assert sorted(n for n, _, error in done if not error) == sorted(n for n, _ in sweep.runs(seeds=[1]))
    direct = run_inprocess({**cfg, "engine": "per-client", "results-dir": str(tmp_path / "direct"),
                            "run-name": name, "progress": False})
    ours, ref = torch.load(tmp_path / "sweep" / name / "final_model.pt"), torch.load(direct / "final_model.pt")
    for k, v in ref.items():
        assert torch.allclose(ours[k], v, rtol=1e-4, atol=1e-6), k
    assert json.loads((tmp_path / "sweep" / name / "config.json").read_text())["engine-used"] in ("cohort",
                                                                                                   "per-client")
    assert run_sweep(sweep, tmp_path / "sweep", seeds=[1], num_cpus=2) == []


def test_an_interrupted_run_resumes_from_its_newest_checkpoint(tmp_path):
    sweep = PRESETS["smoke"]
    over = {"checkpoint-every": 1}
    run_sweep(sweep, tmp_path, seeds=[0], num_cpus=2, overrides=over)
    name = sweep.runs(seeds=[0])[0][0]
    first = torch.load(tmp_path / name / "final_model.pt")
    (tmp_path / name / "final_model.pt").unlink()  # as if stopped after round 2's checkpoint
    (tmp_path / name / "checkpoints" / "round-0003.pt").unlink()
    (done,) = run_sweep(sweep, tmp_path, seeds=[0], num_cpus=2, overrides=over)
    assert done[0] == name and not done[2]
    assert [r["round"] for r in read_metrics(tmp_path / name)] == [1, 2, 3]
    for k, v in first.items():
        assert torch.equal(torch.load(tmp_path / name / "final_model.pt")[k], v)


def test_seeds_are_separate_per_run_and_recorded():
    runs = dict(PRESETS["smoke"].runs(seeds=[3]))
    cfg = runs["sine__fedavg-all__s3"]
    assert cfg["train-seed"] == cfg["data-seed"] == cfg["schedule-seed"] == 3
    assert cfg["strategy"] == "fedavg-all"


def test_runs_come_seed_by_seed_so_a_stopped_sweep_holds_whole_seeds():
    names = [name for name, _ in PRESETS["smoke"].runs(seeds=[0, 1])]
    assert [name.rsplit("__", 1)[1] for name in names] == ["s0", "s0", "s1", "s1"]
