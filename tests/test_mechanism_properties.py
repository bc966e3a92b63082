"""Property-based tests of the InvisibleInk mechanism.

Each property is checked with the project's own test kit (``invink_audit.testing``) against an
independent computation: neighbours are built explicitly and re-aggregated, the Top-k+ superset
and the reference log-probabilities are computed in exact rational arithmetic
(``invink_audit.testing.reference``), Rényi divergences from their definition, and the sampler
with a G-test. Example counts come from the hypothesis profile (``ci``: 100 per property unless
a test says otherwise).
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import example, given, settings
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
    ATTAINMENT_TOLERANCE,
    PRIVACY_ATOL,
    LogitBatch,
    StepClaim,
    assert_linf_sensitivity_attained,
    assert_sampler_matches,
    assert_token_privacy,
    assert_topk_superset,
    check_linf_sensitivity,
    check_token_privacy,
    clip_norms,
    log_ratio_span,
    logit_batches,
    logits,
    mechanism_configs,
    neighbour_private_logits,
    reference_token_log_probs,
    reference_topk_plus_set,
    temperatures,
    top_ks,
    topk_cases,
)
from profiles import examples

#: float64 mechanism vs. exact/oracle computations on logits of magnitude <= 30.
EXACTNESS_ATOL = 1e-12
#: the fast neighbour path (S − c_j) vs. explicit re-aggregation: different summation order.
NEIGHBOUR_ATOL = 1e-12
#: tokens in the mask but not in the exact Top-k+ set must lie within this much (relative to
#: |ℓ_k| + 2C/B) below the threshold: the mechanism lowers it by 4 float64 eps (9e-16); 1e-12 leaves
#: room for the test's own float rounding, while a wrong band (off by O(C/B)) still fails
TOPK_EXTRA_RTOL = 1e-12
#: per-example significance of the sampler G-tests; with SAMPLER_EXAMPLES examples the chance that
#: a correct sampler fails any of them is at most SAMPLER_EXAMPLES * SAMPLER_SIGNIFICANCE = 2e-3.
SAMPLER_SIGNIFICANCE = 1e-4
SAMPLER_EXAMPLES = examples(20)
SAMPLER_DRAWS = 20_000
#: the single large-sample G-test of one fixed step (seeded: it passes or fails deterministically)
LARGE_SAMPLE_SIGNIFICANCE = 1e-3
LARGE_SAMPLE_DRAWS = 400_000
#: upper limit on the search for an input attaining a bound (it stops at the first one found)
ATTAINMENT_SEARCH_EXAMPLES = 1000  # a search that must attain the bound: the same in every profile

ALL_DTYPES = st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64])
LEADING = st.sampled_from([(), (2,), (1, 3)])
BATCHES = logit_batches(leading_shapes=LEADING, dtypes=ALL_DTYPES)
SMALL_BATCHES = logit_batches(vocab_sizes=st.integers(1, 8), batch_sizes=st.integers(1, 5))


def sensitivity(clipping, adjacency):
    return functools.partial(linf_sensitivity, clipping=clipping, adjacency=adjacency)


def naive(recenter=False):
    return lambda private, public, clip_norm: naive_clip_aggregate(private, clip_norm, recenter=recenter)


# ------------------------------------------------------------------------------------------
# 1. sensitivity: bounds hold for arbitrary logits, and are attained


CELLS = [
    # aggregate, clipping used for the claimed bound, adjacency  (paper Property 1, Props. 2–3)
    pytest.param(dclip_aggregate, Clipping.DIFFERENCE, Adjacency.REPLACE_BY_NULL, id="dclip-replace-by-null-C/B"),
    pytest.param(dclip_aggregate, Clipping.DIFFERENCE, Adjacency.ZERO_OUT, id="dclip-zero-out-2C/B"),
    pytest.param(naive(), Clipping.NAIVE, Adjacency.REPLACE_BY_NULL, id="naive-replace-by-null-2C/B"),
    pytest.param(naive(), Clipping.NAIVE, Adjacency.ZERO_OUT, id="naive-zero-out-C/B"),
]


@pytest.mark.parametrize(("aggregate", "clipping", "adjacency"), CELLS)
def test_linf_sensitivity_bound_holds(aggregate, clipping, adjacency):
    check_linf_sensitivity(aggregate, sensitivity(clipping, adjacency), adjacency=adjacency, batches=BATCHES)


@pytest.mark.parametrize(("aggregate", "clipping", "adjacency"), CELLS)
def test_linf_sensitivity_bound_is_attained(aggregate, clipping, adjacency):
    bound_fn = sensitivity(clipping, adjacency)
    batch, clip_norm, witness = assert_linf_sensitivity_attained(
        aggregate, bound_fn, adjacency=adjacency, batches=BATCHES, max_examples=ATTAINMENT_SEARCH_EXAMPLES
    )
    assert bound_fn(clip_norm, batch.batch_size) - ATTAINMENT_TOLERANCE <= witness.change


def test_naive_clipping_has_twice_the_dclip_sensitivity_under_replace_by_null():
    # the paper's factor 2 (Prop. 3): a witness moves naive clipping by 2C/B, twice DClip's C/B
    batch, clip_norm, witness = assert_linf_sensitivity_attained(
        naive(), sensitivity(Clipping.NAIVE, Adjacency.REPLACE_BY_NULL), batches=BATCHES,
        max_examples=ATTAINMENT_SEARCH_EXAMPLES,
    )
    dclip_bound = linf_sensitivity(clip_norm, batch.batch_size, Clipping.DIFFERENCE, Adjacency.REPLACE_BY_NULL)
    assert witness.change / dclip_bound == pytest.approx(2.0, abs=ATTAINMENT_TOLERANCE / dclip_bound)


@pytest.mark.parametrize("adjacency", [Adjacency.REPLACE_BY_NULL, Adjacency.ZERO_OUT])
def test_recentred_naive_clipping_sensitivity_is_2c_over_b_under_both_adjacencies(adjacency):
    # Amin et al.'s recentering: a zero row recentres to the constant C, so zero-out also costs 2C/B
    bound_fn = sensitivity(Clipping.NAIVE, Adjacency.REPLACE_BY_NULL)  # 2C/B
    check_linf_sensitivity(naive(recenter=True), bound_fn, adjacency=adjacency, batches=BATCHES)
    assert_linf_sensitivity_attained(
        naive(recenter=True), bound_fn, adjacency=adjacency, batches=BATCHES, max_examples=ATTAINMENT_SEARCH_EXAMPLES
    )


# ------------------------------------------------------------------------------------------
# 2. Top-k+ superset

# The reference package calls get_topk with B + 1, i.e. a band of 2C/(B+1). Here (B = 2, C = 1,
# k = 1) row 0's clipped contribution φ_pub + clip(φ_0 − φ_pub)/2 = [−0.5, −0.375] puts token 1 on
# top, but φ_pub(1) = −0.875 < ℓ_1 − 2/3: the 2C/(B+1) set misses it; the 2C/B = 1 band keeps it.
PINNED_PUBLIC = [0.0, -0.875]
PINNED_PRIVATE = [[-1.0, 0.125], PINNED_PUBLIC]
PINNED = LogitBatch(torch.tensor(PINNED_PRIVATE), torch.tensor(PINNED_PUBLIC))

# Rounding, the reason for the threshold's slack of 4 float64 eps (invink_audit.mechanism): with
# ℓ_1 = 1, C = 2.9 and B = 5 (k = 1), the exact threshold is 1 − 2·fl(2.9)/5, and the smallest float64
# above it, −0.15999999999999995, is in the set (row 0, clipped to −C and +C, puts token 1 on top);
# float64 evaluates ℓ_1 − 2C/B to −0.15999999999999992, so a threshold without the slack drops token 1.
ROUNDING_PUBLIC = [1.0, -0.15999999999999995]
ROUNDING_PRIVATE = [[-5.0, 5.0]] + [ROUNDING_PUBLIC] * 4
ROUNDING = LogitBatch(
    torch.tensor(ROUNDING_PRIVATE, dtype=torch.float64), torch.tensor(ROUNDING_PUBLIC, dtype=torch.float64)
)


TOPK_CASES = topk_cases(leading_shapes=LEADING, dtypes=ALL_DTYPES)


@given(case=TOPK_CASES)
@example(case=(PINNED, 1.0, 1))
@example(case=(ROUNDING, 2.9, 1))
def test_topk_plus_is_a_superset_of_every_private_topk(case):
    batch, clip_norm, top_k = case
    mask = topk_plus_mask(batch.public_logits, top_k, clip_norm, batch.batch_size)
    assert_topk_superset(mask, batch.private_logits, batch.public_logits, top_k=top_k, clip_norm=clip_norm)


@given(case=TOPK_CASES)
@example(case=(ROUNDING, 2.9, 1))
def test_topk_plus_is_the_exact_set_up_to_rounding(case):
    batch, clip_norm, top_k = case
    # mask ⊇ exact {φ_pub ≥ ℓ_k − 2C/B}; extra tokens only within the documented rounding slack
    mask = topk_plus_mask(batch.public_logits, top_k, clip_norm, batch.batch_size)
    vocab = batch.vocab_size
    publics = batch.public_logits.double().reshape(-1, vocab).tolist()
    for row_mask, pub in zip(mask.reshape(-1, vocab).tolist(), publics, strict=True):
        exact = reference_topk_plus_set(pub, top_k, clip_norm, batch.batch_size)
        inside = {y for y, keep in enumerate(row_mask) if keep}
        assert exact <= inside
        if top_k is not None and top_k < vocab:
            kth = sorted(pub, reverse=True)[top_k - 1]
            slack = TOPK_EXTRA_RTOL * (abs(kth) + 2 * clip_norm / batch.batch_size)
            assert all(pub[y] >= kth - 2 * clip_norm / batch.batch_size - slack for y in inside - exact)


@given(batch=BATCHES, data=st.data(), clip_norm=clip_norms(), top_k=top_ks(), temperature=temperatures())
def test_support_depends_on_public_logits_only(batch, data, clip_norm, top_k, temperature):
    # unrelated private rows with the same public row give the same support
    other = data.draw(logits(tuple(batch.private_logits.shape), dtype=batch.private_logits.dtype))
    kwargs = dict(clip_norm=clip_norm, temperature=temperature, top_k=top_k)
    first = token_log_probs(batch.private_logits, batch.public_logits, **kwargs)
    second = token_log_probs(other, batch.public_logits, **kwargs)
    assert torch.equal(first > -math.inf, second > -math.inf)
    assert torch.equal(first > -math.inf, topk_plus_mask(batch.public_logits, top_k, clip_norm, batch.batch_size))


# ------------------------------------------------------------------------------------------
# 3. per-token privacy


def test_per_token_privacy_with_explicit_neighbours():
    # kit driver: re-runs token_log_probs on every explicitly built neighbour R'_j
    check_token_privacy(
        lambda private, public, config: config.token_log_probs(private, public),
        lambda config: StepClaim(config.epsilon0, config.rho_token),
        configs=mechanism_configs(),
        leading_shapes=LEADING,
        dtypes=ALL_DTYPES,
    )


@st.composite
def configs_and_batches(draw, vocab_sizes=st.integers(1, 10)):
    config = draw(mechanism_configs())
    batch = draw(
        logit_batches(batch_sizes=st.just(config.batch_size), vocab_sizes=vocab_sizes, leading_shapes=LEADING, dtypes=ALL_DTYPES)
    )
    return config, batch


@given(case=configs_and_batches())
def test_per_token_privacy_with_the_fast_neighbour_path(case):
    config, batch = case
    result = config.neighbour_log_probs(batch.private_logits, batch.public_logits)
    report = assert_token_privacy(result.actual, result.neighbours, StepClaim(config.epsilon0, config.rho_token))
    assert report.max_log_ratio_span <= config.epsilon0 + PRIVACY_ATOL  # the kit's slack for float64 spans
    # and the fast path equals explicit re-aggregation of every neighbour
    for j in range(config.batch_size):
        nulled = neighbour_private_logits(batch.private_logits, batch.public_logits, j)
        explicit = config.token_log_probs(nulled, batch.public_logits)
        assert torch.equal(explicit > -math.inf, result.neighbours[..., j, :] > -math.inf)
        finite = explicit > -math.inf
        torch.testing.assert_close(result.neighbours[..., j, :][finite], explicit[finite], rtol=0, atol=NEIGHBOUR_ATOL)


@pytest.mark.parametrize("top_k", [None, 1, 2])
def test_log_ratio_span_attains_epsilon0(top_k):
    # one private row pushed above +C on token 0 and below −C on token 1: the span is exactly 2C/(Bτ)
    clip_norm, temperature, batch_size = 0.75, 1.25, 3
    public = torch.tensor([1.0, 0.5, 0.0, -0.25], dtype=torch.float64)
    private = public.expand(batch_size, 4).clone()
    private[0] += torch.tensor([2.0, -2.0, 0.0, 0.0], dtype=torch.float64)
    config = MechanismConfig(clip_norm, temperature, top_k, batch_size)
    result = config.neighbour_log_probs(private, public)
    span = float(log_ratio_span(result.actual, result.neighbours[0]))
    assert span == pytest.approx(config.epsilon0, abs=EXACTNESS_ATOL)


# ------------------------------------------------------------------------------------------
# 4. exactness on small vocabularies


@given(batch=SMALL_BATCHES, clip_norm=clip_norms(), temperature=temperatures())
def test_token_log_probs_match_exact_oracle_for_every_k(batch, clip_norm, temperature):
    # V <= 8: enumerate every k (and the full vocabulary) and every token
    private = batch.private_logits.double().tolist()
    public = batch.public_logits.double().tolist()
    for top_k in [None, *range(1, batch.vocab_size + 1)]:
        ours = token_log_probs(
            batch.private_logits, batch.public_logits, clip_norm=clip_norm, temperature=temperature, top_k=top_k
        ).tolist()
        oracle = reference_token_log_probs(private, public, clip_norm=clip_norm, temperature=temperature, top_k=top_k)
        for y, (a, b) in enumerate(zip(ours, oracle, strict=True)):
            assert (a == -math.inf) == (b == -math.inf), (top_k, y, a, b)
            if b > -math.inf:
                assert abs(a - b) <= EXACTNESS_ATOL, (top_k, y, a, b)
        assert math.fsum(math.exp(v) for v in ours) == pytest.approx(1.0, abs=EXACTNESS_ATOL)


@settings(max_examples=SAMPLER_EXAMPLES)
@given(batch=SMALL_BATCHES, clip_norm=clip_norms(), temperature=temperatures(), top_k=top_ks(max_value=8))
def test_sampler_frequencies_match_token_log_probs(batch, clip_norm, temperature, top_k):
    log_probs = token_log_probs(batch.private_logits, batch.public_logits, clip_norm=clip_norm, temperature=temperature, top_k=top_k)
    # a fixed seed on purpose (reproducible test; such output is not private)
    assert_sampler_matches(
        sample_tokens, log_probs, num_samples=SAMPLER_DRAWS, generator=torch.Generator().manual_seed(20251),
        significance=SAMPLER_SIGNIFICANCE,
    )


def test_sampler_frequencies_large_sample():
    # one fixed 8-token step, LARGE_SAMPLE_DRAWS draws in one batched call, one G-test
    private = torch.tensor([[0.5, 2.0, -1.0, 0.0, 3.0, -2.0, 1.0, 0.25], [1.0, 1.0, 1.0, -3.0, 0.0, 0.0, 2.0, -1.0]])
    public = torch.tensor([0.0, 1.5, -0.5, -4.0, 2.0, -1.0, 0.5, 0.0])
    log_probs = token_log_probs(private, public, clip_norm=1.0, temperature=0.9, top_k=4)
    result = assert_sampler_matches(
        sample_tokens, log_probs, num_samples=LARGE_SAMPLE_DRAWS, generator=torch.Generator().manual_seed(7),
        significance=LARGE_SAMPLE_SIGNIFICANCE,
    )
    assert result.num_bins == int((log_probs > -math.inf).sum())
