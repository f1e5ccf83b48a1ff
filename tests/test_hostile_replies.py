"""Nothing a client sends can end a run or poison the model: one test per row of issue 20's table.

Each hostile reply comes from node 103 (client 3) beside three honest ones; it must be rejected
with its reason, and the round must give exactly the model and state of the same round without
it, for every registered rule where the row applies.
"""

import copy
import io

import numpy as np
import pytest
from flwr.app import Array
from replies import build_rule, rule_reply, start_round

from strategies import STRATEGIES
from strategies.protocol import FEDAWE_ECHO_FACTOR, FEDAWE_UPDATE_PREFIX

X = np.array([1.0, -1.0, 2.0])
HONEST = {0: np.array([0.5, -0.25, 1.0]), 1: np.array([-0.5, 0.75, 0.25]), 2: np.array([0.25, 0.5, -1.0])}
RULES = sorted(STRATEGIES)


def round_with(name, hostile=None, spec="", rnd=1, x=X, history=None, **kwargs):
    """(model, strategy) after a round of the honest replies plus ``hostile(sent) -> Message``."""
    s = build_rule(name, spec=spec, **kwargs)
    for r, (xr, ups) in enumerate(history or [], start=1):  # earlier honest rounds
        sent = start_round(s, r, xr, [100 + c for c in ups])
        s.aggregate_train(r, [rule_reply(name, sent[100 + c], xr + u, c, u) for c, u in ups.items()])
    sent = start_round(s, rnd, x, [100, 101, 102, 103])
    replies = [rule_reply(name, sent[100 + c], x + u, c, u) for c, u in HONEST.items()]
    if hostile is not None:
        replies.append(hostile(sent[103]))
    arrays, _ = s.aggregate_train(rnd, replies)
    return arrays["w"].numpy(), s


def assert_rejected(name, hostile, why, **kwargs):
    got, s = round_with(name, hostile, **kwargs)
    want, clean = round_with(name, None, **kwargs)
    (node, reason), = s.round_log.rejected
    assert node == 103 and why in reason, reason
    np.testing.assert_array_equal(got, want)
    assert s.round_log.participants == [0, 1, 2] and np.all(np.isfinite(got))


def npy(values) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(values), allow_pickle=False)
    return buf.getvalue()


# ------------------------------------------------- row: an array of strings
@pytest.mark.parametrize("name", RULES)
def test_an_array_of_strings_is_rejected(name):
    assert_rejected(name, lambda sent: rule_reply(name, sent, X, 3, arrays={"w": np.array(["a"] * 3)}),
                    "not a real floating or integer type")


# ------------------------------------------------- row: declared shape differs from the bytes
@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("data, why", [
    (npy(np.ones(4, np.float32)), "holds shape (4,), declared (3,)"),  # one element longer
    (npy(np.ones(1, np.float32)), "holds shape (1,), declared (3,)"),  # one element: no broadcast
    (npy(np.ones(3, np.float32))[:-4], "data bytes"),  # truncated
])
def test_an_array_whose_declared_shape_differs_from_its_bytes_is_rejected(name, data, why):
    forged = Array(dtype="float32", shape=(3,), stype="numpy.ndarray", data=data)
    assert_rejected(name, lambda sent: rule_reply(name, sent, X, 3, arrays={"w": forged}), why)


# ------------------------------------------------- row: undecodable bytes
@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("stype, why", [("torch", "stype 'torch'"), ("numpy.ndarray", "cannot be decoded")])
def test_undecodable_bytes_are_rejected(name, stype, why):
    junk = Array(dtype="float32", shape=(3,), stype=stype, data=b"\x93NOTNUMPY junk bytes")
    assert_rejected(name, lambda sent: rule_reply(name, sent, X, 3, arrays={"w": junk}), why)


# ------------------------------------------------- row: int / float16 / float64 / bool / complex / ...
@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("values", [np.array([True, False, True]), X.astype(np.complex64) + 1j,
                                    np.array(["2020-01-01"] * 3, "datetime64[D]"), np.array(["1.0", "2", "3"])])
def test_bools_complex_datetimes_and_numeric_strings_are_rejected(name, values):
    assert_rejected(name, lambda sent: rule_reply(name, sent, X, 3, arrays={"w": values}),
                    "not a real floating or integer type")


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize("dtype", [np.int64, np.float16, np.float64])
def test_real_integer_and_floating_arrays_are_accepted_as_their_float32_cast(name, dtype):
    model = np.array([2.0, -1.0, 3.0])  # exact in every dtype here
    got, s = round_with(name, lambda sent: rule_reply(name, sent, model, 3, model - X, arrays={"w": model.astype(dtype)}))
    want, _ = round_with(name, lambda sent: rule_reply(name, sent, model, 3, model - X))
    assert s.round_log.rejected == [] and s.round_log.participants == [0, 1, 2, 3]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", RULES)
