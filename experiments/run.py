"""One command for a run on Flower's simulation engine through ``flwr run``, honest about the outcome.

    python -m experiments.run [--run-config "k=v k2='s' ..."] [--num-supernodes N] [--num-gpus 0.25]
    python -m experiments.run --ray-address HEAD:6379 --run-config "data-dir='/shared/data' ..."

What ``flwr run . --stream`` does not do, this does:

- checks the whole run config with the ServerApp's own checks (unknown keys with the closest known
  one, types, ranges, specs, data files, checkpoint) BEFORE submitting, in seconds instead of after
  the simulation's start-up, and exits 2 with the message;
- derives ``num-supernodes`` from ``num-clients`` (and refuses a ``--num-supernodes`` that differs);
- makes ``results-dir``, ``data-dir``, ``state-dir`` and ``resume-from`` absolute (the ServerApp's
  working directory is the SuperLink's), names an unnamed run, and refuses a folder that already
  holds a run;
- runs Flower with telemetry, runtime dependency installation and Ray's accelerator
  FutureWarning off, in a temporary ``FLWR_HOME`` (or ``--flwr-home``), on its own local SuperLink
  ports (``FLWR_LOCAL_SUPERLINK_HTTP_API_PORT``/``FLWR_LOCAL_CONTROL_API_PORT``, reserved so that
  no other process takes them), so it never reuses nor stops anybody else's local SuperLink;
- starts that local SuperLink itself (Flower's own command line, as ``flwr run`` would) and waits
  for it as long as the machine needs, with a progress line every 10 s, up to
  ``--superlink-timeout`` (default 60 s x the host's load per CPU; ``flwr run`` gives it 15 s),
  with the task patience of :mod:`deploy.waits` (a slow ``flwr-simulation`` keeps its task);
- submits the run the same way: ``flwr run`` (which builds and uploads the app: ~200 s at load 22-25
  on 2 CPUs) may take up to ``--submit-timeout`` (default 120 s x the host's load per CPU), every
  other ``flwr`` call up to ``--cli-timeout`` (60 s x load per CPU), each with a progress line every
  10 s and, when it runs out, one paragraph naming the wait and its flag (exit 2);
- finds Flower's executables beside this Python (the venv's ``bin``, first on the ``PATH`` of
  every Flower process), activated venv or not;
- retries a run whose Ray did not start (Ray's own 30 s start-up wait ran out on a busy machine)
  once, and otherwise says so in one paragraph;
- streams the run's log, then reads the run's real status (``flwr ls --run-id``): it prints the
  results folder and exits 0 when the run is ``finished:completed``, otherwise prints the
  ServerApp's one-paragraph error and exits 1 (``flwr run --stream`` exits 0 either way);
- runs on an existing Ray cluster with ``--ray-address HOST:PORT`` (``RAY_ADDRESS`` in the
  SuperLink's environment, after the checks of :mod:`experiments.raycluster`: the cluster answers,
  a client actor fits a node, every node imports this ClientApp at this version, the clients'
  paths are there on every node); without it ``RAY_ADDRESS=local``: a Ray cluster already running
  on the machine is never joined silently;
- stops the detached local SuperLink that ``flwr run`` started (and its ServerApp/Ray children),
  found by a tag in their environment, on success, failure, ``--timeout`` and Ctrl-C.

Exit codes: 0 the run completed; 1 it failed or was stopped (``--timeout``); 2 it was never
submitted (a bad run config or flag, or ``flwr run`` refused it); 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deploy.errors import DeployError
from deploy.flwr_cli import COMPLETED, FINISHED, FLOWER_ENV, FlwrCli, toml_value
from deploy.procs import PortReservation, child_setup, find_exe, kill_pids, tagged_pids, venv_path
from deploy.submission import parse_run_config
from deploy.tuning import SUPERLINK
from deploy.waits import CHECK_EVERY, Waits, for_host, host_slowdown
from experiments.raycluster import (
    RAY_ADDRESS_VAR,
    ClusterError,
    check_cluster,
    parse_federation,
    ray_address_env,
    refuse_settings,
)
from runconfig import ConfigError
from runconfig.defaults import ROOT, default_run_config
from server_app.config import RunConfig
from server_app.results import METRICS, default_run_name

TAG_VAR = "FLCHURN_RUN_TAG"  # inherited by the detached SuperLink and everything it starts
PATH_KEYS = ("results-dir", "data-dir", "state-dir", "resume-from", "devices")
# what Ray says when its raylet did not register within Ray's own (hard-coded) 30 s start-up wait
RAY_STARTUP = ("node timed out during startup", "GCS has become overloaded", "Failed to connect to GCS")


class RunnerError(RuntimeError):
    """A problem found before or while submitting (exit code 2)."""


class RunTimeout(RunnerError):
    """The run went past ``--timeout`` and was stopped (exit code 1)."""


def parse_overrides(text: str) -> dict[str, Any]:
    """``--run-config "k=v k2='s'"`` with Flower's own parser; a TOML mistake is a ConfigError."""
    import click

    try:
        return parse_run_config(text)
    except click.ClickException as err:
        raise ConfigError(f"--run-config {text!r}: {err.message} Give each key once, and string values "
                          "inner quotes, e.g. \"strategy='fedau' num-server-rounds=100\"") from None


