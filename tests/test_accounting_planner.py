"""Planner inverses: paper anchors, br-adaptive gain, and never overspending (hypothesis)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import (
    composed_delta,
    epsilon_for_clip_norm,
    plan_clip_norm,
    plan_max_new_tokens,
    plan_min_batch_size,
    planning_table,
    zcdp_to_epsilon,
)
from accounting.accountants import fits_budget
from accounting.limits import EPSILON_RANGE, MAX_COUNT
from profiles import examples

PAPER = dict(delta=1e-6, max_new_tokens=500, batch_size=7, temperature=1.2)
PAPER_CLIP_NORMS = {1.0: 0.0829, 3.0: 0.2285, 5.0: 0.3615, 10.0: 0.6591}
BR_MIN_GAIN = 1.05  # br-adaptive must give >= 5% larger C than cks at T=500, delta=1e-6

epsilons = st.floats(min_value=0.05, max_value=20.0, allow_nan=False)
deltas = st.floats(min_value=1e-10, max_value=1e-2, allow_nan=False)
batch_sizes = st.integers(min_value=1, max_value=64)
temperatures = st.floats(min_value=0.3, max_value=3.0, allow_nan=False)


@pytest.mark.parametrize("epsilon", sorted(PAPER_CLIP_NORMS))
def test_cks_reproduces_paper_and_br_adaptive_beats_it(epsilon):
    cks = plan_clip_norm(epsilon=epsilon, accountant="cks", **PAPER)
    br = plan_clip_norm(epsilon=epsilon, accountant="br-adaptive", **PAPER)
    bs = plan_clip_norm(epsilon=epsilon, accountant="bun-steinke", **PAPER)
    assert cks.clip_norm == pytest.approx(PAPER_CLIP_NORMS[epsilon], abs=5e-5)
    assert br.clip_norm >= BR_MIN_GAIN * cks.clip_norm
    assert bs.clip_norm < cks.clip_norm
    # rho_token = C^2 / (2 B^2 tau^2) (paper Theorem 2, thm:accounting)
    assert br.rho_token == pytest.approx(br.clip_norm**2 / (2 * 7**2 * 1.2**2), rel=1e-12)
    assert br.rho_sequence == pytest.approx(500 * br.rho_token, rel=1e-12)
    # the forward map at the planned C reports no more than the target
    assert epsilon_for_clip_norm(clip_norm=br.clip_norm, accountant="br-adaptive", **PAPER).epsilon <= epsilon


@settings(max_examples=examples(2000))
@given(epsilon=epsilons, delta=deltas, T=st.integers(1, 100_000), B=batch_sizes, tau=temperatures,
       accountant=st.sampled_from(["cks", "bun-steinke"]))
def test_plan_never_overspends_zcdp(epsilon, delta, T, B, tau, accountant):
    plan = plan_clip_norm(epsilon=epsilon, delta=delta, max_new_tokens=T, batch_size=B, temperature=tau,
                          accountant=accountant)
    rho_seq = T * plan.clip_norm**2 / (2 * B**2 * tau**2)  # independent recomputation
    assert zcdp_to_epsilon(rho_seq, delta, accountant) <= epsilon
    assert zcdp_to_epsilon(rho_seq * 1.001, delta, accountant) > epsilon  # and it is tight


@settings(max_examples=examples(150))
@given(epsilon=st.floats(0.2, 10.0), delta=deltas, T=st.integers(1, 40), B=batch_sizes, tau=temperatures)
def test_plan_never_overspends_br_adaptive(epsilon, delta, T, B, tau):
    plan = plan_clip_norm(epsilon=epsilon, delta=delta, max_new_tokens=T, batch_size=B, temperature=tau)
    eps0 = 2 * plan.clip_norm / (B * tau)
    assert composed_delta(epsilon, eps0, T, "br-adaptive") <= delta
    assert epsilon_for_clip_norm(clip_norm=plan.clip_norm, max_new_tokens=T, batch_size=B, temperature=tau,
                                 delta=delta).epsilon <= epsilon
    cks = plan_clip_norm(epsilon=epsilon, delta=delta, max_new_tokens=T, batch_size=B, temperature=tau,
                         accountant="cks")
    assert plan.clip_norm >= cks.clip_norm * (1 - 1e-9)  # never looser than cks


@settings(max_examples=examples(300))
@given(C=st.floats(0.01, 5.0), delta=deltas, T=st.integers(1, 5000), B=batch_sizes, tau=temperatures)
def test_epsilon_for_clip_norm_is_safe_and_consistent(C, delta, T, B, tau):
    plan = epsilon_for_clip_norm(clip_norm=C, max_new_tokens=T, batch_size=B, temperature=tau, delta=delta,
                                 accountant="cks")
    assert plan.epsilon >= zcdp_to_epsilon(T * C**2 / (2 * B**2 * tau**2), delta, "cks")
    if 0.05 < plan.epsilon <= EPSILON_RANGE.high:  # a reported ε above the plannable range has no inverse
        back = plan_clip_norm(epsilon=plan.epsilon, delta=delta, max_new_tokens=T, batch_size=B,
                              temperature=tau, accountant="cks")
        assert back.clip_norm == pytest.approx(C, rel=1e-6)


@settings(max_examples=examples(300))
@given(epsilon=epsilons, delta=deltas, C=st.floats(0.01, 2.0), B=batch_sizes, tau=temperatures)
def test_max_new_tokens_is_the_largest_feasible(epsilon, delta, C, B, tau):
    eps0 = 2 * C / (B * tau)
    if not fits_budget(epsilon, delta, eps0, 1, "cks"):
        with pytest.raises(ValueError, match="not even one token"):
            plan_max_new_tokens(epsilon=epsilon, delta=delta, clip_norm=C, batch_size=B, temperature=tau,
                                accountant="cks")
        return
    plan = plan_max_new_tokens(epsilon=epsilon, delta=delta, clip_norm=C, batch_size=B, temperature=tau,
                               accountant="cks")
    T = plan.max_new_tokens
    assert zcdp_to_epsilon(T * eps0**2 / 8, delta, "cks") <= epsilon
    if T < MAX_COUNT:  # the answer is capped at the largest valid T (accounting.limits)
        assert zcdp_to_epsilon((T + 1) * eps0**2 / 8, delta, "cks") > epsilon


def test_max_new_tokens_br_adaptive_paper_setting():
    cks = plan_max_new_tokens(epsilon=1.0, delta=1e-6, clip_norm=0.0829, batch_size=7, temperature=1.2,
                              accountant="cks")
    br = plan_max_new_tokens(epsilon=1.0, delta=1e-6, clip_norm=0.0829, batch_size=7, temperature=1.2)
    eps0 = 2 * 0.0829 / (7 * 1.2)
    assert cks.max_new_tokens == 500
    # docs/accounting_notes.md §4: about 11-15% more tokens at fixed C
    assert 1.10 * 500 <= br.max_new_tokens <= 1.16 * 500
    assert fits_budget(1.0, 1e-6, eps0, br.max_new_tokens, "br-adaptive")
    assert not fits_budget(1.0, 1e-6, eps0, br.max_new_tokens + 1, "br-adaptive")


@settings(max_examples=examples(300))
@given(epsilon=epsilons, delta=deltas, T=st.integers(1, 5000), tau=temperatures, C=st.floats(0.01, 20.0),
       accountant=st.sampled_from(["cks", "bun-steinke"]))
def test_min_batch_size_is_the_smallest_reaching_c(epsilon, delta, T, tau, C, accountant):
    plan = plan_min_batch_size(epsilon=epsilon, delta=delta, max_new_tokens=T, temperature=tau, clip_norm=C,
                               accountant=accountant)
    B = plan.batch_size
    assert plan.clip_norm == C
    reach = plan_clip_norm(epsilon=epsilon, delta=delta, max_new_tokens=T, batch_size=B, temperature=tau,
                           accountant=accountant).clip_norm
    assert reach >= C * (1 - 1e-9)
    # the requested C at B is within budget
    rho_seq = T * C**2 / (2 * B**2 * tau**2)
    assert zcdp_to_epsilon(rho_seq, delta, accountant) <= epsilon * (1 + 1e-9)
    if B > 1:
        below = plan_clip_norm(epsilon=epsilon, delta=delta, max_new_tokens=T, batch_size=B - 1,
                               temperature=tau, accountant=accountant).clip_norm
        assert below < C


def test_planning_table_matches_single_plans_and_costs():
    rows = planning_table(epsilons=[1.0, 5.0], batch_sizes=[4, 16], delta=1e-6, max_new_tokens=200,
                          temperature=1.0, accountant="cks")
    assert [(r.plan.epsilon, r.plan.batch_size) for r in rows] == [(1.0, 4), (1.0, 16), (5.0, 4), (5.0, 16)]
    for r in rows:
        single = plan_clip_norm(epsilon=r.plan.epsilon, delta=1e-6, max_new_tokens=200,
                                batch_size=r.plan.batch_size, temperature=1.0, accountant="cks")
        assert r.plan.clip_norm == pytest.approx(single.clip_norm, rel=1e-12)
        assert r.forward_rows_per_token == r.plan.batch_size + 1
        assert r.forward_rows_per_text == 200 * (r.plan.batch_size + 1)
    # C is linear in B at fixed (epsilon, delta, T, tau)
    assert rows[1].plan.clip_norm == pytest.approx(4 * rows[0].plan.clip_norm, rel=1e-9)


def test_edge_values():
    one = plan_clip_norm(epsilon=1.0, delta=1e-6, max_new_tokens=1, batch_size=1, temperature=1.0)
    assert one.clip_norm > 0 and one.max_new_tokens == 1 and one.forward_rows_per_token == 2
    big = plan_clip_norm(epsilon=1.0, delta=1e-6, max_new_tokens=30_000, batch_size=8, temperature=1.0)
    cks = plan_clip_norm(epsilon=1.0, delta=1e-6, max_new_tokens=30_000, batch_size=8, temperature=1.0,
                         accountant="cks")
    assert big.clip_norm == pytest.approx(cks.clip_norm)  # beyond the DP's range the CKS bound is used


BAD = dict(epsilon=1.0, delta=1e-6, max_new_tokens=100, batch_size=4, temperature=1.0)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("epsilon", 0.0), ("epsilon", -1.0), ("epsilon", math.nan), ("epsilon", math.inf),
        ("delta", 0.0), ("delta", 1.0), ("delta", -0.1), ("delta", math.nan),
        ("max_new_tokens", 0), ("max_new_tokens", 2.5), ("batch_size", 0), ("batch_size", True),
        ("temperature", 0.0), ("temperature", -1.0), ("temperature", math.inf), ("accountant", "nope"),
    ],
)
def test_bad_input_names_argument_and_value(name, value):
    with pytest.raises(ValueError, match=rf"{name}.*{value!r}" if name != "accountant" else "accountant"):
        plan_clip_norm(**{**BAD, name: value})
