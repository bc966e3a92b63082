"""AugPE's accounting (accounting.augpe): T Gaussian histograms, checked against dp-accounting (RDP curve, RDP and
PLD accountants), the closed forms, the planner's round trips and its never-overspend property, and input checks.
The μ-GDP profile it uses: tests/test_accounting_gdp.py."""

from __future__ import annotations

import math
import subprocess
import sys

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant
from hypothesis import example, given
from hypothesis import strategies as st

from accounting import (
    AugPEEvent,
    AugPESensitivity,
    ZcdpEvent,
    augpe_l2_sensitivity,
    gdp_to_delta,
    plan_augpe_noise_std,
    zcdp_to_epsilon,
)

#: dp-accounting's RDP of a Gaussian and our α·ρ are the same closed form: they agree to rounding
RDP_RTOL = 1e-9
#: the PLD accountant discretises the loss (interval 1e-4 by default) and rounds pessimistically
PLD_ATOL = 1e-4
#: the CKS conversion of ρ is never below the exact Gaussian ε and, at these budgets, within this factor of it
ZCDP_OVER_EXACT = 1.25
ORDERS = (1.5, 2.0, 3.0, 8.0, 32.0, 256.0)
SENSITIVITIES = list(AugPESensitivity)

stds = st.floats(min_value=0.05, max_value=500.0)
iterations = st.integers(min_value=1, max_value=1000)
sensitivities = st.sampled_from(SENSITIVITIES)


def _gaussian_events(event: AugPEEvent):
    return dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(event.noise_multiplier), event.iterations)


def test_the_sensitivities_are_the_papers_property():
    # paper Property prop:augpe-sens: sqrt(2) under replace-by-null, 1 under add-or-remove; PAPER is the latter's value
    assert augpe_l2_sensitivity(AugPESensitivity.REPLACE_BY_NULL) == math.sqrt(2.0)
    assert augpe_l2_sensitivity("add-or-remove") == 1.0
    assert augpe_l2_sensitivity(AugPESensitivity.PAPER) == 1.0
    event = AugPEEvent(3.0, 4, AugPESensitivity.PAPER)
    assert not event.valid and "NOT A VALID GUARANTEE" in event.describe()
    assert event.rho_replace_by_null == pytest.approx(2.0 * event.rho, rel=1e-15)  # the paper's advantage: 2 in rho
    assert AugPEEvent(3.0, 4).valid and AugPEEvent(3.0, 4, "add-or-remove").valid


@given(stds, iterations, sensitivities)
def test_rho_is_the_closed_form_and_the_rdp_curve_is_dp_accountings(noise_std, num_iterations, sensitivity):
    event = AugPEEvent(noise_std, num_iterations, sensitivity)
    delta_l2 = augpe_l2_sensitivity(sensitivity)
    assert event.rho == pytest.approx(num_iterations * delta_l2**2 / (2 * noise_std**2), rel=1e-14)
    assert event.mu == pytest.approx(math.sqrt(2 * event.rho), rel=1e-14)  # a Gaussian is mu^2/2-zCDP
    accountant = rdp_privacy_accountant.RdpAccountant(orders=ORDERS)
    accountant.compose(_gaussian_events(event))
    # dp-accounting's RDP curve at each order (the accountant's state; there is no public getter)
    for order, rdp in zip(accountant._orders, accountant._rdp):
        assert order * event.rho == pytest.approx(float(rdp), rel=RDP_RTOL)


@pytest.mark.parametrize("sensitivity", SENSITIVITIES)
@pytest.mark.parametrize(("noise_std", "num_iterations"), [(0.8, 1), (5.0, 1), (2.5, 10), (12.0, 7), (40.0, 100)])
@pytest.mark.parametrize("delta", [1e-5, 1e-6, 1e-9])
def test_epsilon_is_between_the_exact_pld_and_the_rdp_accountant(noise_std, num_iterations, sensitivity, delta):
    event = AugPEEvent(noise_std, num_iterations, sensitivity)
    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(_gaussian_events(event))
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(_gaussian_events(event))
    exact, pld_eps, rdp_eps = event.gaussian_epsilon(delta), pld.get_epsilon(delta), rdp.get_epsilon(delta)
    ours = event.epsilon(delta)
    assert exact == pytest.approx(pld_eps, abs=PLD_ATOL)  # the closed form is the tight curve
    assert exact <= ours <= rdp_eps * (1 + 1e-9)  # CKS minimises over every order, dp-accounting over a grid
    assert ours <= ZCDP_OVER_EXACT * exact + 1e-9
    assert ours == zcdp_to_epsilon(event.rho, delta, "cks") * (1 + 1e-12)
    assert ours == ZcdpEvent(event.rho, "augpe").epsilon(delta)  # what a ledger reports for the same rho


@given(st.floats(min_value=0.01, max_value=50.0), st.sampled_from([1e-3, 1e-6, 1e-10]), iterations, sensitivities,
       st.booleans())  # fmt: skip
