"""Start ``python -m deploy launch`` with device classes and wait until it has submitted its run
(the opt-in root tests that interrupt a real launcher share this)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def launch_until_submitted(tmp_path: Path, devices_toml: str) -> tuple[subprocess.Popen, str]:
    """A 2-node launcher with ``devices_toml`` running a long digits/logreg run; returns the process
    and what it printed up to ``submitted run`` (asserted)."""
    devices = tmp_path / "devices.toml"
    devices.write_text(devices_toml)
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy", "launch", "--num-nodes", "2", "--devices", str(devices),
         "--work-dir", str(tmp_path / "work"), "--run-config",
         f"num-server-rounds=50 dataset='digits' model='logreg' local-steps='steps:n=2' checkpoint-every=0 "
         f"results-dir='{tmp_path / 'results'}' progress=false"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    deadline = time.monotonic() + 600
    while "submitted run" not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stdout.readline()
    assert "submitted run" in seen, seen
    return proc, seen
