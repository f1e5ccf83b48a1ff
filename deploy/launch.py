"""Launch a real Flower deployment on loopback: one SuperLink, N SuperNodes, one run.

:class:`Deployment` owns every process it starts:

- ``flower-superlink --insecure`` on a free 127.0.0.1 port, its own ``FLWR_HOME`` and cwd under the
  work dir, runtime dependency installation and telemetry off;
- N SuperNodes (``flower-supernode`` through ``deploy.tuning.SUPERNODE``) ``--insecure --superlink
  127.0.0.1:PORT --port P_i --node-config "partition-id=i num-partitions=N state-dir=... [data-dir=...]"``, each with its own
  ``FLWR_HOME``; a node can be stopped (SIGTERM, graceful) or crashed (SIGKILL of its whole
  process tree) and started again, which gives it a new Flower node id;
- a ``flwr`` CLI home with a ``config.toml`` connection (``[superlink.deploy]``) used to submit
  the run (``flwr run <project> deploy --run-config FILE.toml``) and poll its status
  (``flwr ls --run-id ID --format json``).

No process outlives the deployment: every process starts in its own session (process group),
carries a tag in its environment (``FLCHURN_DEPLOY_TAG``, inherited by flower-superexec,
flwr-serverapp and flwr-clientapp), gets ``PR_SET_PDEATHSIG=SIGKILL`` on Linux (the launcher
dying kills it), and :meth:`Deployment.close` (context-manager exit, ``atexit``, the CLI's
SIGINT/SIGTERM handlers) kills the groups and then sweeps ``/proc`` for anything still carrying
the tag. No zombie either: while a deployment is open the launcher is a child subreaper
(``PR_SET_CHILD_SUBREAPER``), so helpers orphaned by a killed parent are re-parented to it and
reaped (:meth:`Deployment.reap_orphans`), not left to a PID 1 that may not reap. A temp work
dir (``/tmp/flchurn-deploy-*``) is removed by ``close`` unless ``keep_workdir``
(``--keep-workdir``). Everything is single-threaded: the churn driver is stepped from the
caller's loop, so a parent-death signal can never fire because a helper thread ended.

One run (:func:`run_deployment`): the run config is built once (:func:`build_run_config`: one
run name, so the churn driver and the server follow the same folder), the nodes started, the
run submitted and followed; a run can continue from a checkpoint (``resume_from``: a fresh
SuperLink and fresh nodes, the same run folder). Afterwards the realised participation is
compared with the schedule (:func:`deploy.churn.participation_report`); :attr:`Outcome.ok` and
the CLI's exit status require both a completed run and no difference beyond the timing slack.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .tuning import (  # round-latency settings: env, node config, the SuperNode command
    ENV as TUNING_ENV,
    NODE_CONFIG as TUNING_NODE_CONFIG,
    SUPERNODE as TUNING_SUPERNODE,
)

ROOT = Path(__file__).resolve().parent.parent
TAG_VAR = "FLCHURN_DEPLOY_TAG"
NODE_TAG_VAR = "FLCHURN_NODE_TAG"
CONNECTION = "deploy"
NODE_ID_RE = re.compile(r"SuperNode ID: (\d+)")
FINISHED = "finished"
COMPLETED = "finished:completed"
# seconds before each round under churn (round-start-delay): a returning SuperNode, started one round
# early, needs 2-5 s to register, and a tuned round can be shorter than that
DEFAULT_GRACE = 3.0

_LIVE: weakref.WeakSet[Deployment] = weakref.WeakSet()



class DeployError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def parse_run_config(text: str | None) -> dict[str, Any]:
    """``"k=v k2='s'"`` (what ``flwr run --run-config`` takes) -> dict, with Flower's own parser."""
    if not text:
        return {}
    from flwr.common.config import parse_config_args

    return dict(parse_config_args([text]))


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the launcher dying kills the child


def tagged_pids(value: str, var: str = TAG_VAR) -> list[int]:
    """Pids of live processes whose environment has ``var=value`` (Linux /proc; [] elsewhere)."""
    needle = f"{var}={value}".encode()
    out = []
    proc = Path("/proc")
    if not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[-1].split()[0] == "Z":
            continue  # a zombie is already dead
        if needle in env.split(b"\0"):
            out.append(int(entry.name))
    return out


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, value) == 0
    except Exception:  # noqa: BLE001 - Linux only
        return False


