"""Set the platform of an image in a ``docker save`` folder: ``python3 relabel_image.py DIR linux/arm64/v8``.

``docker import --platform linux/arm64`` labels the image with the engine's own platform on Docker
20.10 without the experimental daemon (seen here: ``linux/amd64``), so ``docker run --platform
linux/arm64`` refuses it and a board's engine warns. The image's config (``<sha256>.json``,
named by ``manifest.json``) carries ``os`` / ``architecture`` / ``variant``; this rewrites them,
renames the config to its new digest and points the manifest at it. ``docker load`` of the folder
(as a tar) then gives the same layers under the right platform. Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path


def relabel(folder: Path, platform: str) -> str:
    """Rewrite the saved image in ``folder`` to ``platform`` (os/arch[/variant]); its new config name."""
    parts = platform.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"platform {platform!r} is not OS/ARCH[/VARIANT]")
    manifest_path = folder / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    if len(manifest) != 1:
        raise ValueError(f"{manifest_path}: expected one image, found {len(manifest)}")
    old = folder / manifest[0]["Config"]
    config = json.loads(old.read_text())
    config["os"], config["architecture"] = parts[0], parts[1]
    config.pop("variant", None)
    if len(parts) == 3:
        config["variant"] = parts[2]
    data = json.dumps(config, separators=(",", ":")).encode()
    new_name = hashlib.sha256(data).hexdigest() + ".json"
    old.unlink()
    (folder / new_name).write_bytes(data)
    manifest[0]["Config"] = new_name
    manifest_path.write_text(json.dumps(manifest))
    return new_name


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.splitlines()[0])
    print(relabel(Path(sys.argv[1]), sys.argv[2]))