def test_a_value_beyond_float32_is_rejected_after_the_cast(name):
    huge = np.array([1e300, 0.0, 0.0])  # finite in float64, inf in float32
    assert_rejected(name, lambda sent: rule_reply(name, sent, X, 3, arrays={"w": huge}), "NaN or Inf")


# ------------------------------------------------- one reply, one verdict
@pytest.mark.parametrize("name", RULES)
def test_any_exception_while_reading_a_reply_rejects_that_reply_only(name, monkeypatch):
    s = build_rule(name)
    parse = type(s).parse_reply

    def broken(self, msg, node, rnd):
        if node == 103:
            raise RuntimeError("decoder bug")
        return parse(self, msg, node, rnd)

    monkeypatch.setattr(type(s), "parse_reply", broken)
    assert_rejected(name, lambda sent: rule_reply(name, sent, X, 3), "RuntimeError: decoder bug")


# ------------------------------------------------- rows: FedNova's a-norm
@pytest.mark.parametrize("spec", ["fednova", "fednova:server-momentum=0.9"])
@pytest.mark.parametrize("a_norm", [1e-300, 1e300, 1e-6, 1e6])
def test_fednova_a_norm_outside_what_the_solvers_give_is_rejected(spec, a_norm):
    assert_rejected("fednova", lambda sent: rule_reply("fednova", sent, X + 1.0, 3, **{"a-norm": a_norm}),
                    "no local solver gives it", spec=spec)


def test_fednova_needs_num_steps_and_the_ratio_is_a_spec_key():
    def bare(sent):
        out = rule_reply("fednova", sent, X + 1.0, 3)
        del next(iter(out.content.metric_records.values()))["num-steps"]
        return out

    assert_rejected("fednova", bare, "FedNova needs the 'num-steps' metric")
    # momentum 0.99 gives a-norm up to 100 x num-steps: admitted with max-a-norm-ratio=100 (and, for
    # one client among others at a-norm 2, a max-steps-ratio above 75)
    _, s = round_with("fednova", lambda sent: rule_reply("fednova", sent, X + 1.0, 3, **{"a-norm": 150.0}),
                      spec="fednova:max-a-norm-ratio=100,max-steps-ratio=100")
    assert s.round_log.rejected == []
    _, s = round_with("fednova", lambda sent: rule_reply("fednova", sent, X + 1.0, 3, **{"a-norm": 150.0}),
                      spec="fednova:max-a-norm-ratio=100,max-steps-ratio=30")
    (_, why), = s.round_log.rejected
    assert "metric 'a-norm'=150 > max-steps-ratio 30 x the median of recent ones 2" in why


@pytest.mark.parametrize(("steps", "a_norm", "why"), [(10**7, 1e8, "'num-steps'=1e+07"), (1000, 1000.0, "'num-steps'=1e+03"),
                                                      (2, 100.0, "no local solver gives it")])
def test_fednova_step_counts_far_above_the_others_are_rejected(steps, a_norm, why):
    """Issue 27: num-steps 1e7 with a-norm 1e8 amplified an honest-sized update 2.5e7 times."""
    assert_rejected("fednova", lambda sent: rule_reply("fednova", sent, X + 1.0, 3,
                                                       **{"num-steps": steps, "a-norm": a_norm}), why)


# ------------------------------------------------- rows: FedAWE
@pytest.mark.parametrize("model", [np.full(3, 1e20), X + 1e5])
def test_fedawe_a_far_returned_model_with_a_small_echoed_update_is_rejected(model):
    # x_i^† − η_g u_i is no model the client can hold: the consistency check rejects it first
    assert_rejected("fedawe", lambda sent: rule_reply("fedawe", sent, model, 3, np.full(3, 0.1)), "disagree")
    assert_rejected("fedawe", lambda sent: rule_reply("fedawe", sent, model, 3, np.full(3, 0.1)), "update norm",
                    spec="fedawe:check-start=false")


def test_fedawe_a_huge_echoed_update_is_rejected():
    assert_rejected("fedawe", lambda sent: rule_reply("fedawe", sent, X + 0.1, 3, np.full(3, 1e20)), "disagree")
    assert_rejected("fedawe", lambda sent: rule_reply("fedawe", sent, X + 0.1, 3, np.full(3, 1e20)),
                    "max-update-norm", spec="fedawe:check-start=false")