PR_SET_CHILD_SUBREAPER = 36


def children(parent: int | None = None) -> dict[int, str]:
    """pid -> state letter (R, S, Z, ...) of every child of ``parent`` (default: this process)."""
    parent = os.getpid() if parent is None else parent
    out = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if int(fields[1]) == parent:
            out[int(entry.name)] = fields[0]
    return out


def zombie_children(parent: int | None = None) -> list[int]:
    """Pids of Z-state (dead, not yet reaped) children of ``parent`` (default: this process)."""
    return [pid for pid, state in children(parent).items() if state == "Z"]


def kill_pids(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class Proc:
    """A process we started (in its own session), its log and its tag."""

    name: str
    popen: subprocess.Popen
    log: Path
    tag: str
    started: float = field(default_factory=time.monotonic)
    term_sent: bool = False

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)  # pgid == pid: start_new_session=True
        except (ProcessLookupError, PermissionError):
            pass

    def kill_tree(self) -> None:
        """SIGKILL the group, then anything else that still carries this process's tag."""
        self.signal_group(signal.SIGKILL)
        kill_pids(tagged_pids(self.tag, NODE_TAG_VAR))
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Node:
    partition: int
    port: int
    proc: Proc | None = None
    node_ids: list[int] = field(default_factory=list)  # one per incarnation, once registered
    incarnations: int = 0

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.alive


