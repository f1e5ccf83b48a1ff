"""Churn under Flower's own workflows (``DefaultWorkflow``, ``SecAggPlusWorkflow``) and a
``client_fn`` / NumPyClient app, in process: the grid dates every stage by its ``group_id``, lists
only the online, counts only the stage that trains, and SecAgg+ gives the plain weighted mean of
the clients that took part, under churn and with nodes leaving between stages."""

import copy
import json
import logging

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import Context, FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.compat.common.recorddict_compat import fitins_to_recorddict
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.supercore.run import Run

from availability import build_schedule
from client_app.dropin import availability_mod
from experiments.inprocess import InProcessGrid
from server_app.dropin import NoWorkDone, RoundUnknown, with_availability
from server_app.results import read_matrix

N, SPEC, SEED = 5, "bernoulli:p=0.6", 1
SHAPE = (3, 4)
QUANTUM = 2 * 8.0 / 4194304  # SecAgg+'s quantisation step (clipping range 8, 2**22 levels), per client


class Linear(NumPyClient):
    """A client whose fit returns parameters + (cid + 1) * round / 10, weighted by cid + 1:
    the plain weighted mean of any set of clients is known in closed form."""

    def __init__(self, cid: int) -> None:
        self.cid = cid

    def fit(self, parameters, config):
        rnd = int(config.get("round", 1))
        return [p + (self.cid + 1) * rnd / 10 for p in parameters], self.cid + 1, {}

    def evaluate(self, parameters, config):
        return 0.0, 1, {}


def client_fn(context: Context):
    return Linear(int(context.node_config["partition-id"])).to_client()


def numpy_app(secure: bool) -> ClientApp:
    """A client_fn app with the documented one line (availability_mod among its mods)."""
    return ClientApp(client_fn=client_fn, mods=[secaggplus_mod, availability_mod] if secure else [availability_mod])


class Recorder(LegacyFedAvg):
    """Flower's legacy FedAvg, noting what each round aggregated and from which nodes."""

    def __init__(self, **kwargs) -> None:
        super().__init__(fraction_fit=1.0, min_fit_clients=2, min_available_clients=0, fraction_evaluate=1.0,
                         min_evaluate_clients=1, initial_parameters=ndarrays_to_parameters([np.zeros(SHAPE)]),
                         on_fit_config_fn=lambda rnd: {"round": rnd}, **kwargs)
        self.aggregated: dict[int, tuple[np.ndarray, list[int]]] = {}

    def aggregate_fit(self, server_round, results, failures):
        params, metrics = super().aggregate_fit(server_round, results, failures)
        if params is not None:
            self.aggregated[server_round] = (parameters_to_ndarrays(params)[0],
                                             sorted(p.node_id for p, _ in results))
        return params, metrics


def run_workflow(grid, rounds: int, secure: bool, **secagg) -> Recorder:
    strategy = Recorder()
    context = LegacyContext(Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}),
                            config=ServerConfig(num_rounds=rounds), strategy=strategy)
    fit = SecAggPlusWorkflow(num_shares=secagg.pop("num_shares", 3), reconstruction_threshold=secagg.pop("threshold", 2),
                             max_weight=float(N), **secagg) if secure else None
    DefaultWorkflow(fit_workflow=fit)(grid, context)
    return strategy


class SerialisingGrid(InProcessGrid):
    """Each node gets its own copy of a message's content, as over the wire (SecAgg+ builds one
    content for every node of a stage, and its mod pops the stage out of what it receives)."""

    def deliver(self, msg):
        msg.content = copy.deepcopy(msg.content)
        return super().deliver(msg)


def inner_grid(secure: bool) -> InProcessGrid:
    grid = SerialisingGrid(N, {}, client_app=numpy_app(secure))
    grid.set_run(Run.create_empty(1))
    return grid


def plain_mean(start: np.ndarray, clients: list[int], rnd: int) -> np.ndarray:
    w = np.array([c + 1 for c in clients], dtype=float)
    return start + (w * w).sum() / w.sum() * rnd / 10


