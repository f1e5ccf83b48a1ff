"""The thin ClientApp over a per-SuperNode worker (client_app.worker) and the fast reply pull
(server_app.network.PollingGrid). Worker tests start real processes (Linux only)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid

from client_app.app import app
from client_app.worker import SWITCH, NodeWorker, WorkerError, address, start_time, supernode_of
from client_app.worker_process import serve
from experiments.inprocess import default_run_config
from runconfig import ConfigError, WorkloadConfig, from_run_config
from server_app.network import PollingGrid, fast_pull
from strategies.protocol import CLIENT_RULE, FEDAWE_RUN_KEY, FEDAWE_SERVER_LR
from workloads.workload import get_workload

ROOT = Path(__file__).resolve().parent.parent
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the worker needs Linux")
RUN_CONFIG = {**default_run_config(), "num-clients": 4, "model": "logreg", "local-steps": "steps:n=3",
              "device": "cpu"}


def context(pid=1, worker=False, state_dir=None):
    node = {"partition-id": pid, "num-partitions": 4, SWITCH: worker}
    if state_dir:
        node["state-dir"] = str(state_dir)
    return Context(run_id=7, node_id=50 + pid, state=RecordDict(), run_config=dict(RUN_CONFIG), node_config=node)


def message(rnd, message_type=MessageType.TRAIN, **config):
    arrays = ArrayRecord(get_workload(from_run_config(WorkloadConfig, RUN_CONFIG)).new_model().state_dict())
    msg = Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": rnd, **config})}),
                  dst_node_id=51, message_type=message_type)
    msg.metadata.__dict__["_message_id"] = f"m{rnd}"
    return msg


def same_records(a: RecordDict, b: RecordDict) -> None:
    assert set(a.keys()) == set(b.keys())
    for name, record in a.items():
        other = b[name]
        if isinstance(record, ArrayRecord):
            assert list(record.keys()) == list(other.keys())
            for x, y in zip(record.to_numpy_ndarrays(), other.to_numpy_ndarrays(), strict=True):
                np.testing.assert_array_equal(x, y)
        else:
            assert dict(record) == dict(other)


def same_content(a: Message, b: Message) -> None:
    assert a.has_error() == b.has_error()
    assert a.metadata.reply_to_message_id == b.metadata.reply_to_message_id
    assert a.metadata.message_type == b.metadata.message_type
    same_records(a.content, b.content)


@pytest.fixture
def supernode():
    """A stand-in SuperNode process: the worker only watches its pid."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def worker_pids(supernode_pid):
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"client_app.worker_process" in argv and str(supernode_pid).encode() in argv:
                try:
                    if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(int(entry.name))
                except OSError:
                    pass
    return out


def reaped(pid, timeout=10.0):
    """True once our child ``pid`` has exited and been reaped (its sockets are closed by then)."""
    return wait_until(lambda: os.waitpid(pid, os.WNOHANG)[0] == pid, timeout)


