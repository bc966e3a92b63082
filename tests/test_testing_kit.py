"""Tests of the property-based test kit itself (invink_audit.testing).

A checker is only useful if it fails on a mechanism that violates its property: every checker is
run here against a deliberately broken mechanism (the reference package's 2C/(B+1) band, naive
clipping accounted at C/B, a Top-k set taken from private logits, a temperature mismatch, a biased
sampler) and must raise. Its arithmetic is checked against closed forms and scipy.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accounting.sensitivity import Adjacency, Clipping, linf_sensitivity
from invink_audit.mechanism import (
    MechanismConfig,
    dclip_aggregate,
    naive_clip_aggregate,
    sample_tokens,
    token_log_probs,
    topk_plus_mask,
)
from invink_audit.testing import (
    DEFAULT_LOGIT_BOUND,
    LogitBatch,
    PrivacyBudget,
    StepClaim,
    assert_linf_sensitivity,
    assert_linf_sensitivity_attained,
    assert_sampler_matches,
    assert_token_privacy,
    assert_topk_superset,
    check_linf_sensitivity,
    check_token_privacy,
    check_topk_superset,
    goodness_of_fit,
    log_ratio_span,
    logit_batches,
    logits,
    max_linf_change,
    mechanism_configs,
    neighbour_pairs,
    neighbour_private_logits,
    privacy_budgets,
    reference_private_topk_sets,
    renyi_divergence,
)
from profiles import examples

#: closed-form divergences vs. the kit's float64 computation (measured up to 5e-14 relative, at α = 1.01
#: where the log of a sum near 1 is divided by α − 1)
CLOSED_FORM_RTOL = 1e-12
#: the same where the exact divergence is 0 (p = q): the kit gives ±2e-17, float64 round-off of log 1
CLOSED_FORM_ATOL = 1e-15
#: a value one or two float64 operations away from exact inputs (D_∞ = log 2): a few ulps (eps = 2.2e-16)
ULP_RTOL = 1e-15
#: D_α at α = 1 + 1e-7 against the KL divergence: D_α − KL = O(α − 1) (measured 6e-8 relative)
KL_LIMIT_ALPHA = 1 + 1e-7
KL_LIMIT_RTOL = 1e-6
#: the kit's G-test against scipy's power_divergence: the same statistic summed in another order and
#: the same χ² survival function (both measured ~1e-14 relative)
SCIPY_STATISTIC_RTOL = 1e-12
SCIPY_P_VALUE_RTOL = 1e-9
#: a float64 privacy-loss span against its closed form ε0 = 2C/(Bτ): log-softmax round-off, ~1e-16
SPAN_ATOL = 1e-12
#: significance of the sampler G-tests on 20,000 draws: a correct sampler fails with probability 1e-4
#: (seeded, so deterministically), while a sampler at temperature 1.25 instead of 1 fails by far
SAMPLER_SIGNIFICANCE = 1e-4
SAMPLER_DRAWS = 20_000
#: examples for the kit's own strategy tests (cheap, structural)
STRATEGY_EXAMPLES = examples(30)
#: upper limit on the search for a counterexample to a broken mechanism; the search stops at the first
#: one, and is generous so that the tests do not depend on the hypothesis profile (derandomized in CI).
SEARCH_EXAMPLES = 500  # a search that must find the planted bug: the same in every profile


def INVISIBLEINK_CLAIM(config):  # noqa: N802 (a constant-like claim function)
    """InvisibleInk's per-step claim for a drawn ``MechanismConfig``: its guarantee's ε0 and ρ_tok."""
    from invink_audit.mechanisms import InvisibleInk

    return InvisibleInk(config).guarantee(1, 1e-6)

PINNED_PUBLIC = [0.0, -0.875]
PINNED_PRIVATE = [[-1.0, 0.125], PINNED_PUBLIC]


def seeded(seed: int) -> torch.Generator:
    # a fixed seed on purpose: reproducible test (and not private)
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------
# broken mechanisms


def reference_band_mask(public_logits, top_k, clip_norm, batch_size):
    """The reference `invink` package's Top-k+ set: band 2C/(B+1) instead of 2C/B."""
    if top_k is None or top_k >= public_logits.shape[-1]:
        return torch.ones(public_logits.shape, dtype=torch.bool)
    kth = torch.topk(public_logits.double(), top_k, dim=-1).values[..., -1:]
    return public_logits.double() >= kth - 2 * clip_norm / (batch_size + 1)


