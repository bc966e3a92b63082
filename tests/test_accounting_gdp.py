"""μ-Gaussian DP (accounting.conversions): δ(ε; μ) against its closed form and dp-accounting's PLD accountant, the two
inversions on their safe sides (hypothesis), the edges μ = 0 and μ = ∞, and the values of the two implementations it
replaced (``accounting.gaussian_dp_*`` and ``invink_audit.audit.tradeoff.gdp_*``, computed before their removal)."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from hypothesis import example, given
from hypothesis import strategies as st
from scipy.stats import norm

from accounting import epsilon_to_gdp, gdp_to_delta, gdp_to_epsilon

#: the PLD accountant discretises the privacy loss (interval 1e-4 here) and rounds pessimistically
PLD_RTOL = 1e-6
#: the upward rounding of gdp_to_epsilon's root (a relative 1e-9) and the bisection of epsilon_to_gdp (1e-12)
ROUNDING = 1e-9

# (mu, epsilon, delta) of the removed implementations: accounting.gaussian_dp_delta(mu, eps), bit for bit
OLD_DELTAS = [(0.3, 0.0, 0.11923538474048502), (0.3, 0.5, 0.007573480585463164), (0.3, 3.0, 9.93926566627396e-25),
              (1.0, 0.0, 0.3829249225480263), (1.0, 0.5, 0.23842170813487662), (1.0, 3.0, 0.0015371853694009572),
              (4.0, 0.5, 0.9419161566877955), (4.0, 3.0, 0.8345000818530993)]  # fmt: skip
# (mu, delta, epsilon of accounting.gaussian_dp_epsilon, epsilon of tradeoff.gdp_epsilon: Brent's root, not rounded)
OLD_EPSILONS = [(0.3, 1e-3, 0.7353385713377284, 0.735338570602389), (1.0, 1e-6, 4.886554122348765, 4.886554117462644),
                (1.0, 1e-10, 6.547924073412877, 6.5479240668649545), (4.0, 1e-6, 26.35696395168278, 26.35696392532582),
                (4.0, 1e-10, 32.84827417447264, 32.84827414162678)]  # fmt: skip

mus = st.floats(min_value=1e-6, max_value=60.0)
deltas = st.floats(min_value=1e-300, max_value=0.9)


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-8])
def test_gdp_epsilon_matches_the_gaussian_mechanism_in_dp_accounting(mu, delta):
    """A Gaussian mechanism of sensitivity 1 and noise σ is exactly (1/σ)-GDP (Dong, Roth & Su 2022, Thm 2.7)."""
    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier=1 / mu))
    assert gdp_to_epsilon(mu, delta) == pytest.approx(accountant.get_epsilon(delta), rel=PLD_RTOL, abs=PLD_RTOL)
    assert gdp_to_delta(mu, gdp_to_epsilon(mu, delta)) == pytest.approx(delta, rel=1e-6)
    assert epsilon_to_gdp(gdp_to_epsilon(mu, delta), delta) == pytest.approx(mu, rel=1e-6)


def test_the_profile_is_the_analytic_gaussian_and_decreases():
    # mu = 1, eps = 1: Phi(-1/2) - e Phi(-3/2) (Balle & Wang 2018, Thm. 8), by scipy's normal cdf
    assert gdp_to_delta(1.0, 1.0) == pytest.approx(norm.cdf(-0.5) - math.e * norm.cdf(-1.5), rel=1e-12)
    assert gdp_to_delta(2.0, 0.0) == pytest.approx(2 * norm.cdf(1.0) - 1, rel=1e-12)
    curve = [gdp_to_delta(1.3, e) for e in (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)]
    assert all(a > b for a, b in zip(curve, curve[1:]))
    for mu, delta in [(0.5, 1e-6), (1.0, 1e-5), (3.0, 1e-9), (1e-12, 1e-300)]:
        eps = gdp_to_epsilon(mu, delta)
        assert gdp_to_delta(mu, eps) <= delta  # never below the curve
        if eps > 0:
            assert gdp_to_delta(mu, eps * (1 - 1e-6)) > delta  # and tight
    assert gdp_to_epsilon(1e-3, 0.5) == 0.0  # delta(0) = 2 Phi(mu/2) - 1 < 0.5


def test_the_edges_mu_zero_and_infinite_and_epsilon_infinite():
    assert gdp_to_delta(0.0, 1.0) == 0.0 and gdp_to_delta(0.0, 0.0) == 0.0
    assert gdp_to_delta(math.inf, 1.0) == 1.0 and gdp_to_delta(math.inf, math.inf) == 0.0
    assert gdp_to_delta(1.0, math.inf) == 0.0
    assert gdp_to_epsilon(0.0, 1e-6) == 0.0 and gdp_to_epsilon(math.inf, 1e-6) == math.inf
    assert epsilon_to_gdp(math.inf, 1e-6) == math.inf
    zero = epsilon_to_gdp(0.0, 1e-3)  # ε = 0: the largest μ with 2Φ(μ/2) − 1 ≤ δ
    assert zero == pytest.approx(2 * norm.ppf((1 + 1e-3) / 2), rel=1e-9) and gdp_to_delta(zero, 0.0) <= 1e-3
    for call, message in [(lambda: gdp_to_delta(-1.0, 1.0), "mu must be >= 0"),
                          (lambda: gdp_to_delta(1.0, -1.0), "epsilon must be >= 0"),
                          (lambda: gdp_to_epsilon(1.0, 1.0), "delta must be in"),
                          (lambda: gdp_to_epsilon(math.nan, 1e-6), "mu"),
                          (lambda: epsilon_to_gdp(-1.0, 1e-6), "epsilon must be >= 0")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            call()


@pytest.mark.parametrize(("mu", "epsilon", "delta"), OLD_DELTAS)
def test_delta_is_the_removed_implementations(mu, epsilon, delta):
    assert gdp_to_delta(mu, epsilon) == pytest.approx(delta, rel=1e-13)


@pytest.mark.parametrize(("mu", "delta", "accountant_epsilon", "auditor_epsilon"), OLD_EPSILONS)
def test_epsilon_is_the_removed_implementations(mu, delta, accountant_epsilon, auditor_epsilon):
    assert gdp_to_epsilon(mu, delta) == pytest.approx(accountant_epsilon, rel=1e-13)
    # the auditor's copy returned Brent's root unrounded: now rounded up by at most ROUNDING, never down
    assert auditor_epsilon <= gdp_to_epsilon(mu, delta) <= auditor_epsilon * (1 + 2 * ROUNDING)


@given(mus, deltas)
@example(1e-6, 1e-300)
@example(60.0, 0.9)
def test_epsilon_of_mu_never_understates_epsilon(mu, delta):
    """gdp_to_epsilon errs high: δ(ε) ≤ δ at the returned ε (the claim holds there), and tight."""
    eps = gdp_to_epsilon(mu, delta)
    assert gdp_to_delta(mu, eps) <= delta
    if eps > 0:
        assert gdp_to_delta(mu, eps * (1 - 10 * ROUNDING)) > delta or eps < 1e-12


@given(st.floats(min_value=0.0, max_value=200.0), deltas)
@example(0.0, 1e-300)
@example(1e-3, 1e-10)
def test_mu_of_epsilon_never_overstates_mu(epsilon, delta):
    """epsilon_to_gdp errs low: δ(ε; μ) ≤ δ at the returned μ (noise planned from it suffices), and tight."""
    mu = epsilon_to_gdp(epsilon, delta)
    assert mu > 0 and gdp_to_delta(mu, epsilon) <= delta
    assert gdp_to_delta(mu * (1 + 1e-9), epsilon) > delta
