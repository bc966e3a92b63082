"""The black-box statistics beyond one Clopper–Pearson point (invink_audit.audit.tradeoff), each against an
independent computation: the closed form of Clopper–Pearson at k = n, simulated scores of known μ, the
hand-written bootstrap's values, and a simulation of sequential stopping at the claim's boundary. The μ-GDP
profile itself (against dp-accounting's PLD accountant): tests/test_accounting_gdp.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from accounting import gdp_to_epsilon
from invink_audit.audit.tradeoff import fit_gdp, perfect_attack_ceiling, sequential_bound

#: bootstrap noise of an end of fit_gdp's 95% interval at 4,000 resamples (its width is 0.32; the ends moved 0.007)
BOOTSTRAP_ATOL = 0.03


@pytest.mark.parametrize("n", [10, 100, 5000])
def test_perfect_attack_ceiling_is_the_clopper_pearson_closed_form(n):
    beta, delta = 0.05, 1e-6
    # with k = n (or 0) successes the one-sided Clopper–Pearson limit at β/2 is (β/2)^(1/n)
    tpr_low = (beta / 2) ** (1 / n)
    expected = math.log((tpr_low - delta) / (1 - tpr_low))
    assert perfect_attack_ceiling(n, n, delta=delta, significance=beta) == pytest.approx(expected, rel=1e-9)


def test_fit_gdp_recovers_a_known_mu_and_flags_perfect_separation():
    rng = np.random.default_rng(7)
    mu = 1.5
    fit = fit_gdp(rng.normal(mu, 1, 3000), rng.normal(0, 1, 3000), delta=1e-6, rng=np.random.default_rng(1))
    assert fit.mu.lower <= mu <= fit.mu.upper and fit.mu.upper - fit.mu.lower < 0.3
    assert fit.epsilon.lower <= gdp_to_epsilon(mu, 1e-6) <= fit.epsilon.upper
    apart = fit_gdp(rng.normal(10, 1, 50), rng.normal(0, 1, 50), delta=1e-6)
    # perfect separation: a finite floor set by the trial count (continuity correction), flagged as such
    floor = 2 * __import__("scipy.stats").stats.norm.ppf(50.5 / 51)
    assert apart.separated and math.isfinite(apart.mu.estimate) and apart.mu.estimate <= floor + 1e-9
    assert "floor" in apart.to_json()["kind"]
    # discrete scores: every positive at the top value, 1% of negatives too: a large μ, never 0
    ties = fit_gdp(np.full(200, 120.0), np.r_[np.full(2, 120.0), np.zeros(198)], delta=1e-6)
    assert not ties.separated and ties.mu.estimate > 2.0
    same = fit_gdp(rng.normal(0, 1, 2000), rng.normal(0, 1, 2000), delta=1e-6, rng=np.random.default_rng(2))
    assert same.mu.lower <= 0.1


def test_the_scipy_bootstrap_keeps_the_hand_written_ones_values():
    """fit_gdp's interval by scipy.stats.bootstrap against the values of the hand-written loop it replaced (each
    sample resampled with rng.choice per replicate; computed before its removal): the estimate is the same, the
    ends the same up to bootstrap noise, and the ε ends follow the μ ends."""
    rng = np.random.default_rng(7)
    fit = fit_gdp(rng.normal(1.5, 1, 400), rng.normal(0, 1, 400), delta=1e-6, num_bootstrap=4000,
                  rng=np.random.default_rng(1))  # fmt: skip
    assert fit.mu.estimate == 1.5767384891160032 and fit.mu.method == "bootstrap over trials, 4000 replicates"
    assert fit.mu.lower == pytest.approx(1.4061663806492164, abs=BOOTSTRAP_ATOL)
    assert fit.mu.upper == pytest.approx(1.7292806279321022, abs=BOOTSTRAP_ATOL)
    assert fit.epsilon.estimate == pytest.approx(8.278947504671134, rel=2e-9)  # ε(δ) now rounds up by 1e-9
    assert [fit.epsilon.lower, fit.epsilon.upper] == [gdp_to_epsilon(m, 1e-6) for m in (fit.mu.lower, fit.mu.upper)]
    pos, neg = rng.normal(1.0, 1, 60), rng.normal(0, 1, 60)
    seeded = [fit_gdp(pos, neg, delta=1e-6, num_bootstrap=50, rng=np.random.default_rng(3)) for _ in range(2)]
    assert seeded[0] == seeded[1]  # a seeded bootstrap is reproducible


@pytest.mark.parametrize("looks", [1, 2, 3, 4, 6])
def test_the_looks_spend_at_most_the_significance(looks):
    from invink_audit.audit.tradeoff import SequentialTest

    test = SequentialTest(np.arange(500) % 2 == 0, claimed_epsilon=1.0, delta=1e-6, significance=0.05, num_looks=looks)
    levels = [level for _, level in test.schedule]
    assert sum(levels) <= 0.05 + 1e-15 and levels == sorted(levels) and test.schedule[-1][0] == 500
    with pytest.raises(ValueError, match="num_looks"):
        SequentialTest(np.arange(10) % 2 == 0, claimed_epsilon=1.0, delta=1e-6, significance=0.05, num_looks=0)


def _trials(rng, n, tpr, fpr):
    positive = rng.random(n) < 0.5
    detected = np.where(positive, rng.random(n) < tpr, rng.random(n) < fpr)
    return detected, positive


def test_sequential_stopping_keeps_its_significance_at_the_claims_boundary():
    """A test exactly at the claim (TPR = e^ε·FPR, δ = 0) must be called a violation in at most β of the runs,
    whatever look it stops at."""
    rng = np.random.default_rng(3)
    claim, beta, runs = 1.0, 0.1, 2000
    fpr = 0.2
    tpr = math.exp(claim) * fpr
    false_alarms = sum(
        sequential_bound(*_trials(rng, 200, tpr, fpr), claimed_epsilon=claim, delta=0.0, significance=beta).stopped
        == "violation"
        for _ in range(runs)
    )
    assert false_alarms / runs <= beta


def test_sequential_stopping_stops_early_on_a_blatant_violation_and_when_nothing_can_change():
    rng = np.random.default_rng(4)
    blatant = sequential_bound(*_trials(rng, 4000, 0.99, 0.01), claimed_epsilon=1.0, delta=1e-6, significance=0.05)
    assert blatant.stopped == "violation" and blatant.trials_used <= 1000 and blatant.epsilon_lower_bound > 1.0
    hopeless = sequential_bound(*_trials(rng, 400, 0.5, 0.5), claimed_epsilon=8.0, delta=1e-6, significance=0.05)
    assert hopeless.stopped == "futile" and hopeless.trials_used < 400
    assert all(level <= 0.05 / 2 for _, level, _ in blatant.looks)
    assert sum(level for _, level, _ in sequential_bound(*_trials(rng, 64, 0.5, 0.5), claimed_epsilon=50.0, delta=0.0,
                                                          significance=0.05, num_looks=4).looks) <= 0.05


# ---------------------------------------------------------------------------------------------
# the claim as a curve (PrivacyProfile)


def _brute_force_refutes(tp, p, fp, q, deltas, epsilons, beta):
    """Independent: the scalar Clopper–Pearson bound of stats at every δ' of the curve, one at a time."""
    from invink_audit.audit import stats

    return any(stats.epsilon_lower_bound(tp, p, fp, q, delta=d, significance=beta) > e for d, e in zip(deltas, epsilons))


