"""Issue 46's small fixes: generated keys never in the tracked tree, the default run config read
from an installed (non-editable) package, the compose project named ``flchurn``, and the host's
IP forwarding put back as the edge emulation found it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy.edge.sysctls import HostSysctls
from deploy.errors import DeployError

ROOT = Path(__file__).resolve().parent.parent
GEN_CERTS = ROOT / "docker" / "gen-certs.sh"
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-c", "commit.gpgsign=false"]
needs_tools = pytest.mark.skipif(not all(shutil.which(t) for t in ("git", "openssl", "ssh-keygen")),
                                 reason="needs git, openssl and ssh-keygen")


# ---------------------------------------------------------------- 1. keys outside the tracked tree
def _repo_with_the_script(tmp_path: Path) -> Path:
    """A git repository holding this project's .gitignore and docker/gen-certs.sh, committed."""
    repo = tmp_path / "repo"
    (repo / "docker").mkdir(parents=True)
    shutil.copy2(ROOT / ".gitignore", repo / ".gitignore")
    shutil.copy2(GEN_CERTS, repo / "docker" / "gen-certs.sh")
    subprocess.run([*GIT, "init", "-q", str(repo)], check=True)
    subprocess.run([*GIT, "-C", str(repo), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(repo), "commit", "-qm", "x"], check=True)
    return repo


@needs_tools
def test_gen_certs_default_output_leaves_git_status_clean(tmp_path):
    """Run as the docs do (default OUT, docker/certs): every key and certificate is written, and
    git sees nothing new (without the .gitignore entry, `?? docker/certs/` shows)."""
    repo = _repo_with_the_script(tmp_path)
    res = subprocess.run(["bash", "docker/gen-certs.sh", "", "1"], cwd=repo, capture_output=True, text=True,
                         timeout=300)  # OUT "": the default, as ${1:-...} reads it
    assert res.returncode == 0, res.stderr
    written = sorted(str(p.relative_to(repo)) for p in (repo / "docker" / "certs").rglob("*") if p.is_file())
    assert {"docker/certs/ca.key", "docker/certs/server.key", "docker/certs/keys/node-0"} <= set(written)
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all"],
                            capture_output=True, text=True, check=True).stdout
    assert status == "", status


@needs_tools
def test_every_generated_file_is_ignored_in_this_repository(tmp_path):
    """The names gen-certs.sh writes, checked against this checkout's own ignore rules."""
    out = tmp_path / "certs"
    subprocess.run(["bash", str(GEN_CERTS), str(out), "1"], check=True, capture_output=True, timeout=300)
    names = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert "ca.key" in names and "keys/node-0" in names
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip(f"{ROOT} is not a git work tree")
    paths = [f"docker/certs/{n}" for n in names]
    res = subprocess.run(["git", "-C", str(ROOT), "check-ignore", *paths], capture_output=True, text=True)
    assert sorted(res.stdout.split()) == paths, f"not ignored: {set(paths) - set(res.stdout.split())}"


