"""Local SuperLinks for the tests that run ``flwr run``: each test talks only to a SuperLink it
started, with its own ``FLWR_HOME`` and free ports, so the suite passes beside any other Flower
app on the machine (Flower's ``flwr run`` otherwise submits to whatever local SuperLink answers on
its default port, 39091; Flower 1.41 also had a Control API on 39093).

The SuperLink is started here with Flower's own command line (as ``flwr.cli.local_superlink``
does) rather than by ``flwr run``, which gives it only 15 s to come up: too little on a loaded
machine. ``flwr run`` then finds it on the ports its environment names and uses it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import ROOT

from deploy.procs import free_port

# Flower's defaults for the local SuperLink (flwr.cli.constant; the environment variables change them)
DEFAULT_HTTP_PORT, DEFAULT_CONTROL_PORT = 39091, 39093
QUIET = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
         "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "OMP_NUM_THREADS": "1"}


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


@contextmanager
def local_superlink(home: Path, http: int | None = None, control: int | None = None,
                    timeout: float = 180.0) -> Iterator[dict[str, str]]:
    """A simulation SuperLink with FLWR_HOME ``home`` on ``http``/``control`` (default: free ports);
    yields the environment under which ``flwr`` uses it (and only it); stops it afterwards."""
    http, control = http or free_port(), control or free_port()
    env = {**os.environ, **QUIET, "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(http),
           "FLWR_LOCAL_CONTROL_API_PORT": str(control),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    (home / "local-superlink").mkdir(parents=True, exist_ok=True)
    superlink = subprocess.Popen(
        ["flower-superlink", "--insecure", "--simulation", "--isolation", "subprocess",
         "--control-api-address", f"127.0.0.1:{control}", "--host", "127.0.0.1", "--port", str(http),
         "--database", str(home / "local-superlink" / "state.db")],
        env=env, cwd=home, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # cwd: the ServerApp's
    try:
        deadline = time.monotonic() + timeout
        while not healthy(http):  # what flwr run checks (Flower 1.42 serves Control on the HTTP port too)
            assert superlink.poll() is None and time.monotonic() < deadline, "the local SuperLink did not start"
            time.sleep(0.5)
        yield env
    finally:
        superlink.send_signal(signal.SIGTERM)
        try:
            superlink.wait(timeout=30)
        except subprocess.TimeoutExpired:
            superlink.kill()
            superlink.wait(timeout=30)


def superlinks_of(flwr_home: Path) -> list[int]:
    """The pids of the processes whose command line names ``flwr_home`` (a SuperLink started there)."""
    out = subprocess.run(["pgrep", "-f", str(flwr_home)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def runs(env: dict[str, str], cwd: Path) -> dict[int, str]:
    """Run id -> status of every run the SuperLink of ``env`` knows."""
    ls = subprocess.run(["flwr", "ls", "--format", "json"], env=env, capture_output=True, text=True, timeout=60,
                        cwd=cwd)
    return {int(r["run-id"]): r["status"] for r in json.loads(ls.stdout[ls.stdout.index("{"):])["runs"]}


def flwr_run(app: Path, env: dict[str, str], cwd: Path, run_config: str, num_supernodes: int = 4,
             timeout: float = 400.0) -> tuple[str, str]:
    """``flwr run APP --stream`` on the SuperLink of ``env``; (its output, the run's final status:
    ``flwr run`` exits 0 even for a failed run)."""
    proc = subprocess.run(
        ["flwr", "run", str(app), "--stream", "--run-config", run_config,
         "--federation-config", f"num-supernodes={num_supernodes} client-resources-num-cpus=1"],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    found = re.search(r"Successfully started run (\d+)", log)
    assert found, log[-3000:]
    return log, runs(env, cwd)[int(found.group(1))]
