"""`python -m experiments.run`: checks before submitting, the run's real status as the exit code."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from flower_link import superlinks_of

from experiments.run import failure_paragraph, main, resolve_run_config, results_folder
from server_app.app import FAILED

SMALL = ("num-clients=4 num-server-rounds=2 local-steps='steps:n=2' checkpoint-every=0 "
         "availability='staircase:period=2,low=0.5'")


def test_an_unknown_key_is_refused_before_submitting_with_the_closest_key(tmp_path, capsys):
    code = main(["--run-config", f"num-round=5 results-dir='{tmp_path}'", "--flwr-home", str(tmp_path / "home")])
    err = capsys.readouterr().err
    assert code == 2
    assert "'num-round' (did you mean 'num-server-rounds'?)" in err
    assert not (tmp_path / "home").exists()  # flwr was never called
    assert not any(tmp_path.iterdir())


def test_a_supernode_count_other_than_num_clients_is_refused_naming_both(tmp_path, capsys):
    code = main(["--run-config", f"{SMALL} results-dir='{tmp_path}'", "--num-supernodes", "6"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--num-supernodes 6" in err and "num-clients=4" in err and "--num-supernodes 4" in err


def test_a_toml_mistake_in_run_config_is_an_error_not_a_traceback(capsys):
    assert main(["--run-config", "strategy=fedavg-all"]) == 2  # a string without quotes
    assert capsys.readouterr().err.startswith("error:")


def test_relative_paths_become_absolute_and_the_run_gets_a_name(tmp_path):
    cfg = resolve_run_config({"results-dir": "out", "data-dir": "~/data", "strategy": "fedau"}, cwd=tmp_path)
    assert cfg["results-dir"] == str(tmp_path / "out")
    assert cfg["data-dir"] == str(Path("~/data").expanduser())
    assert cfg["run-name"].endswith("-fedau-digits-s0")
    assert cfg["resume-from"] == "" and cfg["state-dir"] == ""  # empty stays empty


def test_the_failure_paragraph_is_ours_else_flowers_details_else_the_last_exception():
    ours = f"INFO : round 1\nERROR :   {FAILED} ConfigError: num-clients=4, pass num-supernodes=4\nTraceback ...\n"
    assert failure_paragraph(ours, "ignored") == "ConfigError: num-clients=4, pass num-supernodes=4"
    assert failure_paragraph("no marker", "ServerApp failed with exception: boom") == (
        "ServerApp failed with exception: boom")
    trace = "Traceback (most recent call last):\n  File x\nKeyError: 'arrays'\nINFO : bye\n"
    assert failure_paragraph(trace, "") == "KeyError: 'arrays'"


def test_the_results_folder_is_the_one_the_serverapp_reported():
    assert results_folder("round 2/2\nresults: /abs/results/run-a\nINFO :\n") == "/abs/results/run-a"


needs_flwr = pytest.mark.skipif(shutil.which("flwr") is None, reason="the flwr CLI is not on PATH")


def runner(tmp_path, *args):
    """The runner as a user runs it; its FLWR_HOME under tmp_path so its SuperLink can be found."""
    home = tmp_path / "flwr-home"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"}  # the runner sets it
    try:
        proc = subprocess.run([sys.executable, "-m", "experiments.run", "--flwr-home", str(home), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=500)
        assert superlinks_of(home) == []  # the runner stopped the SuperLink it started
        return proc
    finally:
        for pid in superlinks_of(home):
            os.kill(pid, 9)


@pytest.mark.slow
@needs_flwr
def test_a_completed_run_exits_0_and_prints_its_results_folder(tmp_path):
    results = tmp_path / "results"
    # every client online: SMALL's schedule has nobody online in rounds 1-2 for this seed, and a run in
    # which no update was applied is a failed run (server_app.experiment)
    online = SMALL.replace("availability='staircase:period=2,low=0.5'", "availability='always'")
    proc = runner(tmp_path, "--run-config", f"{online} results-dir='{results}' run-name='ok'")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "num-supernodes=4 (= num-clients" in out
    assert "round 2/2" in out  # progress was streamed
    assert f"finished:completed; results: {results / 'ok'}" in out
    assert (results / "ok" / "final_model.pt").is_file()
    assert "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO" not in out  # Ray's FutureWarning is silenced


@pytest.mark.slow
@needs_flwr
def test_a_failed_run_exits_1_with_the_serverapps_one_paragraph(tmp_path):
    results = tmp_path / "results"
    proc = runner(tmp_path, "--skip-checks", "--num-supernodes", "6",
                  "--run-config", f"{SMALL} results-dir='{results}' run-name='bad'")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ConfigError: 6 nodes are connected but the run config has num-clients=4")
    assert "num-supernodes=4" in error
    assert "finished:failed" in proc.stderr
    assert not (results / "bad").exists()


@pytest.mark.slow
@needs_flwr
def test_a_run_past_its_timeout_is_stopped_and_exits_1(tmp_path):
    endless = SMALL.replace("num-server-rounds=2", "num-server-rounds=500")
    proc = runner(tmp_path, "--timeout", "10", "--run-config", f"{endless} results-dir='{tmp_path / 'results'}'")
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    assert "not finished after 10 s: stopped" in proc.stderr
