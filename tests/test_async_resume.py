"""Resuming an asynchronous run on the virtual clock (issue 29 follow-up; server_app/async_resume.py).

- over random configs (rule, K, concurrency, staleness bound, availability, devices with
  sessions, the checkpoint's aggregation, nodes with other ids after the restart), a run resumed
  from its checkpoint records the same rows and ends with the same model as the uninterrupted run,
  bit for bit;
- a checkpoint continues only the loop that wrote it, with the same settings: a synchronous
  checkpoint into an asynchronous run, the reverse, another rule's parameters, a deployment, and
  a checkpoint of an earlier version are refused before anything is touched, naming the problem.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from hypothesis import Phase, example, given, settings, strategies as st

from deploy.errors import DeployError
from deploy.submission import check_run_config
from experiments.inprocess import NODE_ID_BASE, default_run_config, run_inprocess
from runconfig import ConfigError
from server_app import checkpoint
from server_app.results import METRICS, read_metrics

N, ROUNDS = 4, 6
TINY = {"num-clients": N, "dataset": "digits", "model": "mlp", "eval-every": 0, "progress": False,
        "batch-size": 128, "num-server-rounds": ROUNDS}
SESSIONS = ("[fast]\nclients = [0, 1]\nstep_ms = {fast}\nsession_on_s = {on}\nsession_off_s = {off}\n"
            "[slow]\nclients = [2, 3]\nstep_ms = {slow}\n")
OTHER_NODES = [9_000_000 + 17 * i for i in range(N)]  # as a new Flower simulation draws new node ids


@pytest.fixture(autouse=True, scope="module")
def no_plots():
    with pytest.MonkeyPatch.context() as mp:  # the pictures are test_plots.py's; here they cost 1-3 s a run
        mp.setattr("server_app.results.plot_run", lambda *args, **kwargs: None)
        yield


def rows_by_client(run_dir):
    """The rows without wall times, a rejected reply's node and a lost job's node named by its
    client (node ids differ when the run is resumed on other nodes)."""
    client = {node: i for ids in (OTHER_NODES, [NODE_ID_BASE + i for i in range(N)]) for i, node in enumerate(ids)}
    return [{**{k: v for k, v in r.items() if k not in ("round-time", "wall-time")},
             "rejected": [[client[node], why] for node, why in r["rejected"]],
             "lost-nodes": [client[node] for node in r.get("lost-nodes", [])]} for r in read_metrics(run_dir)]


def resume(run_dir, cfg, at, **grid):
    """A copy of ``run_dir`` cut short after checkpoint ``at`` (as a crash leaves it), resumed."""
    copy = run_dir.parent / f"{run_dir.name}-resumed"
    shutil.copytree(run_dir, copy)
    (copy / "final_model.pt").unlink()
    for later in (copy / checkpoint.FOLDER).glob("round-*.pt"):
        if int(later.stem.split("-")[1]) > at:
            later.unlink()
    return run_inprocess({**cfg, "resume-from": str(checkpoint.path_of(copy, at))}, **grid)


@settings(max_examples=5, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.generate))
@given(rule=st.sampled_from(["fedbuff", "fedasync"]), k=st.integers(1, 3), concurrency=st.sampled_from([0, 1, 3]),
       max_staleness=st.sampled_from([0, 1, 100]), availability=st.sampled_from(["always", "sine:gamma=0.6,period=3"]),
       sessions=st.none() | st.tuples(st.integers(100, 900), st.integers(100, 900), st.integers(1, 6),
                                      st.integers(1, 6)),
       at=st.integers(1, ROUNDS - 1), other_nodes=st.booleans(), seed=st.integers(0, 3))
@example(rule="fedbuff", k=3, concurrency=0, max_staleness=100, availability="always", sessions=None, at=1,
         other_nodes=False, seed=0)  # 4 equal jobs arrive at one instant: the 4th waits behind the checkpoint
@example(rule="fedasync", k=1, concurrency=0, max_staleness=100, availability="always", sessions=None, at=1,
         other_nodes=True, seed=0)  # the checkpoint after the 1st of 4 aggregations of one instant: no job goes
#                                    out before the instant's last (they start from version 4)
def test_a_resumed_async_run_equals_the_uninterrupted_run(tmp_path_factory, rule, k, concurrency, max_staleness,
                                                          availability, sessions, at, other_nodes, seed):
    tmp = tmp_path_factory.mktemp("resume")
    spec = f"{rule}:concurrency={concurrency},max-staleness={max_staleness}" + (f",k={k}" if rule == "fedbuff" else "")
    cfg = {**TINY, "strategy": spec, "availability": availability, "schedule-seed": seed, "checkpoint-every": at,
           "local-steps": "steps:n=3" if sessions is None and availability == "always" else "epochs:min=1,max=2",
           "results-dir": str(tmp), "run-name": "full"}
    if sessions is not None:
        (tmp / "devices.toml").write_text(SESSIONS.format(fast=sessions[0], slow=sessions[1], on=sessions[2],
                                                          off=sessions[3]))
        cfg["devices"] = str(tmp / "devices.toml")
    full = run_inprocess(cfg)
    ckpt = checkpoint.load(checkpoint.path_of(full, at))
    loop = ckpt["loop"]
    assert loop["kind"] == checkpoint.VIRTUAL and ckpt["round"] == at
    assert loop["in_flight"] == sum(e["kind"] == "arrival" for e in loop["events"])
    resumed = resume(full, {k: v for k, v in cfg.items() if k != "run-name"},
                     at, **({"node_ids": OTHER_NODES} if other_nodes else {}))
    assert len(read_metrics(full)) == ROUNDS
    assert rows_by_client(resumed) == rows_by_client(full)
    a, b = torch.load(full / "final_model.pt"), torch.load(resumed / "final_model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_the_checkpoint_holds_the_buffer_and_the_arrival_of_the_same_instant(tmp_path):
    """FedBuff K = 3 over 4 equal jobs: the checkpoint after the first aggregation is written while
    the 4th arrival of that instant waits in the queue; the buffer is empty, the 4th is in flight
    with its reply, and the next jobs are not dispatched yet."""
    run = run_inprocess({**TINY, "strategy": "fedbuff:k=3", "availability": "always", "local-steps": "steps:n=3",
                         "checkpoint-every": 1, "num-server-rounds": 2, "results-dir": str(tmp_path)})
    loop = checkpoint.load(checkpoint.path_of(run, 1))["loop"]
    assert loop["now"] == 3.0 and loop["in_flight"] == 1 and loop["jobs_of"] == [1] * N
    (event,) = loop["events"]
    assert event["time"] == 3.0 and event["job"]["version"] == 0 and event["job"]["reply"]["content"]
    assert loop["idle"] == sorted(set(range(N)) - {event["client"]})


# ------------------------------------------------------------------ refusals
@pytest.fixture(scope="module")
def runs(tmp_path_factory, no_plots):
    """One asynchronous run and one synchronous run, each with a checkpoint at 1."""
    tmp = tmp_path_factory.mktemp("refusals")
    base = {**TINY, "availability": "always", "local-steps": "steps:n=1", "checkpoint-every": 1,
            "num-server-rounds": 2, "results-dir": str(tmp)}
    return base, {"async": run_inprocess({**base, "strategy": "fedbuff:k=2", "run-name": "a"}),
                  "sync": run_inprocess({**base, "strategy": "fedavg-active", "run-name": "s"})}


def refused(base, run_dir, match, **over):
    metrics = (run_dir / METRICS).read_text()
    with pytest.raises(ConfigError, match=match):
        run_inprocess({**base, **over, "resume-from": str(checkpoint.path_of(run_dir, 1))})
    assert (run_dir / METRICS).read_text() == metrics  # refused before anything was cut or written


def test_a_synchronous_checkpoint_does_not_resume_an_async_run_nor_the_reverse(runs):
    base, run = runs
    refused(base, run["sync"], r"written by a synchronous run \(the round loop\); this run, with strategy "
                               r"'fedbuff:k=2', is an asynchronous run on the virtual clock", strategy="fedbuff:k=2")
    refused(base, run["async"], r"written by an asynchronous run on the virtual clock; this run, with strategy "
                                r"'fedavg-active', is a synchronous run", strategy="fedavg-active")


def test_another_rule_config_is_refused_naming_the_key(runs):
    base, run = runs
    refused(base, run["async"], r"other settings for \['strategy'\]: strategy='fedbuff:k=2' \(now 'fedbuff:k=3'\)",
            strategy="fedbuff:k=3")
    refused(base, run["async"], r"other settings for \['schedule-seed'\]", strategy="fedbuff:k=2",
            **{"schedule-seed": 5})


def test_a_checkpoint_without_the_loop_state_is_refused(runs, tmp_path):
    base, run = runs
    ckpt = checkpoint.load(checkpoint.path_of(run["async"], 1))
    del ckpt["loop"]  # as the asynchronous loop wrote them before it saved its state
    earlier = tmp_path / "earlier.pt"
    torch.save(ckpt, earlier)
    with pytest.raises(ConfigError, match="an asynchronous run of an earlier version, which saved no event queue; "
                                          "without its jobs in flight"):
        run_inprocess({**base, "strategy": "fedbuff:k=2", "resume-from": str(earlier)})


def test_an_async_deployment_does_not_resume(runs):
    """Gate 'none': jobs in flight run on real nodes. Refused by the ServerApp and by the launcher
    (before it cuts the run folder back)."""
    base, run = runs
    refused(base, run["async"], r"asynchronous deployment does not resume", strategy="fedbuff:k=2",
            **{"availability-gate": "none"})
    deployed = {**default_run_config(), **base, "availability-gate": "none"}
    with pytest.raises(DeployError, match="asynchronous deployment does not resume"):
        check_run_config({**deployed, "strategy": "fedbuff:k=2", "resume-from": str(checkpoint.path_of(run["async"], 1))})
    check_run_config({**deployed, "strategy": "fedavg-active",  # rounds resume
                      "resume-from": str(checkpoint.path_of(run["sync"], 1))})
