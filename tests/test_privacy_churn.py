"""privacy.wrappers: Flower's fixed-clipping DP wrappers with noise for the clients that took part,
and a simulated run under churn (Flower's FedAvg and a project rule inside the wrapper, Flower's
own ``start``, ``with_availability``) that records (ε, δ) per round."""

import json
import math
import uuid
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg as LegacyFedAvg
from flwr.serverapp.strategy import FedAvg, Strategy
from flwr.supercore.run import Run

from availability import build_schedule
from client_app.dropin import availability_mod, identity
from experiments.inprocess import InProcessGrid
from privacy import (
    ChurnAccountant,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    LegacyDifferentialPrivacyClientSideFixedClipping,
    LegacyDifferentialPrivacyServerSideFixedClipping,
    PrivacyConfigError,
)
from server_app.dropin import with_availability
from server_app.results import read_matrix
from strategies import build_strategy

D, Z, C, DELTA = 100_000, 1.0, 0.5, 1e-4


def zeros(d: int = D) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.zeros(d, np.float32))})


def sent_to(node: int, rnd: int) -> Message:
    msg = Message(RecordDict({"config": ConfigRecord({"server-round": rnd})}), dst_node_id=node,
                  message_type=MessageType.TRAIN)
    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return msg


def replies(rnd: int, nodes, examples=None) -> list[Message]:
    """Replies that all moved the global model (zeros) by the same constant, within the clipping
    norm (Flower's clipping divides by the update's norm: a zero update raises ZeroDivisionError):
    the aggregate's spread is the noise's."""
    out = []
    for i, node in enumerate(nodes):
        content = RecordDict({"arrays": ArrayRecord({"w": Array(np.full(D, 1e-3, np.float32))}),
                              "metrics": MetricRecord({"num-examples": examples[i] if examples else 10})})
        out.append(Message(content, reply_to=sent_to(node, rnd)))
    return out


def noise_of(wrapper, rnd: int, nodes, examples=None) -> tuple[float, MetricRecord]:
    wrapper.current_arrays = zeros()  # server-side clipping's reference
    arrays, metrics = wrapper.aggregate_train(rnd, replies(rnd, nodes, examples))
    return float(arrays["w"].numpy().std()), metrics


@pytest.mark.parametrize("side", [DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyClientSideFixedClipping])
def test_the_noise_is_for_the_clients_that_replied_or_flowers_target_as_stated(side):
    """10 clients configured, 4 reply: realised σ = z·C/4 (multiplier z), Flower's target σ = z·C/10
    (the round's multiplier z·4/10, accounted as such); unequal weights raise the sensitivity to
    C·max w / Σ w."""
    realised = side(FedAvg(), Z, C, 10, num_clients=20, delta=DELTA)
    target = side(FedAvg(), Z, C, 10, num_clients=20, delta=DELTA, calibration="target")
    std, metrics = noise_of(realised, 1, [1, 2, 3, 4])
    assert std == pytest.approx(Z * C / 4, rel=0.02)
    assert metrics["dp-noise-multiplier"] == pytest.approx(Z) and metrics["dp-sampling-rate"] == 4 / 20
    std, metrics = noise_of(target, 1, [1, 2, 3, 4])
    assert std == pytest.approx(Z * C / 10, rel=0.02)
    assert metrics["dp-noise-multiplier"] == pytest.approx(Z * 4 / 10)
    std, _ = noise_of(realised, 2, [1, 2, 3], examples=[10, 10, 20])  # Δ = C·20/40
    assert std == pytest.approx(Z * C / 2, rel=0.02)
    expected = ChurnAccountant(20, DELTA)
    expected.compose(1, [1, 2, 3, 4], Z)
    assert metrics["dp-epsilon"] > 0 and realised.churn.accountant.history[0] == expected.history[0]


def test_halving_participation_under_the_target_noise_costs_four_rounds_per_round():
    """Target calibration for 10, 5 reply: multiplier z/2, so one round charges each participant
    what 4 rounds at z would (Gaussian composition: Σ 1/z²)."""
    wrapper = DifferentialPrivacyServerSideFixedClipping(FedAvg(), Z, C, 10, num_clients=10, delta=DELTA,
                                                         calibration="target")
    _, metrics = noise_of(wrapper, 1, [1, 2, 3, 4, 5])
    full = ChurnAccountant(10, DELTA)
    for r in range(1, 5):
        full.compose(r, range(10), Z)
    assert metrics["dp-noise-multiplier"] == pytest.approx(Z / 2)
    assert metrics["dp-epsilon-worst-client"] == pytest.approx(full.epsilon_worst_client(), rel=1e-9)


def test_error_replies_are_clients_that_did_not_take_part():
    """Flower's wrapper skips a round with any error reply; here the error is left out."""
    wrapper = DifferentialPrivacyServerSideFixedClipping(FedAvg(), Z, C, 3, num_clients=5, delta=DELTA)
    wrapper.current_arrays = zeros()
    got = [*replies(1, [1, 2]), Message(Error(code=1000, reason="unavailable"), reply_to=sent_to(3, 1))]
    arrays, metrics = wrapper.aggregate_train(1, got)
    assert arrays is not None and metrics["dp-participants"] == 2


def test_a_zero_update_is_within_the_clipping_norm():
    """Flower's clipping divides by the update's norm (ZeroDivisionError on a client that did not
    move); here such a reply is aggregated."""
    wrapper = DifferentialPrivacyServerSideFixedClipping(FedAvg(), Z, C, 2, num_clients=5, delta=DELTA)
    wrapper.current_arrays = zeros(3)
    same = [Message(RecordDict({"arrays": zeros(3), "metrics": MetricRecord({"num-examples": 4})}),
                    reply_to=sent_to(n, 1)) for n in (1, 2)]
    arrays, metrics = wrapper.aggregate_train(1, same)
    assert arrays is not None and metrics["dp-participants"] == 2