@pytest.mark.parametrize("secure", [False, True])
def test_flowers_default_workflow_trains_only_the_online_and_records_one_line_per_round(secure, tmp_path):
    """DefaultWorkflow (plain or SecAgg+) with a client_fn app: every stage is dated by its group_id,
    the legacy client manager samples among the online only, participation = the schedule in the
    rounds that reach SecAgg+'s threshold, and the aggregate is the plain weighted mean of exactly
    those clients (within SecAgg+'s quantisation)."""
    rounds = 4
    inner = inner_grid(secure)
    grid = with_availability(inner, SPEC, num_clients=N, seed=SEED, results_dir=tmp_path)
    strategy = run_workflow(grid, rounds, secure)
    schedule = build_schedule(SPEC, N, SEED).matrix(rounds)
    assert 0 < schedule.sum() < schedule.size
    trained = {r: sorted({inner.partition_of[m.metadata.dst_node_id] for m in inner.delivered
                          if m.metadata.message_type == MessageType.TRAIN and m.metadata.group_id == str(r)})
               for r in range(1, rounds + 1)}
    online = [np.flatnonzero(row).tolist() for row in schedule]
    assert [trained[r] for r in range(1, rounds + 1)] == [o if len(o) >= 2 else [] for o in online]
    lines = (tmp_path / "rounds.jsonl").read_text().splitlines()
    # one line per round (SecAgg+: its 4 stages in one); a round SecAgg+ could not start is a halted round
    assert len(lines) == rounds
    participation = read_matrix(tmp_path / "participation.csv")
    expected = np.array([row if row.sum() >= 2 else np.zeros_like(row) for row in schedule])
    assert (participation == expected[: len(participation)]).all()
    x = np.zeros(SHAPE)
    for rnd in range(1, rounds + 1):
        if len(online[rnd - 1]) < 2:
            assert rnd not in strategy.aggregated
            continue
        got, nodes = strategy.aggregated[rnd]
        assert sorted(inner.partition_of[n] for n in nodes) == online[rnd - 1]
        want = plain_mean(x, online[rnd - 1], rnd)
        assert np.abs(got - want).max() <= (QUANTUM * N * 20 if secure else 1e-12), rnd
        x = got


def test_secagg_recovers_a_node_that_leaves_between_stages_and_reports_a_round_below_threshold(tmp_path, caplog):
    """Round 1: every client online, client 2 leaves before the masked vectors (it sent its key
    shares): the round completes without it, its masks recovered from the others' shares, the mean
    that of the other four. Round 2: client 3 leaves before unmasking (after its vector): it still
    counts. Round 3: with a threshold of 4, three clients leave at key sharing: the round halts and
    is recorded as halted, with no participants."""
    inner = inner_grid(True)
    departures = {(1, 2): "collect_masked_vectors", (2, 3): "unmask",
                  (3, 0): "share_keys", (3, 1): "share_keys", (3, 4): "share_keys"}
    grid = with_availability(inner, "always", num_clients=N, results_dir=tmp_path, departures=departures,
                             max_idle_rounds=0)
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy = run_workflow(grid, 3, True, num_shares=5, threshold=4)
    x = np.zeros(SHAPE)
    got, nodes = strategy.aggregated[1]
    assert sorted(inner.partition_of[n] for n in nodes) == [0, 1, 3, 4]
    assert np.abs(got - plain_mean(x, [0, 1, 3, 4], 1)).max() <= QUANTUM * N * 20
    got2, nodes2 = strategy.aggregated[2]
    assert sorted(inner.partition_of[n] for n in nodes2) == [0, 1, 2, 3, 4]
    assert np.abs(got2 - plain_mean(got, [0, 1, 2, 3, 4], 2)).max() <= QUANTUM * N * 20
    assert 3 not in strategy.aggregated and "Secure aggregation halted." in caplog.text
    rows = {r["round"]: r for r in map(json.loads, (tmp_path / "rounds.jsonl").read_text().splitlines())}
    assert [rows[r]["secure"]["status"] for r in (1, 2, 3)] == ["completed", "completed", "halted"]
    assert rows[1]["participants"] == [0, 1, 3, 4] and rows[2]["participants"] == [0, 1, 2, 3, 4]
    assert rows[3]["participants"] == [] and "SecAgg+ halted" in " ".join(rows[3]["problems"])
    assert read_matrix(tmp_path / "participation.csv").sum(axis=1).tolist() == [4, 5, 0]


def test_sessions_that_end_mid_round_make_nodes_leave_between_secagg_stages(tmp_path):
    """The virtual clock's sessions give the departures (with_availability(clock=...)): every job
    takes 10 s, client 3's 1 s; clients 2 and 3 are online for the first 5 s only (periodic sessions,
    then off for 100 s). Round 1: client 2 leaves during its training (its masks recovered from the
    shares), client 3 after its masked vector, before unmasking (it counts). Round 2 starts at 10 s,
    when both are off: they are not listed, as unconnected nodes."""
    from server_app.sessionstages import SessionStages
    from virtualtime import VirtualClock, parse_profiles

    devices = {"slow": {"clients": [0, 1, 4], "step_ms": 10_000},
               "leaves": {"clients": [2], "step_ms": 10_000, "session_on_s": 5, "session_off_s": 100,
                          "session_model": "periodic"},
               "uploads-then-leaves": {"clients": [3], "step_ms": 1_000, "session_on_s": 5, "session_off_s": 100,
                                       "session_model": "periodic"}}
    clock = VirtualClock(parse_profiles(devices, N), model_bytes=0, seed=0)
    stages = SessionStages(clock, build_schedule("always", N, 0))
    assert [stages.get((1, c)) for c in range(N)] == [None, None, "collect_masked_vectors", "unmask", None]
    assert stages.start(2) == 10.0 and [stages.get((2, c)) for c in range(N)] == [None, None, "setup", "setup", None]
    inner = inner_grid(True)
    grid = with_availability(inner, "always", num_clients=N, results_dir=tmp_path, clock=clock, max_idle_rounds=0)
    strategy = run_workflow(grid, 2, True, num_shares=5, threshold=3)
    got, nodes = strategy.aggregated[1]
    assert sorted(inner.partition_of[n] for n in nodes) == [0, 1, 3, 4]
    assert np.abs(got - plain_mean(np.zeros(SHAPE), [0, 1, 3, 4], 1)).max() <= QUANTUM * N * 20
    rows = {r["round"]: r for r in map(json.loads, (tmp_path / "rounds.jsonl").read_text().splitlines())}
    assert rows[1]["participants"] == [0, 1, 3, 4] and rows[1]["secure"]["stages"]["unmask"] == [0, 1, 4]
    assert rows[2]["addressed"] == [0, 1, 4] and rows[2]["participants"] == [0, 1, 4]
    with pytest.raises(ValueError, match="departures or a clock"):
        with_availability(inner_grid(True), "always", num_clients=N, clock=clock, departures={(1, 0): "unmask"})


