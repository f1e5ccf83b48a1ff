"""Where a deployed round's seconds go: one churned launch (the README's, the app's default model),
traced in every process it starts, and each node's message of each round cut into its steps.

Every Python process of the deployment loads a tracing ``sitecustomize`` (written to a temporary
folder put first on ``PYTHONPATH``): it writes its start, Flower's log lines and its exit, with the
wall clock, to one file. A forked ``flwr-clientapp`` (:mod:`deploy.prefork`) inherits the hook of
its SuperNode. Per node and round:

- ``pulled``: the node has the message (Flower's ``Receiving: train message``);
- ``-> app``: until the ClientApp process runs Flower's entry point (``Start `flwr-clientapp` process``):
  the SuperExec's poll, then a fork (or, ``--no-prefork``, a process start and Flower's imports);
- ``-> loaded``: the task's input pulled and the FAB installed (``Start `ClientApp` Loading``);
- ``-> reply``: the ClientApp loaded and run (the worker trains): the reply handed to the node
  (``Runtime.PushMessages``);
- ``-> sent``: the node pushed it to the SuperLink (``Sent successfully``).

    python benchmarks/deploy_timeline.py [--rounds 6] [--no-prefork]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")

HOOK = '''
import logging, os, time
_path = os.environ.get("FLCHURN_TIMELINE")
_out = open(_path, "a", buffering=1) if _path else None
_nodes = {}
def _node():
    """The SuperNode this process works for: the farthest ancestor (or itself) running one (its
    forker, a fork of it, runs the same command line); 0 when none."""
    pid = os.getpid()
    if pid not in _nodes:
        p, found = pid, 0
        while p > 1:
            try:
                if b"deploy.tuning\\0supernode" in open(f"/proc/{p}/cmdline", "rb").read():
                    found = p
                p = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                break
        _nodes[pid] = found
    return _nodes[pid]
def _write(what):
    if _out is not None:
        _out.write(f"{time.time():.4f} {_node()} {what}\\n")
_write("START " + open("/proc/self/cmdline", "rb").read().replace(b"\\0", b" ").decode(errors="replace")[:300])
class _Lines(logging.Handler):
    def emit(self, record):
        try:
            _write("LOG " + record.getMessage().splitlines()[0][:200])
        except Exception:
            pass
logging.getLogger("flwr").addHandler(_Lines())
'''

STEPS = [("pulled", "Receiving: train message"), ("app", "Start `flwr-clientapp` process"),
         ("loaded", "Start `ClientApp` Loading"), ("reply", "Runtime.PushMessages"), ("sent", "Sent successfully")]


def parse(lines: list[str]) -> dict[int, list[dict[str, float]]]:
    """SuperNode pid -> its messages, each {step: time} (every line names the SuperNode its process
    works for: the hook walks up its process chain)."""
    messages: dict[int, list[dict[str, float]]] = {}
    current: dict[int, dict[str, float]] = {}
    for line in sorted(lines, key=lambda x: float(x.split(" ", 1)[0])):
        t, node, what = line.rstrip("\n").split(" ", 2)
        if node == "0" or not what.startswith("LOG "):
            continue
        for step, needle in STEPS:
            if needle in what[4:]:
                if step == "pulled":
                    current[int(node)] = {"pulled": float(t)}
                    messages.setdefault(int(node), []).append(current[int(node)])
                elif int(node) in current and step not in current[int(node)]:
                    current[int(node)][step] = float(t)
    return messages


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--no-prefork", action="store_true", help="each flwr-clientapp started (Flower's way)")
    a = ap.parse_args()
    from deploy.local import ProcessSite
    from deploy.prefork import SWITCH_VAR
    from deploy.run import run_deployment

    with tempfile.TemporaryDirectory(prefix="deploy-timeline-") as d:
        tmp = Path(d)
        (tmp / "hook").mkdir()
        (tmp / "hook" / "sitecustomize.py").write_text(HOOK)
        os.environ["FLCHURN_TIMELINE"] = str(tmp / "timeline.txt")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(tmp / "hook"), str(ROOT)])
        if a.no_prefork:
            os.environ[SWITCH_VAR] = "0"
        cfg = {"num-clients": 4, "num-server-rounds": a.rounds, "availability": "group-cyclic:groups=2,window=2",
               "results-dir": str(tmp / "results"), "run-name": "timeline", "progress": False}
        with ProcessSite(4, tmp / "work") as dep:
            out = run_deployment(dep, cfg, churn="rounds")
        rows = [json.loads(x) for x in (out.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        messages = parse((tmp / "timeline.txt").read_text().splitlines())
    by_pulled = sorted((m["pulled"], m) for ms in messages.values() for m in ms if "sent" in m)
    print(f"\n4 nodes, group-cyclic:groups=2,window=2, the app's defaults, {a.rounds} rounds, "
          f"{'no forker' if a.no_prefork else 'forker'}; {out.status}; round times: "
          + " ".join(f"{r['round-time']:.2f}" for r in rows))
    print("| message (by time) | pulled -> app | -> loaded | -> reply | -> sent | pulled -> sent |")
    print("|---|---|---|---|---|---|")
    steps = [s for s, _ in STEPS]
    spans: dict[str, list[float]] = {s: [] for s in steps[1:]}
    for k, (_, m) in enumerate(by_pulled, 1):
        cells = [m.get(b, float("nan")) - m.get(a_, float("nan")) for a_, b in zip(steps, steps[1:], strict=False)]
        for s, c in zip(steps[1:], cells, strict=True):
            spans[s].append(c)
        print(f"| {k} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {m['sent'] - m['pulled']:.2f} |")
    print("| median | " + " | ".join(f"{statistics.median(v):.2f}" for v in spans.values()) + " | |")


if __name__ == "__main__":
    main()
