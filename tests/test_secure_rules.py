"""``secure=secagg+`` (issue 35, item 4): the rules whose server step is a weighted sum of the round's
updates run on Flower's SecAgg+, and their aggregate equals the plain one within its quantisation,
under churn and with nodes leaving between stages (one config, checked in detail, and random configs:
rule, weighting, schedule, N, seeds, rounds, departures); the other rules refuse with the reason."""

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord
from hypothesis import HealthCheck, given, settings, strategies as st

from availability import build_schedule
from client_app.secure import weighted_update
from experiments.inprocess import InProcessGrid, run_inprocess
from runconfig import ConfigError, WorkloadConfig, from_run_config
from runconfig.defaults import default_run_config
from server_app.dropin import with_availability
from server_app.messages import STAGES
from server_app.results import read_metrics
from strategies import build_strategy
from strategies.layout import Layout
from strategies.protocol import SECURE_CLIP_NORM, SECURE_CLIPPING_RANGE, SECURE_EXAMPLE_SCALE, SECURE_FACTORS
from strategies.registry import STRATEGIES
from strategies.secure import REFUSALS, SECURE_RULES
from workloads.workload import get_workload

N, SPEC, SEED = 6, "bernoulli:p=0.75", 5  # online: round 1 {1, 2, 4, 5}, round 2 {1, 2, 5}, round 3 {4}
TINY = {"num-clients": N, "dataset": "digits", "model": "mlp", "eval-every": 0, "local-steps": "steps:n=2",
        "checkpoint-every": 0, "progress": False}
# client 2 leaves round 1 before sending its masked vector (its masks are recovered from the others'
# shares: it does not count); client 5 leaves round 2 before unmasking (its vector counts)
DEPARTURES = {(1, 2): "collect_masked_vectors", (2, 5): "unmask"}
QUANTUM = 2 * 8.0 / 2**22  # SecAgg+'s step per entry (clipping range 8, 2**22 levels)


def secure_and_plain(spec, tmp_path, rounds=3, *, n=N, availability=SPEC, seed=SEED, departures=DEPARTURES,
                     run_config=None, **shared):
    """Each round from the same x^t: the secure rule on the churn grid (``departures`` between stages),
    and the plain rule on the replies of the clients the secure round counted."""
    run_config = {**default_run_config(), **TINY, "num-clients": n, **(run_config or {})}
    inner = InProcessGrid(n, run_config)
    grid = with_availability(inner, availability, num_clients=n, seed=seed, departures=departures,
                             results_dir=tmp_path, max_idle_rounds=0)
    schedule = build_schedule(availability, n, seed)
    # rounds of fewer than two online clients halt SecAgg+: empty rounds, never failed ones (the default
    # max_failed_rounds=3 stays: random schedules give runs of halted rounds)
    common = {"num_clients": n, "probabilities": schedule.prob, "min_available_nodes": 0, **shared}
    secure = build_strategy(f"{spec}{',' if ':' in spec else ':'}secure=secagg+", **common)
    plain = build_strategy(f"{spec}{',' if ':' in spec else ':'}max-norm-ratio=0", **common)  # a secure run's bounds
    x = ArrayRecord(get_workload(from_run_config(WorkloadConfig, run_config)).new_model().state_dict())
    layout, out = Layout.of(x), []
    for rnd in range(1, rounds + 1):
        # Flower's loop announces each round (Strategy.start's line): the churn grid lists round rnd's
        # online nodes even after rounds that sent nothing
        logging.getLogger("flwr").info("[ROUND %s/%s]", rnd, rounds)
        assert list(secure.configure_train(rnd, x, ConfigRecord(), grid)) == []  # the round ran in SecAgg+'s stages
        new_secure, metrics = secure.aggregate_train(rnd, [])
        counted = secure.round_log.participants
        sent = [m for m in plain.configure_train(rnd, x, ConfigRecord(), inner)
                if inner.partition_of[m.metadata.dst_node_id] in counted]
        new_plain, _ = plain.aggregate_train(rnd, inner.send_and_receive(sent))
        assert plain.round_log.participants == counted
        a, b, x0 = layout.flatten(new_secure), layout.flatten(new_plain), layout.flatten(x)
        total = secure.outcome.total
        # x^{t+1} - x^t = M × (the unmasked sum): each of its m terms errs by < one quantum per entry
        gain = float(np.linalg.norm(a - x0) / np.linalg.norm(total)) if total is not None else 0.0
        out.append({"participants": counted, "metrics": dict(metrics), "gap": float(np.abs(a - b).max()),
                    "step": float(np.abs(b - x0).max()), "bound": gain * len(counted) * QUANTUM + 1e-7,
                    "problems": list(secure.problems)})
        x = new_secure
    return out, tmp_path


