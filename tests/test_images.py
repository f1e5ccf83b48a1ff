"""docker/relabel_image.py: an imported image's platform rewritten in a `docker save` folder
(no Docker needed: the folder's format is plain JSON files)."""

import hashlib
import json
import sys
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