def resolve_run_config(user: Mapping[str, Any], cwd: Path | None = None) -> dict[str, Any]:
    """pyproject defaults + ``user``, relative paths made absolute against ``cwd``, the run named."""
    cwd = cwd or Path.cwd()
    cfg = {**default_run_config(), **user}
    for key in PATH_KEYS:
        value = cfg.get(key)
        if isinstance(value, str) and value:
            cfg[key] = str((cwd / Path(value).expanduser()).resolve())  # an absolute path stays itself
    if not cfg.get("run-name") and not cfg.get("resume-from"):
        cfg["run-name"] = default_run_name(str(cfg["strategy"]), str(cfg["dataset"]), int(cfg["train-seed"]))
    return cfg


def check(run_config: Mapping[str, Any], num_supernodes: int | None) -> int:
    """Every check the ServerApp makes before round 1 that needs no nodes (keys, types, ranges, specs,
    data files, model, strategy, checkpoint, a free run folder); returns the number of SuperNodes."""
    from server_app.setup import prepare

    cfg = RunConfig.from_run_config(run_config)  # keys, types, ranges: fast, before torch is imported
    n = cfg.workload.num_clients
    if num_supernodes is not None and num_supernodes != n:
        raise ConfigError(f"--num-supernodes {num_supernodes} but the run config has num-clients={n}; in "
                          f"simulation they must be equal: pass --num-supernodes {n} (or leave it out), "
                          f"or --run-config \"num-clients={num_supernodes}\"")
    setup = prepare(cfg)
    if not cfg.server.resume_from and (setup.run_dir / METRICS).exists():
        raise ConfigError(f"{setup.run_dir} already holds a run: pick another run-name (or resume-from one "
                          "of its checkpoints)")
    return n


def results_folder(log_text: str) -> str:
    """The folder the ServerApp reported (``results: <path>``, its last line on success)."""
    found = re.findall(r"^results: (.+)$", log_text, flags=re.MULTILINE)
    return found[-1].strip() if found else "(not reported in the run's log)"


def failure_paragraph(log_text: str, details: str) -> str:
    """The ServerApp's own error: our one-paragraph line, else Flower's status details, else the
    traceback's last line."""
    from server_app.app import FAILED

    for line in reversed(log_text.splitlines()):
        if FAILED in line:
            return line[line.index(FAILED) + len(FAILED):].strip()
    if details:
        return details.strip()
    exc = [ln.strip() for ln in log_text.splitlines() if re.match(r"^\s*[\w.]+(Error|Exception)\b.*", ln)]
    return exc[-1] if exc else "no error message in the run's log"


def ray_did_not_start(text: str) -> bool:
    """Whether a run's log or status says that Ray timed out while it started."""
    return any(s in text for s in RAY_STARTUP)


def ray_paragraph() -> str:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"Ray did not start, twice: its raylet did not register within Ray's own 30 s start-up wait "
            f"(hard-coded in Ray), on a machine with a 1-minute load of {os.getloadavg()[0]:.1f} on {cpus} CPUs "
            f"(x{host_slowdown():.1f} slower than idle); the simulation never began. Rerun when the machine is "
            f"less busy, or run the same config in process without Ray: python -m experiments.once "
            f"--run-config \"...\"")