def test_a_reply_without_its_weight_is_refused_with_the_key():
    wrapper = DifferentialPrivacyServerSideFixedClipping(FedAvg(), Z, C, 3, num_clients=5, delta=DELTA)
    bad = Message(RecordDict({"arrays": zeros(3), "metrics": MetricRecord({})}),
                  reply_to=sent_to(1, 1))
    with pytest.raises(PrivacyConfigError, match="'num-examples'"):
        wrapper.aggregate_train(1, [bad])
    with pytest.raises(PrivacyConfigError, match="did you mean 'pld'"):
        DifferentialPrivacyServerSideFixedClipping(FedAvg(), Z, C, 3, num_clients=5, delta=DELTA, accountant="pdl")
    with pytest.raises(PrivacyConfigError, match="realised, target"):
        DifferentialPrivacyServerSideFixedClipping(FedAvg(), Z, C, 3, num_clients=5, delta=DELTA, calibration="fixed")


N, ROUNDS, SPEC, SEED = 6, 4, "bernoulli:p=0.5", 3


def churn_app() -> ClientApp:
    """A Message-API ClientApp (one linear layer, one SGD step) with the two churn lines."""
    app = ClientApp(mods=[availability_mod])
    app.query("identity")(identity)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        g = torch.Generator().manual_seed(pid)
        x = torch.randn(16, 4, generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
        loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                   "metrics": MetricRecord({"num-examples": 16, "train_loss": loss.item()})}),
                       reply_to=msg)

    return app


@pytest.mark.parametrize("inner", ["flower-fedavg", "fedavg-active"])
def test_a_simulated_run_under_churn_records_epsilon_per_round(inner, tmp_path):
    """Flower's start, the wrapper around Flower's FedAvg or the project's fedavg-active, 6 clients
    online by bernoulli:p=0.5: one privacy.jsonl line per round, its participants those the
    schedule put online (= participation.csv), its ε the accountant's on that realised schedule."""
    grid = InProcessGrid(N, {}, client_app=churn_app())
    grid.set_run(Run.create_empty(1))
    churned = with_availability(grid, SPEC, num_clients=N, seed=SEED, results_dir=tmp_path)
    rule = (FedAvg(min_available_nodes=0, min_train_nodes=0, min_evaluate_nodes=0, fraction_evaluate=0.0)
            if inner == "flower-fedavg" else build_strategy("fedavg-active", num_clients=N, fraction_evaluate=0.0))
    strategy = DifferentialPrivacyServerSideFixedClipping(rule, Z, C, N, num_clients=N, delta=DELTA,
                                                          results_dir=tmp_path)
    torch.manual_seed(0)
    result = Strategy.start(strategy, grid=churned, initial_arrays=ArrayRecord(torch.nn.Linear(4, 3).state_dict()),
                            num_rounds=ROUNDS, timeout=60)
    schedule = build_schedule(SPEC, N, SEED).matrix(ROUNDS)
    assert 0 < schedule.sum() < schedule.size
    lines = [json.loads(x) for x in (tmp_path / "privacy.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == list(range(1, ROUNDS + 1))
    assert [x["participants"] for x in lines] == schedule.sum(axis=1).tolist()
    assert (read_matrix(tmp_path / "participation.csv") == schedule).all()
    expected = ChurnAccountant(N, DELTA)
    for r, row in enumerate(schedule, start=1):
        expected.compose(r, np.flatnonzero(row).tolist(), Z)
    assert [x["epsilon"] for x in lines] == pytest.approx([s.epsilon for s in expected.history], rel=1e-9)
    assert [x["epsilon_worst_client"] for x in lines] == pytest.approx(
        [s.epsilon_worst_client for s in expected.history], rel=1e-9)
    assert all(x["noise_multiplier"] == Z for x in lines if x["participants"])
    train = result.train_metrics_clientapp
    assert [train[r]["dp-epsilon"] for r in sorted(train)] == pytest.approx([x["epsilon"] for x in lines if math.isfinite(x["epsilon"])])


@pytest.mark.parametrize("side", ["client", "server"])
def test_the_legacy_wrappers_noise_for_who_took_part_and_leave_failures_out(side):
    """Flower's legacy API (fl-dp-sa's): 3 results and a failure, Flower's FedAvg inside: the noise is
    z·C/3 (not Flower's z·C/10), the failure does not stop the round, and server-side clipping bounds
    each update to C (an update of norm 10·C comes back at C: the mean moves by C/3 at most)."""
    cls = {"client": LegacyDifferentialPrivacyClientSideFixedClipping,
           "server": LegacyDifferentialPrivacyServerSideFixedClipping}[side]
    wrapper = cls(LegacyFedAvg(), Z, C, 10, num_clients=20, delta=DELTA)
    wrapper.current_round_params = [np.zeros(D, np.float32)]
    big = np.zeros(D, np.float32)
    big[0] = 10 * C  # one coordinate, far outside the norm
    results = [(SimpleNamespace(node_id=n), FitRes(Status(Code.OK, ""), ndarrays_to_parameters([big]), 10, {}))
               for n in (1, 2, 3)]
    params, metrics = wrapper.aggregate_fit(1, results, [RuntimeError("dropped out")])
    (w,) = parameters_to_ndarrays(params)
    assert metrics["dp-participants"] == 3 and metrics["dp-noise-multiplier"] == pytest.approx(Z)
    assert np.delete(w, 0).std() == pytest.approx(Z * C / 3, rel=0.02)
    if side == "server":
        assert abs(w[0] - C) < 5 * Z * C / 3  # clipped to C, plus the noise
