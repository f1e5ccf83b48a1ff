"""The ``flwr`` CLI, in one place (deployments and ``python -m experiments.run`` both use it):
its ``config.toml`` connection, submitting a run, its status (blocking, or polled in the
background so that a churn driver is never held up), its log, the JSON Flower prints
(``--format json``), and the environment every Flower process gets (:data:`FLOWER_ENV`).

With an ``address``, a connection named ``deploy`` (``[superlink.deploy]``) is written to
``<home>/config.toml``: ``insecure = true``, or ``root-certificates = "<CA file>"`` for TLS.
Without one, the commands name no connection: ``flwr run`` uses the app's default federation
(the local simulation SuperLink). ``FLWR_HOME=<home>`` points the CLI at its home.

Every command waits as long as the host needs (:class:`deploy.waits.Waits`: ``submit`` for ``flwr
run``, ``cli`` for the others, both scaled with the load per CPU), prints a progress line every
10 s while it lasts (``log``), and when it runs out ends in one error naming the wait and its flag
(:func:`deploy.waits.ran_out`), never a ``TimeoutExpired`` traceback.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import DeployError
from .procs import find_exe
from .waits import CHECK_EVERY, FLAGS, Waits, for_host, ran_out

CONNECTION = "deploy"
FINISHED = "finished"
COMPLETED = "finished:completed"
FLOWER_ENV = {  # every Flower process we start (SuperLink, SuperNodes, the CLI): quiet and offline
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",  # Ray's accelerator FutureWarning
    "PYTHONUNBUFFERED": "1",
}


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def parse_json(stdout: str) -> dict[str, Any]:
    """The JSON document of a ``flwr ... --format json`` output ({} when there is none)."""
    try:
        return dict(json.loads(stdout[stdout.index("{"):]))
    except (ValueError, TypeError):
        return {}


def run_entry(doc: Mapping[str, Any], run_id: int) -> tuple[str, str]:
    """(status, status details) of ``run_id`` in a ``flwr ls --format json`` document
    (``("", "")`` if absent)."""
    for run in doc.get("runs", []):
        if int(run.get("run-id", -1)) == run_id:
            return str(run.get("status", "")), str(run.get("status-details", ""))
    return "", ""


def run_status(doc: Mapping[str, Any], run_id: int) -> str:
    """The status of ``run_id`` in a ``flwr ls --format json`` document (``""`` if absent)."""
    return run_entry(doc, run_id)[0]


class FlwrError(DeployError):
    """A ``flwr`` command failed (e.g. ``flwr run`` did not start the run)."""


class FlwrCli:
    """The ``flwr`` CLI against one SuperLink (``address``; None: the app's default federation),
    with its home in ``home``.

    ``env``: the environment of every ``flwr`` call (``FLWR_HOME`` is set to ``home``);
    ``cwd``: where it runs; ``waits``: how long its commands may take (default: scaled to this host now).
    """

    def __init__(self, home: str | Path, address: str | None, *, root_certificates: str | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | Path | None = None,
                 log: Any = None, waits: Waits | None = None) -> None:
        self.home = Path(home)
        self.waits = waits or for_host()
        self.address = address
        self.root_certificates = root_certificates
        self.env = {**(env or {}), "FLWR_HOME": str(self.home)}
        self.cwd = Path(cwd) if cwd else self.home
        self.log = log or (lambda line: None)
        self._ls: subprocess.Popen | None = None
        self.target = [CONNECTION] if address is not None else []  # the connection the commands name
        if address is not None:
            self.write_config()

    def write_config(self) -> Path:
        self.home.mkdir(parents=True, exist_ok=True)
        security = (f'root-certificates = "{self.root_certificates}"\n' if self.root_certificates
                    else "insecure = true\n")
        path = self.home / "config.toml"
        path.write_text(f'[superlink]\ndefault = "{CONNECTION}"\n\n'
                        f'[superlink.{CONNECTION}]\naddress = "{self.address}"\n' + security)
        return path

    def _argv(self, *args: str) -> list[str]:
        return [find_exe("flwr"), *args]

    def __call__(self, *args: str, timeout: float | None = None, wait: str = "cli") -> subprocess.CompletedProcess:
        """``flwr *args``, waited for at most ``timeout`` s (default: the ``wait`` of :attr:`waits`,
        ``cli`` or ``submit``), a progress line every 10 s; :func:`~deploy.waits.ran_out` (naming the
        command and the wait's flag) when it runs out."""
        limit = float(getattr(self.waits, wait) if timeout is None else timeout)
        what = "`flwr run` submits the app" if args[:1] == ("run",) else f"`flwr {' '.join(args[:1])}` answers"
        proc = subprocess.Popen(self._argv(*args), env=self.env, cwd=self.cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
        t0 = time.monotonic()
        while True:
            left = limit - (time.monotonic() - t0)
            try:
                out, err = proc.communicate(timeout=max(0.01, min(CHECK_EVERY, left)))
                return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
            except subprocess.TimeoutExpired:  # retrying communicate loses no output
                took = time.monotonic() - t0
                if took >= limit:
                    proc.kill()
                    proc.communicate()
                    raise ran_out(what, limit, FLAGS[wait]) from None
                self.log(f"waiting until {what} ({took:.0f} s of {limit:.0f} s)")

    def submit(self, project: str | Path, run_config: Mapping[str, Any], timeout: float | None = None,
               federation_config: str | None = None) -> int:
        """``flwr run`` (detached) with ``run_config`` written to a TOML file (and
        ``--federation-config``, e.g. a simulation's ``num-supernodes=4``); returns the run id, or
        raises :class:`FlwrError`; waits at most ``timeout`` s (default: :attr:`waits`' ``submit``)."""
        path = self.home / f"run-config-{uuid.uuid4().hex[:6]}.toml"
        path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
        fed = ["--federation-config", federation_config] if federation_config else []
        res = self("run", str(project), *self.target, "--run-config", str(path), *fed, "--format", "json",
                   timeout=timeout, wait="submit")
        doc = parse_json(res.stdout)
        if res.returncode != 0 or not doc.get("success", False) or "run-id" not in doc:
            raise FlwrError(f"flwr run did not start the run (exit {res.returncode}): "
                            f"{(res.stdout + res.stderr).strip()[-2000:]}")
        run_id = int(doc["run-id"])
        self.log(f"submitted run {run_id}")
        return run_id

    def run_info(self, run_id: int) -> tuple[str, str]:
        """(status, status details) of the run, e.g. ``("finished:failed", "<the error>")``."""
        res = self("ls", *self.target, "--run-id", str(run_id), "--format", "json")
        return run_entry(parse_json(res.stdout), run_id)

    def status(self, run_id: int) -> str:
        """The run's status, e.g. ``running`` or ``finished:completed`` (``""`` if unknown)."""
        return self.run_info(run_id)[0]

    def poll_status(self, run_id: int) -> str | None:
        """Non-blocking status: the first call starts ``flwr ls`` in the background and returns
        None; a later call returns its answer once it has exited (None while it runs)."""
        if self._ls is None:
            self._ls = subprocess.Popen(self._argv("ls", *self.target, "--run-id", str(run_id), "--format", "json"),
                                        env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            return None
        if self._ls.poll() is None:
            return None
        out, self._ls = self._ls.communicate()[0] or "", None
        return run_status(parse_json(out), run_id)

    def stop(self, run_id: int) -> None:
        self("stop", str(run_id), *self.target)

    def run_log(self, run_id: int) -> str:
        res = self("log", str(run_id), *self.target, "--show")
        return res.stdout + res.stderr

    def stream_argv(self, run_id: int) -> list[str]:
        """``flwr log --stream``: the run's log as it comes, until the run ends."""
        return self._argv("log", str(run_id), *self.target, "--stream")

    def close(self) -> None:
        """End a background ``flwr ls`` still running."""
        if self._ls is not None:
            self._ls.kill()
            self._ls.communicate()
            self._ls = None
