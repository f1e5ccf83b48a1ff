"""One in-process run from the command line: the real ServerApp loop and ClientApp, no Ray.

    python -m experiments.once num-server-rounds=5 dataset=digits model=mlp availability=on-off:p=0.9,q=0.3
    python -m experiments.once --run-config "model='myext.nets:tiny_mlp:width=16' num-clients=10" --quiet

Keys and values as in ``pyproject.toml``'s run config (every key is checked before any work: a
mistake exits 2 naming the key, as do data files that data-dir lacks); values are read as int,
float, bool or string. Prints ``results: <folder>`` once and exits 0 when the run finished, 1 when
it failed.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

from availability.spec import parse_value
from runconfig import ConfigError


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> {k: typed v}; quotes around a value are dropped (``model='a:b'``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"run config item {item!r} is not key=value")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            out[key.strip()] = value[1:-1]
        else:
            out[key.strip()] = parse_value(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="*", help="run config overrides key=value")
    parser.add_argument("--run-config", default="", help="overrides as Flower writes them: \"k=v k='text'\"")
    parser.add_argument("--quiet", action="store_true", help="no progress on the console")
    args = parser.parse_args(argv)
    from rich.console import Console

    from experiments.inprocess import run_inprocess
    from workloads.tensordata import DatasetError

    try:
        overrides = parse_assignments([*shlex.split(args.run_config), *args.items])
        folder = run_inprocess(overrides, console=Console(quiet=args.quiet))
    except (ConfigError, DatasetError) as exc:  # a key's value, or data files the keys point at
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the run failed: say why in one line, after the traceback-free summary
        print(f"flchurn run failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.quiet:  # otherwise the run's console has printed it, as its last line
        print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
