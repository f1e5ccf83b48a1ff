"""FedAU, MIFA, FedVARP and ClusterFedVARP against hand-computed values on mocked replies."""

import pickle

import numpy as np
import pytest
from replies import reply, run_round, start_round

from strategies import STRATEGIES, build_strategy
from strategies.memory import ClientTable
from strategies.rules.fedau import FedAU, omega
from strategies.rules.fedvarp import ClusterFedVARP, FedVARP
from strategies.rules.mifa import MIFA


def rounds(strategy, x, schedule, **metrics):
    """Run ``schedule`` (a list of {client: Δ} dicts, {} = empty round); return the models."""
    out = []
    for rnd, updates in enumerate(schedule, start=1):
        updates = {c: np.atleast_1d(np.asarray(d, np.float64)) for c, d in updates.items()}
        x = run_round(strategy, rnd, x, updates, nodes=[100 + c for c in range(strategy.num_clients)], **metrics)
        out.append(x.copy())
    return out


# ---------------------------------------------------------------------------------- registry
def test_registry_names_and_spec_params():
    assert STRATEGIES["fedau"] is FedAU and STRATEGIES["mifa"] is MIFA
    assert STRATEGIES["fedvarp"] is FedVARP and STRATEGIES["cluster-fedvarp"] is ClusterFedVARP
    assert build_strategy("fedau:cutoff=7", num_clients=3).rule.params.cutoff == 7
    m = build_strategy("mifa:gradient-units=true,wait-for-all=true", num_clients=3)
    assert m.rule.params.gradient_units and m.rule.params.wait_for_all and m.required_metrics == ("num-examples", "lr")
    assert build_strategy("cluster-fedvarp:clusters=2", num_clients=4).rule.params.clusters == 2
    with pytest.raises(ValueError, match="weighting"):
        build_strategy("fedvarp", num_clients=3, weighting="num-examples")
    with pytest.raises(ValueError, match="clusters"):
        ClusterFedVARP(num_clients=3, clusters=5)


# ------------------------------------------------------------------------------------- FedAU
def test_fedau_hand_computed_weights_first_appearance_and_empty_round():
    s = FedAU(num_clients=3, cutoff=0)
    xs = rounds(s, np.zeros(1), [
        {0: 2.0, 1: 4.0},  # ω = 1, 1 (no past interval): u = 6/3 = 2
        {2: 3.0},          # first appearance of 2: ω = 1, u = 1
        {},                # empty: model stays; absent counters still tick
        {0: 6.0},          # 0's past intervals [1]: ω = 1, u = 2; records interval 2 + 1 = 3
        {0: 3.0, 2: 3.0},  # ω_0 = mean[1, 3] = 2, ω_2 = mean[2] = 2: u = (6 + 6)/3 = 4
    ])
    np.testing.assert_allclose(np.concatenate(xs), [2, 3, 3, 5, 9])
    np.testing.assert_array_equal(s.rule_state.interval_sum, [1 + 3 + 1, 1, 2 + 3])
    np.testing.assert_array_equal(s.rule_state.interval_num, [3, 1, 2])
    np.testing.assert_array_equal(s.rule_state.count, [0, 4, 0])  # client 1 absent for 4 rounds, no cutoff


def test_fedau_metric_is_mean_omega_of_participants():
    s = FedAU(num_clients=2, cutoff=0)
    rounds(s, np.zeros(1), [{0: 1.0}, {}, {0: 1.0}])  # 0's intervals: [1, 2]
    sent = start_round(s, 4, np.zeros(1), [100, 101])
    _, metrics = s.aggregate_train(4, [reply(sent[100], [1.0], **{"client-id": 0}),
                                       reply(sent[101], [1.0], **{"client-id": 1})])
    assert metrics["mean-omega"] == pytest.approx((1.5 + 1.0) / 2)


@pytest.mark.parametrize(("cutoff", "omega", "sum_", "num"), [(2, 5 / 3, 1 + 2 + 2 + 1, 4), (0, 1.0, 1 + 5, 2)])
def test_fedau_cutoff_records_interval_k_for_a_long_absence(cutoff, omega, sum_, num):
    s = FedAU(num_clients=2, cutoff=cutoff)
    # client 0: present in round 1, absent for 4 rounds (2 empty), back in round 6; client 1 always there
    xs = rounds(s, np.zeros(1), [{0: 0.0, 1: 0.0}, {1: 0.0}, {}, {1: 0.0}, {}, {0: 3.0, 1: 0.0}])
    # with K = 2 the absence of 4 rounds records [2, 2]: ω_0 = mean[1, 2, 2]; without cutoff ω_0 = mean[1]
    np.testing.assert_allclose(xs[-1], [omega * 3.0 / 2])
    assert s.rule_state.interval_sum[0] == sum_ and s.rule_state.interval_num[0] == num and s.rule_state.count[0] == 0