def public_topk_mask(public_logits, top_k, clip_norm, batch_size):
    """Plain public top-k, no expansion: private-only tokens are lost."""
    return reference_band_mask(public_logits, top_k, 0.0, batch_size)


def naive_mechanism(private, public, config):
    """Naive clipping over the full vocabulary; accounted below as if it were DClip (C/B)."""
    return token_log_probs(private, public, clip_norm=config.clip_norm, temperature=config.temperature, top_k=None, clipping=Clipping.NAIVE)


def private_topk_mechanism(private, public, config):
    """Top-k taken from the private aggregate: the support moves with the data (infinite loss)."""
    aggregate = dclip_aggregate(private, public, config.clip_norm)
    k = config.top_k or aggregate.shape[-1]
    kth = torch.topk(aggregate, min(k, aggregate.shape[-1]), dim=-1).values[..., -1:]
    return torch.log_softmax((aggregate / config.temperature).masked_fill(aggregate < kth, -math.inf), dim=-1)


def half_temperature_mechanism(private, public, config):
    """Samples at τ/2 while the accounting assumes τ."""
    return token_log_probs(private, public, clip_norm=config.clip_norm, temperature=config.temperature / 2, top_k=config.top_k)


# ------------------------------------------------------------------------------------------
# the checkers catch them


def test_sensitivity_checker_catches_naive_clipping_claimed_at_c_over_b():
    claimed = functools.partial(linf_sensitivity, clipping=Clipping.DIFFERENCE, adjacency=Adjacency.REPLACE_BY_NULL)
    with pytest.raises(AssertionError, match="sensitivity bound violated"):
        check_linf_sensitivity(lambda p, q, c: naive_clip_aggregate(p, c), claimed, shrink=False, max_examples=SEARCH_EXAMPLES)


def test_sensitivity_checker_catches_dclip_claimed_at_c_over_b_under_zero_out():
    claimed = functools.partial(linf_sensitivity, clipping=Clipping.DIFFERENCE, adjacency=Adjacency.REPLACE_BY_NULL)
    with pytest.raises(AssertionError, match="zero-out"):
        check_linf_sensitivity(dclip_aggregate, claimed, adjacency=Adjacency.ZERO_OUT, shrink=False, max_examples=SEARCH_EXAMPLES)


def test_attainment_checker_catches_a_loose_claim():
    # DClip never moves by 3C/B: a claim that loose is reported, with the best ratio found (1.0)
    with pytest.raises(AssertionError, match=r"largest change found was 0\.333333 x the bound"):
        assert_linf_sensitivity_attained(dclip_aggregate, lambda c, b: 3 * c / b, max_examples=50)


def test_superset_checker_catches_the_reference_band_on_the_pinned_counterexample():
    public, private = torch.tensor(PINNED_PUBLIC), torch.tensor(PINNED_PRIVATE)
    mask = reference_band_mask(public, 1, 1.0, 2)
    assert mask.tolist() == [True, False]
    with pytest.raises(AssertionError, match=r"tokens \[1\] missing"):
        assert_topk_superset(mask, private, public, top_k=1, clip_norm=1.0)
    # the correct band keeps token 1
    assert_topk_superset(topk_plus_mask(public, 1, 1.0, 2), private, public, top_k=1, clip_norm=1.0)


@pytest.mark.parametrize("mask_fn", [reference_band_mask, public_topk_mask], ids=["band-2C/(B+1)", "public-top-k"])
def test_superset_checker_finds_counterexamples_on_its_own(mask_fn):
    with pytest.raises(AssertionError, match="not a superset"):
        check_topk_superset(mask_fn, shrink=False, max_examples=SEARCH_EXAMPLES)


def test_superset_checker_tolerance_ignores_rounding_level_violations():
    # the 2C/(B+1) band misses token 1 by a margin of 0.125: a tolerance below half of it still flags it
    public, private = torch.tensor(PINNED_PUBLIC), torch.tensor(PINNED_PRIVATE)
    mask = reference_band_mask(public, 1, 1.0, 2)
    with pytest.raises(AssertionError):
        assert_topk_superset(mask, private, public, top_k=1, clip_norm=1.0, tolerance=0.06)
    assert_topk_superset(mask, private, public, top_k=1, clip_norm=1.0, tolerance=0.07)


