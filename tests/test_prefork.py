"""deploy.prefork: a SuperNode's ``flwr-clientapp`` and ``flower-superexec`` forked from a process
that has imported Flower, with Flower's own command as the fallback.

A stand-in SuperNode (a Python process that imports Flower's entry points and calls
``start_for_this_process``, as ``deploy.tuning supernode`` does) gives the environment its
SuperExec would inherit; the launchers on that ``PATH`` are run as Flower's SuperExec runs them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy import prefork

ROOT = Path(__file__).resolve().parent.parent
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pidfd, abstract sockets")

STAND_IN = """
import json, sys
from flowerlink import flower_entry_point
from deploy.prefork import COMMANDS, start_for_this_process
for command in COMMANDS:
    flower_entry_point(command)
print(json.dumps(start_for_this_process()), flush=True)
sys.stdin.read()  # until the test closes it: then this "SuperNode" exits
"""


@pytest.fixture
def supernode(tmp_path):
    """(process, environment its SuperExec inherits) of a stand-in SuperNode with its forker."""
    env = {**os.environ, "HOME": str(tmp_path)}  # the launchers go under this HOME's cache
    proc = subprocess.Popen([sys.executable, "-c", STAND_IN], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    extra = json.loads(proc.stdout.readline())
    yield proc, {**env, **extra}
    proc.stdin.close()
    proc.wait(timeout=60)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


@linux_only
@pytest.mark.parametrize("command", prefork.COMMANDS)
def test_a_launched_command_is_flowers_own_with_its_output_and_exit_status(supernode, command):
    """Through the launcher each command prints what Flower's own prints and exits as it does
    (0 for --help, 2 for an unknown flag: argparse), its streams being the launcher's."""
    _, env = supernode
    assert shutil.which(command, path=env["PATH"]).startswith(env["HOME"])  # the launcher, first on PATH
    real = str(Path(sys.executable).parent / command)
    own = subprocess.run([real, "--help"], capture_output=True, text=True)
    forked = subprocess.run([command, "--help"], env=env, capture_output=True, text=True)
    assert forked.returncode == own.returncode == 0
    assert forked.stdout == own.stdout and "--runtime-api-address" in forked.stdout
    bad = subprocess.run([command, "--no-such-flag"], env=env, capture_output=True, text=True)
    own_bad = subprocess.run([real, "--no-such-flag"], capture_output=True, text=True)
    assert bad.returncode == own_bad.returncode == 2 and bad.stderr == own_bad.stderr


@linux_only
def test_the_command_runs_in_a_child_of_the_forker_not_in_the_launcher(supernode):
    """While a forked flwr-clientapp runs (here: retrying a Runtime API nobody serves) it is a
    child of the SuperNode's forker (a fork of the SuperNode), and the launcher waits for it."""
    node, env = supernode
    launcher = subprocess.Popen(["flwr-clientapp", "--runtime-api-address", "127.0.0.1:9", "--token", "x",
                                 "--insecure"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (forker,) = children_of(node.pid)
        deadline = time.monotonic() + 60
        while not children_of(forker) and time.monotonic() < deadline:
            time.sleep(0.05)
        (child,) = children_of(forker)
        argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        assert b"deploy.prefork" not in argv and child != launcher.pid and launcher.poll() is None
        os.kill(child, signal.SIGKILL)
        assert launcher.wait(timeout=60) == 256 - signal.SIGKILL  # the child's end, reported as exit status
    finally:
        launcher.kill()
        launcher.wait()


@linux_only
def test_a_gone_forker_falls_back_to_flowers_own_command(supernode):
    """A SuperNode whose forker is gone (or an address nobody serves) still gets Flower's command."""
    _, env = supernode
    for address in ("flchurn-prefork-nobody", ""):
        out = subprocess.run(["flwr-clientapp", "--help"], env={**env, prefork.ADDRESS_VAR: address},
                             capture_output=True, text=True)
        assert out.returncode == 0 and "--runtime-api-address" in out.stdout


@linux_only
def test_the_forker_exits_with_its_supernode(supernode):
    node, _ = supernode
    (forker,) = children_of(node.pid)
    node.stdin.close()
    node.wait(timeout=60)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{forker}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{forker}").exists() or "Z" in Path(f"/proc/{forker}/stat").read_text().split()[2]


def test_a_forked_child_forgets_the_projects_modules_not_installed_ones():
    """The ClientApp a fork runs imports the app from the FAB Flower installed: none of this
    checkout's modules may stay in sys.modules, every installed package does."""
    code = ("import sys, numpy, flwr, deploy.prefork as p, client_app.pidinfo; p.forget_our_modules(); "
            "print(sorted(n for n in sys.modules if n.split('.')[0] in "
            "{'deploy', 'client_app', 'strategies', 'flowerlink'}), 'numpy' in sys.modules, 'flwr' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[]", "True", "True"]


def test_off_when_asked(monkeypatch):
    monkeypatch.setenv(prefork.SWITCH_VAR, "0")
    assert prefork.start_for_this_process() == {}
