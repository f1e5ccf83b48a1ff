"""Opt-in smoke test of the arm64 SuperNode root built by docker/build-arm64.sh (FLCHURN_ARM64_TESTS=1,
root, qemu-aarch64 binfmt). Runs inside the aarch64 root under emulation (chroot through
qemu-user-static, or `docker run --platform linux/arm64` when the image and an engine are there):
the machine is aarch64, flower-supernode starts, and one local training step of digits/logreg runs
offline. Emulation is ~8x slower than native: nothing here is timed."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("ARM64_CACHE", "/var/cache/flchurn-arm64")) / "rootfs"
IMAGE = os.environ.get("FLCHURN_ARM64_IMAGE", "flchurn-client:arm64")
ENV = ["PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root", "LANG=C.UTF-8",
       "FLWR_TELEMETRY_ENABLED=0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1"]
TRAIN = """
import torch
from runconfig import WorkloadConfig
from workloads.workload import get_workload
w = get_workload(WorkloadConfig(dataset="digits", model="logreg", num_clients=4, partition="iid",
                                local_steps="steps:n=1", device="cpu"))
model = w.new_model()
before = [p.detach().clone() for p in model.parameters()]
res = w.train_client(model, client=0, rnd=1)
moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(model.parameters(), before))
print("trained", res, "moved", moved)
assert moved > 0, "one SGD step left the model unchanged"
"""


def _why_skip() -> str | None:
    if os.environ.get("FLCHURN_ARM64_TESTS") != "1":
        return "opt-in: set FLCHURN_ARM64_TESTS=1 (needs root, qemu-aarch64 binfmt, docker/build-arm64.sh)"
    binfmt = Path("/proc/sys/fs/binfmt_misc")
    if not any("aarch64" in p.name for p in binfmt.glob("*")):
        return "no qemu-aarch64 binfmt handler (apt-get install qemu-user-static binfmt-support)"
    if os.geteuid() != 0:
        return "chroot into the arm64 root needs root"
    if not (ROOT / ".flchurn-deps-installed").exists():
        return f"no finished arm64 root at {ROOT} (marker .flchurn-deps-installed): run sudo docker/build-arm64.sh"
    return None


pytestmark = pytest.mark.skipif(_why_skip() is not None, reason=str(_why_skip()))


@pytest.fixture(scope="module")
def in_root():
    """Run a command in the arm64 root through chroot; /proc, /sys, /dev bound and always unbound."""
    binds = []
    try:
        for m in ("proc", "sys", "dev"):
            target = ROOT / m
            subprocess.run(["mount", "--bind", f"/{m}", str(target)], check=True)
            binds.append(target)

        def run(*cmd: str, timeout: float = 1200) -> subprocess.CompletedProcess:
            return subprocess.run(["chroot", str(ROOT), "/usr/bin/env", "-i", *ENV, *cmd],
                                  capture_output=True, text=True, timeout=timeout)

        yield run
    finally:
        for target in reversed(binds):
            subprocess.run(["umount", "-l", str(target)], check=False)
        mounts = Path("/proc/mounts").read_text()
        assert f" {ROOT}/" not in mounts, f"binds under {ROOT} left mounted"


def test_machine_is_aarch64(in_root):
    out = in_root("uname", "-m")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "aarch64"


def test_flower_supernode_starts(in_root):
    out = in_root("flower-supernode", "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--superlink" in out.stdout and "--node-config" in out.stdout


def test_one_local_training_step_of_digits_logreg(in_root):
    out = in_root("sh", "-c", f"cd /app && python -c '{TRAIN}'")
    print(out.stdout[-2000:])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "moved" in out.stdout


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI")
def test_image_runs_as_linux_arm64():
    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        pytest.skip(f"no image {IMAGE} (or no Docker engine): docker/build-arm64.sh imports it when one answers")
    arch = subprocess.run(["docker", "image", "inspect", "-f", "{{.Architecture}}", IMAGE],
                          capture_output=True, text=True, check=True).stdout.strip()
    assert arch == "arm64"
    out = subprocess.run(["docker", "run", "--rm", "--platform", "linux/arm64", IMAGE, "uname", "-m"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "aarch64"


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI")
def test_the_arm64_supernode_registers_with_a_superlink_on_this_host(tmp_path):
    """`flower-supernode` really starts in the arm64 image (under qemu) and registers with an x86-64
    SuperLink on this host, as a board would with a laptop's."""
    import sys
    import time

    from deploy.nodes import NODE_ID_RE
    from deploy.procs import free_port, port_open

    if subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        pytest.skip(f"no image {IMAGE} (or no Docker engine): docker/build-arm64.sh imports it when one answers")
    port = free_port()
    env = {**os.environ, "FLWR_HOME": str(tmp_path), "FLWR_TELEMETRY_ENABLED": "0"}
    link = subprocess.Popen([str(Path(sys.executable).parent / "flower-superlink"), "--insecure",
                             "--host", "127.0.0.1", "--port", str(port)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    name = f"flchurn-arm64-smoke-{port}"
    try:
        deadline = time.monotonic() + 60
        while not port_open(port):
            assert link.poll() is None and time.monotonic() < deadline, "flower-superlink did not start"
            time.sleep(0.2)
        subprocess.run(["docker", "run", "-d", "--name", name, "--platform", "linux/arm64", "--network", "host",
                        IMAGE, "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}",
                        "--port", str(free_port()), "--node-config", "partition-id=0 num-partitions=1"],
                       check=True, capture_output=True, timeout=120)
        t0 = time.monotonic()
        log = ""
        while not NODE_ID_RE.search(log):
            assert time.monotonic() - t0 < 600, f"the arm64 SuperNode did not register in 600 s:\n{log[-3000:]}"
            time.sleep(2)
            res = subprocess.run(["docker", "logs", name], capture_output=True, text=True, timeout=60)
            log = res.stdout + res.stderr
        print(f"arm64 SuperNode registered as node {NODE_ID_RE.search(log).group(1)} "
              f"{time.monotonic() - t0:.0f} s after docker run (under qemu)")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=120)
        link.terminate()
        link.wait(timeout=60)