@pytest.mark.parametrize("rounds, idle, when", [(4, 2, "no client's update was applied in rounds 1-2"),
                                                (2, 3, "the run ended and no client's update was applied in any of its 2 r")])
def test_secagg_rounds_that_all_halt_fail_the_run_with_the_reason(rounds, idle, when):
    """No success without work: threshold 4 of 5 and bernoulli p=0.3, so no round reaches it; after
    max_idle_rounds such rounds, or when a shorter run ends (DefaultWorkflow's [SUMMARY]), the run
    fails naming the halted SecAgg+."""
    grid = with_availability(inner_grid(True), "bernoulli:p=0.3", num_clients=N, seed=0, max_idle_rounds=idle)
    with pytest.raises(NoWorkDone, match=f"{when}.*SecAgg\\+ halted"):
        run_workflow(grid, rounds, True, num_shares=5, threshold=4)


def test_an_offline_node_gets_flowers_unavailable_reply_and_undated_messages_are_refused():
    inner = InProcessGrid(4, {}, client_app=numpy_app(False))
    grid = with_availability(inner, SPEC, num_clients=4, seed=SEED)
    schedule = grid.schedule.available(0)
    nodes = sorted(inner.partition_of)
    listed = sorted(grid.get_node_ids())
    assert listed == [n for n in nodes if schedule[inner.partition_of[n]]] and 0 < len(listed) < 4
    offline = next(n for n in nodes if n not in listed)
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": 1})}), dst_node_id=offline,
                  message_type=MessageType.EVALUATE)
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE
    assert reply.metadata.src_node_id == SUPERLINK_NODE_ID and reply.metadata.reply_to_message_id == msg.metadata.message_id
    undated = Message(RecordDict(), dst_node_id=listed[0], message_type=MessageType.TRAIN)
    with pytest.raises(RoundUnknown, match="server-round.*group_id.*count_rounds=True"):
        grid.send_and_receive([undated])
    assert not [m for m in inner.delivered if m.metadata.message_type == MessageType.TRAIN]  # refused, not sent


def test_the_grids_own_count_dates_a_loop_whose_messages_name_no_round(tmp_path):
    """count_rounds=True: each send of undated train messages is the next round, and the listing
    follows the schedule round by round."""
    inner = InProcessGrid(4, {}, client_app=numpy_app(False))
    grid = with_availability(inner, SPEC, num_clients=4, seed=SEED, count_rounds=True, results_dir=tmp_path)
    schedule = build_schedule(SPEC, 4, SEED)
    for rnd in range(1, 4):
        nodes = list(grid.get_node_ids())
        assert sorted(inner.partition_of[n] for n in nodes) == np.flatnonzero(schedule.available(rnd - 1)).tolist()
        content = fitins_to_recorddict(FitIns(ndarrays_to_parameters([np.zeros(SHAPE)]), {}), True)
        grid.send_and_receive([Message(content, dst_node_id=n, message_type=MessageType.TRAIN) for n in nodes])
    assert sorted(grid.rounds) == [1, 2, 3]
    assert (read_matrix(tmp_path / "participation.csv") == schedule.matrix(3)).all()


def test_a_round_announced_by_another_threads_loop_does_not_move_this_grids_clock(tmp_path):
    """Flower's loops say their rounds only on its (process-wide) logger: once this grid has sent,
    a ``[ROUND r]`` line from a thread that never sent through it (a loop of a test before, a second
    app in the process) is not this grid's round; one from the thread that sends is."""
    import threading

    grid = with_availability(inner_grid(False), SPEC, num_clients=N, seed=SEED, results_dir=tmp_path)
    flwr_log = logging.getLogger("flwr")
    flwr_log.info("[ROUND %s]", 1)  # before any send: every thread's line counts (Flower's first round)
    assert grid.listing_round() == 1
    assert list(grid.send_and_receive([])) == []  # this thread sends through the grid
    other = threading.Thread(target=flwr_log.info, args=("[ROUND %s]", 3))
    other.start()
    other.join()
    assert grid.announced == 1 and grid.listing_round() == 1
    flwr_log.info("[ROUND %s]", 2)  # the sending thread's loop
    assert grid.announced == 2 and grid.listing_round() == 2
