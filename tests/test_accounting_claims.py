"""accounting.claims: every form of a PrivacyClaim and every figure derived from it, against dp-accounting.

Oracles: dp-accounting's RdpAccountant (zCDP steps as Gaussians of σ = 1/√(2ρ) composed T times; ρ-zCDP events),
its ``compute_epsilon``/``compute_delta`` for single-order Rényi bounds, PLD accountants (μ-GDP as a Gaussian of
σ = 1/μ; pure ε-DP steps self-composed), numerical quadrature of the Gaussian pair's Rényi divergence, and exact
Rényi divergences of randomised response and of two-point bounded-range pairs.
"""

import math

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import common, pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import given
from hypothesis import strategies as st
from scipy import integrate, stats

from accounting import Adjacency, PrivacyClaim, StepClaim, composed_delta, composed_epsilon, zcdp_to_epsilon

DELTAS = (1e-3, 1e-6, 1e-9)
#: relative agreement with an oracle that computes the same bound (dp-accounting's RDP conversion, a PLD of a
#: two-point or Gaussian loss): floating point and our upward rounding only
SAME_BOUND_RTOL = 1e-6
#: our CKS conversion minimises over every order, dp-accounting's RDP accountant over a finite grid: ours is never
#: larger and at most this much smaller
GRID_RTOL = 1e-3


def _rdp_gaussians(rho: float, steps: int) -> rdp_privacy_accountant.RdpAccountant:
    accountant = rdp_privacy_accountant.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(1 / math.sqrt(2 * rho)), steps)
    return accountant


@pytest.mark.parametrize("rho, steps", [(0.01, 50), (0.002, 500), (0.5, 3)])
def test_per_step_zcdp_against_composed_gaussians(rho, steps):
    claim = PrivacyClaim.per_step(steps=steps, rho=rho)
    oracle = _rdp_gaussians(rho, steps)
    for delta in DELTAS:
        ours, theirs = claim.epsilon_at(delta), oracle.get_epsilon(delta)
        assert theirs * (1 - GRID_RTOL) <= ours <= theirs * (1 + 1e-12)
    for epsilon in (0.5, 2.0, 5.0):
        assert claim.delta_at(epsilon) <= oracle.get_delta(epsilon) * (1 + 1e-9)
    for alpha in (1.5, 2.0, 8.0):
        assert claim.sequence_renyi(alpha) == pytest.approx(steps * alpha * rho, rel=1e-12)
    # the same claim at sequence level: the same figures
    sequence = PrivacyClaim.zcdp(steps * rho, steps=steps)
    assert sequence.epsilon_at(1e-6) == pytest.approx(claim.epsilon_at(1e-6), rel=1e-12)
    assert sequence.sequence_renyi(3.0) == pytest.approx(claim.sequence_renyi(3.0), rel=1e-12)


@pytest.mark.parametrize("bounds", [{2.0: 1.0}, {8.0: 4.0}, {1.5: 0.2, 4.0: 0.9, 32.0: 5.0}])
@pytest.mark.parametrize("steps", [1, 8, 100])
def test_renyi_claims_against_dp_accounting(bounds, steps):
    orders, values = list(bounds), [steps * b for b in bounds.values()]
    per_step = PrivacyClaim.per_step(steps=steps, renyi=bounds)
    sequence = PrivacyClaim.rdp(dict(zip(orders, values)), steps=steps)
    for delta in DELTAS:
        theirs = rdp_privacy_accountant.compute_epsilon(orders, values, delta)[0]
        assert per_step.epsilon_at(delta) == pytest.approx(theirs, rel=SAME_BOUND_RTOL, abs=1e-12)
        assert sequence.epsilon_at(delta) == pytest.approx(theirs, rel=SAME_BOUND_RTOL, abs=1e-12)
    for epsilon in (0.1, 2.0, 10.0):
        theirs = rdp_privacy_accountant.compute_delta(orders, values, epsilon)[0]
        assert per_step.delta_at(epsilon) == pytest.approx(theirs, rel=SAME_BOUND_RTOL, abs=1e-300)
    # Rényi divergence is non-decreasing in α: a bound at a larger stated order holds below it, none above the largest
    top = max(orders)
    assert sequence.sequence_renyi(1.01) == min(values)
    assert sequence.sequence_renyi(top) == values[orders.index(top)]
    assert sequence.sequence_renyi(top + 1) == math.inf