@pytest.mark.parametrize(("spec", "weighting"), [
    ("fedavg-active", "num-examples"), ("fedavg-active", "equal"), ("fedavg-all", "auto"), ("fedavg-known-p", "auto"),
    ("fedau:cutoff=5", "auto"), ("debiased-fedavg:estimate=marginal", "auto")])
def test_the_secure_aggregate_equals_the_plain_one_under_churn_and_departures(spec, weighting, tmp_path):
    rounds, folder = secure_and_plain(spec, tmp_path, weighting=weighting)
    assert [r["participants"] for r in rounds] == [[1, 4, 5], [1, 2, 5], []]
    for r in rounds[:2]:
        assert r["metrics"]["secure-completed"] == 1 and r["step"] > 100 * r["bound"]  # a real step, a small gap
        assert r["gap"] <= r["bound"], (spec, r)
    halted = rounds[2]
    assert halted["metrics"]["secure-completed"] == 0 and halted["gap"] == 0 == halted["step"]
    assert halted["problems"] == []  # churn (one node online) is an empty round, not a failed one
    # the churn grid's own record follows the SecAgg+ rounds (round 3 sent no message: Flower's setup
    # refuses a single node before sending)
    lines = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    assert [line["secure"]["status"] for line in lines[:2]] == ["completed", "completed"]
    assert [line["participants"] for line in lines[:2]] == [[1, 4, 5], [1, 2, 5]]


# -- the same equality over random configs (developers' guide: equality claims are tested over random
# configs, not one): rule and its options, weighting, schedule and its parameters, N, seeds, rounds,
# and nodes leaving between SecAgg+'s stages. Derandomized: CI sees the same draws every time.
RANDOM_RULES = {  # rule -> its specs; those with a weighting of their own draw it
    "fedavg-active": ["fedavg-active"], "fedavg-all": ["fedavg-all"], "fedavg-known-p": ["fedavg-known-p"],
    "fedau": ["fedau", "fedau:cutoff=2", "fedau:cutoff=0"],
    "debiased-fedavg": ["debiased-fedavg:estimate=share", "debiased-fedavg:estimate=marginal"],
}
WEIGHTED = ("fedavg-active", "fedavg-all")  # the others weight 1/N (refuse num-examples) or by 1/p
STAGE_NAMES = list(STAGES)  # setup (gone from the round's start), ..., unmask


@st.composite
def secure_configs(draw, rule):
    n, rounds = draw(st.integers(3, 8)), draw(st.integers(2, 3))
    unit = st.sampled_from([0.3, 0.5, 0.7, 0.9])
    availability = draw(st.one_of(
        st.just("always"), unit.map(lambda p: f"bernoulli:p={p}"),
        st.tuples(unit, unit).map(lambda pq: f"on-off:p={pq[0]},q={pq[1]},spread=0.1"),
        st.tuples(st.integers(1, 3), unit).map(lambda g: f"group-dropout:groups={g[0]},fail=0.3,recover=0.6,p={g[1]}"),
        st.tuples(st.integers(1, 3), unit).map(lambda g: f"group-cyclic:groups={g[0]},window=1,sample={g[1]}"),
        st.sampled_from([0.2, 0.4]).map(lambda a: f"dropout:alpha={a}"),
        st.sampled_from([0.3, 1.0]).map(lambda s: f"ln:sigma={s}")))
    leaving = draw(st.dictionaries(st.tuples(st.integers(1, rounds), st.integers(0, n - 1)),
                                   st.sampled_from(STAGE_NAMES), max_size=3))
    return {"spec": draw(st.sampled_from(RANDOM_RULES[rule])), "n": n, "rounds": rounds,
            "availability": availability, "seed": draw(st.integers(0, 2**16)), "departures": leaving,
            "weighting": draw(st.sampled_from(["equal", "num-examples"])) if rule in WEIGHTED else "auto",
            "train-seed": draw(st.integers(0, 3))}


