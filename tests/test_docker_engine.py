"""DockerEngine (deploy/dockerengine.py) against real Docker engines: hosts that are network
namespaces on a private bridge, each with its own dockerd reached over tcp:// with mutual TLS
(tests/netns_hosts.py), the SuperNode image delivered to them by docker/push-images.sh.

Opt-in (the image costs minutes): FLCHURN_DOCKER_TESTS=1, as root, with dockerd on PATH and the
client image (FLCHURN_TEST_IMAGE, default flchurn-client:latest; build it with
``TARGET=client docker/build-local.sh``) on the engine FLCHURN_IMAGE_FROM (default the local
socket). FLCHURN_DOCKER_DATA=DIR keeps the test engines' data roots (and so the image) between
runs; everything else made is removed at the end, failure or not (checked).

  FLCHURN_DOCKER_TESTS=1 pytest -s tests/test_docker_engine.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from deploy.dockerapi import DockerAPI
from deploy.errors import DeployError
from deploy.hostengine import HostUnreachable, NodeLaunch
from deploy.hosts import HostSpec

ROOT = Path(__file__).resolve().parents[1]
IMAGE = os.environ.get("FLCHURN_TEST_IMAGE", "flchurn-client:latest")
SOURCE = os.environ.get("FLCHURN_IMAGE_FROM", os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"))
NODE_ID = re.compile(r"SuperNode ID: (\d+)|node[ _-]id[\"':= ]+(\d+)", re.I)


def _why_not() -> str | None:
    if os.environ.get("FLCHURN_DOCKER_TESTS") != "1":
        return "opt-in: FLCHURN_DOCKER_TESTS=1 (real Docker engines in network namespaces, minutes)"
    if os.geteuid() != 0:
        return "needs root (network namespaces, dockerd)"
    for exe in ("dockerd", "docker", "nsenter", "ip"):
        if shutil.which(exe) is None:
            return f"needs {exe} on PATH (apt-get install docker.io)"
    if DockerAPI(SOURCE, timeout=5).ping(5) is not None:
        return f"no Docker engine at {SOURCE} to take the image from (FLCHURN_IMAGE_FROM)"
    status, _ = DockerAPI(SOURCE).request("GET", f"/images/{IMAGE}/json")
    if status != 200:
        return f"{SOURCE} has no {IMAGE}: TARGET=client docker/build-local.sh"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=str(_why_not()))


def say(line: str) -> None:
    print(f"[docker-engine] {line}", flush=True)


@pytest.fixture(scope="module")
def hosts():
    from tests.netns_hosts import DockerHosts

    made = DockerHosts(["h1", "h2", "h3"], log=say)
    try:
        made.up()
        missing = [h for h in made.hosts.values()
                   if DockerAPI(h.socket).request("GET", f"/images/{IMAGE}/json")[0] != 200]
        if missing:
            t0 = time.monotonic()
            res = subprocess.run([str(ROOT / "docker" / "push-images.sh"), "--from", SOURCE, "--image", IMAGE,
                                  *[f"{h.tcp}={h.tls_dir}" for h in missing]], capture_output=True, text=True,
                                 timeout=1800)
            say(res.stdout.strip())
            assert res.returncode == 0, res.stderr
            say(f"image delivered to {len(missing)} engine(s) in {time.monotonic() - t0:.1f} s")
        yield made
    finally:
        made.close()
        left = made.leftovers()
        assert not left, f"left behind: {left}"


@pytest.fixture(scope="module")
def superlink(hosts, tmp_path_factory):
    """A SuperLink with TLS and SuperNode authentication on the bridge (not loopback), 4 keys registered."""
    certs = tmp_path_factory.mktemp("certs")
    subprocess.run([str(ROOT / "docker" / "gen-certs.sh"), str(certs), "4"], check=True, capture_output=True,
                   env={**os.environ, "SAN_EXTRA": f"IP:{hosts.bridge_ip}"})
    port = 9392
    home = tmp_path_factory.mktemp("superlink")
    log = open(home / "superlink.log", "wb")  # noqa: SIM115
    exe = Path(os.environ.get("VIRTUAL_ENV", Path(shutil.which("flwr") or "python").parent.parent))
    proc = subprocess.Popen([
        str(exe / "bin" / "python"), "-m", "deploy.tuning", "superlink", "--ssl-ca-certfile", str(certs / "ca.crt"),
        "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"),
        "--enable-supernode-auth", "--disable-runtime-dependency-installation", "--host", hosts.bridge_ip,
        "--port", str(port)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "FLWR_HOME": str(home)},
        start_new_session=True)
    log.close()
    try:
        (home / "config.toml").write_text(f'[superlink]\ndefault = "t"\n[superlink.t]\naddress = "{hosts.bridge_ip}:{port}"\n'
                                          f'root-certificates = "{certs / "ca.crt"}"\n')
        ids = {}
        deadline = time.monotonic() + 120
        for i in range(4):
            while True:
                res = subprocess.run(["flwr", "supernode", "register", str(certs / "keys" / f"node-{i}.pub"), "t",
                                      "--format", "json"], capture_output=True, text=True, env={**os.environ, "FLWR_HOME": str(home)})
                if res.returncode == 0 and '"success": true' in res.stdout:
                    ids[i] = int(json.loads(res.stdout)["node-id"])
                    break
                assert time.monotonic() < deadline, f"registration failed: {res.stdout} {res.stderr}"
                time.sleep(1)
        yield {"address": f"{hosts.bridge_ip}:{port}", "certs": certs, "ids": ids, "log": home / "superlink.log"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def engine(hosts, name: str, url: str | None = None, image: str = IMAGE, timeout: float = 5.0):
    from deploy.dockerengine import DockerEngine

    h = hosts.hosts[name]
    spec = HostSpec(name=name, engine="docker", clients=(0, 1, 2, 3), address=h.address, docker=url or h.tcp,
                    tls_dir=h.tls_dir if (url or h.tcp).startswith("tcp") else None, image=image)
    return DockerEngine(spec, f"t{uuid.uuid4().hex[:8]}", log=say, timeout=timeout)


def launch(link, i: int, port: int = 9094) -> NodeLaunch:
    return NodeLaunch(client=i, name=f"flchurn-test-{uuid.uuid4().hex[:6]}-node-{i}", superlink=link["address"],
                      ca_cert=(link["certs"] / "ca.crt").read_bytes(),
                      private_key=(link["certs"] / "keys" / f"node-{i}").read_bytes(),
                      node_config={"partition-id": i, "num-partitions": 4, "state-dir": "/state"}, runtime_port=port)


def node_id(eng, i: int, timeout: float = 400.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in NODE_ID.finditer(eng.logs(i)):
            return int(m[1] or m[2])
        time.sleep(0.5)
    raise AssertionError(f"client {i}: no node id in its log within {timeout:.0f} s:\n{eng.logs(i)[-2000:]}")


def test_an_engine_starts_stops_kills_and_removes_supernode_containers(hosts, superlink):
    eng = engine(hosts, "h1")
    assert eng.reachable() is None
    first = launch(superlink, 0)
    t0 = time.monotonic()
    eng.start(first)
    starts = [time.monotonic() - t0]
    assert eng.state(0) == "running" and eng.running() == {0}
    nid = node_id(eng, 0)
    assert nid == superlink["ids"][0]  # its key's id, given at registration
    at1 = eng.started_at(0)
    stops, kills = [], []
    for cycle in range(3):
        t0 = time.monotonic()
        code = eng.stop(0, grace=30)
        stops.append(time.monotonic() - t0)
        assert code == 0, eng.logs(0)[-2000:]  # SIGTERM reached the SuperNode (init): a clean exit
        assert eng.state(0) == "exited" and eng.running() == set() and eng.exit_code(0) == 0
        assert eng.stop(0, grace=30) is None  # not running: nothing to stop
        t0 = time.monotonic()
        eng.start(first)
        starts.append(time.monotonic() - t0)
        at2 = eng.started_at(0)
        assert at2 is not None and at2 > at1, (at1, at2)  # the engine's clock: a new incarnation
        at1 = at2
        assert node_id(eng, 0) == nid  # the same key, the same id across restarts
        assert len(NODE_ID.findall(eng.logs(0))) == 1  # logs of the current start only
        if cycle < 2:
            continue
        t0 = time.monotonic()
        assert eng.kill(0) == 137  # SIGKILL: a crash
        kills.append(time.monotonic() - t0)
        assert eng.state(0) == "exited"
    # a second client on the same host needs its own runtime port (the host's network)
    with pytest.raises(DeployError, match="runtime port 9094"):
        eng.start(launch(superlink, 1, port=9094))
    eng.start(launch(superlink, 1, port=9095))
    assert node_id(eng, 1) == superlink["ids"][1]
    eng.signal(1, signal.SIGTERM)  # every leaving node at once, then stop waits (no second SIGTERM)
    assert eng.stop(1, grace=30) == 0
    eng.start(launch(superlink, 1, port=9095))
    node_id(eng, 1)
    eng.signal(1, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while eng.state(1) == "running":  # it is down before the driver's stop comes
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert eng.stop(1, grace=30) == 0  # that exit is the stop's
    assert eng.stop(1, grace=30) is None  # and nothing more to stop
    say(f"h1 (tcp, TLS): start {_fig(starts)}, stop {_fig(stops)}, kill {_fig(kills)}")
    eng.close()
    assert eng.state(0) == "absent" and eng.state(1) == "absent"
    api = DockerAPI(hosts.hosts["h1"].socket)
    assert [c["Names"] for c in api.json("GET", "/containers/json?all=1")] == []
    eng.close()  # idempotent


def test_a_launch_that_changed_recreates_the_container_and_an_unknown_one_is_never_touched(hosts, superlink):
    eng = engine(hosts, "h2", url=hosts.hosts["h2"].socket)  # unix:// of the same engine
    try:
        a = launch(superlink, 2)
        eng.start(a)
        node_id(eng, 2)
        eng.stop(2, grace=30)
        created = eng._inspect(2)["Created"]
        eng.start(a)  # the same launch: docker start of the same container
        assert eng._inspect(2)["Created"] == created
        eng.stop(2, grace=30)
        b = NodeLaunch(**{**a.__dict__, "node_config": {**a.node_config, "report-timing": True}})
        eng.start(b)  # a changed launch: a new container of that name
        assert eng._inspect(2)["Created"] != created
        assert "report-timing=true" in " ".join(eng._inspect(2)["Config"]["Cmd"])
        other = engine(hosts, "h2", url=hosts.hosts["h2"].socket)  # another deployment's tag
        with pytest.raises(DeployError, match="did not make"):
            other.start(b)
        assert eng.state(2) == "running"
    finally:
        eng.close()


def test_a_host_whose_link_is_down_is_unreachable_by_name_then_back(hosts, superlink):
    eng = engine(hosts, "h3", timeout=3.0)
    try:
        eng.start(launch(superlink, 3))
        node_id(eng, 3)
        hosts.link("h3", False)
        try:
            assert "no answer within" in (eng.reachable(2.0) or "")
            with pytest.raises(HostUnreachable, match="host h3 unreachable: its Docker engine tcp://"):
                eng.running()
            t0 = time.monotonic()
            with pytest.raises(HostUnreachable):
                eng.stop(3, grace=10)
            assert time.monotonic() - t0 < 15  # bounded by the engine's timeout
        finally:
            hosts.link("h3", True)
        deadline = time.monotonic() + 30
        while eng.reachable(2.0) is not None:
            assert time.monotonic() < deadline, "h3 did not come back"
        assert eng.running() == {3}  # the container lived on; the engine answers again
        assert eng.stop(3, grace=30) == 0
    finally:
        eng.close()


def test_an_image_missing_on_the_host_is_named_with_the_way_to_send_it(hosts, superlink):
    eng = engine(hosts, "h2", image="flchurn-not-there:0")
    assert not eng.image_present()
    with pytest.raises(DeployError, match=r"image flchurn-not-there:0 is not on its engine .*push-images\.sh"):
        eng.start(launch(superlink, 0))
    eng.close()


def test_an_engine_without_the_right_client_certificate_is_refused(hosts, tmp_path):
    from tests.netns_hosts import engine_certs

    engine_certs(tmp_path, {"x": hosts.hosts["h1"].address})  # another CA: the engine refuses us
    api = DockerAPI(hosts.hosts["h1"].tcp, tmp_path / "client", timeout=5)
    assert "TLS" in (api.ping(5) or "") or "reset" in (api.ping(5) or "")



@pytest.fixture
def sshd(hosts, tmp_path, monkeypatch):
    """sshd in host h1's namespace (key login as root; the session's DOCKER_HOST is h1's engine)
    and an ssh_config for it (FLCHURN_SSH_CONFIG)."""
    if shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists():
        pytest.skip("no sshd (apt-get install openssh-server)")
    h = hosts.hosts["h1"]
    for key in ("host", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / key)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "id.pub").read_text())
    (tmp_path / "sshd_config").write_text(
        f"ListenAddress {h.address}\nPort 22\nHostKey {tmp_path / 'host'}\nPidFile {tmp_path / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
        f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\nUsePAM no\n"
        f"SetEnv DOCKER_HOST={h.socket}\n")
    (tmp_path / "ssh_config").write_text(
        f"Host {h.address}\n  IdentityFile {tmp_path / 'id'}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {tmp_path / 'known_hosts'}\n  StrictHostKeyChecking accept-new\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen(["nsenter", f"--net=/var/run/netns/{h.ns}", "/usr/sbin/sshd", "-D", "-e", "-f",
                             str(tmp_path / "sshd_config")], stderr=open(tmp_path / "sshd.log", "wb"),  # noqa: SIM115
                            start_new_session=True)
    monkeypatch.setenv("FLCHURN_SSH_CONFIG", str(tmp_path / "ssh_config"))
    try:
        time.sleep(1)
        yield f"ssh://root@{h.address}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)


def test_an_engine_over_ssh_dial_stdio(hosts, superlink, sshd):
    eng = engine(hosts, "h1", url=sshd, timeout=15.0)
    try:
        assert eng.reachable(10.0) is None
        t0 = time.monotonic()
        eng.start(launch(superlink, 3))  # a key whose last node stopped cleanly (a SIGKILLed one waits ~60 s)
        start = time.monotonic() - t0
        assert node_id(eng, 3) == superlink["ids"][3]
        t0 = time.monotonic()
        assert eng.stop(3, grace=30) == 0
        say(f"h1 over ssh: start {start:.2f} s, stop {time.monotonic() - t0:.2f} s")
        t0 = time.monotonic()
        for _ in range(5):
            eng.running()
        say(f"h1 over ssh: a request {(time.monotonic() - t0) / 5 * 1000:.0f} ms (one master connection)")
    finally:
        eng.close()
    from deploy.dockerengine import DockerEngine

    bad = DockerEngine(HostSpec(name="h9", engine="docker", clients=(0,), docker="ssh://root@127.0.0.9:1"), "t",
                       log=say, timeout=3.0)
    why = bad.reachable(3.0) or ""
    assert "ssh exited 255" in why, why  # ssh's own word, in the reason
    with pytest.raises(HostUnreachable, match="host h9 unreachable: .*ssh exited 255"):
        bad.close()  # what it made there cannot be removed: said, not skipped

def _fig(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} s (n={len(xs)}, {min(xs):.2f}-{max(xs):.2f})" if xs else "-"


# ---------------------------------------------------------------------------- the full run (MultiHostSite)
N, R, CUT_HOST, CUT_ROUND, SLOW_HOST, RTT_MS = 6, 5, "h2", 3, "h3", 4000.0
SPEC = "group-cyclic:groups=2,window=1"  # clients 0-2 on in odd rounds, 3-5 in even ones
PLACEMENT = {"h1": [0, 3], "h2": [1, 4], "h3": [2, 5]}  # every host has a client on in every round


def _rounds(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    return sum(1 for line in metrics.read_text().splitlines() if '"round"' in line) if metrics.exists() else 0


def _cut_one_round(hosts, run_dir: Path, lines: list[str], done) -> None:
    """Host CUT_HOST's veth down as round CUT_ROUND starts, up when its line appears."""
    cut = False
    while not done.is_set():
        n = _rounds(run_dir)
        if not cut and n >= CUT_ROUND - 1:
            hosts.link(CUT_HOST, False)
            lines.append(f"TEST: cut host {CUT_HOST} after {n} rounds")
            cut = True
        if cut and n >= CUT_ROUND:
            hosts.link(CUT_HOST, True)
            lines.append(f"TEST: mended host {CUT_HOST} after {n} rounds")
            return
        time.sleep(0.05)