@pytest.mark.parametrize(
    ("mechanism", "message"),
    [
        pytest.param(naive_mechanism, "exceeds epsilon0", id="naive-clipping-accounted-at-C/B"),
        pytest.param(private_topk_mechanism, "infinite privacy loss", id="top-k-from-private-logits"),
        pytest.param(half_temperature_mechanism, "exceeds epsilon0", id="temperature-mismatch"),
    ],
)
def test_token_privacy_checker_catches_broken_mechanisms(mechanism, message):
    with pytest.raises(AssertionError, match=message):
        check_token_privacy(mechanism, INVISIBLEINK_CLAIM, configs=mechanism_configs(), shrink=False,
                            max_examples=SEARCH_EXAMPLES)


def test_token_privacy_checker_catches_an_understated_rho():
    # the span is fine but the claimed zCDP parameter is a quarter of the truth
    with pytest.raises(AssertionError, match=r"D_.* exceeds its claim"):
        check_token_privacy(
            lambda p, q, config: config.token_log_probs(p, q),
            lambda config: StepClaim(config.epsilon0, config.rho_token / 4),
            configs=mechanism_configs(),
            shrink=False,
            max_examples=SEARCH_EXAMPLES,
        )


def test_sampler_checker_catches_biased_samplers():
    log_probs = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0], dtype=torch.float64))

    def too_hot(lp, generator):
        return sample_tokens(lp * 0.8, generator)  # temperature 1.25 instead of 1

    def leaky(lp, generator):
        tokens = sample_tokens(lp, generator)
        tokens[0] = 4  # one draw of a zero-probability token
        return tokens

    with pytest.raises(AssertionError, match="do not match"):
        assert_sampler_matches(
            too_hot, log_probs, num_samples=SAMPLER_DRAWS, generator=seeded(1), significance=SAMPLER_SIGNIFICANCE
        )
    with pytest.raises(AssertionError, match="zero-probability"):
        assert_sampler_matches(leaky, log_probs, num_samples=1000, generator=seeded(1))
    assert_sampler_matches(
        sample_tokens, log_probs, num_samples=SAMPLER_DRAWS, generator=seeded(1), significance=SAMPLER_SIGNIFICANCE
    )


# ------------------------------------------------------------------------------------------
# the checkers' arithmetic


@pytest.mark.parametrize("alpha", [1.01, 1.5, 2.0, 7.0, 100.0])
@pytest.mark.parametrize(("a", "b"), [(0.3, 0.6), (0.01, 0.5), (0.5, 0.5), (0.999, 0.001)])
def test_renyi_divergence_matches_the_bernoulli_closed_form(alpha, a, b):
    exact = math.log(a**alpha * b ** (1 - alpha) + (1 - a) ** alpha * (1 - b) ** (1 - alpha)) / (alpha - 1)
    log_p = torch.log(torch.tensor([a, 1 - a], dtype=torch.float64))
    log_q = torch.log(torch.tensor([b, 1 - b], dtype=torch.float64))
    assert float(renyi_divergence(log_p, log_q, alpha)) == pytest.approx(exact, rel=CLOSED_FORM_RTOL, abs=CLOSED_FORM_ATOL)


def test_renyi_divergence_limits_and_supports():
    log_p = torch.log(torch.tensor([0.2, 0.8, 0.0], dtype=torch.float64))
    log_q = torch.log(torch.tensor([0.5, 0.4, 0.1], dtype=torch.float64))
    kl = 0.2 * math.log(0.2 / 0.5) + 0.8 * math.log(0.8 / 0.4)
    assert float(renyi_divergence(log_p, log_q, KL_LIMIT_ALPHA)) == pytest.approx(kl, rel=KL_LIMIT_RTOL)  # α → 1: KL
    assert float(renyi_divergence(log_p, log_q, math.inf)) == pytest.approx(math.log(2.0), rel=ULP_RTOL)
    assert float(renyi_divergence(log_q, log_p, 2.0)) == math.inf  # q has mass where p has none
    assert float(renyi_divergence(log_p, log_p, 3.0)) == pytest.approx(0.0, abs=CLOSED_FORM_ATOL)
    with pytest.raises(ValueError, match="alpha"):
        renyi_divergence(log_p, log_q, 1.0)


