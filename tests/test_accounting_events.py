"""The one privacy event: ε0, ρ_tok and ρ_sequence of a release computed in one place, and
every record (plan, ledger release) built on it, checked against independent computations."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting import (
    Accountant,
    Adjacency,
    BudgetLedger,
    Clipping,
    GenerationEvent,
    Plan,
    Release,
    br_to_zcdp,
    epsilon_for_clip_norm,
    plan_clip_norm,
)
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
    release = Release.of(clip_norm=clip_norm, batch_size=batch_size, temperature=temperature, max_new_tokens=max_new_tokens)
    event = GenerationEvent(clip_norm, batch_size, temperature, max_new_tokens)
    assert release.event == event and release.epsilon0 == event.epsilon0 and release.num_steps == event.num_steps


def test_a_planned_release_and_its_ledger_entry_agree_on_every_figure(tmp_path):
    plan = plan_clip_norm(epsilon=4.0, delta=1e-6, max_new_tokens=64, batch_size=7, temperature=1.0)
    release = Release.of(clip_norm=plan.clip_norm, batch_size=7, temperature=1.0, max_new_tokens=64)
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


def test_plan_and_release_store_the_event_so_an_inconsistent_record_cannot_be_built():
    event = GenerationEvent(2.0, 7, 1.2, 50)
    plan = Plan(event, 8.87, 1e-6, "br-adaptive")
    assert (plan.clip_norm, plan.batch_size, plan.temperature, plan.max_new_tokens) == (2.0, 7, 1.2, 50)
    assert plan.rho_sequence == event.rho_sequence and plan.epsilon0 == event.epsilon0
    with pytest.raises(TypeError):  # no second copy of rho or C to disagree with the event
        Plan(clip_norm=1.0, rho_token=123.0, rho_sequence=-5.0, epsilon=1.0, delta=1e-6, accountant="cks")
    with pytest.raises(ValueError, match="clip_norm must be in"):
        GenerationEvent(1e7, 7, 1.0, 50)  # out of range: refused when the record is built, not when read
    for bad in ({"epsilon": -1.0}, {"epsilon": math.nan}, {"delta": 1.0}, {"accountant": "renyi"}):
        with pytest.raises(ValueError):
            Plan(**{"event": event, "epsilon": 1.0, "delta": 1e-6, "accountant": "cks", **bad})
    with pytest.raises(ValueError, match="event must be"):
        Plan((2.0, 7, 1.2, 50), 1.0, 1e-6, "cks")
    release = Release(event, 3, "r-1", "a label")
    assert release.num_steps == 50 and release.clip_norm == 2.0
    with pytest.raises(ValueError, match="num_batches"):
        Release(event, 0)


def test_a_ledger_record_of_every_format_reads_back_into_the_same_release():
    flat = {"release_id": "r-1", "label": "x", "clip_norm": 0.5, "batch_size": 4, "temperature": 1.0,
            "max_new_tokens": 32, "texts_per_batch": 2, "num_batches": 9, "clipping": "difference",
            "adjacency": "replace-by-null"}
    release = Release.from_json(flat)
    assert release == Release(GenerationEvent(0.5, 4, 1.0, 32, 2), 9, "r-1", "x")
    assert release.to_json() == flat  # the file format is unchanged
    legacy = {k: v for k, v in flat.items() if k not in ("texts_per_batch", "clipping", "adjacency")}
    assert Release.from_json(legacy).event == GenerationEvent(0.5, 4, 1.0, 32)  # defaults of an older record


@settings(max_examples=8, deadline=None)
@given(st.floats(min_value=0.05, max_value=5.0), st.integers(min_value=1, max_value=16),
       st.floats(min_value=0.5, max_value=2.0), st.integers(min_value=1, max_value=80),
       st.sampled_from([a.value for a in Accountant]))
def test_one_epsilon_for_one_release_whoever_asks(clip_norm, batch_size, temperature, max_new_tokens, accountant):
    """The planner, the InvisibleInk mechanism's guarantee and the ledger's one-release spend report the same ε
    (the issue's example: 8.8692905009658 and 8.86929050095693 before), rounded up over the accountant's value."""
    from accounting.accountants import EPSILON_ROUNDING, _composed_epsilon
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import InvisibleInk

    delta = 1e-6
    event = GenerationEvent(clip_norm, batch_size, temperature, max_new_tokens)
    planned = epsilon_for_clip_norm(clip_norm=clip_norm, max_new_tokens=max_new_tokens, batch_size=batch_size,
                                    temperature=temperature, delta=delta, accountant=accountant).epsilon
    mechanism = InvisibleInk(MechanismConfig(clip_norm=clip_norm, batch_size=batch_size, temperature=temperature,
                                             top_k=None), accountant=accountant)
    guaranteed = mechanism.guarantee(max_new_tokens, delta).epsilon
    assert planned == guaranteed == event.epsilon(delta, accountant)
    assert planned == _composed_epsilon(delta, event.epsilon0, max_new_tokens, accountant) * (1 + EPSILON_ROUNDING)
    with tempfile.TemporaryDirectory() as folder:
        ledger = BudgetLedger.create(Path(folder) / "l.json", epsilon=1e4, delta=delta, accountant=accountant)
        assert ledger.charge(Release(event))["epsilon_spent_after"] == planned


def test_the_issues_example_gives_one_epsilon(tmp_path):
    plan = epsilon_for_clip_norm(clip_norm=2.0, max_new_tokens=50, batch_size=7, temperature=1.2, delta=1e-6)
    ledger = BudgetLedger.create(tmp_path / "l.json", epsilon=20.0, delta=1e-6)
    spent = ledger.charge(Release(plan.event))["epsilon_spent_after"]
    assert plan.epsilon == spent == pytest.approx(8.8692905009658, rel=1e-12)