@pytest.fixture(scope="module")
def docker_run(hosts, tmp_path_factory):
    """6 clients on the 3 namespaced engines under group-cyclic, through deploy.multihost."""
    import threading

    from deploy.edge.relay import Impairment, argv as relay_argv
    from deploy.hosts import parse_hosts
    from deploy.multihost import MultiHostSite
    from deploy.procs import free_port
    from deploy.run import run_deployment
    from deploy.waits import host_slowdown

    tmp = tmp_path_factory.mktemp("dockerrun")
    port, relay_port = free_port(), free_port()
    doc = {"superlink": {"address": hosts.bridge_ip, "port": port},
           "hosts": {name: {"engine": "docker", "docker": hosts.hosts[name].tcp,
                            "tls-dir": str(hosts.hosts[name].tls_dir), "image": IMAGE, "state-dir": "/state",
                            "clients": cs} for name, cs in PLACEMENT.items()}}
    plan = parse_hosts(doc, num_clients=N)
    # the slow host: its SuperNodes' connections to the SuperLink go through the edge relay (added
    # RTT), by a DNAT rule inside its own namespace (gone with it)
    relay = subprocess.Popen(relay_argv((hosts.bridge_ip, relay_port), (hosts.bridge_ip, port),
                                        Impairment(RTT_MS, 0.0, 0)), cwd=ROOT, stdout=open(tmp / "relay.log", "wb"),  # noqa: SIM115
                             stderr=subprocess.STDOUT, start_new_session=True)
    hosts.nsexec(SLOW_HOST, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", hosts.bridge_ip,
                 "--dport", str(port), "-j", "DNAT", "--to-destination", f"{hosts.bridge_ip}:{relay_port}")
    slow = host_slowdown()
    config = {"num-server-rounds": R, "strategy": "fedavg-active", "availability": SPEC, "schedule-seed": 0,
              "dataset": "digits", "model": "logreg", "local-steps": "steps:n=2", "partition": "iid",
              "round-timeout": round(90.0 * slow), "wait-for-nodes": round(180.0 * slow), "checkpoint-every": 0,
              "device": "cpu", "results-dir": str(tmp / "results"), "run-name": "docker-hosts", "progress": False}
    lines: list[str] = []
    done = threading.Event()
    site = MultiHostSite(plan, tmp / "work", log=lambda line: (lines.append(line), say(line)))
    result: dict = {"log": lines, "site": site}
    try:
        site.start_superlink()
        cutter = threading.Thread(target=_cut_one_round, args=(hosts, tmp / "results" / "docker-hosts", lines, done),
                                  daemon=True)
        cutter.start()
        t0 = time.monotonic()
        out = run_deployment(site, config, churn="rounds", churn_mode="term", timeout=2400)
        result.update(out=out, wall=time.monotonic() - t0, incarnations=dict(site.incarnations),
                      switch=site.switch_summary(), node_ids={i: list(v) for i, v in site.node_ids.items()})
        # before the engines are closed: the containers of the last round's off clients, on their own engine
        result["states"] = {i: (site.engines[plan.host_of_client[i]].state(i),  # type: ignore[attr-defined]
                                site.engines[plan.host_of_client[i]].exit_code(i)) for i in range(N)}  # type: ignore[attr-defined]
    finally:
        done.set()
        site.close()
        relay.terminate()
        relay.wait(timeout=30)
        hosts.nsexec(SLOW_HOST, "iptables", "-t", "nat", "-F", "OUTPUT", check=False)
        result["relay_log"] = (tmp / "relay.log").read_text()
    result["containers_after_close"] = {n: DockerAPI(h.socket).json("GET", "/containers/json?all=1")
                                        for n, h in hosts.hosts.items()}
    out = result["out"]
    say(out.report.summary() if out.report else "no report")
    say(f"run {result['wall']:.1f} s; participants per round {[row['participants'] for row in out.rows]}")
    say("reply times " + str([row.get("client-reply-time") for row in out.rows]))
    say("\n".join(line for line in lines if "unreachable" in line or "reachable again" in line or "TEST" in line))
    say(result["switch"])
    return result