@pytest.mark.parametrize("junk, why", [
    ({FEDAWE_ECHO_FACTOR: np.array(["1"])}, "not a real floating or integer type"),
    ({FEDAWE_ECHO_FACTOR: Array(dtype="float64", shape=(1,), stype="numpy.ndarray", data=b"junk")}, "cannot be decoded"),
    ({FEDAWE_UPDATE_PREFIX + "w": np.array(["a", "b", "c"])}, "not a real floating or integer type"),
    ({FEDAWE_UPDATE_PREFIX + "w": Array(dtype="float32", shape=(3,), stype="torch", data=b"x")}, "stype 'torch'"),
    ({"fedawe.extra": np.ones(1)}, "unknown FedAWE reply keys"),
])
def test_fedawe_junk_fields_are_rejected(junk, why):
    assert_rejected("fedawe", lambda sent: rule_reply("fedawe", sent, X + 0.1, 3, arrays=junk), why)


def test_fedawe_echo_factor_is_capped_by_the_clients_last_accepted_round():
    s = build_rule("fedawe")
    x = X.astype(np.float32)
    for rnd in (1, 2, 3):  # client 3 claims t + 1 every round: fine only while it has never been accepted
        sent = start_round(s, rnd, x, [100, 103])
        out, _ = s.aggregate_train(rnd, [rule_reply("fedawe", sent[100], x + 0.1, 0, np.full(3, 0.1)),
                                         rule_reply("fedawe", sent[103], x + 0.1, 3, np.full(3, 0.1), factor=rnd)])
        x = out["w"].numpy()
        if rnd == 1:
            assert s.round_log.participants == [0, 3]
        else:
            (node, reason), = s.round_log.rejected
            assert node == 103 and f"outside [1, {rnd - 1}]" in reason  # accepted at t = 0: cap t − 0
    assert s.last_accepted == {0: 2, 3: 0}
    restored = build_rule("fedawe")
    restored.load_state_dict(s.state_dict())
    assert restored.last_accepted == {0: 2, 3: 0}  # one number per client, kept by checkpoints


@pytest.mark.parametrize("rule", ["fedawe", "fedpbc"])
def test_fedawe_u_i_must_agree_with_a_model_the_client_can_hold(rule):
    """x_i^† − η_g u_i must be x^0, a broadcast to that client since, or x^t: client 0, back in
    round 3 from its copy x^2 (adopted after round 1), is accepted with a consistent u_i and
    rejected when u_i is off by 1e-3 in one coordinate, or when its start is a model it never got."""
    s = build_rule(rule, min_available_nodes=1)  # one node per round: no wait for a second
    xs = [X.astype(np.float32)]
    for rnd, client in ((1, 0), (2, 1)):
        sent = start_round(s, rnd, xs[-1], [100 + client])
        out, _ = s.aggregate_train(rnd, [rule_reply(rule, sent[100 + client], xs[-1] + 0.1, client, np.full(3, 0.1))])
        xs.append(out["w"].numpy())
    factor = 2 if rule == "fedawe" else 1
    u = np.array([0.3, -0.2, 0.1], np.float32)
    for start, update, ok in ((xs[1], u, True), (xs[1], u + np.array([1e-3, 0, 0], np.float32), False),
                              (xs[1] + 0.05, u, False)):
        t = copy.deepcopy(s)
        sent = start_round(t, 3, xs[2], [100])
        t.aggregate_train(3, [rule_reply(rule, sent[100], start + u, 0, update, factor=factor)])
        assert (t.round_log.participants == [0]) is ok, t.round_log.rejected
        assert ok or "disagree" in t.round_log.rejected[0][1]


# ------------------------------------------------- row: MIFA's reported lr
@pytest.mark.parametrize("lr", [1e-30, 1e30])
def test_mifa_gradient_units_reject_an_lr_far_from_the_reference(lr):
    history = [(X, HONEST)]  # a first honest round (lr 0.1) sets the reference
    assert_rejected("mifa", lambda sent: rule_reply("mifa", sent, X + 0.1, 3, lr=lr), "max-lr-ratio 100",
                    spec="mifa:gradient-units=true", rnd=2, history=history)
    assert_rejected("mifa", lambda sent: rule_reply("mifa", sent, X + 0.1, 3, lr=lr), "reference lr 0.1",
                    spec="mifa:gradient-units=true,lr=0.1")  # the run's lr given: from round 1


# ------------------------------------------------- row: FedExP's extrapolated step
def test_fedexp_colluding_clients_cannot_extrapolate_beyond_max_step():
    s = build_rule("fedexp", spec="fedexp:max-model-ratio=0")  # two replies: no median; no model bound
    sent = start_round(s, 1, X, [100, 101])
    out, metrics = s.aggregate_train(1, [rule_reply("fedexp", sent[100], X + 1e2, 0),
                                         rule_reply("fedexp", sent[101], X - 1e2 + 1e-3, 1)])
    assert metrics["fedexp-step"] == 10.0  # Eq. (9) alone: ~1e7
    assert np.abs(out["w"].numpy() - X).max() < 0.1
    off = build_rule("fedexp", spec="fedexp:max-step=0,max-model-ratio=0")
    sent = start_round(off, 1, X, [100, 101])
    _, metrics = off.aggregate_train(1, [rule_reply("fedexp", sent[100], X + 1e2, 0),
                                         rule_reply("fedexp", sent[101], X - 1e2 + 1e-3, 1)])
    assert metrics["fedexp-step"] > 1e3