class Deployment:
    """SuperLink + N SuperNodes on loopback. Use as a context manager; always closes."""

    def __init__(
        self,
        num_nodes: int,
        work_dir: str | Path | None = None,
        *,
        project: str | Path = ROOT,
        data_dir: str | Path | None = None,
        node_env: Mapping[int, Mapping[str, str]] | None = None,
        node_config_extra: Mapping[int, Mapping[str, Any]] | None = None,
        log: Callable[[str], None] | None = None,
        keep_workdir: bool = False,
    ) -> None:
        if num_nodes < 1:
            raise DeployError("num_nodes must be >= 1")
        self.num_nodes = num_nodes
        # a temp work dir we made is removed by close() unless keep_workdir; a given one is kept
        self.remove_workdir = work_dir is None and not keep_workdir
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="flchurn-deploy-")).resolve()
        self.project = Path(project).resolve()
        self.data_dir = Path(data_dir).resolve() if data_dir else None
        self.node_env = {int(k): dict(v) for k, v in (node_env or {}).items()}
        self.node_config_extra = {int(k): dict(v) for k, v in (node_config_extra or {}).items()}
        self.log = log or (lambda line: None)
        self.tag = uuid.uuid4().hex
        self.superlink: Proc | None = None
        self.superlink_port = 0
        self.nodes = {i: Node(i, 0) for i in range(num_nodes)}
        self.cli_home = self.work_dir / "cli"
        self.state_dir = self.work_dir / "state"
        self.logs = self.work_dir / "logs"
        self.closed = False
        self.spawned: list[Proc] = []  # every process started, all incarnations (reaped by close)
        for d in (self.cli_home, self.state_dir, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        # orphaned helpers (flower-superexec, flwr-clientapp of a killed node) are re-parented to
        # us, not to PID 1 (which need not reap): reap_orphans() and close() reap them
        self.subreaper = sys.platform.startswith("linux") and _prctl(PR_SET_CHILD_SUBREAPER, 1)
        _LIVE.add(self)

    # ------------------------------------------------------------------ processes
    def _env(self, flwr_home: Path, node_tag: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update(TUNING_ENV)
        env.update({
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
            "PYTHONUNBUFFERED": "1",
            TAG_VAR: self.tag,
            NODE_TAG_VAR: node_tag,
        })
        env.update(extra or {})
        return env

    def _spawn(self, name: str, argv: list[str], flwr_home: Path, cwd: Path,
               extra_env: Mapping[str, str] | None = None) -> Proc:
        if self.closed:
            raise DeployError("deployment is closed")
        flwr_home.mkdir(parents=True, exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        exe = shutil.which(argv[0], path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
        if exe is None:
            raise DeployError(f"{argv[0]} not found next to {sys.executable} or on PATH")
        node_tag = f"{self.tag}-{name}"
        log_path = self.logs / f"{name}.log"
        with log_path.open("ab") as fh:
            popen = subprocess.Popen(
                [exe, *argv[1:]], cwd=cwd, env=self._env(flwr_home, node_tag, extra_env),
                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_set_pdeathsig if sys.platform.startswith("linux") else None,
            )
        self.spawned.append(Proc(name, popen, log_path, node_tag))
        return self.spawned[-1]

    def start_superlink(self, timeout: float = 60.0) -> None:
        self.superlink_port = free_port()
        home = self.work_dir / "superlink"
        self.superlink = self._spawn(
            "superlink",
            ["flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
             "--host", "127.0.0.1", "--port", str(self.superlink_port)],
            home, home,
        )
        deadline = time.monotonic() + timeout
        while not port_open(self.superlink_port):
            if not self.superlink.alive:
                raise DeployError(f"flower-superlink exited ({self.superlink.popen.returncode}); "
                                  f"see {self.superlink.log}")
            if time.monotonic() > deadline:
                raise DeployError(f"flower-superlink did not listen on 127.0.0.1:{self.superlink_port} "
                                  f"within {timeout:.0f} s; see {self.superlink.log}")
            time.sleep(0.1)
        self.write_cli_config()
        self.log(f"SuperLink on 127.0.0.1:{self.superlink_port} (log {self.superlink.log})")

    def write_cli_config(self) -> Path:
        path = self.cli_home / "config.toml"
        path.write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n'
            f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.superlink_port}"\ninsecure = true\n'
        )
        return path

    def node_config(self, i: int) -> str:
        cfg: dict[str, Any] = {**TUNING_NODE_CONFIG, "partition-id": i, "num-partitions": self.num_nodes,
                               "state-dir": str(self.state_dir)}
        if self.data_dir:
            cfg["data-dir"] = str(self.data_dir)
        cfg.update(self.node_config_extra.get(i, {}))
        return " ".join(f"{k}={toml_value(v)}" for k, v in cfg.items())

    def start_node(self, i: int, wait: bool = False, timeout: float = 60.0) -> Node:
        """Start SuperNode ``i`` (no-op if running); ``wait`` until it has registered."""
        node = self.nodes[i]
        if node.running:
            return node
        if self.superlink is None:
            raise DeployError("start the SuperLink first")
        node.incarnations += 1
        node.port = free_port()
        home = self.work_dir / f"node-{i}"
        node.proc = self._spawn(
            f"node-{i}.{node.incarnations}",
            [*TUNING_SUPERNODE, "--insecure", "--superlink", f"127.0.0.1:{self.superlink_port}",
             "--host", "127.0.0.1", "--port", str(node.port), "--node-config", self.node_config(i)],
            home, home, self.node_env.get(i),
        )
        self.log(f"node {i}: started (incarnation {node.incarnations}, pid {node.proc.popen.pid})")
        if wait:
            self.wait_registered(i, timeout)
        return node

    def registered_id(self, i: int) -> int | None:
        """The Flower node id of node ``i``'s current incarnation, once it has registered."""
        node = self.nodes[i]
        if node.proc is None:
            return None
        try:
            text = node.proc.log.read_text(errors="replace")
        except OSError:
            return None
        m = NODE_ID_RE.search(text)
        if m is None:
            return None
        nid = int(m.group(1))
        if len(node.node_ids) < node.incarnations:
            node.node_ids.append(nid)
        return nid

    def wait_registered(self, i: int, timeout: float = 60.0) -> int:
        deadline = time.monotonic() + timeout
        while (nid := self.registered_id(i)) is None:
            node = self.nodes[i]
            if not node.running:
                raise DeployError(f"SuperNode {i} exited before registering; see {node.proc.log}")
            if time.monotonic() > deadline:
                raise DeployError(f"SuperNode {i} did not register within {timeout:.0f} s; see {node.proc.log}")
            time.sleep(0.1)
        return nid

    def stop_node(self, i: int, mode: str = "term", timeout: float = 10.0) -> None:
        """``term``: SIGTERM to the SuperNode (it deactivates; the SuperLink answers its pending
        messages with NODE_UNAVAILABLE), then the rest of its tree; ``kill``: SIGKILL the tree
        (a crash: the SuperLink notices only when the heartbeat expires)."""
        node = self.nodes[i]
        if node.proc is None:
            return
        if mode not in ("term", "kill"):
            raise ValueError(f"mode must be 'term' or 'kill', not {mode!r}")
        self.registered_id(i)  # remember its id before it goes
        if mode == "term" and node.proc.alive:
            try:
                if not node.proc.term_sent:
                    self.signal_node(i, signal.SIGTERM)
                node.proc.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.log(f"node {i}: no exit {timeout:.0f} s after SIGTERM; killing it")
        node.proc.kill_tree()
        self.log(f"node {i}: stopped ({mode})")

    def signal_node(self, i: int, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to SuperNode ``i`` and return at once (:meth:`stop_node` then finishes it):
        lets several nodes shut down at the same time."""
        node = self.nodes[i]
        if node.running:
            self.registered_id(i)  # remember its id before it goes
            node.proc.popen.send_signal(sig)
            node.proc.term_sent |= sig == signal.SIGTERM

    def running_nodes(self) -> set[int]:
        return {i for i, n in self.nodes.items() if n.running}

    def kill_superlink(self) -> None:
        """SIGKILL the SuperLink and everything under it (its SuperExec and the ServerApp): a crash."""
        if self.superlink is not None:
            self.superlink.kill_tree()
            self.log("SuperLink killed (with its ServerApp)")

    def restart(self) -> None:
        """A fresh SuperLink (new port, empty state) and no SuperNode running: what a resumed run
        starts from. The nodes are started again by the caller (the churn driver or run_deployment)."""
        for i in self.nodes:
            self.stop_node(i, "kill")
        self.kill_superlink()
        self.reap_orphans()
        self.start_superlink()

    def _orphans(self) -> dict[int, str]:
        """Helpers re-parented to us (we are their subreaper): our children we did not spawn."""
        own = {p.popen.pid for p in self.spawned}
        return {pid: state for pid, state in children().items() if pid not in own}

    def reap_orphans(self) -> None:
        """Reap our dead children: the processes we spawned (every incarnation, through Popen)
        and helpers re-parented to us."""
        for p in self.spawned:
            p.popen.poll()
        for pid in [pid for pid, state in self._orphans().items() if state == "Z"]:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass

    # ------------------------------------------------------------------ the flwr CLI
    def flwr(self, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
        exe = shutil.which("flwr", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
        if exe is None:
            raise DeployError("the flwr CLI is not on PATH")
        env = self._env(self.cli_home, f"{self.tag}-cli")
        env.pop(NODE_TAG_VAR)
        return subprocess.run([exe, *args], env=env, cwd=self.work_dir, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def submit(self, run_config: Mapping[str, Any]) -> int:
        """``flwr run`` (detached) with ``run_config`` written to a TOML file; returns the run id."""
        path = self.work_dir / f"run-config-{uuid.uuid4().hex[:6]}.toml"
        path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in run_config.items()))
        res = self.flwr("run", str(self.project), CONNECTION, "--run-config", str(path), "--format", "json")
        try:
            doc = json.loads(res.stdout[res.stdout.index("{"):])
        except (ValueError, json.JSONDecodeError):
            doc = {}
        if res.returncode != 0 or not doc.get("success", False) or "run-id" not in doc:
            raise DeployError(f"flwr run failed (rc {res.returncode}):\n{res.stdout}\n{res.stderr}")
        run_id = int(doc["run-id"])
        self.log(f"submitted run {run_id}")
        return run_id

    def status(self, run_id: int) -> str:
        """The run's status, e.g. ``running`` or ``finished:completed`` (``""`` if unknown)."""
        res = self.flwr("ls", CONNECTION, "--run-id", str(run_id), "--format", "json", timeout=60)
        try:
            doc = json.loads(res.stdout[res.stdout.index("{"):])
        except (ValueError, json.JSONDecodeError):
            return ""
        for run in doc.get("runs", []):
            if int(run.get("run-id", -1)) == run_id:
                return str(run.get("status", ""))
        return ""

    def run_log(self, run_id: int) -> str:
        res = self.flwr("log", str(run_id), CONNECTION, "--show", timeout=60)
        return res.stdout + res.stderr

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Stop every process of this deployment (idempotent, safe from atexit and handlers)."""
        if self.closed:
            return
        self.closed = True
        procs = [n.proc for n in self.nodes.values() if n.proc is not None]
        if self.superlink is not None:
            procs.append(self.superlink)
        for p in procs:
            if p.alive:
                try:
                    p.popen.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in procs:
            p.signal_group(signal.SIGKILL)
        for p in procs:
            try:
                p.popen.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while True:  # re-parented helpers (flower-superexec, flwr-serverapp/clientapp, client workers)
            left = tagged_pids(self.tag)
            kill_pids(left)
            self.reap_orphans()  # the killed ones that were re-parented to us
            # (a helper that is dying has no readable environment and is not a zombie yet: wait for it)
            if (not left and not self._orphans() and all(p.popen.returncode is not None for p in self.spawned)
                    or time.monotonic() > deadline):
                break
            time.sleep(0.1)
        if self.subreaper:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)
        if self.remove_workdir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
            self.log(f"deployment stopped; work dir {self.work_dir} removed (keep it with --keep-workdir)")
        else:
            self.log(f"deployment stopped; logs in {self.logs}")

    def leftovers(self) -> list[int]:
        return tagged_pids(self.tag)

    def __enter__(self) -> Deployment:
        try:
            self.start_superlink()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for dep in list(_LIVE):
        dep.close()


def run_dir_of(run_config: Mapping[str, Any]) -> Path:
    """The folder the ServerApp writes for ``run_config``, by the server's own rule
    (:func:`server_app.experiment.run_folder`: a resumed run continues in its checkpoint's folder)."""
    from server_app.config import RunConfig
    from server_app.experiment import run_folder

    return run_folder(RunConfig.from_run_config(dict(run_config)))


def latest_checkpoint(run_dir: str | Path) -> Path:
    """The newest checkpoint of a run folder that loads (one cut short by a crash is skipped)."""
    import torch

    for path in sorted((Path(run_dir) / "checkpoints").glob("round-*.pt"), reverse=True):
        try:
            torch.load(path, map_location="cpu", weights_only=False)
            return path
        except Exception:  # noqa: BLE001 - a partial file: try the previous one
            continue
    raise DeployError(f"no readable checkpoint in {Path(run_dir) / 'checkpoints'}: "
                      "a run can be resumed only if it ran with checkpoint-every >= 1")


# ---------------------------------------------------------------------- one run, end to end
def default_run_config(project: str | Path = ROOT) -> dict[str, Any]:
    """``[tool.flwr.app.config]`` of the project's pyproject.toml (what Flower starts from)."""
    import tomllib

    doc = tomllib.loads((Path(project) / "pyproject.toml").read_text())
    return dict(doc["tool"]["flwr"]["app"]["config"])


@dataclass
class Outcome:
    status: str
    run_id: int
    run_dir: Path
    rows: list[dict[str, Any]]  # the rounds this run recorded (a resumed run: checkpoint + 1 on)
    run_config: dict[str, Any]
    driver: Any = None
    wall: float = 0.0
    submitted_at: float = 0.0
    report: Any = None  # deploy.churn.ParticipationReport: realised participation vs the schedule

    @property
    def completed(self) -> bool:
        return self.status == COMPLETED

    @property
    def ok(self) -> bool:
        """Completed, and participation followed the schedule up to the documented timing slack."""
        return self.completed and (self.report is None or not self.report.failures)


def build_run_config(dep: Any, user: Mapping[str, Any], *, grace: float = 0.0,
                     project: str | Path = ROOT) -> dict[str, Any]:
    """The run config actually submitted: the project's defaults, the user's keys, and what a
    deployment must force. Call it once per run: it decides the run name.

    Forced: ``num-clients`` = number of SuperNodes (a user value that differs is an error),
    ``availability-gate="none"`` (the churn driver, not the server, decides who is there), an
    absolute ``results-dir`` (the ServerApp's cwd is the SuperLink's), a ``run-name`` (default
    ``deploy-<time>-<strategy>-<dataset>-s<seed>``, made unique in ``results-dir``),
    ``min-nodes`` = N (the caller lowers it to the round-1 count under churn) and
    ``round-start-delay`` = the churn grace when > 0.
    """
    from server_app.results import default_run_name

    n = dep.num_nodes
    if "num-clients" in user and int(user["num-clients"]) != n:
        raise DeployError(f"run config num-clients={user['num-clients']} but {n} SuperNodes were asked for: "
                          f"num-clients follows --num-nodes, so drop it from the run config "
                          f"(or pass --num-nodes {user['num-clients']})")
    cfg = {**default_run_config(project), **user, "num-clients": n, "availability-gate": "none"}
    results = Path(str(cfg.get("results-dir") or "results")).expanduser()
    cfg["results-dir"] = str(results if results.is_absolute() else (Path.cwd() / results).resolve())
    if cfg.get("resume-from"):
        ckpt = Path(str(cfg["resume-from"])).expanduser().resolve()
        if not ckpt.is_file():
            raise DeployError(f"resume-from {ckpt}: no such checkpoint file (see <run>/checkpoints/)")
        cfg["resume-from"] = str(ckpt)
    if not cfg.get("run-name"):
        base = "deploy-" + default_run_name(str(cfg["strategy"]), str(cfg["dataset"]), int(cfg["train-seed"]))
        name, k = base, 1
        while (Path(cfg["results-dir"]) / name).exists():
            k += 1
            name = f"{base}-{k}"
        cfg["run-name"] = name
    elif not cfg.get("resume-from") and (Path(cfg["results-dir"]) / str(cfg["run-name"])).exists():
        raise DeployError(f"run-name {cfg['run-name']!r}: {cfg['results-dir']}/{cfg['run-name']} holds a run "
                          f"already; pick another run-name (or leave it out for a fresh one), or continue "
                          f"that run with --resume-from")
    cfg["min-nodes"] = n
    if grace > 0:
        cfg["round-start-delay"] = float(grace)
    return cfg


def prepare_resume(cfg: Mapping[str, Any]) -> int:
    """Cut the run folder's ``metrics.jsonl`` back to the checkpoint's round (what the ServerApp
    does on resume, done first so that nothing follows stale rounds); return that round."""
    import torch

    from server_app.results import RunRecorder

    ckpt = torch.load(str(cfg["resume-from"]), map_location="cpu", weights_only=False)
    RunRecorder(run_dir_of(cfg), int(cfg["num-clients"])).resume_at(int(ckpt["round"]))
    return int(ckpt["round"])


def run_deployment(
    dep: Deployment,
    user_config: Mapping[str, Any],
    *,
    churn: str | None = None,
    churn_mode: str = "term",
    grace: float | None = None,
    lookahead: bool = True,
    crashes: Mapping[int, list[tuple[int, float]]] | None = None,
    speedup: float = 1.0,
    timeout: float = 1800.0,
    on_row: Callable[[dict[str, Any]], None] | None = None,
    status_every: float = 10.0,
    resume_from: str | Path | None = None,
) -> Outcome:
    """Start the nodes (all, or the schedule's round-1 set), submit the run, drive churn, wait,
    then compare the realised participation with the schedule (``Outcome.report``).

    ``churn``: None (all nodes stay up), ``"rounds"`` (:class:`deploy.churn.RoundChurn`) or
    ``"wallclock"`` (:class:`deploy.churn.WallClockChurn`, trace-intervals specs). ``grace`` is
    passed as ``round-start-delay`` when the ServerApp supports it (default 1 s under churn),
    otherwise ignored with a warning. ``resume_from``: a checkpoint file; the run continues from
    it in its own run folder, on a fresh SuperLink and freshly started nodes. Returns when the
    run has finished (any status) or the SuperLink died, or raises DeployError after
    ``timeout`` seconds (after ``flwr stop``).
    """
    from server_app.config import RunConfig

    from .churn import (
        RoundChurn,
        RunFollower,
        WallClockChurn,
        build_run_schedule,
        participation_report,
        server_supports,
    )

    g = 0.0
    if churn:
        supported = server_supports("round-start-delay")
        g = (DEFAULT_GRACE if supported else 0.0) if grace is None else float(grace)
        if g > 0 and not supported:
            dep.log(f"the ServerApp has no 'round-start-delay' key: grace {g} s ignored (see deploy/churn.py)")
            g = 0.0
    user = {**user_config, **({"resume-from": str(resume_from)} if resume_from else {})}
    cfg = build_run_config(dep, user, grace=g, project=dep.project)  # the one run name
    RunConfig.from_run_config(cfg)  # every key checked before any process trains
    num_rounds = int(cfg["num-server-rounds"])
    run_dir = run_dir_of(cfg)
    start_round = 1
    if cfg.get("resume-from"):
        start_round = prepare_resume(cfg) + 1
    elif (run_dir / "metrics.jsonl").exists():
        raise DeployError(f"{run_dir} already holds a run; pick another run-name (or resume it)")
    schedule = build_run_schedule(cfg) if churn else None
    driver: Any = None
    if churn == "rounds":
        driver = RoundChurn(dep, schedule, num_rounds, run_dir, mode=churn_mode, grace=g, lookahead=lookahead,
                            crashes=crashes, start_round=start_round)
    elif churn == "wallclock":
        driver = WallClockChurn(dep, schedule, mode=churn_mode, speedup=speedup)
    elif churn is not None:
        raise ValueError(f"churn must be None, 'rounds' or 'wallclock', not {churn!r}")
    if driver is not None:
        cfg["min-nodes"] = driver.min_nodes
    if dep.superlink is None or not dep.superlink.alive or (start_round > 1 and dep.running_nodes()):
        dep.restart()
    if driver is not None:
        driver.prepare()
    else:
        for i in range(dep.num_nodes):
            dep.start_node(i)
        for i in range(dep.num_nodes):
            dep.wait_registered(i)
    follow = RunFollower(run_dir)  # the same folder as the driver's: both come from cfg
    t0 = time.monotonic()
    run_id = dep.submit(cfg)
    if isinstance(driver, WallClockChurn):
        driver.t0 = t0
    out = Outcome("", run_id, run_dir, follow.rows, cfg, driver, submitted_at=t0)
    next_status = t0 + status_every
    while True:
        if driver is not None:
            driver.step()
        for row in follow.poll():
            if on_row:
                on_row(row)
        if dep.superlink is None or not dep.superlink.alive:
            out.status = "superlink-died"
            break
        now = time.monotonic()
        if now >= next_status:
            dep.reap_orphans()
            out.status = dep.status(run_id)
            if out.status.startswith(FINISHED):
                break
            done = bool(out.rows) and out.rows[-1]["round"] >= num_rounds
            next_status = now + (1.0 if done else status_every)
        if now - t0 > timeout:
            dep.flwr("stop", str(run_id), CONNECTION, timeout=60)
            raise DeployError(f"run {run_id} not finished after {timeout:.0f} s (stopped); logs in {dep.logs}")
        time.sleep(0.1)
    follow.poll()
    if driver is not None:
        driver.done = True
    out.wall = time.monotonic() - t0
    if not isinstance(driver, WallClockChurn):  # wall-clock churn follows time, not rounds
        expected = (schedule.matrix(num_rounds).astype(bool) if schedule is not None
                    else np.ones((num_rounds, dep.num_nodes), dtype=bool))
        client_of_node = {nid: i for i, node in dep.nodes.items() for nid in node.node_ids}
        for i in dep.nodes:
            dep.registered_id(i)  # record the current incarnation's node id
        out.report = participation_report(
            expected, out.rows, explained=driver.explained() if driver is not None else {},
            client_of_node=client_of_node, diagnose=driver.diagnose if driver is not None else None)
    return out


# ---------------------------------------------------------------------- the CLI
def _install_signal_handlers() -> None:
    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)
    # SIGINT raises KeyboardInterrupt already; both unwind through the finally in launch_main


def add_launch_args(p) -> None:
    p.add_argument("--num-nodes", type=int, required=True, help="number of SuperNodes = num-clients")
    p.add_argument("--run-config", default="", help="run config overrides, as for flwr run: \"k=v k2='s'\"")
    p.add_argument("--churn", action="store_true", help="stop/start SuperNodes to follow the availability schedule")
    p.add_argument("--churn-mode", choices=("term", "kill"), default="term",
                   help="how a node goes offline: SIGTERM (graceful) or SIGKILL (crash)")
    p.add_argument("--wall-clock", action="store_true",
                   help="churn by elapsed time (trace-intervals specs) instead of by rounds")
    p.add_argument("--speedup", type=float, default=1.0, help="trace seconds per real second (wall-clock churn)")
    p.add_argument("--grace", type=float, default=None,
                   help="round-start-delay passed to the ServerApp under churn (default 3 s if supported)")
    p.add_argument("--no-lookahead", action="store_true",
                   help="start returning nodes only when their round starts (needs grace >= node start time)")
    p.add_argument("--work-dir", default=None,
                   help="where logs, FLWR_HOMEs and client state go (default: a temp dir, removed at exit)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the temp work dir (logs) after exit")
    p.add_argument("--data-dir", default=None, help="node_config data-dir of every SuperNode")
    p.add_argument("--resume-from", default=None,
                   help="continue a run from a checkpoint file, or from the newest checkpoint of a run folder "
                        "(pass the same --run-config; clients' state-dir survives only with the same --work-dir)")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up (and stop the run) after this many seconds")


def launch_main(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    _install_signal_handlers()
    user = parse_run_config(args.run_config)
    num_rounds = int({**default_run_config(), **user}["num-server-rounds"])
    work = Path(args.work_dir).resolve() if args.work_dir else None
    resume = Path(args.resume_from).resolve() if args.resume_from else None
    dep = Deployment(args.num_nodes, work, data_dir=args.data_dir, keep_workdir=args.keep_workdir,
                     log=lambda s: console.log(s) if not progress.live.is_started else progress.console.log(s))
    columns = (TextColumn("[bold]rounds"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[status]}"), TimeElapsedColumn())
    progress = Progress(*columns, console=console, disable=not console.is_terminal)
    task = progress.add_task("run", total=num_rounds, status="starting")

    def on_row(row: dict[str, Any]) -> None:
        status = f"round {row['round']}: participants {row['participants']}" + (
            f", acc {row['test-accuracy']:.3f}" if "test-accuracy" in row else "")
        progress.update(task, completed=row["round"], status=status)
        if not console.is_terminal:
            console.print(status, soft_wrap=True)

    code = 1
    try:
        console.print(f"work dir: {dep.work_dir}")
        if resume is not None and resume.is_dir():
            resume = latest_checkpoint(resume)
        dep.start_superlink()
        with progress:
            out = run_deployment(
                dep, user, churn=("wallclock" if args.wall_clock else "rounds") if args.churn else None,
                churn_mode=args.churn_mode, grace=args.grace, lookahead=not args.no_lookahead,
                speedup=args.speedup, timeout=args.timeout, on_row=on_row, resume_from=resume)
        console.print(f"run {out.run_id}: {out.status} in {out.wall:.1f} s; results: {out.run_dir}")
        if out.report is not None:
            console.print(out.report.summary(), soft_wrap=True)
        code = 0 if out.ok else 1
        if not out.completed:
            console.print(f"[red]run did not complete[/]; see the logs in {dep.logs} (--keep-workdir keeps them)")
        elif not out.ok:
            console.print(f"[red]participation departs from the schedule beyond the timing slack:[/] "
                          f"{out.report.failure_text()}", soft_wrap=True)
    except DeployError as err:
        console.print(f"[red]error:[/] {err}")
    except KeyboardInterrupt:
        console.print("interrupted: stopping everything")
        code = 130
    finally:
        dep.close()
    return code