def test_a_profile_refutes_exactly_when_the_scalar_bound_does_at_some_delta():
    from invink_audit.audit import stats
    from invink_audit.audit.tradeoff import PrivacyProfile

    rng = np.random.default_rng(0)
    curve = PrivacyProfile.of(lambda d: gdp_to_epsilon(0.8, d), 1e-6, num_points=12)
    assert curve.deltas[0] == 1e-6 and curve.deltas[-1] == pytest.approx(0.5) and curve.epsilon == gdp_to_epsilon(0.8, 1e-6)
    p, q = 400, 380
    tp, fp = rng.integers(0, p + 1, 300), rng.integers(0, q + 1, 300)
    points = curve.bounds(tp, p, fp, q, significance=0.05)
    for t, f, pt in zip(tp, fp, points):
        assert (pt.power_margin > 0) == _brute_force_refutes(int(t), p, int(f), q, curve.deltas, curve.epsilons, 0.05)
        assert (pt.margin > 0) == (pt.power_margin > 0)
        assert pt.epsilon_lower_bound == pytest.approx(
            stats.epsilon_lower_bound(int(t), p, int(f), q, delta=pt.delta, significance=0.05), abs=1e-9)
    # a point claim is the classic bound: its margin is the bound minus the claim
    point = PrivacyProfile.point(1.0, 1e-6).bounds([300], p, [40], q, significance=0.05)[0]
    assert point.margin == pytest.approx(stats.epsilon_lower_bound(300, p, 40, q, delta=1e-6, significance=0.05) - 1.0)
    with pytest.raises(ValueError, match="as many epsilons"):
        PrivacyProfile((1e-6, 1e-3), (1.0,))
    with pytest.raises(ValueError, match="delta must be in"):
        PrivacyProfile.of(lambda d: 1.0, 0.7)


def test_testing_the_curve_keeps_its_significance_and_refutes_what_the_point_cannot():
    """Scores of μ-Gaussian DP (a shift by μ of a standard normal) against a μ-GDP claim: at the boundary the
    sequential test on the curve calls at most β of the runs a violation; at 2μ (the doubled per-token ε0
    of a mutant, in GDP terms) it refutes nearly always with 2,000 trials, where the quoted point
    ε(10⁻⁶) never can (its ceiling at these trials is below the claim)."""
    from invink_audit.audit.tradeoff import PrivacyProfile, SequentialTest

    rng = np.random.default_rng(5)
    mu, beta, n = 0.5, 0.1, 2000
    curve = PrivacyProfile.of(lambda d: gdp_to_epsilon(mu, d), 1e-6)

    def run(true_mu):
        positive = rng.random(n) < 0.5
        scores = rng.normal(size=n) + np.where(positive, true_mu, 0.0)
        # a fixed threshold (chosen before the trials, as the selection split does): FPR ≈ 0.16
        test = SequentialTest(positive, claimed_epsilon=curve.epsilon, delta=curve.delta, significance=beta, profile=curve)
        while test.look(scores >= 1.0) is None:
            pass
        return test.result()

    at_claim = [run(mu).stopped == "violation" for _ in range(400)]
    assert np.mean(at_claim) <= beta
    doubled = [run(2 * mu) for _ in range(50)]
    assert np.mean([r.stopped == "violation" for r in doubled]) >= 0.9
    assert all(r.epsilon_lower_bound < curve.epsilon for r in doubled)  # the quoted point alone: never refuted
    refuted = [r.profile for r in doubled if r.stopped == "violation"]
    assert all(pt.delta > 1e-4 and pt.epsilon_lower_bound > pt.claimed_epsilon for pt in refuted)