def test_fedau_weights_tend_to_inverse_probability():
    rng = np.random.default_rng(0)
    p = np.array([0.9, 0.5, 0.2, 0.1])
    s = FedAU(num_clients=4, cutoff=0)
    for t in range(4000):
        s.aggregate(t, np.zeros(1), [_report(c, 0.0) for c in np.flatnonzero(rng.random(4) < p)])
    np.testing.assert_allclose(omega(s.rule_state), 1 / p, rtol=0.1)


def _report(client, delta):
    from strategies import ClientReport

    return ClientReport(client_id=int(client), node_id=100 + int(client),
                        delta=np.atleast_1d(np.asarray(delta, np.float32)), num_examples=1)


# -------------------------------------------------------------------------------------- MIFA
def test_mifa_applies_the_table_mean_every_round_including_stale_and_empty():
    s = MIFA(num_clients=4)
    xs = rounds(s, np.zeros(2), [
        {0: [4.0, 0.0], 1: [0.0, 8.0]},  # Y0, Y1 set: u = [4, 8]/4 = [1, 2]
        {},                              # empty: the stale table still applies [1, 2]
        {0: [-4.0, 4.0]},                # Y0 replaced: u = ([-4, 4] + [0, 8])/4 = [-1, 3]
    ])
    np.testing.assert_allclose(np.stack(xs), [[1, 2], [2, 4], [1, 7]])
    assert s.rule_state.table.num_seen == 2


def test_mifa_wait_for_all_is_fedavg_until_every_client_was_seen():
    s = MIFA(num_clients=2, wait_for_all=True)
    xs = rounds(s, np.zeros(1), [{0: 2.0}, {}, {1: 4.0}, {}])
    # FedAvg over active (2), empty keeps it, table full -> MIFA mean (2+4)/2 = 3, then 3 again
    np.testing.assert_allclose(np.concatenate(xs), [2, 2, 5, 8])


def test_mifa_gradient_units_rescale_by_the_current_lr_and_reject_replies_without_lr():
    s = MIFA(num_clients=2, gradient_units=True, min_available_nodes=1)
    x = run_round(s, 1, np.zeros(1), {0: np.array([2.0])}, lr=0.5)  # Y0 = 4; u = 0.5 * 4/2 = 1
    x = run_round(s, 2, x, {1: np.array([1.0])}, lr=0.25)  # Y1 = 4; u = 0.25 * (4+4)/2 = 1
    x = run_round(s, 3, x, {}, nodes=[100, 101])  # empty: last lr 0.25 -> 1
    np.testing.assert_allclose(x, [3.0])
    sent = start_round(s, 4, x, [100])
    arrays, metrics = s.aggregate_train(4, [reply(sent[100], [9.0], **{"client-id": 0})])
    assert metrics["num-rejected"] == 1 and "lr" in s.round_log.rejected[0][1]
    np.testing.assert_allclose(arrays["w"].numpy(), [4.0])  # the table still applies


# ----------------------------------------------------------------------------------- FedVARP
def test_fedvarp_hand_computed_with_ybar_first_appearance_and_empty_round():
    s = FedVARP(num_clients=4)
    xs = rounds(s, np.zeros(1), [
        {0: 4.0, 1: 8.0},    # y = 0, ȳ = 0: v = 6; y0 = 4, y1 = 8, ȳ = 3
        {0: 2.0},            # v = (2 - 4) + 3 = 1; y0 = 2, ȳ = 2.5
        {},                  # empty: the model stays
        {1: 10.0, 2: 1.0},   # v = ((10 - 8) + (1 - 0))/2 + 2.5 = 4; ȳ = 13/4
        {3: 1.0},            # first appearance: v = 1 + 3.25
    ])
    np.testing.assert_allclose(np.concatenate(xs), [6, 7, 7, 11, 15.25])
    np.testing.assert_allclose(s.rule_state.table.mean(), [(2 + 10 + 1 + 1) / 4])


def test_cluster_fedvarp_hand_computed():
    s = ClusterFedVARP(num_clients=4, clusters=2)  # clusters [0, 0, 1, 1], N_c/N = 1/2
    xs = rounds(s, np.zeros(1), [
        {0: 4.0, 1: 8.0},  # v = 6; y_0 = 6
        {1: 2.0, 2: 6.0},  # v = ((2 - 6) + (6 - 0))/2 + (6/2) = 4; y_0 = 2, y_1 = 6
        {},                # stays
        {3: 0.0},          # v = (0 - 6) + (2 + 6)/2 = -2
    ])
    np.testing.assert_allclose(np.concatenate(xs), [6, 10, 10, 8])
    np.testing.assert_array_equal(s.rule_state.cluster_of, [0, 0, 1, 1])
    same = ClusterFedVARP(num_clients=4, cluster_of=(7, 7, 9, 9))  # any labels, set in code
    np.testing.assert_array_equal(rounds(same, np.zeros(1), [{0: 4.0, 1: 8.0}, {1: 2.0, 2: 6.0}, {}, {3: 0.0}]), xs)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        ClusterFedVARP(num_clients=4, cluster_of=(0, 1, 1))