@needs_tools
def test_gen_certs_refuses_a_folder_git_would_track(tmp_path):
    repo = _repo_with_the_script(tmp_path)
    res = subprocess.run(["bash", "docker/gen-certs.sh", "docker/mykeys", "1"], cwd=repo, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2
    assert "docker/mykeys is inside the git work tree" in res.stderr and "not git-ignored" in res.stderr
    assert not (repo / "docker" / "mykeys").exists()


# ---------------------------------------------------------------- 2. default_run_config installed
def test_default_run_config_from_an_installed_package(tmp_path):
    """`pip install --no-deps --target SITE .` (not editable), then, with the cwd elsewhere and only
    SITE on the path, default_run_config() is pyproject.toml's [tool.flwr.app.config]. Needs
    pyproject.toml to ship itself in the wheel (runconfig.defaults.FORCE_INCLUDE)."""
    from runconfig.defaults import FORCE_INCLUDE

    site = tmp_path / "site"
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *isolation, "-q", "--target",
                          str(site), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (site / "runconfig" / "_pyproject.toml").is_file(), (
        f"the wheel carries no runconfig/_pyproject.toml: pyproject.toml needs\n{FORCE_INCLUDE}")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    code = ("import json, runconfig.defaults as d; "
            "print(json.dumps([d.__file__, str(d.project_file()), d.default_run_config()]))")
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    got = subprocess.run([sys.executable, "-S", "-c", code], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    module, source, config = json.loads(got.stdout.strip().splitlines()[-1])
    assert Path(module).is_relative_to(site) and Path(source) == site / "runconfig" / "_pyproject.toml"
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert config == expected


def test_an_install_without_the_copy_names_the_fix(tmp_path, monkeypatch):
    import runconfig.defaults as d

    monkeypatch.setattr(d, "ROOT", tmp_path)
    monkeypatch.setattr(d, "PACKAGED", tmp_path / "runconfig" / "_pyproject.toml")
    with pytest.raises(FileNotFoundError, match="force-include"):  # this app, installed from a wheel without its copy
        d.default_run_config(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"no pyproject.toml in the Flower app's project folder {tmp_path / 'app'}"):
        d.default_run_config(tmp_path / "app")


def test_a_users_project_is_read_from_its_own_pyproject(tmp_path):
    from runconfig import ConfigError
    from runconfig.defaults import default_run_config

    (tmp_path / "pyproject.toml").write_text('[tool.flwr.app.config]\nnum-server-rounds = 3\n')
    assert default_run_config(tmp_path) == {"num-server-rounds": 3}
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"has no \[tool.flwr.app.config\] table"):
        default_run_config(tmp_path)


# ---------------------------------------------------------------- 3. the compose project's name
@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
@pytest.mark.parametrize("shell, name", [(None, "flchurn"), ("flchurn-test", "flchurn-test")])
def test_the_compose_project_is_named_flchurn(tmp_path, shell, name):
    """Compose reads COMPOSE_PROJECT_NAME from docker/.env (the first compose file's folder) whatever
    the cwd; seen here through interpolation, the same environment compose names the project from.
    The shell's value still wins (docker/stack.py's throw-away projects)."""
    probe = tmp_path / "probe.yml"
    probe.write_text('services:\n  superlink:\n    labels:\n      project: "${COMPOSE_PROJECT_NAME:-docker}"\n')
    env = {k: v for k, v in os.environ.items() if k != "COMPOSE_PROJECT_NAME"}
    if shell:
        env["COMPOSE_PROJECT_NAME"] = shell
    res = subprocess.run(["docker-compose", "-f", str(ROOT / "docker" / "compose.yml"), "-f", str(probe), "config"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert yaml.safe_load(res.stdout)["services"]["superlink"]["labels"]["project"] == name


# ---------------------------------------------------------------- 4. IP forwarding put back
def _fake_proc(tmp_path: Path, value: str) -> Path:
    path = tmp_path / "sys" / "net" / "ipv4" / "ip_forward"
    path.parent.mkdir(parents=True)
    path.write_text(value + "\n")
    return path


def test_ip_forwarding_set_during_the_run_is_restored_at_close(tmp_path):
    path = _fake_proc(tmp_path, "0")
    lines: list[str] = []
    sysctls = HostSysctls(root=tmp_path / "sys", log=lines.append)
    sysctls.record()
    path.write_text("1\n")  # what dockerd (or routing by hand) does during the run
    assert sysctls.changed() == ["net.ipv4.ip_forward=1 (was 0)"]
    assert sysctls.restore() == []
    assert path.read_text().strip() == "0" and sysctls.changed() == []
    assert lines == ["net.ipv4.ip_forward: 1 at close, restored to 0 (its value at setup)"]


def test_a_host_that_forwarded_before_keeps_forwarding(tmp_path):
    path = _fake_proc(tmp_path, "1")
    sysctls = HostSysctls(root=tmp_path / "sys")
    sysctls.record()
    assert sysctls.restore() == [] and path.read_text().strip() == "1"


def test_a_setting_that_cannot_be_restored_is_reported(tmp_path):
    path = _fake_proc(tmp_path, "0")
    lines: list[str] = []
    sysctls = HostSysctls(root=tmp_path / "sys", log=lines.append)
    sysctls.record()
    path.unlink()
    path.mkdir()  # unreadable as a setting: neither read nor written
    assert sysctls.restore() == ["net.ipv4.ip_forward=? (was 0)"]
    assert "could not restore net.ipv4.ip_forward=? (was 0)" in lines[0]
    with pytest.raises(DeployError, match="cannot read net.ipv4.ip_forward"):
        HostSysctls(root=tmp_path / "nothing").record()


def test_edge_limits_close_restores_what_setup_found(tmp_path):
    """EdgeLimits records the host's settings at setup and its close (the launcher's exit, failure,
    Ctrl-C) puts them back; leftovers() names one left changed."""
    import uuid

    from deploy.edge.devices import parse_devices
    from deploy.edge.limits import EdgeLimits

    path = _fake_proc(tmp_path, "0")
    limits = EdgeLimits(parse_devices({"fast": {"count": 1}}, 1), uuid.uuid4().hex[:8],
                        sysctls=HostSysctls(root=tmp_path / "sys"))
    limits.sysctls.record()  # what setup() does first (setup itself needs root: the edge tests)
    path.write_text("1\n")
    assert limits.leftovers() == ["net.ipv4.ip_forward=1 (was 0)"]
    assert limits.close() == []
    assert path.read_text().strip() == "0" and limits.leftovers() == []


ROOT_EDGE = (None if os.environ.get("FLCHURN_EDGE_TESTS") == "1" and os.geteuid() == 0 and shutil.which("unshare")
             else "opt-in: FLCHURN_EDGE_TESTS=1, as root, with unshare (util-linux)")

IN_OWN_NETNS = r"""
import json, sys, uuid
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from deploy.edge.devices import parse_devices
from deploy.edge.limits import EdgeLimits
forward = Path("/proc/sys/net/ipv4/ip_forward")
forward.write_text("0\n")  # this process's own network namespace: the host's setting is untouched
limits = EdgeLimits(parse_devices({"slow": {"count": 1, "cpus": 0.5, "up_kbps": 1000}}, 1), uuid.uuid4().hex[:8])
limits.setup()
made = limits.leftovers()
forward.write_text("1\n")  # as a Docker engine started for the run would
left = limits.close()
print(json.dumps([made, left, forward.read_text().strip(), limits.leftovers()]))
"""


@pytest.mark.skipif(ROOT_EDGE is not None, reason=str(ROOT_EDGE))
def test_a_real_setup_and_close_restore_ip_forwarding_in_a_private_network_namespace():
    """The real EdgeLimits (a cgroup, a namespace, a veth pair), run in a network namespace of its
    own (`unshare --net`) so that the host's forwarding is never touched, even by a failing test."""
    res = subprocess.run(["unshare", "--net", sys.executable, "-c", IN_OWN_NETNS, str(ROOT)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    made, left, forward, after = json.loads(res.stdout.strip().splitlines()[-1])
    assert made, "the limits should exist between setup and close"
    assert left == [] and forward == "0" and after == []