class FlowerRun:
    """``flwr`` commands (:class:`deploy.flwr_cli.FlwrCli`, the app's default federation) against
    one private local SuperLink (its own FLWR_HOME, reserved ports and tag), started here."""

    def __init__(self, flwr_home: Path, ray_address: str = "local", waits: Waits | None = None) -> None:
        self.flwr_home = flwr_home
        self.tag = uuid.uuid4().hex
        # held until the SuperLink stops: no other process can take them in between (deploy.procs)
        self.http, self.control = PortReservation(), PortReservation()
        self.waits = waits or for_host()
        env = {**os.environ, **FLOWER_ENV, **self.waits.env(), TAG_VAR: self.tag,
               "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(self.http.port),
               "FLWR_LOCAL_CONTROL_API_PORT": str(self.control.port),
               RAY_ADDRESS_VAR: ray_address}  # flwr-simulation's ray.init() reads it (experiments.raycluster)
        env["PATH"] = venv_path(env)  # flwr, flower-superlink and their helpers: this venv's
        try:
            find_exe("flwr")
        except DeployError:
            raise RunnerError(f"the flwr CLI is not installed beside {sys.executable}: pip install -e . "
                              "in this venv") from None
        self.cli = FlwrCli(flwr_home, None, env=env, cwd=Path.cwd(), waits=self.waits,
                           log=lambda line: print(line, flush=True))

    def healthy(self) -> bool:
        """What ``flwr run`` asks before it starts a local SuperLink of its own: is one serving?"""
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http.port}/health", timeout=1) as res:
                return bool(res.status == 200)
        except OSError:
            return False

    def start_superlink(self, timeout: float) -> float:
        """The local SuperLink ``flwr run`` would start (Flower's command line), started here and
        waited for up to ``timeout`` s (progress every 10 s); returns the seconds it took."""
        folder = self.flwr_home / "local-superlink"
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / "superlink.log"
        argv = [*SUPERLINK, "--insecure", "--simulation", "--isolation", "subprocess",
                "--control-api-address", f"127.0.0.1:{self.control.port}", "--host", "127.0.0.1",
                "--port", str(self.http.port), "--log-file", str(log), "--database", str(folder / "state.db")]
        with (folder / "superlink.out").open("ab") as out:
            proc = subprocess.Popen(argv, env=self.cli.env, cwd=self.cli.cwd, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=child_setup(None))
        t0 = time.monotonic()
        next_note = t0 + CHECK_EVERY
        while not self.healthy():
            now = time.monotonic()
            if proc.poll() is not None:
                raise RunnerError(f"the local SuperLink exited ({proc.returncode}) while starting; see {log} and "
                                  f"{folder / 'superlink.out'}")
            if now - t0 > timeout:
                raise RunnerError(f"the local SuperLink did not start within {timeout:.0f} s (lengthen this wait with "
                                  f"--superlink-timeout SECONDS; its default scales with the host's load); see {log}")
            if now >= next_note:
                print(f"waiting for the local SuperLink ({now - t0:.0f} s of {timeout:.0f} s)", flush=True)
                next_note = now + CHECK_EVERY
            time.sleep(0.2)
        return time.monotonic() - t0

    def submit(self, run_config: Mapping[str, Any], federation_config: str) -> int:
        try:
            return self.cli.submit(ROOT, run_config, federation_config=federation_config)  # waits.submit
        except DeployError as err:
            raise RunnerError(str(err)) from None

    def stream(self, run_id: int, timeout: float) -> str:
        """Print the run's log as it comes (until the run ends); return it. After ``timeout`` s the
        run is stopped (``flwr stop``) and RunnerError raised."""
        proc = subprocess.Popen(self.cli.stream_argv(run_id), env=self.cli.env, cwd=self.cli.cwd, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        expired = threading.Event()

        def stop() -> None:
            expired.set()
            self.cli.stop(run_id)
            proc.terminate()

        watchdog = threading.Timer(timeout, stop)
        watchdog.start()
        lines = []
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                lines.append(line)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=10.0 * self.waits.host)
        if expired.is_set():
            raise RunTimeout(f"run {run_id} not finished after {timeout:.0f} s: stopped")
        return "".join(lines)

    def status(self, run_id: int, wait: float | None = None) -> tuple[str, str]:
        """(status, status details) once the run has finished, or the last seen after ``wait`` s
        (default: half the ``flwr`` command wait, 30 s x the host's load per CPU)."""
        deadline = time.monotonic() + (self.waits.cli / 2 if wait is None else wait)
        while True:
            status, details = self.cli.run_info(run_id)
            if status.startswith(FINISHED) or time.monotonic() > deadline:
                return status, details
            time.sleep(1.0)

    def stop_superlink(self) -> None:
        """SIGTERM, then SIGKILL, every process carrying this runner's tag (the SuperLink it started);
        then its ports are free again."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = tagged_pids(self.tag, TAG_VAR)
            if not pids:
                break
            kill_pids(pids, sig)
            deadline = time.monotonic() + 5.0 * self.waits.host
            while tagged_pids(self.tag, TAG_VAR) and time.monotonic() < deadline:
                time.sleep(0.2)
        self.http.release()
        self.control.release()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-config", default="", help="run config overrides, as for flwr run: \"k=v k2='s'\"")
    p.add_argument("--num-supernodes", type=int, default=None, help="default: the run config's num-clients")
    p.add_argument("--num-cpus", type=int, default=1, help="client-resources-num-cpus (integer >= 1)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="client-resources-num-gpus (e.g. 0.25)")
    p.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="run on this existing Ray cluster (its head's GCS address); default: a private local Ray")
    p.add_argument("--federation-config", default="", help="more of Flower's simulation keys, \"k=v ...\" "
                   "(e.g. init-args-num-cpus=2 for the local Ray)")
    p.add_argument("--flwr-home", default=None, help="FLWR_HOME for the CLI and its local SuperLink "
                   "(default: a temporary folder, removed afterwards)")
    p.add_argument("--skip-checks", action="store_true",
                   help="submit without the checks made here first (the ServerApp makes them anyway)")
    p.add_argument("--timeout", type=float, default=24 * 3600.0, help="stop the run after this many seconds")
    p.add_argument("--superlink-timeout", type=float, default=None,
                   help="seconds the local SuperLink may take to start (default 60 s x the host's load per CPU)")
    p.add_argument("--submit-timeout", type=float, default=None,
                   help="seconds `flwr run` may take to submit the app (default 120 s x the host's load per CPU)")
    p.add_argument("--cli-timeout", type=float, default=None,
                   help="seconds any other flwr command (ls, stop, log) may take (default 60 s x load per CPU)")
    args = p.parse_args(argv)

    try:
        user = parse_overrides(args.run_config)
        extra = parse_federation(args.federation_config)
        if args.ray_address:
            refuse_settings(user, extra)
        run_config = resolve_run_config(user)
        if args.skip_checks:
            nodes = args.num_supernodes or int(run_config["num-clients"])
        else:
            print("checking the run config ...", flush=True)
            nodes = check(run_config, args.num_supernodes)
        if args.num_cpus < 1:
            raise ConfigError(f"--num-cpus {args.num_cpus}: client-resources-num-cpus must be an integer >= 1")
        waits = for_host().override(superlink=args.superlink_timeout, submit=args.submit_timeout,
                                    cli=args.cli_timeout)  # DeployError naming a flag that is not positive
        if args.ray_address:
            check_cluster(args.ray_address, run_config, args.num_cpus, args.num_gpus, host_slowdown())
    except (ValueError, RunnerError, ClusterError, DeployError) as err:  # ConfigError, SpecError, DatasetError, a TOML mistake
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.num_supernodes is None:
        print(f"num-supernodes={nodes} (= num-clients; --num-supernodes to say so yourself)")
    federation = f"num-supernodes={nodes} client-resources-num-cpus={args.num_cpus}"
    if args.num_gpus:
        federation += f" client-resources-num-gpus={args.num_gpus}"
    federation += "".join(f" {k}={toml_value(v)}" for k, v in extra.items())
    ray_address, note = ray_address_env(args.ray_address)
    if note:
        print(note, flush=True)

    home = Path(args.flwr_home).resolve() if args.flwr_home else Path(tempfile.mkdtemp(prefix="flchurn-flwr-"))
    home.mkdir(parents=True, exist_ok=True)
    flower = None
    try:
        flower = FlowerRun(home, ray_address, waits)
        took = flower.start_superlink(flower.waits.superlink)
        print(f"local SuperLink up in {took:.1f} s", flush=True)
        for attempt in (1, 2):
            run_id = flower.submit(run_config, federation)
            print(f"run {run_id}: {run_config['strategy']} on {run_config['dataset']}, {nodes} SuperNodes, "
                  f"{run_config['num-server-rounds']} rounds (FLWR_HOME={home}, {RAY_ADDRESS_VAR}={ray_address})",
                  flush=True)
            log_text = flower.stream(run_id, args.timeout)
            status, details = flower.status(run_id)
            if status == COMPLETED or attempt == 2 or not ray_did_not_start(log_text + details):
                break
            print(f"run {run_id}: Ray did not start within its 30 s start-up wait (a busy machine): "
                  "submitting the run once more", file=sys.stderr, flush=True)
    except RunTimeout as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (RunnerError, DeployError) as err:  # DeployError: a flwr command's wait ran out (deploy.waits.ran_out)
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: stopping the local SuperLink", file=sys.stderr)
        return 130
    finally:
        if flower is not None:
            flower.stop_superlink()
        if not args.flwr_home:
            shutil.rmtree(home, ignore_errors=True)
    if status == COMPLETED:
        print(f"run {run_id}: {status}; results: {results_folder(log_text)}")
        return 0
    paragraph = ray_paragraph() if ray_did_not_start(log_text + details) else failure_paragraph(log_text, details)
    print(f"run {run_id}: {status or 'unknown status'}\nerror: {paragraph}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