@pytest.mark.parametrize("rule", sorted(RANDOM_RULES))  # each rule on three drawn configs
@given(data=st.data())
@settings(max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
def test_the_secure_aggregate_equals_the_plain_one_on_random_configs(rule, data):
    """Every round of a random config: the secure model within the quantisation bound of the plain
    rule's on the same counted replies; a completed round counts exactly the online clients that did
    not leave before sending their masked vectors (one that leaves before unmasking counts), a halted
    one counts none and moves nothing; a round of two or more online clients, none leaving, completes."""
    cfg = data.draw(secure_configs(rule), label="config")
    schedule = build_schedule(cfg["availability"], cfg["n"], cfg["seed"])
    with tempfile.TemporaryDirectory() as tmp:
        rounds, _ = secure_and_plain(cfg["spec"], Path(tmp), cfg["rounds"], n=cfg["n"], availability=cfg["availability"],
                                     seed=cfg["seed"], departures=cfg["departures"], weighting=cfg["weighting"],
                                     run_config={"train-seed": cfg["train-seed"]})
    for rnd, r in enumerate(rounds, start=1):
        online = np.flatnonzero(schedule.available(rnd - 1)).tolist()
        leaving = {c: stage for (at, c), stage in cfg["departures"].items() if at == rnd and c in online}
        stays = [c for c in online if leaving.get(c, "unmask") == "unmask"]
        assert r["gap"] <= r["bound"], (rnd, r)
        if len(online) >= 2 and not leaving:  # nobody leaves: SecAgg+ has every share it needs
            assert r["metrics"]["secure-completed"] == 1, (rnd, r)
        if r["metrics"].get("secure-completed") == 1:
            assert r["participants"] == stays and r["step"] > 100 * r["bound"], (rnd, r)  # a real step, a small gap
        else:
            assert r["participants"] == [] and r["gap"] == 0 == r["step"], (rnd, r)


def test_rounds_with_one_client_online_are_empty_rounds_and_never_end_the_run(tmp_path):
    """Cyclic groups of one client: SecAgg+ halts every round (it needs two), which is churn, not a
    rule's failure: more halted rounds in a row than the default ``max_failed_rounds`` (3) and the
    run goes on, each round empty, with no problem recorded."""
    rounds, _ = secure_and_plain("fedau", tmp_path, rounds=5, n=3, availability="group-cyclic:groups=3,window=1,sample=1.0",
                                 departures={})
    assert [r["metrics"]["secure-completed"] for r in rounds] == [0] * 5
    assert all(r["problems"] == [] and r["step"] == 0 and r["participants"] == [] for r in rounds)


def test_the_projects_serverapp_runs_a_secure_rule_under_churn(tmp_path):
    """``strategy = "fedau:secure=secagg+"`` in the project's own ServerApp (in process, server gate):
    every round with two or more online clients completes with exactly those clients. The cohort
    engine trains such a run per client (SecAgg+'s stages run in each client's mod), and says so."""
    path = run_inprocess({**TINY, "strategy": "fedau:secure=secagg+", "availability": SPEC, "schedule-seed": SEED,
                          "num-server-rounds": 2, "results-dir": str(tmp_path), "engine": "cohort"})
    assert json.loads((path / "config.json").read_text())["engine-used"] == "per-client"
    rows = read_metrics(path)
    schedule = build_schedule(SPEC, N, SEED)
    assert [r["participants"] for r in rows] == [np.flatnonzero(schedule.available(t)).tolist() for t in range(2)]
    assert [r["secure-completed"] for r in rows] == [1, 1] and all(r["update-norm"] > 0 for r in rows)


@pytest.mark.parametrize("name", sorted(set(STRATEGIES) - SECURE_RULES))
def test_every_other_rule_refuses_secure_with_its_reason(name):
    cls = STRATEGIES[name]
    with pytest.raises(ValueError, match=f"strategy '{name}' cannot run with secure=secagg\\+") as err:
        build_strategy(f"{name}:secure=secagg+", num_clients=4, probabilities=lambda t: np.ones(4))
    reason = "asynchronous" if getattr(cls, "asynchronous", False) else REFUSALS[name]
    assert reason in str(err.value)


def test_a_users_subclass_runs_secure_unless_it_overrides_the_weighted_sum():
    from strategies.rules.fedau import FedAU
    from strategies.secure import refusal, secure_class

    class Tracked(FedAU):
        name = "tracked-fedau"

        def summary(self):
            super().summary()

    class OwnSum(FedAU):
        name = "own-sum"

        def aggregate(self, t, x, reports):
            return x, {}

    assert refusal(Tracked) == "" and issubclass(secure_class(Tracked, "secagg+"), Tracked)
    assert "OwnSum overrides aggregate of FedAU" in refusal(OwnSum)


def test_the_flower_surface_the_secure_round_drives_is_there():
    """strategies/secagg.py runs SecAggPlusWorkflow's stages one by one and reads its state's fields
    (docs/flower-versions.md): fails here, naming them, when Flower changes them."""
    import dataclasses
    import inspect

    from flwr.server.workflow import SecAggPlusWorkflow
    from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState

    fields = {f.name for f in dataclasses.fields(WorkflowState)}
    assert {"nid_to_fitins", "sampled_node_ids", "active_node_ids", "threshold", "num_shares"} <= fields
    for stage in ("setup_stage", "share_keys_stage", "collect_masked_vectors_stage", "unmask_stage"):
        assert list(inspect.signature(getattr(SecAggPlusWorkflow, stage)).parameters) == ["self", "grid", "context",
                                                                                        "state"], stage
    from flwr.server.workflow.secure_aggregation import secaggplus_workflow
    assert "factor_extract(" in inspect.getsource(SecAggPlusWorkflow.unmask_stage)  # strategies/secagg_checks.py
    assert callable(secaggplus_workflow.factor_extract)


@pytest.mark.parametrize(("spec", "why"), [
    ("fedau:secure=secagg+,robust=median", "robust"),
    ("fedavg-active:secure=secagg+,max-norm-ratio=5", "max-norm-ratio"),
    ("fedavg-active:secure=secagg+,max-weight-share=0.5", "max-weight-share"),
    ("fedavg-all:secure=aes", "must be one of \\['secagg\\+'\\]"),
])
def test_bounds_that_need_each_update_are_refused_under_secure(spec, why):
    with pytest.raises(ValueError, match=why):
        build_strategy(spec, num_clients=4)


def test_a_refused_secure_spec_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'strategy'.*mifa.*each client's latest"):
        run_inprocess({**TINY, "strategy": "mifa:secure=secagg+", "results-dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"'devices'.*SecAgg\+'s four stages"):
        run_inprocess({**TINY, "strategy": "fedau:secure=secagg+", "devices": "devices.toml", "results-dir": str(tmp_path)})
    assert not any(tmp_path.iterdir())


def test_the_client_clips_weights_and_refuses_what_secaggs_range_would_clip():
    """The norm bound moved to the client: ‖Δ‖ clipped before the factor; data-size weights scale by
    n_i / the server's scale; an entry beyond the clipping range is refused, not clipped."""
    start = [np.zeros(4, np.float32), np.zeros(2, np.int64)]
    trained = [np.array([3.0, 4.0, 0.0, 0.0], np.float32), np.array([7, 7])]  # ‖Δ‖ = 5; integers stay out
    config = {SECURE_FACTORS: [0.5, 0.25], SECURE_CLIP_NORM: 2.5, SECURE_CLIPPING_RANGE: 8.0, SECURE_EXAMPLE_SCALE: 0.0}
    got = weighted_update(start, trained, config, {"client-id": 1, "num-examples": 10})
    np.testing.assert_allclose(got, [0.375, 0.5, 0.0, 0.0])  # (3, 4) × 2.5/5 × 0.25
    got = weighted_update(start, trained, {**config, SECURE_EXAMPLE_SCALE: 20.0}, {"client-id": 0, "num-examples": 10})
    np.testing.assert_allclose(got, [0.375, 0.5, 0.0, 0.0])  # × 0.5 × 10/20
    with pytest.raises(ValueError, match="beyond SecAgg\\+'s clipping range 0.2.*secure-clipping-range"):
        weighted_update(start, trained, {**config, SECURE_CLIPPING_RANGE: 0.2}, {"client-id": 1, "num-examples": 1})
    with pytest.raises(ValueError, match="client id 2 has no factor"):
        weighted_update(start, trained, config, {"client-id": 2, "num-examples": 1})


def test_a_survivor_whose_reply_is_rejected_makes_the_round_apply_nothing():
    """Its masked vector is inside the sum, so the round cannot apply the others' alone: fail closed,
    with the reason in the round's problems (here every reply claims more examples than allowed)."""
    run_config = {**default_run_config(), **TINY}
    grid = InProcessGrid(3, {**run_config, "num-clients": 3})
    secure = build_strategy("fedavg-all:secure=secagg+", num_clients=3, min_available_nodes=0, max_num_examples=10)
    x = ArrayRecord(get_workload(from_run_config(WorkloadConfig, {**run_config, "num-clients": 3})).new_model().state_dict())
    secure.configure_train(1, x, ConfigRecord(), grid)
    new, metrics = secure.aggregate_train(1, [])
    assert metrics["secure-completed"] == 1 and metrics["secure-survivors"] == 3
    assert secure.round_log.participants == [] and len(secure.round_log.rejected) == 3
    assert any("fail closed" in p for p in secure.problems)
    layout = Layout.of(x)
    assert np.array_equal(layout.flatten(new), layout.flatten(x))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("flower-superlink") is None or shutil.which("flwr") is None,
                    reason="flower-superlink / flwr not on PATH")
@pytest.mark.skipif(not os.environ.get("FLCHURN_EXTRA_DEPLOY_TESTS"), reason="a 3-9 minute deployment: opt-in with "
                    "FLCHURN_EXTRA_DEPLOY_TESTS=1 (CI's time budget; secure rounds under churn run in CI in process)")
def test_a_secure_rule_deployed_with_churn_completes_every_round_with_the_online_clients(tmp_path):
    """``python -m deploy launch --churn`` with ``fedau:secure=secagg+``: 4 SuperNode processes,
    stopped and restarted by bernoulli:p=0.75 seed 1 (online {0,1,2,3}, {1,2}, {0,1,2,3}); every
    round completes SecAgg+ with exactly the online clients (measured: docs/secure-aggregation.md)."""
    from deploy.local import ProcessSite
    from deploy.run import run_deployment

    spec, seed, rounds = "bernoulli:p=0.75", 1, 3
    cfg = {"num-server-rounds": rounds, "strategy": "fedau:secure=secagg+", "availability": spec,
           "schedule-seed": seed, "dataset": "digits", "model": "mlp", "local-steps": "steps:n=2", "eval-every": 0,
           "checkpoint-every": 0, "device": "cpu", "results-dir": str(tmp_path / "results"), "progress": False}
    with ProcessSite(4, tmp_path / "work") as site:
        out = run_deployment(site, cfg, churn="rounds", timeout=1200)
    assert out.completed, out.status
    schedule = build_schedule(spec, 4, seed).matrix(rounds)
    assert [r["participants"] for r in out.rows] == [[c for c in range(4) if row[c]] for row in schedule]
    assert [r["secure-completed"] for r in out.rows] == [1] * rounds
    assert out.report is not None and not out.report.failures, out.report.failure_text()
