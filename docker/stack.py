"""Drive the compose stack (docker/compose.yml, + compose.tls.yml) from Python, for
tests/test_containers.py and docker/bench.py: bring it up in a throw-away project whose results,
data and certificates live in a host folder, run the churn service, read what happened
(metrics.jsonl, container states), tear it down.

Needs the docker CLI, a Docker engine, Compose (``docker compose`` or ``docker-compose`` 1.29)
and the image (docker/build-local.sh); :func:`unavailable` says what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKER_DIR = ROOT / "docker"
IMAGE = os.environ.get("FLCHURN_IMAGE", "flchurn:latest")
NODE_CONTAINER = "flchurn-supernode-{i}"
NUM_NODES = 4  # the compose files define supernode-0 .. supernode-3


def _ok(cmd: list[str], timeout: float = 20.0) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_command() -> list[str] | None:
    """``docker compose`` (v2) if the CLI has it, else ``docker-compose`` (1.29 on Debian)."""
    if _ok(["docker", "compose", "version"]):
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def unavailable() -> str | None:
    """Why the stack cannot run here (None: it can)."""
    if shutil.which("docker") is None:
        return "no docker CLI (apt-get install docker.io)"
    if not _ok(["docker", "info"]):
        return "no Docker engine answers on the docker socket (start dockerd as root)"
    if not _ok(["docker", "image", "inspect", IMAGE]):
        return f"image {IMAGE} is not built (run docker/build-local.sh, or set FLCHURN_IMAGE)"
    if compose_command() is None:
        return "no Compose (apt-get install docker-compose, or the docker compose plugin)"
    return None


class Stack:
    """One compose project. ``workdir`` gets ``results/`` (bind-mounted at /results), ``data/``
    (at /data) and, with ``tls``, ``certs/`` (docker/gen-certs.sh)."""

    def __init__(self, workdir: Path, *, tls: bool = False, project: str = "flchurn-test",
                 overrides: tuple[Path, ...] = ()) -> None:
        self.tls = tls
        self.results = Path(workdir) / "results"
        self.data = Path(workdir) / "data"
        self.certs = Path(workdir) / "certs"
        for d in (self.results, self.data):
            d.mkdir(parents=True, exist_ok=True)
        self.results.chmod(0o777)  # the containers run as uid 1000
        files = [DOCKER_DIR / "compose.yml"] + ([DOCKER_DIR / "compose.tls.yml"] if tls else []) + list(overrides)
        self.cmd = (compose_command() or ["docker-compose"]) + [a for f in files for a in ("-f", str(f))]
        self.env = {**os.environ, "COMPOSE_PROJECT_NAME": project, "FLCHURN_IMAGE": IMAGE,
                    "RESULTS_VOLUME": str(self.results), "DATA_DIR": str(self.data),
                    "CERTS_DIR": str(self.certs)}

    def compose(self, *args: str, timeout: float = 300.0, check: bool = True,
                **env: str) -> subprocess.CompletedProcess:
        res = subprocess.run([*self.cmd, *args], env={**self.env, **env}, capture_output=True,
                             text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {res.returncode}:\n{res.stdout}\n{res.stderr}")
        return res

    def wait_log(self, service: str, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.compose("logs", "--no-color", service, check=False).stdout:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} did not log {text!r} within {timeout:.0f} s")
            time.sleep(0.5)

    def up(self) -> None:
        """SuperLink, then (TLS: certificates and key registration) the four SuperNodes."""
        self.down()
        if self.tls:
            subprocess.run(["bash", str(DOCKER_DIR / "gen-certs.sh"), str(self.certs), str(NUM_NODES)],
                           check=True, capture_output=True, timeout=120)
            subprocess.run(["chown", "-R", "1000", str(self.certs)], check=True)
        self.compose("up", "-d", "superlink")
        self.wait_log("superlink", "Starting")
        if self.tls:
            self.compose("--profile", "tls", "run", "--rm", "-T", "--no-deps", "register")
        self.compose("up", "-d", *(f"supernode-{i}" for i in range(NUM_NODES)))

    def start_churn(self, **env: str) -> subprocess.Popen:
        """The churn service (submit, follow, stop/start nodes) in the background; env:
        NUM_ROUNDS, AVAILABILITY, ROUND_TIMEOUT, RUN_NAME, CHURN_MODE, STRATEGY."""
        return subprocess.Popen([*self.cmd, "--profile", "churn", "run", "--rm", "-T", "--no-deps", "churn"],
                                env={**self.env, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)

    def churn(self, timeout: float = 900.0, **env: str) -> subprocess.CompletedProcess:
        """:meth:`start_churn` and wait for it; the output is in ``stdout``."""
        proc = self.start_churn(**env)
        out, _ = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")

    def down(self) -> None:
        self.compose("--profile", "churn", "--profile", "tls", "down", "-v", "--remove-orphans",
                     timeout=120, check=False)

    def __enter__(self) -> Stack:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def rows(self, run_name: str) -> list[dict]:
        path = self.results / run_name / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def config(self, run_name: str) -> dict:
        return json.loads((self.results / run_name / "config.json").read_text())


def node_states() -> dict[int, str]:
    """Node -> the container's state as ``docker ps -a`` shows it (running, exited, ...)."""
    out = subprocess.run(["docker", "ps", "-a", "--format", "{{.Names}} {{.State}}"],
                         capture_output=True, text=True, timeout=30).stdout
    names = {NODE_CONTAINER.format(i=i): i for i in range(NUM_NODES)}
    return {names[n]: s for n, s in (line.split() for line in out.splitlines()) if n in names}


def node_exit_codes() -> dict[int, int]:
    """Node -> the exit code of its container's last run (``docker inspect``; 0 while running)."""
    names = [NODE_CONTAINER.format(i=i) for i in range(NUM_NODES)]
    out = subprocess.run(["docker", "inspect", "--format", "{{.Name}} {{.State.ExitCode}}", *names],
                         capture_output=True, text=True, timeout=30).stdout
    index = {n: i for i, n in enumerate(names)}
    return {index[n.lstrip("/")]: int(c) for n, c in (line.split() for line in out.splitlines())
            if n.lstrip("/") in index}
