"""The behaviour every :class:`~invink_audit.mechanisms.Mechanism` owes the engine and the auditor, as a pytest base
class: subclass :class:`MechanismContract` (as ``Test...``), define ``make_mechanism``, and pytest runs the inherited
checks on seeded random logits (docs/guide/testing-kit.md, §"The mechanism contract"; the interface:
docs/guide/baselines.md).
"""

from __future__ import annotations

import math

import torch

from invink_audit.mechanisms.base import Mechanism, MechanismGuarantee
from accounting.sensitivity import Adjacency
from invink_audit.testing.checkers import StepClaim, assert_token_privacy, claim_adjacency

__all__ = ["MechanismContract"]

#: tolerance of a distribution's total mass (float64 arithmetic over a few dozen outcomes)
_NORMALISATION_ATOL = 1e-9


class MechanismContract:
    """Inherit, implement :meth:`make_mechanism`, and pytest runs the checks (module docstring)."""

    vocab_size: int = 16
    num_texts: int = 3
    seeds: tuple[int, ...] = (0, 1, 2)
    #: logit scales: moderate (clipping partly active) and saturating (every difference clipped)
    logit_scales: tuple[float, ...] = (2.0, 50.0)
    max_new_tokens: int = 8
    delta: float = 1e-6

    def make_mechanism(self) -> Mechanism:
        """The mechanism under test (a fresh one each call)."""
        raise NotImplementedError("a MechanismContract subclass implements make_mechanism()")

    def claim(self, mechanism: Mechanism):
        """What the mechanism claims of each step, checked against every neighbour: its guarantee's per-step figures
        (override to state a claim in another form, e.g. ``StepClaim(renyi={2.0: 0.5})``)."""
        return mechanism.guarantee(self.max_new_tokens, self.delta)

    # -- inputs ------------------------------------------------------------------------------------

    def logits(self, mechanism: Mechanism, seed: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``private`` (G, B, V) and ``public`` (G, V), float64; reference 0 of every text is null."""
        generator = torch.Generator().manual_seed(seed)
        shape = (self.num_texts, mechanism.batch_size, self.vocab_size)
        public = torch.randn(shape[0], shape[2], generator=generator, dtype=torch.float64) * scale
        private = public[:, None, :] + torch.randn(shape, generator=generator, dtype=torch.float64) * scale
        private[:, 0] = public  # a null reference's row is the public row
        return private, public

    def start(self, mechanism: Mechanism, seed: int, *, exact: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh state for every text and one step's auxiliary uniforms, both float64."""
        generator = torch.Generator().manual_seed(10_000 + seed)

        def uniforms(count: int) -> torch.Tensor:
            u = torch.rand(self.num_texts, count, generator=generator, dtype=torch.float64)
            return u.clamp(1e-12, 1 - 1e-12)  # in (0, 1)

        state = mechanism.initial_state(uniforms(mechanism.aux_size(exact=exact, at_start=True)), exact=exact)
        return state, uniforms(mechanism.aux_size(exact=exact, at_start=False))

    def cases(self):
        """(mechanism, private, public, seed) for every seed and scale."""
        for seed in self.seeds:
            for scale in self.logit_scales:
                mechanism = self.make_mechanism()
                yield (mechanism, *self.logits(mechanism, seed, scale), seed)

    # -- the checks --------------------------------------------------------------------------------

    def test_declares_a_consistent_outcome_space(self):
        mechanism = self.make_mechanism()
        assert isinstance(mechanism, Mechanism), type(mechanism)
        assert isinstance(mechanism.name, str) and mechanism.name.strip(), mechanism.name
        assert isinstance(mechanism.num_modes, int) and mechanism.num_modes >= 1, mechanism.num_modes
        assert len(mechanism.mode_names) == mechanism.num_modes, mechanism.mode_names
        assert isinstance(mechanism.batch_size, int) and mechanism.batch_size >= 1, mechanism.batch_size
        width = mechanism.num_outcomes(self.vocab_size)
        assert width == mechanism.num_modes * self.vocab_size + int(mechanism.can_halt)
        stop = mechanism.stop_outcome(self.vocab_size)
        assert (stop == width - 1) if mechanism.can_halt else stop is None
        assert mechanism.describe().get("mechanism"), mechanism.describe()

    def test_every_step_is_a_float64_distribution(self):
        for mechanism, private, public, seed in self.cases():
            for exact in (False, True):
                state, aux = self.start(mechanism, seed, exact=exact)
                assert state.shape == (self.num_texts, mechanism.state_size(exact=exact)), state.shape
                step = mechanism.step(private, public, state, aux, exact=exact, neighbours=False)
                _assert_distribution(step.log_probs, (self.num_texts, mechanism.num_outcomes(self.vocab_size)), public)

    def test_the_exact_state_gives_every_neighbours_distribution(self):
        for mechanism, private, public, seed in self.cases():
            state, aux = self.start(mechanism, seed, exact=True)
            step = mechanism.step(private, public, state, aux, exact=True, neighbours=True)
            width = mechanism.num_outcomes(self.vocab_size)
            assert step.neighbours is not None, "neighbours=True returned no neighbour distributions"
            _assert_distribution(step.neighbours, (self.num_texts, mechanism.batch_size, width), public)
            # reference 0 is already null: replacing it by null changes nothing
            assert torch.allclose(step.neighbours[:, 0], step.log_probs, atol=1e-9, rtol=0, equal_nan=False), (
                "the neighbour of an already-null reference differs from the actual distribution"
            )

    def test_the_per_step_claim_holds_against_every_neighbour(self):
        claim = self.claim(self.make_mechanism())
        if claim_adjacency(claim) is Adjacency.ADD_REMOVE:
            raise ValueError(f"{type(self).__name__}.claim() is stated under add-remove adjacency, but a Mechanism's "
                             "neighbours (step(..., neighbours=True)) are replace-by-null: check it with "
                             "audit_generator or check_token_privacy, which build add-remove neighbours")
        if not StepClaim.of(claim).claims:
            import pytest

            pytest.skip(f"{self.make_mechanism().name} makes no per-step claim")
        for mechanism, private, public, seed in self.cases():
            state, aux = self.start(mechanism, seed, exact=True)
            step = mechanism.step(private, public, state, aux, exact=True, neighbours=True)
            actual = step.log_probs if step.check_actual is None else step.check_actual
            neighbours = step.neighbours if step.check_neighbours is None else step.check_neighbours
            assert_token_privacy(actual, neighbours, claim)

    def test_a_text_does_not_depend_on_the_others(self):
        for mechanism, private, public, seed in self.cases():
            state, aux = self.start(mechanism, seed, exact=False)
            together = mechanism.step(private, public, state, aux, exact=False, neighbours=False).log_probs
            for g in range(self.num_texts):
                part = slice(g, g + 1)
                alone = mechanism.step(private[part], public[part], state[part], aux[part], exact=False,
                                       neighbours=False).log_probs  # fmt: skip
                assert torch.allclose(alone[0], together[g], atol=1e-12, rtol=0), f"text {g} changes with the others"

    def test_advance_keeps_the_state_and_says_which_texts_stop(self):
        for mechanism, private, public, seed in self.cases():
            for exact in (False, True):
                state, aux = self.start(mechanism, seed, exact=exact)
                step = mechanism.step(private, public, state, aux, exact=exact, neighbours=False)
                outcomes = step.log_probs.argmax(dim=-1)  # an outcome of positive probability
                new_state, stops = mechanism.advance(step, state, outcomes, aux, exact=exact)
                assert new_state.shape == state.shape and new_state.dtype == torch.float64, new_state.shape
                assert stops.shape == (self.num_texts,) and stops.dtype == torch.bool, (stops.shape, stops.dtype)

    def test_the_guarantee_is_well_formed(self):
        from accounting import zcdp_to_epsilon

        guarantee = self.make_mechanism().guarantee(self.max_new_tokens, self.delta)
        assert isinstance(guarantee, MechanismGuarantee), type(guarantee)
        assert guarantee.delta == self.delta and guarantee.max_new_tokens == self.max_new_tokens
        assert math.isfinite(guarantee.epsilon) and guarantee.epsilon > 0, guarantee.epsilon
        if guarantee.a_priori:
            assert guarantee.rho_sequence is not None and guarantee.rho_sequence > 0, guarantee.rho_sequence
        if guarantee.composition == "zcdp":
            floor = zcdp_to_epsilon(guarantee.rho_sequence, self.delta, "cks")
            assert guarantee.epsilon >= floor * (1 - 1e-9), (guarantee.epsilon, floor)
        if guarantee.composition == "bounded-range" and guarantee.step_rho is not None:
            expected = self.max_new_tokens * guarantee.step_rho
            assert math.isclose(guarantee.rho_sequence, expected, rel_tol=1e-9), (guarantee.rho_sequence, expected)


def _assert_distribution(log_probs: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    assert tuple(log_probs.shape) == shape, (tuple(log_probs.shape), shape)
    assert log_probs.dtype == torch.float64, log_probs.dtype
    assert log_probs.device == like.device, (log_probs.device, like.device)
    assert not torch.isnan(log_probs).any(), "NaN log-probabilities"
    assert not (log_probs == math.inf).any(), "+inf log-probabilities"
    mass = torch.logsumexp(log_probs, dim=-1)
    assert torch.allclose(mass, torch.zeros_like(mass), atol=_NORMALISATION_ATOL, rtol=0), mass