def test_log_ratio_span():
    log_p = torch.log(torch.tensor([[0.5, 0.25, 0.25, 0.0]], dtype=torch.float64))
    log_q = torch.log(torch.tensor([[0.25, 0.25, 0.5, 0.0]], dtype=torch.float64))
    assert log_ratio_span(log_p, log_q).tolist() == pytest.approx([2 * math.log(2)])
    log_r = torch.log(torch.tensor([[0.5, 0.25, 0.0, 0.25]], dtype=torch.float64))
    assert log_ratio_span(log_p, log_r).tolist() == [math.inf]


def test_goodness_of_fit_matches_scipy_g_test():
    from scipy.stats import power_divergence

    probs = [0.4, 0.3, 0.2, 0.1]
    counts = torch.tensor([410, 290, 185, 115])
    ours = goodness_of_fit(counts, torch.log(torch.tensor(probs, dtype=torch.float64)))
    theirs = power_divergence(counts.tolist(), [p * 1000 for p in probs], lambda_="log-likelihood")
    assert ours.statistic == pytest.approx(float(theirs.statistic), rel=SCIPY_STATISTIC_RTOL)
    assert ours.p_value == pytest.approx(float(theirs.pvalue), rel=SCIPY_P_VALUE_RTOL)
    assert (ours.dof, ours.num_bins, ours.num_samples) == (3, 4, 1000)


def test_goodness_of_fit_pools_small_expected_counts():
    probs = torch.tensor([0.9, 0.09, 0.006, 0.004], dtype=torch.float64)
    result = goodness_of_fit(torch.tensor([900, 90, 6, 4]), probs.log())
    # expected 900, 90, 6, 4: the last two are pooled (10 ≥ 5) → 3 bins
    assert result.num_bins == 3 and result.dof == 2
    result = goodness_of_fit(torch.tensor([996, 2, 1, 1]), torch.tensor([0.997, 0.001, 0.001, 0.001]).log())
    assert result.num_bins == 1 and result.p_value == 1.0