def test_cluster_fedvarp_limits_are_fedvarp_and_fedavg_active():
    rng = np.random.default_rng(1)
    schedule = [{int(c): rng.normal(size=3) for c in np.flatnonzero(rng.random(5) < 0.5)} for _ in range(8)]
    x0 = np.zeros(3)
    np.testing.assert_allclose(rounds(ClusterFedVARP(num_clients=5), x0, schedule),
                               rounds(FedVARP(num_clients=5), x0, schedule), atol=1e-5)
    from strategies import FedAvgActive

    np.testing.assert_allclose(rounds(ClusterFedVARP(num_clients=5, clusters=1), x0, schedule),
                               rounds(FedAvgActive(num_clients=5), x0, schedule), atol=1e-5)


# ------------------------------------------------------------------------------------ memory
def test_client_table_running_mean_matches_the_rows_and_disk_equals_ram(tmp_path):
    rng = np.random.default_rng(2)
    ram, disk = ClientTable(6, 5), ClientTable(6, 5, tmp_path)
    assert disk.disk_backed and not ram.disk_backed and disk.path.startswith(str(tmp_path))
    for _ in range(200):
        i, v = int(rng.integers(6)), rng.normal(size=5).astype(np.float32)
        ram.set_row(i, v)
        disk.set_row(i, v)
    np.testing.assert_array_equal(np.asarray(disk.rows), ram.rows)
    np.testing.assert_allclose(ram.mean(), ram.rows.mean(axis=0, dtype=np.float64), atol=1e-12)
    np.testing.assert_array_equal(disk.mean(), ram.mean())
    assert ram.nbytes == disk.nbytes == 6 * 5 * 4 + 5 * 8 + 6
    restored = ClientTable.from_state(pickle.loads(pickle.dumps(disk.state_dict())))
    np.testing.assert_array_equal(restored.rows, ram.rows)
    path = disk.path
    disk.close()
    assert not (tmp_path / path).exists()


TABLE_SPECS = ["mifa", "mifa:gradient-units=true", "mifa:wait-for-all=true", "fedvarp", "cluster-fedvarp:clusters=2",
               "cluster-fedvarp:clusters=3", "fedstale:beta=0.3", "fedstale:weights=paper"]


@pytest.mark.parametrize("seed", range(8))
def test_disk_backed_strategies_equal_ram_ones(seed, tmp_path):
    """Over random configs (rule and its options, N, d, rounds, participation, empty rounds,
    scales), a rule whose client table is on disk (``memory-dir``) gives the RAM table's models,
    bit for bit."""
    rng = np.random.default_rng(seed)
    spec = TABLE_SPECS[seed]
    n, d, p = int(rng.integers(3, 12)), int(rng.integers(1, 20)), float(rng.uniform(0.1, 0.9))
    schedule = [{int(c): rng.normal(size=d) * 10 ** rng.uniform(-3, 1) for c in np.flatnonzero(rng.random(n) < p)}
                for _ in range(int(rng.integers(2, 9)))]
    lr = {"lr": 0.1} if "gradient-units" in spec else {}
    on_disk = build_strategy(f"{spec}{',' if ':' in spec else ':'}memory-dir={tmp_path / 'table'}", num_clients=n)
    in_ram = build_strategy(spec, num_clients=n)
    np.testing.assert_array_equal(rounds(on_disk, np.zeros(d), schedule, **lr), rounds(in_ram, np.zeros(d), schedule, **lr))
    assert on_disk.rule_state.table.disk_backed and not in_ram.rule_state.table.disk_backed


# ------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("spec", ["fedau:cutoff=2", "mifa", "mifa:wait-for-all=true,gradient-units=true",
                                  "fedvarp", "cluster-fedvarp:clusters=2", "fedvarp:memory-dir=DISK"])
def test_state_dict_round_trip_continues_identically(spec, tmp_path):
    spec = spec.replace("DISK", str(tmp_path))
    rng = np.random.default_rng(4)
    schedule = [{int(c): rng.normal(size=3) for c in np.flatnonzero(rng.random(5) < 0.5)} for _ in range(4)]
    schedule[1] = {}
    a = build_strategy(spec, num_clients=5)
    x = rounds(a, np.zeros(3), schedule[:3], lr=0.1)[-1]
    state = pickle.loads(pickle.dumps(a.state_dict()))  # what a checkpoint file holds
    b = build_strategy(spec, num_clients=5, seed=123)
    b.load_state_dict(state)
    nodes = [100 + c for c in range(5)]
    xa = run_round(a, 4, x, schedule[3], nodes=nodes, lr=0.1)
    xb = run_round(b, 4, x, schedule[3], nodes=nodes, lr=0.1)
    np.testing.assert_array_equal(xa, xb)
    assert not np.array_equal(xa, x)
