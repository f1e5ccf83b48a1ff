"""A returning node is warm (issue 40, item 6): its SuperNode command starts the client worker at
once, from the app the node installed when it first took part, with the run's workload built, and
the node's ClientApp reaches that worker (the same address) instead of starting its own."""

from __future__ import annotations

import json
import os
import sys

import pytest

from client_app.worker import NodeWorker
from deploy.tuning import start_warm_worker
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


def test_a_node_that_never_took_part_gets_its_siblings_installed_app_and_keeps_its_own(tmp_path):
    from deploy.tuning import installed_apps, share_installed_app

    sibling = tmp_path / "node-0" / "apps" / "flchurn.flchurn.0.1.0.abcdef12"
    (sibling / "client_app").mkdir(parents=True)
    (sibling / "client_app" / "worker_process.py").write_text("# the app\n")
    newcomer = tmp_path / "node-1"
    share_installed_app(newcomer, [tmp_path / "node-0", tmp_path / "node-2"])  # node-2: no home yet
    (copy,) = installed_apps(newcomer)
    assert copy.name == sibling.name and (copy / "client_app" / "worker_process.py").read_text() == "# the app\n"
    (copy / "own").write_text("kept")
    share_installed_app(newcomer, [tmp_path / "node-0"])  # it has one now: left as it is
    assert installed_apps(newcomer) == [copy] and (copy / "own").is_file()