@pytest.mark.parametrize("mu", [0.1, 1.0, 3.0])
def test_gdp_against_the_gaussian_pld(mu):
    claim = PrivacyClaim.gdp(mu, steps=20)
    oracle = pld_privacy_accountant.PLDAccountant()
    oracle.compose(dp_event.GaussianDpEvent(1 / mu))
    for delta in DELTAS:
        assert claim.epsilon_at(delta) == pytest.approx(oracle.get_epsilon(delta), rel=SAME_BOUND_RTOL, abs=1e-9)
    for epsilon in (0.0, 0.5, 2.0):
        assert claim.delta_at(epsilon) == pytest.approx(oracle.get_delta(epsilon), rel=SAME_BOUND_RTOL, abs=1e-12)


@pytest.mark.parametrize("mu, alpha", [(0.5, 2.0), (1.0, 1.5), (2.0, 4.0)])
def test_gdp_renyi_is_the_gaussian_pairs(mu, alpha):
    """D_α(N(μ, 1) ‖ N(0, 1)) by quadrature equals αμ²/2."""

    def integrand(x):
        return math.exp(alpha * stats.norm.logpdf(x, mu) + (1 - alpha) * stats.norm.logpdf(x))

    mass, _ = integrate.quad(integrand, -40, 40, points=[0.0, mu, alpha * mu])
    assert PrivacyClaim.gdp(mu, steps=1).sequence_renyi(alpha) == pytest.approx(math.log(mass) / (alpha - 1), rel=1e-7)


@pytest.mark.parametrize("epsilon, steps", [(0.1, 100), (0.5, 10), (1.0, 1), (0.05, 2000)])
def test_pure_epsilon_steps_against_the_pld(epsilon, steps):
    claim = PrivacyClaim.per_step(steps=steps, epsilon=epsilon)
    pld = privacy_loss_distribution.from_privacy_parameters(common.DifferentialPrivacyParameters(epsilon, 0.0))
    pld = pld.self_compose(steps)
    for delta in DELTAS:
        assert claim.epsilon_at(delta) == pytest.approx(pld.get_epsilon_for_delta(delta), rel=SAME_BOUND_RTOL, abs=1e-9)
    for total in (0.5 * epsilon * steps, 0.9 * epsilon * steps):
        assert claim.delta_at(total) == pytest.approx(pld.get_delta_for_epsilon(total), rel=SAME_BOUND_RTOL, abs=1e-15)
    assert claim.delta_at(epsilon * steps) == 0.0  # basic composition: T ε with δ = 0
    # optimal composition is never looser than its zCDP bound (T ε²/2, Bun & Steinke Prop. 1.4)
    assert claim.epsilon_at(1e-6) <= zcdp_to_epsilon(steps * epsilon**2 / 2, 1e-6) * (1 + 1e-9)


def test_bounded_range_steps_use_the_accountant():
    claim = PrivacyClaim.per_step(steps=40, epsilon0=0.3)
    assert claim.epsilon_at(1e-6) == composed_epsilon(1e-6, 0.3, 40)
    assert claim.delta_at(2.0) == composed_delta(2.0, 0.3, 40)
    oracle = rdp_privacy_accountant.RdpAccountant()
    oracle.compose(dp_event.ZCDpEvent(0.3**2 / 8), 40)
    assert claim.epsilon_at(1e-6) <= oracle.get_epsilon(1e-6)  # BR composition is tighter than its zCDP bound
    assert claim.sequence_renyi(2.0) == pytest.approx(40 * 2.0 * 0.3**2 / 8)
    # several per-step forms: the tightest figure of each
    both = PrivacyClaim.per_step(steps=40, epsilon0=0.3, rho=1e-4)
    assert both.epsilon_at(1e-6) == pytest.approx(zcdp_to_epsilon(40 * 1e-4, 1e-6))
    assert both.epsilon_at(1e-6) < claim.epsilon_at(1e-6)


