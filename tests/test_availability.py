"""Tests of the availability schedules: spec errors, statistics, exact structure, determinism."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from availability import SCHEDULES, Schedule, ScheduleError, SpecError, build_schedule

N, C = 40, 10
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def nu() -> np.ndarray:
    return np.random.default_rng(123).dirichlet(np.full(C, 0.1), N)


CLUSTERS = np.arange(N) % 5
RANDOM_SPECS = ["bernoulli:p=0.3", "stationary", "staircase", "sine", "interleaved-sine",
                "fedau-bernoulli", "markov", "cyclic:c=20", "group-cyclic:groups=4,window=3,sample=0.5",
                "dropout:alpha=0.3", "dropout:alpha=0.5,keep_per_cluster=true", "ln:sigma=0.5",
                "sln:sigma=0.5"]


def build(spec: str, nu: np.ndarray, seed: int = 0, n: int = N) -> Schedule:
    return build_schedule(spec, n, seed, label_dists=nu[:n], clusters=CLUSTERS[:n])


def within_binomial(empirical: np.ndarray, p_mean: np.ndarray, var: np.ndarray, z: float = 5.0):
    """|empirical - expected| <= z standard deviations (+ a tiny floor for p = 0 or 1)."""
    tol = z * np.sqrt(var) + 1e-9
    bad = np.flatnonzero(np.abs(empirical - p_mean) > tol)
    assert bad.size == 0, f"clients {bad}: {empirical[bad]} vs {p_mean[bad]} (tol {tol[bad]})"


# ------------------------------------------------------------------ spec and input errors
@pytest.mark.parametrize(("spec", "needle"), [
    ("", "empty spec"),
    ("sine:", "nothing after ':'"),
    ("sine:gamma", "not key=value"),
    ("sine:gamma=0.3,gamma=0.2", "given twice"),
    ("Sine Wave", "bad name"),
    ("sinus", "unknown availability model 'sinus'"),
    ("sine:gama=0.3", "unknown parameter(s) ['gama']"),
    ("staircase:period=2.5", "expected an integer"),
    ("dropout:keep_per_cluster=yes", "expected true/false"),
])
def test_malformed_specs_name_the_problem(spec, needle, nu):
    with pytest.raises(ScheduleError) as err:
        build(spec, nu)
    assert needle in str(err.value)


def test_unknown_model_lists_known_names(nu):
    with pytest.raises(ScheduleError) as err:
        build("weibull:k=2", nu)
    for name in ("always", "sine", "markov", "trace-matrix", "group-cyclic"):
        assert name in str(err.value)


@pytest.mark.parametrize(("spec", "key", "interval"), [
    ("bernoulli:p=1.5", "p", "[0, 1]"),
    ("bernoulli:p=-0.1", "p", "[0, 1]"),
    ("sine:gamma=1.2", "gamma", "[0, 1]"),
    ("sine:period=0", "period", "[1, inf)"),
    ("staircase:low=-1", "low", "[0, 1]"),
    ("interleaved-sine:floor=2", "floor", "[0, 1]"),
    ("fedau-bernoulli:pbar=0", "pbar", "(0, 1]"),
    ("fedau-bernoulli:pmin=1.5", "pmin", "[0, 1]"),
    ("markov:q=0", "q", "(0, 1]"),
    ("markov:q=1.01", "q", "(0, 1]"),
    ("cyclic:c=1", "c", "[2, inf)"),
    ("group-cyclic:groups=0", "groups", f"[1, {N}]"),
    (f"group-cyclic:groups={N + 1}", "groups", f"[1, {N}]"),
    ("group-cyclic:window=0", "window", "[1, inf)"),
    ("group-cyclic:sample=1.5", "sample", "[0, 1]"),
    ("dropout:alpha=1", "alpha", "[0, 1)"),
    ("ln:sigma=-1", "sigma", "[0, inf)"),
    ("sln:period=1", "period", "[2, inf)"),
    ("trace-intervals:path=x.json,round_seconds=0", "round_seconds", "(0, inf)"),
])
def test_out_of_range_parameters_name_key_value_and_range(spec, key, interval, nu):
    with pytest.raises(ScheduleError) as err:
        build(spec, nu)
    msg = str(err.value)
    assert f"'{key}'" in msg and interval in msg and spec.split("=")[-1] in msg


def test_error_type_is_a_spec_error_and_value_error():
    assert issubclass(ScheduleError, SpecError) and issubclass(ScheduleError, ValueError)


@pytest.mark.parametrize("spec", ["stationary", "staircase", "sine", "interleaved-sine",
                                  "fedau-bernoulli", "markov", "cyclic"])
def test_label_models_need_label_distributions(spec, nu):
    with pytest.raises(ScheduleError, match="label distributions"):
        build_schedule(spec, N, 0)
    with pytest.raises(ScheduleError, match="shape"):
        build_schedule(spec, N, 0, label_dists=nu[:-1])
    bad = nu.copy()
    bad[3] *= 0.5
    with pytest.raises(ScheduleError, match="row 3 sums to 0.5"):
        build_schedule(spec, N, 0, label_dists=bad)


def test_bad_basic_inputs(nu):
    with pytest.raises(ScheduleError, match="seed"):
        build_schedule("always", N, -1)
    with pytest.raises(ScheduleError, match="num_clients"):
        build_schedule("always", 0, 0)
    s = build_schedule("always", N, 0)
    for t in (-1, 1.5, True):
        with pytest.raises(ScheduleError, match="round"):
            s.available(t)
    with pytest.raises(ScheduleError, match="client"):
        s.is_available(N, 0)


def test_dropout_keep_per_cluster_needs_clusters():
    with pytest.raises(ScheduleError, match="needs `clusters`"):
        build_schedule("dropout:keep_per_cluster=true", N, 0)
    with pytest.raises(ScheduleError, match="shape"):
        build_schedule("dropout:keep_per_cluster=true", N, 0, clusters=CLUSTERS[:-1])
    with pytest.raises(ScheduleError, match="droppable"):  # 5 clusters keep 5, 38 > 35 to drop
        build_schedule("dropout:alpha=0.95,keep_per_cluster=true", N, 0, clusters=CLUSTERS)


# ------------------------------------------------------------------ base rates
def test_fedawe_base_rates_follow_the_paper(nu):
    eye = np.eye(C)  # one-hot clients expose phi itself
    phis = np.array([build_schedule("stationary", C, s, label_dists=eye).prob(0)
                     for s in range(200)])
    assert np.all(phis >= 0) and np.all(phis[:, C // 2:] <= 0.5)
    assert phis[:, : C // 2].max() > 0.9  # U(0, 1) on the first half
    assert abs(phis[:, : C // 2].mean() - 0.5) < 0.05 and abs(phis[:, C // 2:].mean() - 0.25) < 0.03
    s = build("stationary", nu)
    np.testing.assert_allclose(s.prob(7), nu @ s.phi)
    assert s.describe()["base_prob"] == pytest.approx(list(nu @ s.phi))


def test_fedau_base_rates_follow_the_paper(nu):
    s = build("fedau-bernoulli:pbar=0.1,pmin=0.02", nu)
    assert s.phi.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(s.prob(0), np.maximum(0.02, 0.1 * C * (nu @ s.phi)))
    assert s.prob(0).min() >= 0.02


def test_modulations_have_the_papers_values(nu):
    base = build("stationary", nu).prob(0)
    stair, sine = build("staircase", nu), build("sine:gamma=0.2", nu)
    np.testing.assert_allclose(stair.prob(3), base)
    np.testing.assert_allclose(stair.prob(13), 0.4 * base)
    np.testing.assert_allclose(stair.prob(23), base)
    np.testing.assert_allclose(sine.prob(5), base)  # sin = 1: f = 1
    np.testing.assert_allclose(sine.prob(15), 0.6 * base)  # sin = -1: f = 1 - 2 gamma
    inter = build("interleaved-sine", nu)
    for t in range(20):
        p = base * (0.3 * np.sin(2 * np.pi * t / 20) + 0.7)
        np.testing.assert_allclose(inter.prob(t), np.where(p >= 0.1, p, 0.0))
    assert (inter.prob(15) == 0).any() and (inter.prob(15) > 0).any()


def test_lognormal_rates_normalised_by_max(nu):
    s = build("ln:sigma=0.5", nu)
    assert s.prob(0).max() == 1.0 and s.prob(0).min() > 0
    sln = build("sln:sigma=0.5,period=24", nu)
    f = 0.4 * np.sin(np.linspace(0, 2 * np.pi, 24)) + 0.5  # FLGo's table
    for t in (0, 5, 30):
        np.testing.assert_allclose(sln.prob(t), s.prob(0) * f[t % 24])


# ------------------------------------------------------------------ statistics
@pytest.mark.parametrize("spec", ["bernoulli:p=0.3", "stationary", "fedau-bernoulli",
                                  "sine", "staircase", "interleaved-sine", "sln:sigma=0.5"])
def test_bernoulli_means_match_prob(spec, nu):
    s, rounds = build(spec, nu, seed=3), 4000
    m = s.matrix(rounds)
    p = np.array([s.prob(t) for t in range(rounds)])
    assert p.dtype == np.float64 and p.shape == (rounds, N) and (p >= 0).all() and (p <= 1).all()
    within_binomial(m.mean(axis=0), p.mean(axis=0), (p * (1 - p)).sum(axis=0) / rounds**2)


@pytest.mark.parametrize("spec", ["sine", "sln:sigma=0.3,period=20"])
def test_sine_shows_its_period(spec, nu):
    rounds = 2000
    frac = build(spec, nu, seed=1).matrix(rounds).mean(axis=1)
    t = np.arange(rounds)
    assert frac[t % 20 == 5].mean() > frac[t % 20 == 15].mean() + 0.05
    spectrum = np.abs(np.fft.rfft(frac - frac.mean()))
    assert int(np.argmax(spectrum)) == rounds // 20


def test_staircase_high_then_low(nu):
    rounds = 2000
    frac = build("staircase:period=20,low=0.4", nu, seed=2).matrix(rounds).mean(axis=1)
    phase = np.arange(rounds) % 20
    ratio = frac[phase >= 10].mean() / frac[phase < 10].mean()
    assert ratio == pytest.approx(0.4, abs=0.05)


def test_markov_stationary_mean_and_transitions(nu):
    s, rounds = build("markov:q=0.05", nu, seed=4), 20000
    m = s.matrix(rounds)
    p = s.base
    a, b = 0.05, 0.05 * (1 / p - 1)
    scale = np.maximum(1.0, b)
    a, b = a / scale, b / scale
    np.testing.assert_allclose(s.prob(123), p)
    lam = 1 - a - b  # lag-1 autocorrelation inflates the variance of the mean
    within_binomial(m.mean(axis=0), p, p * (1 - p) / rounds * (1 + lam) / (1 - lam))
    prev, nxt = m[:-1], m[1:]
    n_off, n_on = (~prev).sum(axis=0), prev.sum(axis=0)
    up = (~prev & nxt).sum(axis=0) / np.maximum(n_off, 1)
    down = (prev & ~nxt).sum(axis=0) / np.maximum(n_on, 1)
    within_binomial(up, a, a * (1 - a) / np.maximum(n_off, 1))
    ok = n_on > 50
    within_binomial(down[ok], b[ok], b[ok] * (1 - b[ok]) / n_on[ok])
    assert (b > 0.99).any() and (a < 0.05).any()  # the rescaling case is exercised


def test_cyclic_on_exactly_k_rounds_per_cycle(nu):
    c = 20
    s = build(f"cyclic:c={c}", nu, seed=5)
    k = np.maximum(1, np.round(c * s.base)).astype(int)
    cycle = k + np.maximum(1, c - k)
    m = s.matrix(int(cycle.max()) * 4)
    for i in range(N):
        row = m[:, i]
        L = cycle[i]
        for start in range(0, 3 * L, 7):  # any window of one cycle holds k_i on-rounds...
            assert row[start: start + L].sum() == k[i]
        window = row[:L]  # ...in one contiguous (circular) run
        assert np.count_nonzero(window != np.roll(window, 1)) in (0, 2)
        np.testing.assert_array_equal(row[L: 2 * L], window)
    np.testing.assert_allclose(s.prob(0), k / cycle)
    assert len(set(s.phase.tolist())) > 1


def test_cyclic_always_on_client_still_has_one_off_round():
    # one-hot clients with pbar = 1: p_i = min(1, C phi_i) = 1 for every phi_i >= 1/C
    s = build_schedule("cyclic:c=10,pbar=1.0", C, 0, label_dists=np.eye(C))
    full = np.flatnonzero(s.base == 1.0)
    assert full.size > 0
    m = s.matrix(33)
    for i in full:  # on for c = 10 rounds, then off for max(1, c - k) = 1 (FedAU's code)
        assert (~m[:, i]).sum() == 3 and m[:11, i].sum() == 10
        assert s.prob(0)[i] == pytest.approx(10 / 11)


def test_group_cyclic_one_group_per_window(nu):
    s = build("group-cyclic:groups=3,window=4", nu)
    m = s.matrix(60)
    sizes = np.bincount(s.group)
    assert sizes.max() - sizes.min() <= 1 and np.all(np.diff(s.group) >= 0)  # contiguous
    for t in range(60):
        assert set(s.group[m[t]].tolist()) == {(t // 4) % 3}
        assert m[t].sum() == sizes[(t // 4) % 3]
    sampled = build("group-cyclic:groups=3,window=4,sample=0.5", nu).matrix(2000)
    for t in range(0, 2000, 97):
        assert set(s.group[sampled[t]].tolist()) <= {(t // 4) % 3}
    on_share = sampled.sum() / sum(sizes[(t // 4) % 3] for t in range(2000))
    assert on_share == pytest.approx(0.5, abs=0.03)


def test_dropout_exact_count_per_round(nu):
    s = build("dropout:alpha=0.3", nu)
    m = s.matrix(1000)
    assert np.all((~m).sum(axis=1) == round(0.3 * N))
    np.testing.assert_allclose(s.prob(0), 1 - 12 / N)
    within_binomial(m.mean(axis=0), s.prob(0), s.prob(0) * (1 - s.prob(0)) / 1000)


def test_dropout_keeps_one_per_cluster_with_exact_marginal():
    clusters = np.repeat([0, 1, 2, 3], [1, 2, 5, 12])
    n = len(clusters)
    s = build_schedule("dropout:alpha=0.7,keep_per_cluster=true", n, 0, clusters=clusters)
    m = s.matrix(4000)
    assert np.all((~m).sum(axis=1) == 14)
    for cl in range(4):
        assert m[:, clusters == cl].any(axis=1).all()
    p = s.prob(0)
    within_binomial(m.mean(axis=0), p, p * (1 - p) / 4000)
    assert p[0] == 1.0 and p[-1] < p[2]
    free = build_schedule("dropout:alpha=0.7", n, 0).matrix(300)
    assert not all(free[:, clusters == cl].any(axis=1).all() for cl in range(4))


# ------------------------------------------------------------------ traces
def test_trace_matrix_round_trip_and_wrap(tmp_path):
    truth = np.random.default_rng(0).random((7, 5)) < 0.5
    path = tmp_path / "trace.csv"
    path.write_text("# a comment\nc0,c1,c2,c3,c4\n\n"
                    + "\n".join(",".join(str(int(v)) for v in row) for row in truth) + "\n")
    s = build_schedule(f"trace-matrix:path={path}", 5, 0)
    np.testing.assert_array_equal(s.matrix(7), truth)
    np.testing.assert_array_equal(s.available(7), truth[0])  # wraps around
    np.testing.assert_array_equal(s.available(7 * 3 + 4), truth[4])
    np.testing.assert_array_equal(s.prob(2), truth[2].astype(float))


def test_trace_matrix_header_of_ids_reorders_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("2,0,1\n1,0,0\n0,1,1\n")
    s = build_schedule(f"trace-matrix:path={path}", 3, 0)
    np.testing.assert_array_equal(s.matrix(2), [[0, 0, 1], [1, 1, 0]])


def test_trace_matrix_errors(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("1,0,1\n1,0\n")
    with pytest.raises(ScheduleError) as err:
        build_schedule(f"trace-matrix:path={path}", 3, 0)
    assert str(path) in str(err.value) and "expected 3" in str(err.value) and "found 2" in str(err.value)
    path.write_text("1,0,1\n1,0,2\n")
    with pytest.raises(ScheduleError, match=r"line 2, column 3: expected 0 or 1, found '2'"):
        build_schedule(f"trace-matrix:path={path}", 3, 0)
    with pytest.raises(ScheduleError, match="not found.*nope.csv"):
        build_schedule(f"trace-matrix:path={tmp_path / 'nope.csv'}", 3, 0)
    with pytest.raises(ScheduleError, match="needs parameter 'path'"):
        build_schedule("trace-matrix", 3, 0)


def test_trace_intervals_round_trip_and_wrap(tmp_path):
    doc = {"period": 600, "clients": {"0": [[0, 120]], "1": [[540, 660]], "2": [],
                                      "3": [[60, 61], [300, 420]], "99": [[0, 1]]}}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(doc))
    s = build_schedule(f"trace-intervals:path={path},round_seconds=60", 4, 0)
    m = s.matrix(20)  # tau = 60 t mod 600; rows 10.. repeat rows 0..
    expect = np.zeros((10, 4), dtype=bool)
    expect[[0, 1], 0] = True
    expect[[9, 0], 1] = True  # [540, 660) wraps to [540, 600) + [0, 60)
    expect[[1, 5, 6], 3] = True
    np.testing.assert_array_equal(m[:10], expect)
    np.testing.assert_array_equal(m[10:], expect)
    assert s.is_available(1, 19) and not s.is_available(2, 0)


def test_trace_intervals_errors(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"period": 100, "clients": {"0": [[0, 10]]}}))
    with pytest.raises(ScheduleError, match=r"no intervals for client\(s\) \[1, 2\]"):
        build_schedule(f"trace-intervals:path={path}", 3, 0)
    path.write_text(json.dumps({"period": 100, "clients": {"0": [[10, 5]]}}))
    with pytest.raises(ScheduleError, match="client 0.*start < end"):
        build_schedule(f"trace-intervals:path={path}", 1, 0)
    path.write_text(json.dumps({"clients": {}}))
    with pytest.raises(ScheduleError, match="'period'"):
        build_schedule(f"trace-intervals:path={path}", 1, 0)
    with pytest.raises(ScheduleError, match="not found.*missing.json"):
        build_schedule(f"trace-intervals:path={tmp_path / 'missing.json'}", 1, 0)


# ------------------------------------------------------------------ determinism and API
@pytest.mark.parametrize("spec", ["always", *RANDOM_SPECS])
def test_same_inputs_same_matrix_in_any_query_order(spec, nu):
    m = build(spec, nu, seed=11).matrix(150)
    assert m.dtype == bool and m.shape == (150, N)
    np.testing.assert_array_equal(build(spec, nu, seed=11).matrix(150), m)
    fresh = build(spec, nu, seed=11)
    for t in np.random.default_rng(0).permutation(150):
        np.testing.assert_array_equal(fresh.available(int(t)), m[t])
        assert fresh.is_available(int(t) % N, int(t)) == m[t, int(t) % N]
    json.dumps(fresh.describe())
    assert fresh.describe()["spec"] == spec and fresh.describe()["num_clients"] == N


@pytest.mark.parametrize("spec", RANDOM_SPECS)
def test_different_seed_different_matrix(spec, nu):
    assert not np.array_equal(build(spec, nu, seed=1).matrix(150), build(spec, nu, seed=2).matrix(150))


def test_same_matrix_in_another_process(nu):
    code = ("import numpy as np, sys; from availability import build_schedule; "
            "nu = np.random.default_rng(123).dirichlet(np.full(10, 0.1), 40); "
            "m = build_schedule('markov', 40, 9, label_dists=nu).matrix(300); "
            "sys.stdout.write(np.packbits(m).tobytes().hex())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    here = build_schedule("markov", 40, 9, label_dists=nu).matrix(300)
    assert out == np.packbits(here).tobytes().hex()


def documented_models() -> set[str]:
    """The spec names in the table of availability models in the docs (the one place they are listed)."""
    import re

    docs = ROOT / "docs"
    for page in ("availability.md", "extending.md"):
        path = docs / page
        if not path.is_file():
            continue
        text = path.read_text()
        start = text.find("<!-- availability-models -->")
        if start < 0:
            continue
        table = text[start:text.find("<!-- /availability-models -->", start)]
        return set(re.findall(r"^\| `([a-z0-9-]+)", table, flags=re.M))
    raise AssertionError("no table of availability models (<!-- availability-models -->) in docs/")


def test_registry_is_the_documented_table():
    assert set(SCHEDULES) == documented_models()
    for name, cls in SCHEDULES.items():
        assert cls.name == name and cls.__doc__ and f"[{name}" in cls.__doc__


def test_a_new_model_in_a_new_module_is_found_without_touching_any_list(tmp_path, monkeypatch):
    from availability.registry import discover

    pkg = tmp_path / "moremodels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "weekly.py").write_text(
        "import numpy as np\nfrom availability import BernoulliSchedule\n"
        "class Weekly(BernoulliSchedule):\n"
        "    \"\"\"[weekly:p=0.5] Online on weekdays with probability p.\"\"\"\n"
        "    name = 'weekly'\n    defaults = {'p': 0.5}\n"
        "    def _setup(self, **_):\n        self.base = np.full(self.num_clients, self.params['p'])\n"
        "    def _prob(self, t):\n        return self.base * (t % 7 < 5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = discover("moremodels")
    assert list(found) == ["weekly"] and found["weekly"].__module__ == "moremodels.weekly"
    assert "weekly" not in SCHEDULES  # a package's discovery does not leak into another's


def test_an_installed_model_is_found_by_its_entry_point(tmp_path, monkeypatch):
    from extension_fixtures import install

    (tmp_path / "mychains.py").write_text(
        "from availability.chains import OnOff\n"
        "class Sticky(OnOff):\n"
        "    \"\"\"[sticky:p=0.95,q=0.05,spread=0.0] A very persistent on/off chain.\"\"\"\n"
        "    name = 'sticky'\n    defaults = {'p': 0.95, 'q': 0.05, 'spread': 0.0}\n")
    install(tmp_path / "site", "mychains", "1.0", "[flchurn.availability]\nsticky = mychains:Sticky\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    s = build_schedule("sticky:q=0.1", 5, 0)
    ref = build_schedule("on-off:p=0.95,q=0.1,spread=0.0", 5, 0)  # the same chain, the same streams
    assert s.spec == "sticky:q=0.1" and np.array_equal(s.matrix(30), ref.matrix(30))


def test_the_on_off_chain_has_the_stationary_law_q_over_q_plus_1_minus_p():
    rounds = 20000
    s = build_schedule("on-off:p=0.7,q=0.2,spread=0.15", 30, 4)
    p, q = s.p_stay, s.q_join
    assert np.allclose(s.prob(0), q / (q + 1 - p)) and np.allclose(s.prob(77), s.prob(0))
    m = s.matrix(rounds)
    pi, lam = q / (q + 1 - p), p - q  # lam: the chain's second eigenvalue
    # the long-run fraction's standard error: sqrt(pi (1 - pi) (1 + lam) / (1 - lam) / rounds)
    se = np.sqrt(pi * (1 - pi) * (1 + lam) / (1 - lam) / rounds)
    assert np.all(np.abs(m.mean(axis=0) - pi) < 5 * se)
    # the transitions themselves: P(on -> on) = p_i, P(off -> on) = q_i
    on, nxt = m[:-1], m[1:]
    stay = (on & nxt).sum(0) / on.sum(0)
    join = (~on & nxt).sum(0) / (~on).sum(0)
    assert np.all(np.abs(stay - p) < 0.05) and np.all(np.abs(join - q) < 0.05)
    # heterogeneous: the clients' laws differ
    assert np.ptp(pi) > 0.1


def test_the_on_off_chain_refuses_a_client_that_never_moves():
    with pytest.raises(ScheduleError, match="no stationary law"):
        build_schedule("on-off:p=1.0,q=0.0,spread=0.0", 3, 0)


def test_group_dropout_takes_whole_groups_out_together():
    s = build_schedule("group-dropout:groups=4,fail=0.2,recover=0.3", 12, 1)
    m = s.matrix(3000)
    for g in range(4):
        block = m[:, s.group == g]
        assert np.all(block.all(axis=1) | ~block.any(axis=1))  # all in or all out (p = 1)
    assert abs(m.mean() - 0.3 / 0.5) < 0.05 and np.allclose(s.prob(5), 0.6)
    assert not np.array_equal(m[:, 0], m[:, -1])  # groups move independently
    with_coins = build_schedule("group-dropout:groups=4,fail=0.2,recover=0.3,p=0.5", 12, 1).matrix(3000)
    assert abs(with_coins.mean() - 0.5 * 0.6) < 0.05 and not np.any(with_coins & ~m)  # same group chain
    clusters = np.repeat(np.arange(3), 4)
    by_cluster = build_schedule("group-dropout:use-clusters=true", 12, 0, clusters=clusters)
    assert np.array_equal(by_cluster.group, clusters)
    with pytest.raises(ScheduleError, match="clusters"):
        build_schedule("group-dropout:use_clusters=true", 12, 0)


def test_builtin_random_streams_stay_out_of_the_range_reserved_for_extensions():
    from availability.base import BUILTIN_TAGS, EXTENSION_TAGS

    assert len(set(BUILTIN_TAGS)) == len(BUILTIN_TAGS)
    assert all(t not in EXTENSION_TAGS and t < EXTENSION_TAGS.start for t in BUILTIN_TAGS)


def test_spec_keys_in_kebab_or_snake_case_are_the_same_key():
    a = build_schedule("dropout:alpha=0.3,keep-per-cluster=false", 10, 0).matrix(5)
    b = build_schedule("dropout:alpha=0.3,keep_per_cluster=false", 10, 0).matrix(5)
    assert np.array_equal(a, b)
    with pytest.raises(ScheduleError, match="given twice"):
        build_schedule("dropout:keep-per-cluster=false,keep_per_cluster=true", 10, 0)


@pytest.mark.parametrize("spec, needs", [
    ("always", set()), ("bernoulli:p=0.5", set()), ("ln", set()), ("group-cyclic", set()),
    ("sine:gamma=0.3", {"label_dists"}), ("stationary", {"label_dists"}), ("markov", {"label_dists"}),
    ("fedau-bernoulli", {"label_dists"}), ("cyclic", {"label_dists"}),
    ("dropout:alpha=0.3", set()), ("dropout:alpha=0.3,keep_per_cluster=true", {"clusters"}),
    ("on-off", set()), ("group-dropout", set()), ("group-dropout:use-clusters=true", {"clusters"}),
])
def test_a_schedule_says_what_it_needs(spec, needs):
    from availability import schedule_needs

    assert schedule_needs(spec) == needs


def test_schedule_for_builds_the_workload_only_when_needed():
    from availability import schedule_for

    calls = []

    class Inputs:
        label_dists = np.full((N, 4), 0.25)
        clusters = None

    def make():
        calls.append(1)
        return Inputs()

    plain = schedule_for({"availability": "bernoulli:p=0.5", "num-clients": N, "schedule-seed": 3}, make)
    assert calls == [] and plain.num_clients == N
    assert np.array_equal(plain.matrix(5), build_schedule("bernoulli:p=0.5", N, 3).matrix(5))
    sine = schedule_for({"availability": "sine:gamma=0.3", "num-clients": N, "schedule-seed": 3}, make)
    assert calls == [1]
    assert np.array_equal(sine.matrix(5), build_schedule("sine:gamma=0.3", N, 3, Inputs.label_dists).matrix(5))
    with pytest.raises(ScheduleError, match="needs the workload's label_dists"):
        schedule_for({"availability": "sine:gamma=0.3", "num-clients": N})
    with pytest.raises(ScheduleError, match="unknown availability model 'nope'"):
        schedule_for({"availability": "nope", "num-clients": N})
