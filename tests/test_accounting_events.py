"""The one privacy event (issue 13): ε0, ρ_tok and ρ_sequence of a release computed in one place, and
every record (plan, ledger release) built on it, checked against independent computations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accounting import Adjacency, BudgetLedger, Clipping, GenerationEvent, Release, br_to_zcdp, plan_clip_norm
from accounting.conversions import br_to_zcdp_total

clip_norms = st.floats(min_value=1e-3, max_value=1e3)
batches = st.integers(min_value=1, max_value=512)
temperatures = st.floats(min_value=0.05, max_value=10.0)
tokens = st.integers(min_value=1, max_value=4096)


@given(clip_norms, batches, temperatures, tokens, st.integers(min_value=1, max_value=4))
def test_the_event_matches_the_papers_closed_form(clip_norm, batch_size, temperature, max_new_tokens, texts):
    event = GenerationEvent(clip_norm, batch_size, temperature, max_new_tokens, texts)
    # paper Theorem 2 (thm:accounting) (difference clipping, replace-by-null): rho_tok = C^2 / (2 B^2 tau^2), eps0 = 2C/(B tau)
    assert event.epsilon0 == pytest.approx(2 * clip_norm / (batch_size * temperature), rel=1e-12)
    assert event.rho_token == pytest.approx(clip_norm**2 / (2 * batch_size**2 * temperature**2), rel=1e-12)
    assert event.rho_sequence == pytest.approx(texts * max_new_tokens * event.rho_token, rel=1e-12)


@given(clip_norms, batches, temperatures, tokens)
def test_plan_and_release_are_built_on_the_same_event(clip_norm, batch_size, temperature, max_new_tokens):
    release = Release(clip_norm=clip_norm, batch_size=batch_size, temperature=temperature, max_new_tokens=max_new_tokens)
    event = GenerationEvent(clip_norm, batch_size, temperature, max_new_tokens)
    assert release.event == event and release.epsilon0 == event.epsilon0 and release.num_steps == event.num_steps


def test_a_planned_release_and_its_ledger_entry_agree_on_every_figure(tmp_path):
    plan = plan_clip_norm(epsilon=4.0, delta=1e-6, max_new_tokens=64, batch_size=7, temperature=1.0)
    release = Release(clip_norm=plan.clip_norm, batch_size=7, temperature=1.0, max_new_tokens=64)
    assert plan.event == release.event
    assert plan.rho_token == plan.event.rho_token and plan.rho_sequence == pytest.approx(plan.event.rho_sequence)
    ledger = BudgetLedger.create(tmp_path / "l.json", epsilon=10.0, delta=1e-6)
    entry = ledger.charge(release)
    assert entry["epsilon0"] == release.event.epsilon0 and entry["num_steps"] == 64


def test_other_clippings_and_adjacencies_change_the_sensitivity_only_through_the_event():
    base = GenerationEvent(1.0, 8, 1.0, 16)
    naive = GenerationEvent(1.0, 8, 1.0, 16, clipping=Clipping.NAIVE)
    assert naive.epsilon0 > base.epsilon0  # naive clipping: twice the sensitivity (paper Appendix B)
    assert naive.epsilon0 == pytest.approx(2 * base.epsilon0)
    assert GenerationEvent(1.0, 8, 1.0, 16, adjacency="zero-out").adjacency is Adjacency.ZERO_OUT


def test_br_to_zcdp_is_the_squared_range_over_eight_and_never_overflows():
    assert br_to_zcdp(2.0) == 0.5  # Cesar & Rogers 2021, Lemma 3.2
    assert br_to_zcdp_total([2.0, 1.0]) == pytest.approx(0.625)
    assert math.isinf(br_to_zcdp(1e200))  # a product, not **: inf rather than OverflowError
    with pytest.raises(ValueError):
        GenerationEvent(0.0, 8, 1.0, 16)