def test_sequence_epsilon_delta_claim():
    claim = PrivacyClaim.approx_dp(2.0, 1e-6, steps=10)
    assert claim.epsilon_at(1e-6) == claim.epsilon_at(1e-3) == 2.0 and claim.epsilon_at(1e-7) == math.inf
    assert claim.delta_at(2.0) == claim.delta_at(5.0) == 1e-6 and claim.delta_at(1.9) == 1.0
    assert claim.sequence_renyi(2.0) == math.inf
    pure = PrivacyClaim.approx_dp(0.5, 0.0, steps=10)
    assert pure.delta_at(0.5) == 0.0 and pure.sequence_renyi(2.0) == pytest.approx(2.0 * 0.5**2 / 2)
    assert pure.sequence_renyi(100.0) == 0.5  # D_α ≤ D_∞ ≤ ε


# ---------------------------------------------------------------------------------------------
# epsilon_lower_at: the ε of the worst mechanism a claim admits (a reported ε below it is wrong given the claim)


@pytest.mark.parametrize("claim, rho_total", [
    (PrivacyClaim.per_step(steps=8, renyi={8.0: 4.0}), 8 * 4.0 / 8.0),  # DP-Fusion at α = 8, β = 0.5
    (PrivacyClaim.per_step(steps=50, rho=0.01, renyi={2.0: 0.05}), 50 * 0.01),
    (PrivacyClaim.zcdp(0.3, steps=5), 0.3),
    (PrivacyClaim.rdp({2.0: 1.0, 4.0: 1.2}, steps=5), 0.3),
])  # fmt: skip
def test_renyi_and_zcdp_lower_bound_is_the_gaussian_pld(claim, rho_total):
    """The Gaussian with total ρ meets the claim; its exact ε (dp-accounting's PLD, erring high by its discretisation)
    is what the lower bound states, never above our upper bound."""
    oracle = pld_privacy_accountant.PLDAccountant()
    oracle.compose(dp_event.GaussianDpEvent(1 / math.sqrt(2 * rho_total)))
    for delta in DELTAS:
        lower = claim.epsilon_lower_at(delta)
        assert lower == pytest.approx(oracle.get_epsilon(delta), rel=1e-4) and lower <= oracle.get_epsilon(delta)
        assert lower <= claim.epsilon_at(delta)


@pytest.mark.parametrize("epsilon, steps", [(0.5, 10), (1.0, 1), (0.1, 100)])
def test_pure_lower_bound_is_the_composed_randomised_responses(epsilon, steps):
    claim = PrivacyClaim.per_step(steps=steps, epsilon=epsilon)
    pld = privacy_loss_distribution.from_privacy_parameters(common.DifferentialPrivacyParameters(epsilon, 0.0))
    pld = pld.self_compose(steps)
    for delta in DELTAS:
        lower = claim.epsilon_lower_at(delta)
        assert lower == pytest.approx(claim.epsilon_at(delta), rel=1e-6)
        if lower > 0:  # just below it, T randomised responses (brute force) spend more than δ
            assert pld.get_delta_for_epsilon(lower) > delta * (1 - 1e-9)