def wait_until(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@linux_only
def test_thin_app_gives_the_direct_handlers_reply_and_state(supernode, tmp_path):
    """Same message, same numbers; FedAWE's client-held state comes back in context.state."""
    node = NodeWorker(supernode.pid)
    fedawe = {CLIENT_RULE: "fedawe", FEDAWE_RUN_KEY: "k1", FEDAWE_SERVER_LR: 1.0}
    direct_ctx, thin_ctx = context(), context(worker=True, state_dir=tmp_path / "thin")
    direct_ctx.node_config["state-dir"] = str(tmp_path / "direct")
    for msg in (message(1), message(2, MessageType.EVALUATE), message(3, **fedawe),
                message(3, "train.adopt", **fedawe), message(5, **fedawe)):
        direct = app(msg, direct_ctx)
        thin = node.call(msg, thin_ctx)
        same_content(direct, thin)
        assert not thin.has_error() and thin.metadata.src_node_id == 51
    assert len(direct_ctx.state.keys()) > 0
    same_records(direct_ctx.state, thin_ctx.state)
    # the worker wrote the client's copy to the state dir, like the direct handler did
    assert [p.name for p in (tmp_path / "thin" / "client-1").iterdir()] == ["fedawe-k1.pt"]


@linux_only
def test_a_handler_error_is_raised_in_the_client_app_and_the_worker_lives_on(supernode):
    node = NodeWorker(supernode.pid)
    bad = context(worker=True)
    bad.node_config["num-partitions"] = 3  # != num-clients: the handler raises ConfigError
    with pytest.raises(ConfigError, match="num-partitions=3"):
        node.call(message(1), bad)
    [pid] = worker_pids(supernode.pid)
    same_content(app(message(1), context()), node.call(message(1), context(worker=True)))
    assert worker_pids(supernode.pid) == [pid]


@linux_only
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_worker_exits_when_its_supernode_dies(supernode, sig):
    node = NodeWorker(supernode.pid)
    node.connect().close()  # starts it (as our child here; under a SuperNode, the ClientApp's)
    assert wait_until(lambda: len(worker_pids(supernode.pid)) == 1)
    [pid] = worker_pids(supernode.pid)
    supernode.send_signal(sig)
    supernode.wait()
    assert reaped(pid), "worker outlived its SuperNode"
    assert node._try_connect() is None  # nobody answers at that address any more


@linux_only
def test_a_killed_worker_is_replaced_at_the_next_message(supernode):
    node = NodeWorker(supernode.pid)
    first = node.call(message(1), context(worker=True))
    [pid] = worker_pids(supernode.pid)
    os.kill(pid, signal.SIGKILL)
    assert reaped(pid)
    same_content(first, node.call(message(1), context(worker=True)))
    assert len(worker_pids(supernode.pid)) == 1


@linux_only
def test_worker_of_a_reused_pid_never_serves(supernode):
    """A pid whose start time differs is another process: no worker listens for it."""
    started = start_time(supernode.pid)
    assert serve(supernode.pid, started + 1) == 0  # returns at once, binds nothing
    assert NodeWorker(supernode.pid)._try_connect() is None
    assert address(supernode.pid, started) != address(supernode.pid, started + 1)


@linux_only
def test_the_supernode_is_found_through_flowers_parent_pid_chain(supernode):
    """SuperNode -> ``flower-superexec --parent-pid SUPERNODE`` -> ``flwr-clientapp --parent-pid SUPEREXEC``."""
    superexec = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "--parent-pid",
                                  str(supernode.pid)])
    try:
        client = subprocess.run(
            [sys.executable, "-c", "import os; from client_app.worker import supernode_of; print(supernode_of(os.getpid()))",
             "--parent-pid", str(superexec.pid)], cwd=ROOT, capture_output=True, text=True, check=True)
    finally:
        superexec.kill()
        superexec.wait()
    assert client.stdout.strip() == str(supernode.pid)
    assert supernode_of(os.getpid()) is None  # pytest was not started by a SuperExec
    with pytest.raises(WorkerError, match="not started by a SuperNode's own SuperExec"):
        app(message(1), context(worker=True))


def test_switch_must_be_a_boolean():
    ctx = context()
    ctx.node_config[SWITCH] = "yes"
    with pytest.raises(ConfigError, match="client-worker='yes'"):
        app(message(1), ctx)


def test_the_client_app_module_does_not_import_torch():
    code = "import sys, client_app.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------- deploy.tuning.SUPERNODE
def test_nodes_sharing_a_host_split_its_cpus_into_compute_threads(monkeypatch, tmp_path):
    from deploy import tuning
    from deploy.local import ProcessSite

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    assert [tuning.host_share(n) for n in (1, 2, 3, 8, 20)] == [8, 4, 2, 1, 1]
    assert tuning.compute_threads_env(0) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                                             "OPENBLAS_NUM_THREADS": "1"}
    assert ProcessSite(4, tmp_path / "w").threads_env["OMP_NUM_THREADS"] == "2"  # what every node process gets