# ------------------------------------------------- row: a big update in a round of 2 replies
def two_replies(name, big, client=3):
    """Round 1: clients 0-2 honest; round 2: client 0 and ``client`` (``big``). (strategy, x^3)."""
    s = build_rule(name)
    x = X.astype(np.float32)
    sent = start_round(s, 1, x, [100, 101, 102])
    out, _ = s.aggregate_train(1, [rule_reply(name, sent[100 + c], x + u, c, u) for c, u in HONEST.items()])
    x1 = out["w"].numpy()
    sent = start_round(s, 2, x1, [100, 100 + client])
    u0 = np.full(3, 0.1, np.float32)
    replies = [rule_reply(name, sent[100], x1 + u0, 0, u0), rule_reply(name, sent[100 + client], x1 + big, client, big)]
    if name == "fedawe":  # round 2: client 0 adopted x^2 (echo factor 1); client 3 was never seen
        replies[1] = rule_reply(name, sent[100 + client], (X if client == 3 else x1) + big, client, big,
                                factor=2 if client == 3 else 1)
    out, _ = s.aggregate_train(2, replies)
    return s, x1, out["w"].numpy()


@pytest.mark.parametrize("name", RULES)
def test_a_big_update_among_two_replies_is_bounded_by_the_running_median(name):
    """From a client with an entry it is rejected; from a newcomer it is cut to the limit (the
    median of round 1's norms x max-norm-ratio) and the round is the round with it at the limit;
    where Δ_i's payloads cannot be cut with it (SCAFFOLD, FedAWE, FedPBC) it is rejected."""
    big = np.array([9e5, 0.0, 0.0], np.float32)
    s, _, x2 = two_replies(name, big, client=1)
    (node, reason), = s.round_log.rejected
    assert node == 101 and "median of recent norms" in reason and np.abs(x2).max() < 100
    s, x1, x2 = two_replies(name, big)
    if name.startswith(("scaffold", "amplified-scaffold", "fedawe", "fedpbc")):
        (node, reason), = s.round_log.rejected
        assert node == 103 and np.abs(x2).max() < 100
        return
    assert s.round_log.rejected == [] and [node for node, _ in s.round_log.cut] == [103]
    x = X.astype(np.float32)
    norms = [float(np.linalg.norm(((x + u.astype(np.float32)) - x).astype(np.float64))) for u in HONEST.values()]
    limit = s.bounds.max_norm_ratio * sorted(norms)[1]  # the lower median of round 1's three norms
    delta = (x1 + big) - x1
    _, _, want = two_replies(name, delta * np.float32(limit / np.linalg.norm(delta.astype(np.float64))))
    np.testing.assert_allclose(x2, want, rtol=1e-5, atol=1e-5 * limit)


def test_the_running_median_survives_a_checkpoint():
    s = build_rule("fedavg-active")
    sent = start_round(s, 1, X, [100, 101, 102])
    s.aggregate_train(1, [rule_reply("fedavg-active", sent[100 + c], X + u, c) for c, u in HONEST.items()])
    t = build_rule("fedavg-active")
    t.load_state_dict(s.state_dict())
    assert list(t.bounds.history) == list(s.bounds.history) and len(t.bounds.history) == 3


# ------------------------------------------------- row: num-examples = 1e9
@pytest.mark.parametrize("name", ["fedavg-active", "fednova", "fedexp", "fedawe", "pow-d"])
def test_a_client_claiming_a_huge_data_size_is_capped_by_max_weight_share(name):
    def greedy(sent):
        return rule_reply(name, sent, X + 1.0, 3, **{"num-examples": 10**9})

    kw = {"weighting": "num-examples"}
    uncapped, _ = round_with(name, greedy, **kw)
    capped, s = round_with(name, greedy, spec=f"{name}:max-weight-share=0.4".replace("pow-d:", "pow-d:variant=rpow-d,"),
                           **kw)
    assert s.round_log.rejected == []
    w = s.weights([type("R", (), {"num_examples": n})() for n in (10, 10, 10, 10**9)])
    np.testing.assert_allclose(w, [0.2, 0.2, 0.2, 0.4])
    assert np.abs(capped - X).max() < np.abs(uncapped - X).max()  # the greedy client no longer dominates