def test_the_docker_run_follows_the_schedule_with_the_cut_round_explained(docker_run):
    from tests.multihost_hosts import assert_rows_follow

    out = docker_run["out"]
    assert out.ok, f"status {out.status}; report {out.report and out.report.failure_text()}"
    assert len(out.rows) == R
    explained = out.driver.explained()
    want = assert_rows_follow(out.rows, SPEC, N, explained)
    assert any(f"host {CUT_HOST} unreachable" in line for line in docker_run["log"])
    cut_clients = {c for c in PLACEMENT[CUT_HOST] if want[CUT_ROUND - 1, c]}
    missed = cut_clients - set(out.rows[CUT_ROUND - 1]["participants"])
    assert missed, f"{cut_clients} took part in the cut round: the link was not cut in time"
    for c in missed:
        assert f"host {CUT_HOST} unreachable" in explained[CUT_ROUND, c], explained
    later = {c for row in out.rows[CUT_ROUND:] for c in row["participants"]}
    assert set(PLACEMENT[CUT_HOST]) & later, out.rows


def test_the_off_containers_exited_on_their_engines_and_ids_are_the_keys(docker_run):
    from availability import build_schedule

    want = build_schedule(SPEC, N, 0).matrix(R).astype(bool)
    for i, (state, code) in docker_run["states"].items():
        if not want[R - 1, i]:  # off in the last round: stopped by its engine, a clean exit
            assert (state, code) == ("exited", 0), (i, state, code)
    assert all(n >= 2 for n in docker_run["incarnations"].values()), docker_run["incarnations"]
    assert all(len(ids) == 1 for ids in docker_run["node_ids"].values()), docker_run["node_ids"]
    assert all(cs == [] for cs in docker_run["containers_after_close"].values())


def test_the_relayed_host_replies_later(docker_run):
    """In each round, the relayed host's client against the median of the other hosts' clients."""
    assert "connection 0 closed" in docker_run["relay_log"]  # its SuperNodes' traffic went through the relay
    lags = []
    for row in docker_run["out"].rows:
        times = {int(c): s for c, s in (row.get("client-reply-time") or {}).items()}
        slow = [s for c, s in times.items() if c in PLACEMENT[SLOW_HOST]]
        fast = [s for c, s in times.items() if c not in PLACEMENT[SLOW_HOST]]
        if slow and fast:
            lags.append(slow[0] - statistics.median(fast))
    say(f"relayed host's reply time minus the others' median, per round: {[round(x, 1) for x in lags]} s "
        f"(added RTT {RTT_MS / 1000:g} s)")
    assert len(lags) >= 3 and statistics.median(lags) > RTT_MS / 1000, lags
