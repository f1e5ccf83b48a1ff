"""The honest-heterogeneity matrix (issue 39, item 1): false rejections per rule x case, printed.

Every registered rule (or ``--rules``) x the cases of ``tests/honest_cases.py`` (a client back after
10, 50 and 150 rounds away; local steps 1-250 with the data size; data sizes 1 to 10,000; a
newcomer whose label no other client has; an fp16 client; a client whose loss is far above the
others'; every client's learning rate x10 over the first rounds; every client's labels permuted
mid-run; rounds of 200 and 1,000 replies), synchronous, and FedAsync and FedBuff asynchronous
(jobs of 5-15 s on a virtual clock, one honest 0.2 s device among them in the ``fast`` case).
Per cell: honest replies, rejected (the false-rejection rate), cut (data sizes, clipped updates,
participation weights capped), the largest
``norm / (reference x widening)`` any honest reply reached (what ``max-norm-ratio`` must exceed),
the largest latest / first of the update norms' references (what ``max-reference-growth`` must let
through), the largest ``norm / (the first norms' reference x widening)`` (what ``max-norm-ratio`` x
``max-reference-growth`` must exceed), among the widened replies the largest work factor, gap
factor, their product and norm / reference without widening (how much of the widening honest
replies use: what ``WIDEN_RATIO`` must let through), and the largest difference of the final model from the same run with the bounds off (0: bit for
bit). Softmax regression clients in NumPy through the real strategies (mocked messages): no
Flower run, no dataset. ``tests/test_honest_matrix.py`` asserts the CI subset of this matrix.

    OPENBLAS_NUM_THREADS=1 python benchmarks/honest_matrix.py [--rules fedavg-active,scaffold] [--cases back-10,fp16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from honest_cases import CASES, Recorder, case, run_async, run_sync  # noqa: E402

from strategies import STRATEGIES  # noqa: E402

ASYNC_RULES = ["fedasync", "fedbuff"]
ASYNC_CASES = ["back-10", "steps-by-size", "newcomer-labels", "fast"]


def cell(name: str, case_name: str, asynchronous: bool) -> dict:
    run = run_async if asynchronous else run_sync
    c = case("back-10" if case_name == "fast" else case_name)
    if case_name == "fast":  # an honest fast device: 0.2 s jobs among 5-12 s ones
        c.speeds[7] = 0.2
    with Recorder() as rec:
        on = run(name, c)
    c = case("back-10" if case_name == "fast" else case_name)
    if case_name == "fast":
        c.speeds[7] = 0.2
    off = run(name, c, bounds=False)
    return {"replies": on.replies, "rejected": len(on.rejected), "cut": on.cut,
            "max-ratio": max(rec.ratios["update"] + rec.ratios["other"], default=0.0),
            "growth": rec.growth, "over-first": rec.over_first, "diff": float(np.abs(on.x - off.x).max()), "first": on.rejected[:1],
            "work": rec.work, "gap": rec.gap, "product": rec.product, "unwidened": rec.unwidened}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rules", default=",".join(sorted(STRATEGIES)))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--async-cases", default=",".join(ASYNC_CASES))
    args = ap.parse_args()
    rules, cases = args.rules.split(","), [c for c in args.cases.split(",") if c]
    print("| mode | case | rule | honest replies | rejected | false-rejection rate | cut | max ratio | "
          "latest/first | max norm/first | work | gap | work x gap | norm/ref unwidened | max diff from bounds off |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    total = rejected = 0
    worst: tuple[float, str] = (0.0, "")
    grown: tuple[float, str] = (1.0, "")
    over: tuple[float, str] = (0.0, "")
    product: tuple[float, str] = (0.0, "")
    unwidened: tuple[float, str] = (0.0, "")
    cells = [(False, c, r) for c in cases for r in rules]
    cells += [(True, c, r) for c in args.async_cases.split(",") if c for r in ASYNC_RULES if r in rules]
    for asynchronous, case_name, name in cells:
        t0 = time.perf_counter()
        got = cell(name, case_name, asynchronous)
        total, rejected = total + got["replies"], rejected + got["rejected"]
        worst = max(worst, (got["max-ratio"], f"{name} {case_name}"))
        grown = max(grown, (got["growth"], f"{name} {case_name}"))
        over = max(over, (got["over-first"], f"{name} {case_name}"))
        product = max(product, (got["product"], f"{name} {case_name}"))
        unwidened = max(unwidened, (got["unwidened"], f"{name} {case_name}"))
        print(f"| {'async' if asynchronous else 'sync'} | {case_name} | {name} | {got['replies']} | {got['rejected']} | "
              f"{got['rejected'] / max(1, got['replies']):.3f} | {got['cut']} | {got['max-ratio']:.1f} | {got['growth']:.2f} | {got['over-first']:.1f} | "
              f"{got['work']:.2f} | {got['gap']:.0f} | {got['product']:.1f} | {got['unwidened']:.1f} | "
              f"{got['diff']:.2g} | {got['first'] or ''} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\nhonest replies {total}, rejected {rejected} (false-rejection rate {rejected / max(1, total):.4f}); "
          f"largest norm / (reference x widening): {worst[0]:.1f} ({worst[1]}); largest latest / first "
          f"of the update norms' references: {grown[0]:.2f} ({grown[1]}); largest update norm / (first norms' "
          f"reference x widening), what max-norm-ratio x max-reference-growth must exceed: {over[0]:.1f} ({over[1]}); "
          f"largest work x gap factor used: {product[0]:.1f} ({product[1]}); largest norm / reference without "
          f"widening among widened replies: {unwidened[0]:.1f} ({unwidened[1]})")


if __name__ == "__main__":
    main()