def test_bounded_range_lower_bound_brackets_a_finer_accountant():
    """A report from br-adaptive at a finer lattice (also certified) lies between the lower and the upper bound."""
    from accounting.bounded_range import br_adaptive_delta, br_adaptive_epsilon

    claim = PrivacyClaim.per_step(steps=5, epsilon0=0.5)
    lower, finer, upper = claim.epsilon_lower_at(1e-6), br_adaptive_epsilon(1e-6, 0.5, 5, lattice_steps=200), claim.epsilon_at(1e-6)
    assert 0.95 * upper < lower < finer < upper
    assert br_adaptive_delta(lower, 0.5, 5).lower > 1e-6
    # BR with its implied zCDP (ρ = ε0²/8, as a MechanismGuarantee states it): the BR mechanism meets both
    assert PrivacyClaim.per_step(steps=5, epsilon0=0.5, rho=0.5**2 / 8).epsilon_lower_at(1e-6) == lower
    # a Rényi bound below what a BR step implies: no single worst mechanism is constructed, the bound is 0
    assert PrivacyClaim.per_step(steps=5, epsilon0=0.5, renyi={2.0: 1e-3}).epsilon_lower_at(1e-6) == 0.0


@pytest.mark.parametrize("epsilon, delta", [(1.0, 1e-6), (0.5, 0.0), (3.0, 0.01)])
def test_epsilon_delta_lower_bound_is_the_four_outcome_mechanism(epsilon, delta):
    """P = (δ, (1-δ)e^ε/(1+e^ε), (1-δ)/(1+e^ε), 0) against its mirror: its hockey-stick δ(ε') by brute force is δ' at
    the lower bound (and ε at δ, inf below δ); epsilon_at stays ε, an upper bound."""
    claim = PrivacyClaim.approx_dp(epsilon, delta, steps=3)
    a = (1 - delta) / (1 + math.exp(epsilon))
    p, q = np.array([delta, a * math.exp(epsilon), a, 0.0]), np.array([0.0, a, a * math.exp(epsilon), delta])
    for target in (delta or 1e-9, delta + 1e-3, delta + 0.05):
        lower = claim.epsilon_lower_at(target)
        spent = np.clip(p - math.exp(lower) * q, 0, None).sum()
        assert spent >= target and spent == pytest.approx(target, abs=1e-7)  # lowered: on the spending side
        assert lower <= claim.epsilon_at(target) == epsilon
    assert claim.epsilon_lower_at(delta or 1e-9) == pytest.approx(epsilon, rel=1e-7)
    if delta > 0:
        assert claim.epsilon_lower_at(delta / 2) == math.inf


def _renyi(p: np.ndarray, q: np.ndarray, alpha: float) -> float:
    return float(np.log(np.sum(p**alpha * q ** (1 - alpha))) / (alpha - 1))


@given(epsilon=st.floats(1e-3, 5.0), alpha=st.floats(1.01, 50.0))
def test_pure_epsilon_renyi_bound_holds_for_randomised_response(epsilon, alpha):
    """Randomised response is the extreme ε-DP pair; its exact D_α is within min(αε²/2, ε) (Bun & Steinke, Prop. 1.4)."""
    p = np.array([math.exp(epsilon), 1.0]) / (1 + math.exp(epsilon))
    bound = StepClaim(epsilon=epsilon).implied_renyi(alpha)
    assert _renyi(p, p[::-1], alpha) <= bound * (1 + 1e-9) + 1e-12


@given(epsilon0=st.floats(1e-3, 5.0), alpha=st.floats(1.01, 50.0), mass=st.floats(0.01, 0.99))
def test_bounded_range_renyi_bound_holds_for_two_point_pairs(epsilon0, alpha, mass):
    """A two-point pair whose log-ratios differ by exactly ε0 (P = (m, 1 − m), Q's first mass m/(m + (1 − m)e^{ε0}))
    is ε0-bounded-range; its D_α in both directions is within αε0²/8 (Cesar & Rogers 2021, Lemma 3.2)."""
    p = np.array([mass, 1 - mass])
    q1 = mass / (mass + (1 - mass) * math.exp(epsilon0))
    q = np.array([q1, 1 - q1])
    ratios = np.log(p / q)
    assert ratios[0] - ratios[1] == pytest.approx(epsilon0, rel=1e-9)
    bound = StepClaim(epsilon0=epsilon0).implied_renyi(alpha)
    assert max(_renyi(p, q, alpha), _renyi(q, p, alpha)) <= bound * (1 + 1e-9) + 1e-12