@example(1e-2, 1e-10, 1000, AugPESensitivity.REPLACE_BY_NULL, False)
def test_the_planned_noise_never_overspends_and_is_tight(epsilon, delta, num_iterations, sensitivity, exact):
    noise_std = plan_augpe_noise_std(epsilon, delta, num_iterations, sensitivity, exact_gaussian=exact)
    event = AugPEEvent(noise_std, num_iterations, sensitivity)
    spent = event.gaussian_epsilon(delta) if exact else event.epsilon(delta)
    assert spent <= epsilon
    less = AugPEEvent(noise_std * (1 - 1e-6), num_iterations, sensitivity)
    assert (less.gaussian_epsilon(delta) if exact else less.epsilon(delta)) > epsilon  # the safe side, but close
    if exact:  # the exact plan's μ-GDP curve holds at (ε, δ) (accounting.conversions.epsilon_to_gdp errs low)
        assert gdp_to_delta(event.mu, epsilon) <= delta
    if not exact:  # epsilon -> sigma -> epsilon round trip, and sigma -> epsilon -> sigma
        assert spent == pytest.approx(epsilon, rel=1e-6)
        again = plan_augpe_noise_std(spent, delta, num_iterations, sensitivity)
        assert again == pytest.approx(noise_std, rel=1e-6) and again >= noise_std * (1 - 1e-12)


def test_the_exact_plan_needs_less_noise_and_the_paper_convention_hides_a_factor_sqrt2():
    zcdp = plan_augpe_noise_std(1.0, 1e-6, 10)
    exact = plan_augpe_noise_std(1.0, 1e-6, 10, exact_gaussian=True)
    assert exact < zcdp
    paper = plan_augpe_noise_std(1.0, 1e-6, 10, AugPESensitivity.PAPER)
    assert zcdp / paper == pytest.approx(math.sqrt(2.0), rel=1e-9)  # same epsilon, sqrt(2) less noise claimed
    # the paper's noise, accounted correctly under replace-by-null, spends twice the rho it claims: eps 1.45, not 1
    assert AugPEEvent(paper, 10).rho == pytest.approx(2 * AugPEEvent(paper, 10, AugPESensitivity.PAPER).rho, rel=1e-15)
    assert AugPEEvent(paper, 10).epsilon(1e-6) > 1.4


def test_only_the_correct_replace_by_null_event_has_a_ledger_record():
    event = AugPEEvent(4.0, 3)
    record = event.zcdp_event()
    assert isinstance(record, ZcdpEvent) and record.rho == event.rho and "augpe" in record.mechanism
    with pytest.raises(ValueError, match="not a valid guarantee"):
        AugPEEvent(4.0, 3, AugPESensitivity.PAPER).zcdp_event()
    with pytest.raises(ValueError, match="add-or-remove guarantee does not compose"):
        AugPEEvent(4.0, 3, AugPESensitivity.ADD_OR_REMOVE).zcdp_event()
    assert event.to_json()["rho"] == event.rho and event.to_json()["valid"] is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_std": 0.0, "iterations": 1}, "noise_std must be in"),
        ({"noise_std": float("nan"), "iterations": 1}, "noise_std must be in"),
        ({"noise_std": "2", "iterations": 1}, "noise_std must be in"),
        ({"noise_std": 1.0, "iterations": 0}, "iterations must be an integer"),
        ({"noise_std": 1.0, "iterations": 2.0}, "iterations must be an integer"),
        ({"noise_std": 1.0, "iterations": True}, "iterations must be an integer"),
        ({"noise_std": 1.0, "iterations": 1, "sensitivity": "zero-out"}, "augpesensitivity must be one of"),
    ],
)
def test_a_bad_event_is_refused_with_its_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AugPEEvent(**kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0.0, 1e-6, 3), {}, "epsilon must be in"),
        ((1.0, 1.0, 3), {}, "delta must be in"),
        ((1.0, 0.0, 3), {}, "delta must be in"),
        ((1.0, 1e-6, 0), {}, "iterations must be an integer"),
        ((1.0, 1e-6, 3), {"accountant": "moments"}, "accountant must be one of"),
        ((1.0, 1e-6, 3), {"exact_gaussian": "yes"}, "exact_gaussian must be a bool"),
        ((1e-6, 1e-300, 10**9), {"accountant": "bun-steinke"}, "above 1e\\+12"),
        ((1e-6, 1e-300, 3), {}, "allows no zCDP budget"),  # CKS's orders stop at 1e7: rho underflows to 0
    ],
)
def test_a_bad_plan_is_refused_with_its_name(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_augpe_noise_std(*args, **kwargs)
    with pytest.raises(ValueError, match="delta must be in"):
        AugPEEvent(1.0, 1).epsilon(1.5)


def test_the_edges_t_one_and_large_budgets():
    one = AugPEEvent(1.0, 1)
    assert one.rho == pytest.approx(1.0, rel=1e-15)  # Delta^2 / (2 sigma^2) with Delta = sqrt(2), sigma = 1
    assert AugPEEvent(1e12, 1).epsilon(1e-6) < 1e-10  # almost no privacy loss
    assert AugPEEvent(plan_augpe_noise_std(1e4, 0.5, 1), 1).epsilon(0.5) <= 1e4  # the largest budget plans
    assert math.isfinite(AugPEEvent(1e-6, 10**9).epsilon(1e-300))  # the smallest noise, most steps: finite


def test_importing_accounting_loads_no_torch():
    code = "import sys, accounting, accounting.augpe; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
