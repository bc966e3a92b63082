"""One record per concept: the accountant is an enum end to end, the mechanism is built from
the privacy event, and one default top-k serves generation and audits.

The accountant enum must change nothing a user sees: records compare equal to the accountant's name,
print it, and write it to JSON exactly as the plain strings did.
"""

from __future__ import annotations

import json

import pytest

from accounting import Accountant, Adjacency, Clipping, GenerationEvent, as_accountant, plan_clip_norm
from invink_audit.audit.model_audit import ModelAuditSettings
from invink_audit.generation import DEFAULT_TOP_K, GenerationConfig
from invink_audit.mechanism import MechanismConfig


@pytest.mark.parametrize("name", [a.value for a in Accountant])
def test_records_hold_the_enum_and_read_and_write_as_its_name(name):
    plan = plan_clip_norm(epsilon=3.0, delta=1e-6, max_new_tokens=16, batch_size=4, temperature=1.0, accountant=name)
    config = GenerationConfig(batch_size=4, max_new_tokens=16, delta=1e-6, epsilon=3.0, accountant=name)
    guarantee = config.guarantee()
    settings = ModelAuditSettings(max_new_tokens=16, epsilon=3.0, accountant=name)
    for accountant in (plan.accountant, config.mechanism.accountant, guarantee.details["accountant"], settings.accountant):
        assert accountant is Accountant(name)
        assert accountant == name and f"{accountant}" == name and str(accountant) == name
    # JSON as before: the name, never "Accountant.X"
    assert json.loads(json.dumps(guarantee.to_json()))["accountant"] == name
    assert json.dumps({"accountant": plan.accountant}) == json.dumps({"accountant": name})


def test_an_unknown_accountant_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="accountant must be one of 'br-adaptive'"):
        as_accountant("renyi")
    with pytest.raises(ValueError, match="accountant must be one of"):
        GenerationConfig(batch_size=4, max_new_tokens=16, delta=1e-6, epsilon=3.0, accountant="renyi")
    with pytest.raises(ValueError, match="accountant must be one of"):
        ModelAuditSettings(max_new_tokens=4, epsilon=1.0, accountant="renyi")


def test_the_mechanism_built_from_the_event_is_the_one_built_by_hand():
    plan = plan_clip_norm(epsilon=3.0, delta=1e-6, max_new_tokens=32, batch_size=7, temperature=1.1)
    built = MechanismConfig.from_event(plan.event, top_k=50)
    assert built == MechanismConfig(clip_norm=plan.clip_norm, temperature=1.1, top_k=50, batch_size=7)
    # one formula for ε0 and ρ_tok: the mechanism, the event and the plan agree exactly, not approximately
    assert built.epsilon0 == plan.event.epsilon0 == plan.epsilon0
    assert built.rho_token == plan.event.rho_token == plan.rho_token
    naive = GenerationEvent(0.5, 4, 1.0, 8, clipping=Clipping.NAIVE)
    assert MechanismConfig.from_event(naive, top_k=None).clipping is Clipping.NAIVE
    with pytest.raises(ValueError, match="replace-by-null"):
        MechanismConfig.from_event(GenerationEvent(0.5, 4, 1.0, 8, adjacency=Adjacency.ZERO_OUT), top_k=None)


def test_one_default_top_k_for_generation_and_audits():
    assert GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=1.0).mechanism.config.top_k == DEFAULT_TOP_K
    assert ModelAuditSettings(max_new_tokens=4, epsilon=1.0).top_k == DEFAULT_TOP_K == 100


def test_one_guarantee_record_writes_invisibleinks_figures_and_any_other_mechanisms():
    """The run's guarantee is the mechanism's: InvisibleInk's records keep the planner's figures (B among them), any
    other mechanism's the common form; a void one is written as null with its reason."""
    import dataclasses

    from invink_audit.generation import ReleaseConfig
    from invink_audit.mechanisms import AminConfig, AminMechanism
    from invink_audit.mechanisms.base import PLANNER_FIGURES

    config = GenerationConfig(batch_size=4, max_new_tokens=16, delta=1e-6, epsilon=3.0, top_k=7)
    g = config.guarantee()
    figures = g.to_json()
    assert tuple(figures) == PLANNER_FIGURES and (figures["batch_size"], figures["top_k"]) == (4, 7)
    assert (figures["rho_token"], figures["epsilon0"]) == (g.step_rho, g.step_epsilon0) and g.holds
    void = dataclasses.replace(g, void_reason="seeded")
    assert not void.holds and void.record_fields() == {"guarantee": None, "guarantee_void_reason": "seeded"}
    amin = ReleaseConfig(AminMechanism(AminConfig(clip_norm=2.0, batch_size=4)), 16, 1e-6).guarantee()
    assert list(amin.to_json()) == ["mechanism", "kind", "epsilon", "delta", "rho_sequence", "max_new_tokens",
                                    "composition", "description"]  # fmt: skip
    # the mechanism's own guarantee names no B: the common form, as a release recorded by its mechanism wrote it
    assert "clip_norm" not in config.mechanism.guarantee(16, 1e-6).to_json()