def test_assert_token_privacy_reports_what_it_measured():
    config = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=2)
    public = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
    private = torch.tensor([[5.0, -5.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    result = config.neighbour_log_probs(private, public)
    report = assert_token_privacy(result.actual, result.neighbours, INVISIBLEINK_CLAIM(config))
    assert report.max_log_ratio_span == pytest.approx(config.epsilon0, abs=SPAN_ATOL)  # 2C/(Bτ) = 1
    assert 0 < report.max_renyi_over_alpha <= config.rho_token
    with pytest.raises(ValueError, match="neighbour_log_probs must have shape"):
        assert_token_privacy(result.actual, result.actual, StepClaim(1.0, 1.0))


def test_linf_sensitivity_assertion_on_a_single_input():
    private = torch.tensor([[10.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    public = torch.zeros(2)
    witness = assert_linf_sensitivity(lambda p, q: dclip_aggregate(p, q, 1.5), private, public, bound=0.5)
    assert (witness.change, witness.index) == (0.5, 0)  # C/B = 1.5/3, from row 0
    with pytest.raises(AssertionError, match="row 0"):
        assert_linf_sensitivity(lambda p, q: dclip_aggregate(p, q, 1.5), private, public, bound=0.4)


def test_reference_topk_sets_cover_every_tie_break():
    # contributions of the single row equal φ_pub = [1, 1, 0]: with k = 1 both tied tokens are top-1
    sets = reference_private_topk_sets([[1.0, 1.0, 0.0]], [1.0, 1.0, 0.0], 1, 0.5)
    assert sets == {0: frozenset({0, 1})}


# ------------------------------------------------------------------------------------------
# strategies


@settings(max_examples=STRATEGY_EXAMPLES)
@given(st.data())
def test_logits_strategy_shapes_dtypes_and_ranges(data):
    shape = data.draw(st.sampled_from([(3,), (2, 5), (1, 2, 4)]))
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]))
    tensor = data.draw(logits(shape, dtype=dtype, min_value=-4.0, max_value=4.0))
    assert tensor.shape == shape and tensor.dtype == dtype
    assert bool(torch.isfinite(tensor).all()) and bool((tensor.abs() <= 4.0).all())


@settings(max_examples=STRATEGY_EXAMPLES)
@given(batch=logit_batches(leading_shapes=st.sampled_from([(), (2,)]), dtypes=st.just(torch.float16)))
def test_logit_batches_strategy(batch):
    assert isinstance(batch, LogitBatch)
    assert batch.private_logits.shape == batch.public_logits.shape[:-1] + (batch.batch_size, batch.vocab_size)
    assert batch.private_logits.dtype == batch.public_logits.dtype == torch.float16
    assert bool((batch.private_logits.abs() <= DEFAULT_LOGIT_BOUND).all())


@settings(max_examples=STRATEGY_EXAMPLES)
@given(pair=neighbour_pairs(adjacency=Adjacency.REPLACE_BY_NULL), zero=neighbour_pairs(adjacency=Adjacency.ZERO_OUT))
def test_neighbour_pairs_strategy(pair, zero):
    j = pair.index
    assert torch.equal(pair.neighbour.private_logits[..., j, :], pair.original.public_logits)
    keep = [i for i in range(pair.original.batch_size) if i != j]
    assert torch.equal(pair.neighbour.private_logits[..., keep, :], pair.original.private_logits[..., keep, :])
    assert bool((zero.neighbour.private_logits[..., zero.index, :] == 0).all())


def test_add_remove_neighbours_remove_the_row():
    """Add-remove is never substituted by zero-out: neighbour j is the batch without row j."""
    private, public = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), torch.full((3,), 0.5)
    assert torch.equal(neighbour_private_logits(private, public, 0, adjacency="add-remove"), private[1:])
    assert torch.equal(neighbour_private_logits(private, public, 1, adjacency="add-remove"), private[:1])

    def mean_of_clipped(p, q):
        return q + (p - q).clamp(-1, 1).mean(-2)

    witness = max_linf_change(mean_of_clipped, private, public, adjacency="add-remove")
    # by hand: clipped rows (0.5, 1, 1) and (1, 1, 1), mean (0.75, 1, 1); either row left out moves it by 0.25 (zeroing
    # a row instead, (-0.5, -0.5, -0.5), would move it by 0.75)
    assert witness.change == 0.25 and witness.adjacency is Adjacency.ADD_REMOVE
    assert max_linf_change(mean_of_clipped, private, public, adjacency="zero-out").change == 0.75


def test_token_privacy_checks_build_the_claims_adjacency():
    """check_token_privacy builds add-remove neighbours (B - 1 rows) for an add-remove claim, replace-by-null (B rows)
    for a StepClaim, which states no relation."""
    from accounting import PrivacyClaim

    seen = set()

    def step(private, public):
        seen.add(private.shape[-2])
        return torch.log_softmax(public + 0.0 * private.sum(-2), -1)

    sizes = st.just(3)
    check_token_privacy(step, PrivacyClaim.per_step(steps=1, epsilon=1.0, adjacency="add-remove"), batch_sizes=sizes,
                        max_examples=3)  # fmt: skip
    assert seen == {3, 2}
    seen.clear()
    check_token_privacy(step, StepClaim(epsilon=1.0), batch_sizes=sizes, max_examples=3)
    assert seen == {3}


def test_neighbour_private_logits_is_pure_and_validated():
    private, public = torch.ones(2, 3, 4), torch.zeros(2, 4)
    out = neighbour_private_logits(private, public, 1)
    assert bool((private == 1).all()) and bool((out[:, 1] == 0).all()) and bool((out[:, 0] == 1).all())
    with pytest.raises(ValueError, match="index"):
        neighbour_private_logits(private, public, 3)


@settings(max_examples=STRATEGY_EXAMPLES)
@given(budget=privacy_budgets(), config=mechanism_configs())
def test_budget_and_config_strategies_produce_valid_objects(budget, config):
    assert 0.01 <= budget.epsilon <= 20 and 1e-12 <= budget.delta <= 1e-3
    assert isinstance(config, MechanismConfig) and config.epsilon0 > 0


def test_privacy_budget_validates():
    with pytest.raises(ValueError, match="delta"):
        PrivacyBudget(1.0, 1.0)
    with pytest.raises(ValueError, match="epsilon"):
        PrivacyBudget(math.inf, 1e-6)


# ------------------------------------------------------------------------------------------
# the guide's example mask (docs/guide/testing-kit.md; tests/test_readme_examples.py runs the whole example as written)


def _mask_with_slack(public_logits, top_k, clip_norm, batch_size, *, slack=True):
    kth = torch.topk(public_logits.double(), top_k, dim=-1).values[..., -1:]
    band = 2 * clip_norm / batch_size
    margin = 4 * torch.finfo(torch.float64).eps * (kth.abs() + band) if slack else 0.0
    return public_logits.double() >= kth - band - margin


def test_a_top_k_plus_mask_without_rounding_slack_drops_a_token_the_exact_set_keeps():
    # C = 2.9, B = 5, k = 1: the exact threshold 1 - 2*2.9/5 = -0.16 keeps -0.15999999999999995, but float64
    # evaluates it to -0.15999999999999992 (tests/test_mechanism_properties.py, ROUNDING)
    public = torch.tensor([1.0, -0.15999999999999995], dtype=torch.float64)
    private = torch.stack([torch.tensor([-5.0, 5.0], dtype=torch.float64)] + [public] * 4)
    assert_topk_superset(_mask_with_slack(public, 1, 2.9, 5), private, public, top_k=1, clip_norm=2.9)
    with pytest.raises(AssertionError):
        assert_topk_superset(_mask_with_slack(public, 1, 2.9, 5, slack=False), private, public, top_k=1, clip_norm=2.9)


# -- the checkers check what a claim states, and only that --------------------------------------------------------


def _clipped_mixture(bound):
    """A per-step function of two distributions: the public one tilted by the private one's log-ratio clipped at
    ``bound`` (B = 1): a privacy-loss range of at most 2·bound."""

    def step(private, public):
        lp, lq = private[..., 0, :].double().log_softmax(-1), public.double().log_softmax(-1)
        return (lq + (lp - lq).clamp(-bound, bound)).log_softmax(-1)

    return step


def test_a_per_step_function_of_two_distributions_is_checked_against_its_claim():
    claim = StepClaim(epsilon0=1.0, renyi={2.0: 2 * 1.0**2 / 8})  # range 1 implies D_2 <= 2 * 1/8 (Cesar & Rogers)
    check_token_privacy(_clipped_mixture(0.5), claim, batch_sizes=st.just(1), max_examples=50)
    with pytest.raises(AssertionError, match="exceeds"):
        check_token_privacy(_clipped_mixture(0.6), claim, batch_sizes=st.just(1), shrink=False,
                            max_examples=SEARCH_EXAMPLES)


def test_only_what_the_claim_states_is_checked():
    actual = torch.log(torch.tensor([0.9, 0.1], dtype=torch.float64))
    neighbours = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))  # span log 9 = 2.197, D_2 <= 1.022
    assert_token_privacy(actual, neighbours, StepClaim(renyi={2.0: 1.1}))  # no range claim: the span is not checked
    with pytest.raises(AssertionError, match="span"):
        assert_token_privacy(actual, neighbours, StepClaim(epsilon0=2.0, renyi={2.0: 1.1}))
    with pytest.raises(AssertionError, match="D_2 "):
        assert_token_privacy(actual, neighbours, StepClaim(renyi={2.0: 1.0}))
    report = assert_token_privacy(actual, neighbours, StepClaim(renyi={2.0: 1.1}), alphas=(30.0,))
    assert report.worst_alpha == 2.0  # an order the claim does not name is not checked
    with pytest.raises(AssertionError, match="D_30 "):  # a zCDP claim binds every order (D_30 > 30 * 0.05)
        assert_token_privacy(actual, neighbours, StepClaim(rho=0.05), alphas=(30.0,))
    with pytest.raises(ValueError, match="nothing to check"):
        assert_token_privacy(actual, neighbours, StepClaim())
    with pytest.raises(AssertionError, match="NaN"):
        assert_token_privacy(actual, torch.full((1, 2), math.nan, dtype=torch.float64), StepClaim(rho=1.0))


def test_the_default_slack_is_the_distributions_dtype_tolerance():
    actual = torch.log(torch.tensor([0.5 + 4e-7, 0.5 - 4e-7]))  # float32: a span of 1.6e-6 over a claim of 0
    neighbours = torch.log(torch.tensor([[0.5, 0.5]]))
    assert_token_privacy(actual, neighbours, StepClaim(epsilon0=1e-12))
    with pytest.raises(AssertionError, match="span"):
        assert_token_privacy(actual.double(), neighbours.double(), StepClaim(epsilon0=1e-12))
