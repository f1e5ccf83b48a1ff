"""A returning node is warm (issue 40, item 6): its SuperNode command starts the client worker at
once, from the app the node installed when it first took part, with the run's workload built, and
the node's ClientApp reaches that worker (the same address) instead of starting its own."""

from __future__ import annotations

import json
import os
import sys

import pytest

from client_app.worker import NodeWorker
from deploy.warmstart import start_warm_worker
from tests.conftest import ROOT
from tests.test_worker import RUN_CONFIG, context, message, reaped, wait_until, worker_pids

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker needs Linux")


@linux_only
def test_a_warm_worker_is_the_one_the_clientapp_reaches_with_its_workload_built(tmp_path, monkeypatch, capfd):
    apps = tmp_path / "flwr-home" / "apps"
    apps.mkdir(parents=True)
    (apps / "flchurn.flchurn.0.1.0.abcdef12").symlink_to(ROOT)  # what Flower installed for this node
    cfg = tmp_path / "warm.json"
    cfg.write_text(json.dumps(RUN_CONFIG))
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = start_warm_worker(str(cfg))  # this process plays the SuperNode
    assert proc is not None
    try:
        assert wait_until(lambda: "warm, the run's workload built" in capfd.readouterr().err, timeout=120)
        reply = NodeWorker(os.getpid()).call(message(1), context(worker=True, state_dir=tmp_path / "state"))
        assert not reply.has_error()
        assert worker_pids(os.getpid()) == [proc.pid]  # the ClientApp reached the warm one, started no other
    finally:
        proc.kill()
        assert reaped(proc.pid)


def test_a_node_without_an_installed_app_gets_no_warm_worker(tmp_path, monkeypatch):
    """Its first start in a run: nothing installed yet, its first message starts the worker."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "empty-home"))
    assert start_warm_worker(str(tmp_path / "warm.json")) is None


def test_a_node_that_never_took_part_gets_the_superlinks_installed_app_whole_and_keeps_its_own(tmp_path):
    from deploy.warmstart import installed_apps, share_installed_app

    superlink = tmp_path / "superlink" / "apps" / "flchurn.flchurn.0.1.0.abcdef12"
    (superlink / "client_app").mkdir(parents=True)
    (superlink / "client_app" / "worker_process.py").write_text("# the app\n")
    (superlink / "pyproject.toml").write_text("[project]\n")
    newcomer = tmp_path / "node-1"
    share_installed_app(newcomer, tmp_path / "nobody")  # no source yet: nothing
    assert installed_apps(newcomer) == []
    share_installed_app(newcomer, tmp_path / "superlink")
    (copy,) = installed_apps(newcomer)
    assert copy.name == superlink.name and (copy / "client_app" / "worker_process.py").read_text() == "# the app\n"
    assert (copy / "pyproject.toml").is_file() and sorted(p.name for p in (newcomer / "apps").iterdir()) == [copy.name]
    (copy / "own").write_text("kept")
    share_installed_app(newcomer, tmp_path / "superlink")  # it has one now: left as it is
    assert installed_apps(newcomer) == [copy] and (copy / "own").is_file()
    racing = tmp_path / "node-2"  # Flower's own install began first (a folder, half-written): kept, no copy
    (racing / "apps" / superlink.name).mkdir(parents=True)
    (racing / "apps" / superlink.name / "half").write_text("")
    share_installed_app(racing, tmp_path / "superlink")
    assert [p.name for p in (racing / "apps").iterdir()] == [superlink.name]
    assert not (racing / "apps" / superlink.name / "pyproject.toml").exists()


def test_a_digits_worker_after_the_first_skips_scikit_learn_and_gets_the_same_split(tmp_path, monkeypatch):
    """A returning node's worker rebuilds the workload; importing scikit-learn (scipy) was most of
    that build for digits. The seeded split is cached: a later build in a fresh process (as a
    worker is) imports no scikit-learn and gets the same arrays; a corrupt cache is split again."""
    import subprocess

    import numpy as np

    from workloads.data import _load_digits

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = _load_digits(None, False, 3)  # split by scikit-learn, cached
    code = ("import sys, numpy as np; from workloads.data import _load_digits; "
            "np.savez(sys.argv[1], *_load_digits(None, False, 3)); print('sklearn' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", code, str(tmp_path / "later.npz")], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300, check=True)
    with np.load(tmp_path / "later.npz") as z:
        later = [z[f"arr_{i}"] for i in range(4)]
    (cached,) = (tmp_path / "flchurn").glob("digits-*-s3.npz")
    cached.write_bytes(b"not a zip")
    again = _load_digits(None, False, 3)  # split again
    assert run.stdout.split()[-1] == "False"  # no scikit-learn in the later worker
    assert all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(first, later, again, strict=True))
    assert [len(a) for a in first] == [1437, 1437, 360, 360]
    assert not np.array_equal(first[1], _load_digits(None, False, 4)[1])  # another seed, another split
