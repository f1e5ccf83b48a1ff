"""Resume over random configs (developers' guide: equality claims are tested over random configs, not
one): a synchronous run resumed from any round's checkpoint ends exactly as the uninterrupted run,
same metrics and same final model bit for bit, for any rule whose state the server holds.

tests/test_strategy_state.py checks the same claim for nine rules on one config (resumed at round
3); here hypothesis draws the rule (with its default parameters), the schedule and its parameters, N,
the rounds, the resume round, the seeds, the local steps and the evaluation cadence. Derandomized:
CI sees the same draws every time. FedAWE's, FedPBC's and SCAFFOLD's clients hold state of their own
(resumed with their state dir in tests/test_new_rules.py); the asynchronous rules resume by
tests/test_async_resume.py.
"""

import json
import shutil

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from experiments.inprocess import run_inprocess
from strategies import STRATEGIES
from strategies.protocol import CORRECTED_RULES

CLIENT_HELD = {"fedawe", "fedpbc", *CORRECTED_RULES}  # their clients keep state the server's checkpoint has not
RULES = sorted(n for n, cls in STRATEGIES.items() if n not in CLIENT_HELD and not getattr(cls, "asynchronous", False))
UNIT = st.sampled_from([0.3, 0.5, 0.7, 0.9])
SCHEDULES = st.one_of(  # the models that need no label distributions (the quadratic workload has none)
    st.just("always"), UNIT.map(lambda p: f"bernoulli:p={p}"),
    st.tuples(UNIT, UNIT).map(lambda pq: f"on-off:p={pq[0]},q={pq[1]},spread=0.1"),
    st.tuples(st.integers(1, 3), UNIT).map(lambda g: f"group-dropout:groups={g[0]},fail=0.3,recover=0.6,p={g[1]}"),
    st.sampled_from([0.2, 0.4]).map(lambda a: f"dropout:alpha={a}"),
    st.sampled_from([0.3, 1.0]).map(lambda s: f"ln:sigma={s}"))


@st.composite
def resumed_runs(draw):
    rounds = draw(st.integers(3, 5))
    return {"strategy": draw(st.sampled_from(RULES)), "availability": draw(SCHEDULES),
            "num-clients": draw(st.integers(3, 8)), "num-server-rounds": rounds,
            "resume-at": draw(st.integers(1, rounds - 1)), "schedule-seed": draw(st.integers(0, 2**16)),
            "train-seed": draw(st.integers(0, 3)), "local-steps": f"steps:n={draw(st.integers(1, 3))}",
            "eval-every": draw(st.sampled_from([1, 2]))}


def rows(run):
    return [{k: v for k, v in json.loads(line).items() if "time" not in k}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=resumed_runs())
def test_a_run_resumed_from_a_random_round_ends_exactly_as_the_uninterrupted_run(drawn, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    at = drawn.pop("resume-at")
    cfg = {"dataset": "quadratic", "model": "quadratic", "partition": "natural", "batch-size": 1, "lr": 0.3,
           "progress": False, "checkpoint-every": 1, "device": "cpu", "results-dir": str(tmp), **drawn}
    full = run_inprocess({**cfg, "run-name": "full"})
    copy = tmp / "resumed"
    shutil.copytree(full, copy)
    (copy / "final_model.pt").unlink()
    resumed = run_inprocess({**cfg, "resume-from": str(copy / "checkpoints" / f"round-{at:04d}.pt")})
    assert resumed == copy
    assert rows(resumed) == rows(full) and len(rows(full)) == drawn["num-server-rounds"], drawn
    a, b = torch.load(full / "final_model.pt"), torch.load(resumed / "final_model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a), drawn
