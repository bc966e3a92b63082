"""Every mechanism passes :class:`invink_audit.testing.MechanismContract` by subclassing it: InvisibleInk (Top-k+
and full vocabulary), Amin et al. 2024, AdaPMixED and the custom mechanism of ``examples/custom_mechanism.py``;
and the contract fails the mechanisms it must fail (a planted temperature bug, an unnormalised step, texts that
leak into each other)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from invink_audit.mechanism import MechanismConfig
from invink_audit.mechanisms import (
    AdaPMixEDConfig,
    AdaPMixEDMechanism,
    AminConfig,
    AminMechanism,
    InvisibleInk,
    MechanismStep,
)
from invink_audit.testing import MechanismContract


def _example():
    path = Path(__file__).parents[1] / "examples" / "custom_mechanism.py"
    spec = importlib.util.spec_from_file_location("custom_mechanism_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLE = _example()


class TestInvisibleInkTopKPlus(MechanismContract):
    def make_mechanism(self):
        return InvisibleInk(MechanismConfig(clip_norm=0.8, batch_size=3, temperature=1.1, top_k=5))


class TestInvisibleInkFullVocabulary(MechanismContract):
    def make_mechanism(self):
        return InvisibleInk(MechanismConfig(clip_norm=2.0, batch_size=4, temperature=0.7, top_k=None))


class TestAmin(MechanismContract):
    def make_mechanism(self):
        return AminMechanism(AminConfig(clip_norm=1.5, batch_size=4, svt_noise=1.0, max_private_tokens=4))


class TestAdaPMixED(MechanismContract):
    def make_mechanism(self):
        return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=3, epsilon=8.0, delta=1e-6))


class TestTheCustomMechanismExample(MechanismContract):
    def make_mechanism(self):
        return EXAMPLE.FullVocabularyDClip(clip_norm=1.0, batch_size=3, temperature=1.0)


# -- the contract fails what it must fail -------------------------------------------------------------


class _PlantedTemperatureBug(MechanismContract):  # not collected (no Test prefix): run by hand below
    def make_mechanism(self):
        return EXAMPLE.FullVocabularyDClip(clip_norm=1.0, batch_size=3, temperature=1.0, sample_temperature=0.5)


class _Unnormalised(EXAMPLE.FullVocabularyDClip):
    def step(self, private, public, state, aux, *, exact, neighbours):
        step = super().step(private, public, state, aux, exact=exact, neighbours=neighbours)
        return MechanismStep(step.log_probs + 0.01, None if step.neighbours is None else step.neighbours + 0.01)


class _LeaksAcrossTexts(EXAMPLE.FullVocabularyDClip):
    def _log_probs(self, private, public):
        shared = public.double().mean(dim=0, keepdim=True)  # every text sees the batch's mean public row
        return super()._log_probs(private, public + 1e-3 * shared)


class _Contract(MechanismContract):
    def __init__(self, mechanism_type):
        self.mechanism_type = mechanism_type

    def make_mechanism(self):
        return self.mechanism_type(clip_norm=1.0, batch_size=3, temperature=1.0)


def test_a_planted_temperature_bug_fails_the_per_step_claim():
    with pytest.raises(AssertionError):
        _PlantedTemperatureBug().test_the_per_step_claim_holds_against_every_neighbour()
    _PlantedTemperatureBug().test_every_step_is_a_float64_distribution()  # it is still a distribution


def test_an_unnormalised_step_fails():
    with pytest.raises(AssertionError):
        _Contract(_Unnormalised).test_every_step_is_a_float64_distribution()


def test_texts_that_see_each_other_fail():
    with pytest.raises(AssertionError, match="changes with the others"):
        _Contract(_LeaksAcrossTexts).test_a_text_does_not_depend_on_the_others()


def test_the_contract_needs_a_mechanism():
    with pytest.raises(NotImplementedError, match="make_mechanism"):
        MechanismContract().make_mechanism()
    assert torch.get_default_dtype() == torch.float32  # the contract changes no global state


# -- the self-test's planted bugs pass the contract except for the property each breaks -----------------------

_BUGS = dict(clip_norm=1.0, temperature=1.0, top_k=3, batch_size=3, max_new_tokens=8, reference_lengths=(12, 0, 0))


def _failing_checks(mechanism) -> set[str]:
    """The contract checks that ``mechanism`` fails (every other one passes)."""

    class Contract(MechanismContract):
        def make_mechanism(self):
            return mechanism

    failed = set()
    for name in (n for n in dir(MechanismContract) if n.startswith("test_")):
        try:
            getattr(Contract(), name)()
        except AssertionError:
            failed.add(name)
    return failed


@pytest.mark.parametrize("bug, broken", [
    ("naive-clipping", "test_the_per_step_claim_holds_against_every_neighbour"),  # twice the claimed range
    ("low-temperature", "test_the_per_step_claim_holds_against_every_neighbour"),
    ("private-top-k", "test_the_per_step_claim_holds_against_every_neighbour"),  # a support the neighbour lacks
    ("data-dependent-budget", "test_the_guarantee_is_well_formed"),  # stated for T = 12 from the data, not 8
])
def test_each_planted_bug_is_a_mechanism_failing_only_the_contract_check_of_its_bug(bug, broken):
    from invink_audit.audit import synthetic
    from invink_audit.mechanisms import Mechanism

    audited = {m.name: m for m in synthetic.mutants(**_BUGS)}[bug]
    assert isinstance(audited.mechanism, Mechanism) and audited.mechanism.name == bug
    assert _failing_checks(audited.mechanism) == {broken}


def test_the_correct_mechanism_of_the_selftest_passes_the_whole_contract():
    from invink_audit.audit import synthetic

    kw = {k: v for k, v in _BUGS.items() if k != "reference_lengths"}
    assert _failing_checks(synthetic.correct_mechanism(**kw).mechanism) == set()


# -- the contract checks the claim the mechanism makes, in the form it makes it ------------------------------------


class TestAClaimAtOneRenyiOrder(MechanismContract):
    """The custom example, claimed as a per-step Rényi bound at α = 2 only (C = 1, B = 3, τ = 1: a range of 2/3,
    so D_2 <= 2 (2/3)² / 8 = 1/9)."""

    def make_mechanism(self):
        return EXAMPLE.FullVocabularyDClip(clip_norm=1.0, batch_size=3, temperature=1.0)

    def claim(self, mechanism):
        from invink_audit.testing import StepClaim

        return StepClaim(renyi={2.0: 1 / 9})


def test_a_claim_the_mechanism_exceeds_at_its_one_order_fails():
    from invink_audit.testing import StepClaim

    class Understated(TestAClaimAtOneRenyiOrder):
        def claim(self, mechanism):
            return StepClaim(epsilon0=math.inf, renyi={2.0: 1e-4})

    with pytest.raises(AssertionError, match="D_2 "):
        Understated().test_the_per_step_claim_holds_against_every_neighbour()


def test_an_add_remove_claim_is_refused_not_checked_against_replace_by_null_neighbours():
    """A Mechanism's neighbours are replace-by-null: the contract refuses an add-remove claim rather than checking it
    against the wrong relation."""
    from accounting import PrivacyClaim

    class AddRemove(TestAClaimAtOneRenyiOrder):
        def claim(self, mechanism):
            return PrivacyClaim.per_step(steps=1, renyi={2.0: 1 / 9}, adjacency="add-remove")

    with pytest.raises(ValueError, match="add-remove adjacency"):
        AddRemove().test_the_per_step_claim_holds_against_every_neighbour()
    # the same claim under replace-by-null is checked (and holds)
    TestAClaimAtOneRenyiOrder().test_the_per_step_claim_holds_against_every_neighbour()