FORMS = st.one_of(
    st.builds(lambda r, t: PrivacyClaim.per_step(steps=t, rho=r), st.floats(1e-4, 1.0), st.integers(1, 200)),
    st.builds(lambda b, a, t: PrivacyClaim.per_step(steps=t, renyi={a: b}), st.floats(1e-3, 2.0), st.floats(1.5, 30.0),
              st.integers(1, 200)),
    st.builds(lambda e, t: PrivacyClaim.per_step(steps=t, epsilon=e), st.floats(1e-3, 1.0), st.integers(1, 200)),
    st.builds(lambda m: PrivacyClaim.gdp(m, steps=1), st.floats(1e-2, 5.0)),
    st.builds(lambda r: PrivacyClaim.zcdp(r, steps=1), st.floats(1e-3, 20.0)),
)


@given(claim=FORMS, delta=st.sampled_from(DELTAS))
def test_epsilon_at_never_overspends_delta(claim, delta):
    """ε(δ) errs high: the claim's own δ at that ε is at most δ."""
    epsilon = claim.epsilon_at(delta)
    assert claim.delta_at(epsilon) <= delta * (1 + 1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rho": 1.0, "mu": 2.0}, "one form.*got rho and mu"),
        ({}, "got neither"),
        ({"epsilon": 1.0}, "needs both"),
        ({"delta": 1e-6}, "needs both"),
        ({"epsilon": 1.0, "delta": 1.0}, r"delta must be in \(0, 1\)"),
        ({"rho": -1.0}, "rho must be >= 0"),
        ({"renyi": {}}, "at least one order"),
        ({"renyi": {1.0: 1.0}}, "alpha must be a finite number > 1"),
        ({"rho": 1.0, "reported_epsilon": 2.0}, "reported epsilon needs its delta"),
        ({"rho": 1.0, "adjacency": "zero-in"}, "adjacency must be one of"),
        ({"rho": 1.0, "adjacency": "zero-out"}, "'replace-by-null' or 'add-remove'; got 'zero-out'"),
        ({"rho": 1.0, "data_dependent": "yes"}, "data_dependent must be a bool"),
        ({"step": {"rho": 1.0}}, "step must be a StepClaim"),
    ],
)
def test_bad_claims_are_refused_with_what_was_given(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrivacyClaim(steps=5, **kwargs)


def test_bad_inputs_elsewhere():
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        PrivacyClaim.zcdp(1.0, steps=0)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        StepClaim(epsilon=0.0)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        PrivacyClaim.zcdp(1.0, steps=1).epsilon_at(0.0)
    with pytest.raises(ValueError, match="alpha must be a finite number > 1"):
        PrivacyClaim.zcdp(1.0, steps=1).sequence_renyi(1.0)
    with pytest.raises(ValueError, match="a claim is a PrivacyClaim"):
        PrivacyClaim.of({"rho": 1.0})
    with pytest.raises(ValueError, match="sensitivity is stated under replace-by-null and zero-out"):
        from accounting import linf_sensitivity

        linf_sensitivity(1.0, 4, adjacency="add-remove")


def test_adjacency_and_record():
    claim = PrivacyClaim.zcdp(0.5, steps=4, adjacency="add-remove", source="toy")
    assert claim.adjacency is Adjacency.ADD_REMOVE and claim.adjacency == "add-remove"
    assert claim.form == "rho" and claim.a_priori and PrivacyClaim.of(claim) is claim
    assert claim.describe() == "0.5-zCDP, T=4, add-remove, a-priori: toy"
    assert PrivacyClaim.rdp({2.0: 1.0}, steps=1, data_dependent=True).describe().endswith("DATA-DEPENDENT")
    # edge values: nothing learned, and nothing claimed at an order
    assert PrivacyClaim.zcdp(0.0, steps=3).epsilon_at(1e-6) == 0.0 and PrivacyClaim.gdp(0.0, steps=1).delta_at(0.0) == 0.0
    assert StepClaim(renyi={2.0: math.inf}).claims is False
