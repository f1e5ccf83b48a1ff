"""docker/relabel_image.py: an imported image's platform rewritten in a `docker save` folder
(no Docker needed: the folder's format is plain JSON files); docker/sources.py: the one source
list of every image, and the wheel built from it as the image builds it (no Docker needed)."""

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "docker"))
from relabel_image import relabel  # noqa: E402  (docker/relabel_image.py)


def saved_image(folder: Path) -> dict:
    config = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/opt/venv/bin"]},
              "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]}}
    data = json.dumps(config).encode()
    name = hashlib.sha256(data).hexdigest() + ".json"
    (folder / name).write_bytes(data)
    (folder / "manifest.json").write_text(json.dumps([{"Config": name, "RepoTags": ["flchurn-client:arm64"],
                                                       "Layers": ["abc/layer.tar"]}]))
    return config


def test_relabel_rewrites_the_platform_and_renames_the_config_by_its_digest(tmp_path):
    before = saved_image(tmp_path)
    new_name = relabel(tmp_path, "linux/arm64/v8")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest[0]["Config"] == new_name and manifest[0]["RepoTags"] == ["flchurn-client:arm64"]
    data = (tmp_path / new_name).read_bytes()
    assert hashlib.sha256(data).hexdigest() + ".json" == new_name  # docker load checks this digest
    after = json.loads(data)
    assert (after["os"], after["architecture"], after["variant"]) == ("linux", "arm64", "v8")
    assert after["rootfs"] == before["rootfs"] and after["config"] == before["config"]  # nothing else moved
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(["manifest.json", new_name])


@pytest.mark.parametrize("platform", ["arm64", "linux/", "linux/arm64/v8/extra"])
def test_relabel_refuses_a_malformed_platform(tmp_path, platform):
    saved_image(tmp_path)
    with pytest.raises(ValueError, match="OS/ARCH"):
        relabel(tmp_path, platform)


# ---------------------------------------------------------------- the images' one source list
ROOT = Path(__file__).resolve().parent.parent
import sources  # noqa: E402  (docker/sources.py: the list every Dockerfile and build script reads)

IMPORTS_FROM_THE_WHEEL = r"""
import importlib, json, sys, tomllib
from pathlib import Path
site = Path(sys.argv[1]).resolve()
with open(sys.argv[2], "rb") as fh:
    components = tomllib.load(fh)["tool"]["flwr"]["app"]["components"]
names = ["server_app.app", "client_app.app", "deploy", *json.loads(sys.argv[3])]
loaded = {}
for name in names:
    module = importlib.import_module(name)
    loaded[name] = str(Path(module.__file__).resolve())
for ref in components.values():  # the Flower app's components: what flwr-serverapp/clientapp load
    module, attr = ref.split(":")
    getattr(importlib.import_module(module), attr)
    loaded[ref] = str(Path(sys.modules[module].__file__).resolve())
outside = {k: v for k, v in loaded.items() if not v.startswith(str(site))}
print(json.dumps({"loaded": len(loaded), "outside": outside}))
"""


def entry_modules(site: Path) -> list[str]:
    """Every module in the unpacked wheel that runs as ``python -m`` (what the images' compose
    files, the launcher and the churn service start), ``pkg/__main__.py`` aside (importing runs it)."""
    out = []
    for path in sorted(site.rglob("*.py")):
        if path.name != "__main__.py" and '__name__ == "__main__"' in path.read_text():
            out.append(".".join(path.relative_to(site).with_suffix("").parts))
    return out


def python_without_the_checkout(site: Path) -> tuple[list[str], dict[str, str]]:
    """``python -S`` (no .pth files: not the editable install of a checkout) that sees the unpacked
    wheel and the venv's dependencies only."""
    import sysconfig

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), sysconfig.get_paths()["purelib"],
                                                        sysconfig.get_paths()["platlib"]]),
           "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return [sys.executable, "-S"], env


def test_every_image_reads_the_one_source_list():
    """No Dockerfile or build script names the packages itself: they take docker/sources.py's list."""
    listed = sources.packages(ROOT)
    for name in ("Dockerfile", "Dockerfile.client", "build-local.sh", "build-arm64.sh"):
        text = (ROOT / "docker" / name).read_text()
        assert "docker/sources.py" in text, name
        code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
        naming = [ln for ln in code for pkg in listed if re.search(rf"(^|[\s/]){pkg}(/|\s|$)", ln)]
        assert naming == [], f"{name} names packages itself: {naming}"


def test_the_wheel_built_from_the_images_source_list_imports_every_entry_point(tmp_path):
    """What the image's `pip install --no-deps .` builds, from what docker/sources.py copies: it
    imports the ServerApp, the ClientApp, deploy and every `python -m` module (a package missing
    from pyproject.toml's list fails here, as `virtualtime` once failed in the image)."""
    app = tmp_path / "app"
    assert sources.copy(ROOT, app) == sources.sources(ROOT)
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", str(app),
                            "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("flchurn-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    assert sorted(p.name for p in site.iterdir() if p.is_dir() and not p.name.endswith(".dist-info")) \
        == sorted(sources.packages(ROOT))
    modules = entry_modules(site)
    assert "deploy.tuning" in modules and "client_app.worker_process" in modules  # the images' commands
    python, env = python_without_the_checkout(site)
    empty = tmp_path / "cwd"
    empty.mkdir()
    res = subprocess.run([*python, "-c", IMPORTS_FROM_THE_WHEEL, str(site), str(ROOT / "pyproject.toml"),
                          json.dumps(modules)], cwd=empty, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["outside"] == {} and report["loaded"] >= len(modules) + 3
    cli = subprocess.run([*python, "-m", "deploy", "--help"], cwd=empty, env=env, capture_output=True, text=True,
                         timeout=120)
    assert cli.returncode == 0 and "launch" in cli.stdout, cli.stderr[-2000:]
