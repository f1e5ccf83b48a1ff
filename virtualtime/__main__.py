"""``python -m virtualtime convert IN OUT``: FedScale's trace files to and from their text form,
and onto this project's devices file and ``trace-intervals`` availability (:mod:`.fedscale`).

    convert IN OUT                        pickle -> text (JSON Lines), text -> pickle
    convert IN OUT --to devices --nodes N [--classes K --seed S | --batch-size B]
    convert IN OUT --to intervals --nodes N [--period S]

A trace that cannot be read, or a wrong option, exits 2 with a message naming the problem.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

from . import fedscale
from .errors import ProfileError
from .traces import classes_from_trace


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m virtualtime", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("convert", help="convert a FedScale trace (pickle or text form)")
    c.add_argument("src", help="a client_device_capacity or client_behave_trace: FedScale's pickle or its text form")
    c.add_argument("dst", help="the file to write")
    c.add_argument("--to", choices=("auto", "text", "pickle", "devices", "intervals"), default="auto",
                   help="auto (default): a pickle becomes text, text becomes a pickle")
    c.add_argument("--nodes", type=int, help="--to devices/intervals: the number of clients (SuperNodes)")
    c.add_argument("--classes", type=int, default=3, help="--to devices: classes by speed (default 3)")
    c.add_argument("--seed", type=int, default=0, help="--to devices: the seed that draws the clients")
    c.add_argument("--batch-size", type=int,
                   help="--to devices: one class per node with FedScale's step time (3 x batch x ms per sample)")
    c.add_argument("--period", type=float, help="--to intervals: the period in s (default: the longest finish_time)")
    return p


def convert(args: argparse.Namespace) -> str:
    """Write ``args.dst``; the line to print."""
    kind, doc = fedscale.read_any(args.src)
    to = args.to
    if to == "auto":
        to = "text" if fedscale.is_pickle(args.src) else "pickle"
    if to in ("devices", "intervals") and args.nodes is None:
        raise ProfileError(f"--to {to} needs --nodes (the number of clients)")
    want = {"devices": fedscale.CAPACITY, "intervals": fedscale.BEHAVIOUR}.get(to)
    if want is not None and kind != want:
        raise ProfileError(f"--to {to} needs a {want}; {args.src} is a {kind}")
    dst = Path(args.dst)
    if to == "text":
        dst.write_text(fedscale.to_text(kind, doc))
    elif to == "pickle":
        dst.write_bytes(pickle.dumps(doc, protocol=4))
    elif to == "devices":
        if args.batch_size is not None:
            text = fedscale.devices_per_client(doc, args.nodes, args.batch_size)
        else:
            text = classes_from_trace(fedscale.capacity_rows(doc), args.nodes, args.classes, args.seed)
        dst.write_text(text)
    else:
        out, notes = fedscale.intervals_from_behaviour(doc, args.nodes, args.period)
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        dst.write_text(json.dumps(out))
    return f"{kind} ({len(doc)} clients) -> {to}: {dst}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        print(convert(args))
    except ProfileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {args.dst}: {err.strerror or err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
