"""Device classes for the compose stack (deploy/composedevices.py) and the in-container network
wrapper (deploy/edgenode.py): what they generate, without Docker or root."""

import shutil
import subprocess
import sys

import pytest
import yaml

from deploy.edge import edgenode
from deploy.edge.composedevices import compose_override, node_override
from deploy.edge.devices import parse_devices
from deploy.errors import DeployError

PLAN_DOC = {"board": {"count": 1, "cpus": 0.2, "mem_mb": 256, "up_kbps": 1000, "down_kbps": 2000,
                      "rtt_ms": 80, "loss": 0.01},
            "phone": {"clients": [2], "cpus": 1.5}}


def test_override_sets_each_limited_node_and_leaves_the_rest_alone():
    plan = parse_devices(PLAN_DOC, num_nodes=4)
    doc = yaml.safe_load(compose_override(plan))
    assert set(doc["services"]) == {"supernode-0", "supernode-2"}
    board = doc["services"]["supernode-0"]
    assert board["cpu_quota"] == 2000 and board["cpu_period"] == 10000 and board["cpus"] == 0  # 0.2 CPU
    assert board["mem_limit"] == "256m" and board["memswap_limit"] == "256m"
    assert board["stop_grace_period"] == "50s"  # 10 s at full speed, 5x longer at 0.2 CPU
    assert board["cap_add"] == ["NET_ADMIN"] and board["user"] == "root"
    assert board["entrypoint"] == ["python", "-m", "deploy.edge.edgenode"]
    env = board["environment"]
    assert env["FLCHURN_UP_KBPS"] == "1000" and env["FLCHURN_DOWN_KBPS"] == "2000"
    assert env["FLCHURN_RTT_MS"] == "80" and env["FLCHURN_LOSS"] == "0.01"
    assert env["FLCHURN_RUN_AS"] == "1000:1000" and env["OMP_NUM_THREADS"] == "1"
    # a CPU-only class: no capability, no root, no wrapper; threads = whole CPUs of the quota
    phone = doc["services"]["supernode-2"]
    assert phone["cpu_quota"] == 15000 and phone["environment"]["OMP_NUM_THREADS"] == "2"
    assert phone["stop_grace_period"] == "10s"
    assert "cap_add" not in phone and "user" not in phone and "entrypoint" not in phone
    assert node_override(plan, 1) == {} and node_override(plan, 3) == {}


def test_override_environment_reads_back_through_the_wrapper():
    plan = parse_devices(PLAN_DOC, num_nodes=4)
    env = yaml.safe_load(compose_override(plan))["services"]["supernode-0"]["environment"]
    assert edgenode.limits_from_env(env) == {"up_kbps": 1000, "down_kbps": 2000, "rtt_ms": 80, "loss": 0.01}


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_docker_compose_accepts_the_override(tmp_path):
    override = tmp_path / "devices.yml"
    override.write_text(compose_override(parse_devices(PLAN_DOC, num_nodes=4)))
    res = subprocess.run(["docker-compose", "-f", "docker/compose.yml", "-f", str(override), "config"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    merged = yaml.safe_load(res.stdout)["services"]
    assert merged["supernode-0"]["cap_add"] == ["NET_ADMIN"]
    assert merged["supernode-0"]["command"][:3] == ["python", "-m", "deploy.tuning"]  # the base command stays
    assert merged["supernode-1"].get("cap_add") is None
    assert merged["supernode-0"]["cpu_quota"] == 2000 and not merged["supernode-0"].get("cpus")


def test_cli_refuses_caps_beyond_the_host(tmp_path):
    devices = tmp_path / "d.toml"
    devices.write_text("[big]\ncount = 4\ncpus = 4096\n")
    res = subprocess.run([sys.executable, "-m", "deploy", "compose-devices", "--devices", str(devices),
                          "--num-nodes", "4"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "CPU caps add up to 16384" in res.stderr
    ok = subprocess.run([sys.executable, "-m", "deploy", "compose-devices", "--devices", str(devices),
                         "--num-nodes", "4", "--no-host-check"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "cpu_quota: 40960000" in ok.stdout


@pytest.mark.parametrize("env, problem", [({"FLCHURN_UP_KBPS": "fast"}, "not a number"),
                                          ({"FLCHURN_LOSS": "1.0"}, "out of range"),
                                          ({"FLCHURN_DOWN_KBPS": "0"}, "out of range"),
                                          ({"FLCHURN_RTT_MS": "-5"}, "out of range")])
def test_wrapper_rejects_bad_limits(env, problem):
    with pytest.raises(DeployError, match=problem):
        edgenode.limits_from_env(env)


def test_shape_commands_cap_both_directions():
    cmds = edgenode.shape_commands("eth0", 1000, 500)
    assert cmds[0][:6] == ["tc", "qdisc", "replace", "dev", "eth0", "root"] and "1000kbit" in cmds[0]
    assert ["ip", "link", "add", edgenode.IFB, "type", "ifb"] in cmds
    assert any("mirred" in c and "eth0" in c for c in cmds)  # ingress redirected to the IFB device
    assert cmds[-1][:5] == ["tc", "qdisc", "replace", "dev", edgenode.IFB] and "500kbit" in cmds[-1]
    assert edgenode.shape_commands("eth0", None, None) == []
    assert len(edgenode.shape_commands("eth0", 1000, None)) == 1


def test_superlink_argument_is_pointed_at_the_relay():
    argv = ["python", "-m", "deploy.tuning", "supernode", "--superlink", "superlink:8000", "--port", "9094"]
    assert edgenode.with_superlink(argv, "127.0.0.1:9099")[5] == "127.0.0.1:9099"
    assert edgenode.with_superlink(["x", "--superlink=a:1"], "127.0.0.1:9") == ["x", "--superlink=127.0.0.1:9"]
    with pytest.raises(DeployError, match="no --superlink"):
        edgenode.with_superlink(["flower-supernode", "--insecure"], "127.0.0.1:9")


def test_wrapper_without_limits_execs_the_command_unchanged():
    res = subprocess.run([sys.executable, "-m", "deploy.edge.edgenode", sys.executable, "-c", "print('ran')"],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert "no network limits" in res.stdout and res.stdout.rstrip().endswith("ran")


def test_wrapper_puts_a_relay_in_front_of_the_superlink(tmp_path):
    """rtt/loss: a relay on 127.0.0.1 is started before the exec and --superlink points at it; the
    command (which keeps the wrapper's PID) sees the relay as its own child and stops it here."""
    from deploy.procs import free_port
    port = free_port()
    script = (
        "import os, signal, socket, sys\n"
        "print('argv', sys.argv[1:])\n"
        f"socket.create_connection(('127.0.0.1', {port}), timeout=10).close()\n"
        "kids = open(f'/proc/self/task/{os.getpid()}/children').read().split()\n"
        "[os.kill(int(k), signal.SIGTERM) for k in kids]\n"
        "print('relays', len(kids))\n")
    env = {"PATH": "/usr/bin:/bin", "FLCHURN_RTT_MS": "40", "FLCHURN_RELAY_PORT": str(port)}
    res = subprocess.run([sys.executable, "-m", "deploy.edge.edgenode", sys.executable, "-c", script,
                          "--superlink", "superlink.invalid:8000"], capture_output=True, text=True, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert f"'--superlink', '127.0.0.1:{port}'" in res.stdout and "relays 1" in res.stdout
    assert "rtt_ms=40" in res.stdout
