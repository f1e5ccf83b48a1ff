"""privacy.accountant: the ε the run's realised participation gives, against computations written
here from the papers (not through dp-accounting): the analytic Gaussian mechanism (Balle & Wang
2018, Theorem 8), the integer-order RDP of the Poisson-subsampled Gaussian (Mironov, Talwar & Zhang
2019, Sec. 3.3) and the RDP-to-(ε, δ) conversion dp-accounting documents (Canonne, Kamath &
Steinke 2020, Prop. 12)."""

import math

import numpy as np
import pytest
from scipy.optimize import brentq
from scipy.stats import norm

from privacy import ChurnAccountant, PrivacyConfigError

N, DELTA = 20, 1e-5


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact ε of a Gaussian mechanism of sensitivity 1 and noise 1/μ at δ."""
    def gap(eps):
        return norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta
    return brentq(gap, 0.0, 500.0)


def sampled_gaussian_rdp(q: float, z: float, alpha: int) -> float:
    """RDP at integer order α of the Poisson-subsampled Gaussian (add/remove one)."""
    if q == 1:
        return alpha / (2 * z * z)
    terms = [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
             + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * z * z) for k in range(alpha + 1)]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)


def rdp_epsilon(schedule: list[tuple[float, float]], delta: float, orders) -> float:
    """ε at δ of the composed rounds (q_t, z_t), by the improved RDP conversion."""
    best = math.inf
    for a in orders:
        r = sum(sampled_gaussian_rdp(q, z, a) for q, z in schedule)
        best = min(best, r + math.log1p(-1 / a) - math.log(delta * a) / (a - 1))
    return max(best, 0.0)


def run(acc: ChurnAccountant, participants: list[list[int]], z: float | list[float] = 1.0):
    zs = z if isinstance(z, list) else [z] * len(participants)
    return [acc.compose(t + 1, who, zt) for t, (who, zt) in enumerate(zip(participants, zs, strict=True))]


def test_full_participation_matches_the_analytic_gaussian_and_the_rdp_closed_form():
    """q = 1 every round: T rounds at z are one Gaussian at z/√T. PLD gives the exact ε (the analytic
    Gaussian) to its discretisation, RDP an upper bound equal to the RDP closed form."""
    T, z = 4, 1.5
    everyone = [list(range(N))] * T
    exact = analytic_gaussian_epsilon(math.sqrt(T) / z, DELTA)
    rdp = run(ChurnAccountant(N, DELTA), everyone, z)[-1]
    pld = run(ChurnAccountant(N, DELTA, method="pld"), everyone, z)[-1]
    assert pld.epsilon == pytest.approx(exact, rel=2e-3)
    assert rdp.epsilon == pytest.approx(rdp_epsilon([(1.0, z)] * T, DELTA, ChurnAccountant(N, DELTA).orders), rel=1e-9)
    assert exact < rdp.epsilon < 1.3 * exact
    # with everyone in every round the worst client is charged every round: the same figure
    assert rdp.epsilon_worst_client == pytest.approx(rdp.epsilon, rel=1e-9)


def test_a_churned_schedule_is_composed_at_its_realised_rates():
    """Rounds with 3..9 of 20 clients and two noise levels: the accountant's ε after every round
    equals the independent RDP composition at q_t = m_t / N."""
    rng = np.random.default_rng(0)
    counts = [3, 9, 5, 0, 7, 4]
    who = [sorted(rng.choice(N, m, replace=False).tolist()) for m in counts]
    zs = [1.0, 1.0, 2.0, 1.0, 0.8, 1.2]
    acc = ChurnAccountant(N, DELTA)
    spent = run(acc, who, zs)
    for t, s in enumerate(spent):
        released = [(m / N, z) for m, z in zip(counts[:t + 1], zs[:t + 1], strict=True) if m]
        assert s.epsilon == pytest.approx(rdp_epsilon(released, DELTA, acc.orders), rel=1e-7)
        assert s.sampling_rate == counts[t] / N and s.participants == counts[t]
    assert spent[3].epsilon == spent[2].epsilon and spent[3].noise_multiplier == 0  # nothing released in round 4
    assert all(a.epsilon < b.epsilon for a, b in zip(spent[3:], spent[4:], strict=False))


def test_halving_participation_lowers_the_amplified_epsilon_as_the_closed_form_says():
    """The same 10 rounds at 10 of 20 clients and at 5 of 20: ε at q = 1/4 is what the closed form
    gives at q = 1/4, below that at q = 1/2."""
    T = 10
    full = run(ChurnAccountant(N, DELTA), [list(range(10))] * T)[-1]
    half = run(ChurnAccountant(N, DELTA), [list(range(5))] * T)[-1]
    orders = ChurnAccountant(N, DELTA).orders
    assert full.epsilon == pytest.approx(rdp_epsilon([(0.5, 1.0)] * T, DELTA, orders), rel=1e-7)
    assert half.epsilon == pytest.approx(rdp_epsilon([(0.25, 1.0)] * T, DELTA, orders), rel=1e-7)
    assert half.epsilon < 0.75 * full.epsilon


def test_a_client_in_half_the_rounds_is_charged_half_the_rounds():
    """No amplification: clients that alternate (evens in odd rounds, odds in even rounds) are each
    charged T/2 rounds, exactly the ε of T/2 rounds with everyone, and the closed form's."""
    T, z = 12, 2.0
    evens, odds = list(range(0, N, 2)), list(range(1, N, 2))
    acc = ChurnAccountant(N, DELTA)
    alternating = run(acc, [evens, odds] * (T // 2), z)[-1]
    half_rounds = run(ChurnAccountant(N, DELTA), [list(range(N))] * (T // 2), z)[-1]
    everyone = run(ChurnAccountant(N, DELTA), [list(range(N))] * T, z)[-1]
    assert alternating.epsilon_worst_client == pytest.approx(half_rounds.epsilon_worst_client, rel=1e-9)
    assert alternating.epsilon_worst_client == pytest.approx(rdp_epsilon([(1.0, z)] * (T // 2), DELTA, acc.orders),
                                                             rel=1e-9)
    assert alternating.epsilon_worst_client < 0.8 * everyone.epsilon_worst_client


def test_the_state_replays_to_the_same_figures():
    acc = ChurnAccountant(N, DELTA)
    run(acc, [[0, 1, 2], [], [4, 5]], [1.0, 1.0, 0.7])
    again = ChurnAccountant(N, DELTA)
    again.load_state_dict(acc.state_dict())
    assert again.history == acc.history
    with pytest.raises(PrivacyConfigError, match="loaded into"):
        ChurnAccountant(N + 1, DELTA).load_state_dict(acc.state_dict())


@pytest.mark.parametrize("make, match", [
    (lambda: ChurnAccountant(0, DELTA), "positive integer"),
    (lambda: ChurnAccountant(N, 1.0), r"in \(0, 1\)"),
    (lambda: ChurnAccountant(N, DELTA, method="rpd"), "did you mean 'rdp'"),
    (lambda: ChurnAccountant(N, DELTA).compose(1, [0], 0.0), "positive finite"),
    (lambda: ChurnAccountant(N, DELTA).compose(1, [0, 0], 1.0), "listed twice"),
    (lambda: ChurnAccountant(2, DELTA).compose(1, [0, 1, 2], 1.0), "> population"),
])
def test_bad_settings_are_refused_with_the_reason(make, match):
    with pytest.raises(PrivacyConfigError, match=match):
        make()


def test_rounds_must_increase():
    acc = ChurnAccountant(N, DELTA)
    acc.compose(2, [0], 1.0)
    with pytest.raises(PrivacyConfigError, match="rounds must increase"):
        acc.compose(2, [1], 1.0)