@pytest.mark.parametrize("after_s", [0.3, 6.0])
def test_a_supernode_stopped_while_it_starts_or_runs_exits_cleanly(tmp_path, after_s):
    """SIGTERM right after the start (before Flower's own handlers: a `docker stop` of a node
    that is off in round 1) and once it runs (Flower's graceful exit) both give exit 0, not 143."""
    from deploy.procs import free_port

    env = {**os.environ, "FLWR_HOME": str(tmp_path), "FLWR_TELEMETRY_ENABLED": "0"}
    log = tmp_path / "supernode.log"
    with log.open("w") as out:  # a file, not a pipe: Flower's SuperExec child may outlive the node
        proc = subprocess.Popen([sys.executable, "-m", "deploy.tuning", "supernode", "--insecure",
                                 "--superlink", "127.0.0.1:9", "--port", str(free_port())], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        time.sleep(after_s)
        assert proc.poll() is None, log.read_text()[-2000:]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        assert proc.returncode == 0, (proc.returncode, log.read_text()[-2000:])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the SuperExec it started, if still there


def test_supernode_command_caps_the_pull_loops_sleeps_and_flower_still_has_them(monkeypatch):
    import inspect
    import time as time_module

    from flwr.supernode import start_client_internal

    from deploy.tuning import IDLE_SLEEP, _CappedSleep

    # a tripwire for a Flower upgrade: the loop this patches still sleeps through `time.sleep`
    source = inspect.getsource(start_client_internal)
    assert "import time\n" in source and "time.sleep(3)" in source
    slept = []
    monkeypatch.setattr(time_module, "sleep", slept.append)
    capped = _CappedSleep(IDLE_SLEEP)
    capped.sleep(3)
    capped.sleep(IDLE_SLEEP / 2)
    assert slept == [IDLE_SLEEP, IDLE_SLEEP / 2]
    assert capped.monotonic is time_module.monotonic  # everything else is the time module's


# ---------------------------------------------------------------------- PollingGrid
class SlowGrid(Grid):
    """Replies become pullable ``delay[node]`` seconds after the push (None: never)."""

    def __init__(self, delay):
        self.delay, self.pushed, self.pulls = delay, {}, 0

    def push_messages(self, messages):
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"id{m.metadata.dst_node_id}"
            self.pushed[m.metadata.message_id] = (m, time.monotonic())
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        now, out = time.monotonic(), []
        for mid in list(message_ids):
            m, at = self.pushed[mid]
            d = self.delay[m.metadata.dst_node_id]
            if d is not None and now >= at + d:
                out.append(Message(RecordDict({"metrics": MetricRecord({"n": m.metadata.dst_node_id})}), reply_to=m))
        return out

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("PollingGrid must not use the slow loop")

    create_message = get_node_ids = set_run = run = None


def pushed_to(nodes):
    return [Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in nodes]


def test_polling_grid_returns_every_reply_once_as_soon_as_all_are_in():
    inner = SlowGrid({1: 0.0, 2: 0.15, 3: 0.3})
    t0 = time.monotonic()
    replies = PollingGrid(inner, interval=0.02).send_and_receive(pushed_to([1, 2, 3]), timeout=5)
    took = time.monotonic() - t0
    assert sorted(r.content["metrics"]["n"] for r in replies) == [1, 2, 3]
    assert took < 1.0 and inner.pulls >= 3  # it kept looking, and stopped once all were in


def test_polling_grid_stops_at_the_timeout_with_what_arrived():
    inner = SlowGrid({1: 0.0, 2: None})
    replies = PollingGrid(inner, interval=0.02).send_and_receive(pushed_to([1, 2]), timeout=0.2)
    assert [r.content["metrics"]["n"] for r in replies] == [1]


def test_polling_grid_rejects_a_bad_interval_and_fast_pull_leaves_other_grids_alone():
    with pytest.raises(ValueError, match="interval"):
        PollingGrid(SlowGrid({}), interval=0)
    other = SlowGrid({})
    assert fast_pull(other) is other


# ---------------------------------------------------------------------- a real deployment
@linux_only
@pytest.mark.slow
def test_deployed_run_through_workers_matches_in_process_and_workers_die_with_their_nodes(tmp_path):
    from deploy import tuning
    from deploy.local import ProcessSite
    from deploy.run import run_deployment
    from experiments.inprocess import run_inprocess
    from server_app.results import read_metrics

    n = 2
    cfg = {"num-clients": n, "num-server-rounds": 2, "strategy": "fedavg-all", "availability": "always",
           "dataset": "digits", "model": "logreg", "local-steps": "steps:n=2", "partition": "iid",
           "checkpoint-every": 0, "device": "cpu", "progress": False, "round-timeout": 60.0}
    worker_on = {i: dict(tuning.NODE_CONFIG) for i in range(n)}  # as the launcher merges it
    with ProcessSite(n, tmp_path / "dep", node_config_extra=worker_on) as dep:
        out = run_deployment(dep, {**cfg, "results-dir": str(tmp_path / "dep-results"), "run-name": "d"})
        assert out.ok, out.status
        supernodes = [dep.nodes[i].proc.popen.pid for i in range(n)]
        assert all(len(worker_pids(pid)) == 1 for pid in supernodes)  # one per node, it served both rounds
        os.kill(supernodes[0], signal.SIGKILL)  # the SuperNode alone, not its process group
        assert wait_until(lambda: not worker_pids(supernodes[0]), timeout=10), "worker outlived its SuperNode"
        assert len(worker_pids(supernodes[1])) == 1
    assert not worker_pids(supernodes[1])  # closing the deployment takes the workers too
    here = run_inprocess({**cfg, "results-dir": str(tmp_path / "inproc"), "run-name": "i"})
    for deployed, local in zip(read_metrics(out.run_dir), read_metrics(here), strict=True):
        for key in ("train-loss", "update-norm", "test-loss", "test-accuracy"):
            assert deployed[key] == pytest.approx(local[key], rel=1e-6), key
