"""Unit tests of invink_audit.mechanism: hand-computed values, edge cases, validation, purity, devices.

The hypothesis properties (sensitivity, Top-k+ superset, per-token privacy, exactness) are in
test_mechanism_properties.py.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import invink_audit
from accounting.sensitivity import Adjacency, Clipping, linf_sensitivity
from invink_audit import mechanism as mech
from invink_audit.mechanism import (
    ACCUMULATION_DTYPE,
    MechanismConfig,
    NeighbourLogProbs,
    SeededGeneratorWarning,
    dclip_aggregate,
    make_generator,
    naive_clip_aggregate,
    neighbour_log_probs,
    sample_tokens,
    token_log_probs,
    topk_plus_mask,
)

#: float64 results of a few operations on small logits agree to this (rounding is ~1e-16).
EXACT_ATOL = 1e-12
#: a guarantee (ρ_tok, ε0) against its closed form evaluated in another order: a few float64 ulps (2.2e-16)
FORMULA_RTOL = 1e-15

# the CUDA cases carry the `cuda` marker, so `make gpu-check` (pytest -m cuda) runs them
DEVICES = ["cpu"] + ([pytest.param("cuda", marks=pytest.mark.cuda)] if torch.cuda.is_available() else [])
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def seeded(seed: int = 0, device: str = "cpu") -> torch.Generator:
    # a fixed seed on purpose: tests must be reproducible (and their outputs are not private)
    return torch.Generator(device=device).manual_seed(seed)


def t(values, dtype=torch.float32, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


# ------------------------------------------------------------------------------------------
# aggregates: hand-computed values


def test_dclip_aggregate_hand_computed():
    private = t([[1.0, 5.0, -0.5], [0.0, 0.0, -9.0]])
    public = t([0.0, 0.0, 1.0])
    # clip_2(φ_i − φ_pub) = [[1, 2, -1.5], [0, 0, -2]]; mean = [0.5, 1, -1.75]; + φ_pub
    out = dclip_aggregate(private, public, 2.0)
    assert out.dtype == ACCUMULATION_DTYPE
    torch.testing.assert_close(out, torch.tensor([0.5, 1.0, -0.75], dtype=torch.float64), rtol=0, atol=0)


def test_dclip_aggregate_of_null_references_is_public_row():
    public = t([[0.3, -2.0, 7.0], [1.0, 1.0, 1.0]])
    private = public.unsqueeze(-2).expand(2, 4, 3)
    assert torch.equal(dclip_aggregate(private, public, 0.1), public.double())


def test_naive_clip_aggregate_hand_computed():
    private = t([[3.0, -5.0], [1.0, 1.0]])
    torch.testing.assert_close(naive_clip_aggregate(private, 2.0), t([1.5, -0.5], torch.float64), rtol=0, atol=0)
    # recentering (Amin et al. 2024): rows shifted to max C = 2 → [2, -6]→[2, -2] and [2, 2]
    torch.testing.assert_close(
        naive_clip_aggregate(private, 2.0, recenter=True), t([2.0, 0.0], torch.float64), rtol=0, atol=0
    )


# ------------------------------------------------------------------------------------------
# Top-k+


def test_topk_plus_mask_band_is_two_c_over_b():
    public = t([3.0, 2.0, 1.0, 0.0, -1.0])
    # ℓ_2 = 2; B = 2: band 2·1/2 = 1 → {φ ≥ 1}; B = 4: band 0.5 → {φ ≥ 1.5}
    assert topk_plus_mask(public, 2, 1.0, 2).tolist() == [True, True, True, False, False]
    assert topk_plus_mask(public, 2, 1.0, 4).tolist() == [True, True, False, False, False]
    # B = 1: band 2 → {φ ≥ 0}
    assert topk_plus_mask(public, 2, 1.0, 1).tolist() == [True, True, True, True, False]


def test_topk_plus_mask_includes_the_exact_boundary():
    # ℓ_1 = 0, band 2·1/2 = 1: a token at exactly −1 is in, one a float32 ulp below is out
    below = torch.nextafter(t([-1.0]), t([-2.0])).item()
    assert topk_plus_mask(t([0.0, -1.0]), 1, 1.0, 2).tolist() == [True, True]
    assert topk_plus_mask(t([0.0, below]), 1, 1.0, 2).tolist() == [True, False]


def test_topk_plus_mask_ties_at_kth_value_are_all_included():
    public = t([1.0, 1.0, 1.0, 0.0, 5.0])
    # ℓ_2 = 1 (counted with multiplicity: 5, 1, 1, 1): all three tied tokens are in, even as C → 0
    assert topk_plus_mask(public, 2, 1e-9, 3).tolist() == [True, True, True, False, True]
    assert int(topk_plus_mask(public, 2, 1e-9, 3).sum()) == 4 > 2


@pytest.mark.parametrize("top_k", [None, 4, 5, 1000])
def test_topk_plus_mask_full_vocabulary(top_k):
    public = t([[0.0, -50.0, 3.0, 1.0], [9.0, 9.0, -9.0, 0.0]])
    assert topk_plus_mask(public, top_k, 0.01, 3).all()


def test_topk_plus_mask_band_comes_from_the_sensitivity_calculator(monkeypatch):
    public = t([3.0, 2.0, 1.0, 0.0, -1.0])
    assert topk_plus_mask(public, 1, 1.0, 2).tolist() == [True, True, False, False, False]
    # doubling what the calculator says doubles the band (no literal C/B inside the mechanism)
    monkeypatch.setattr(mech, "linf_sensitivity", lambda *args, **kwargs: 2 * linf_sensitivity(*args, **kwargs))
    assert topk_plus_mask(public, 1, 1.0, 2).tolist() == [True, True, True, False, False]


def test_topk_plus_mask_leading_dimensions():
    public = t([[[3.0, 2.0, 1.0]], [[0.0, 0.0, -5.0]]])  # (2, 1, 3)
    assert topk_plus_mask(public, 1, 0.25, 1).tolist() == [[[True, False, False]], [[True, True, False]]]


def test_topk_plus_columns_hold_every_member_of_every_row_with_ties():
    # integer logits: many exact ties, including at the k-th value and at the threshold
    gen = torch.Generator().manual_seed(0)
    public = torch.randint(-6, 7, (50, 3, 40), generator=gen).to(torch.float64)
    for top_k, clip_norm, batch_size in ((1, 0.5, 2), (3, 1.0, 2), (5, 3.0, 3), (10, 0.0001, 4)):
        mask = topk_plus_mask(public, top_k, clip_norm, batch_size)
        index = mech.topk_plus_columns(public, top_k, clip_norm, batch_size)
        assert index.shape[-1] == int(mask.sum(dim=-1).max()) < public.shape[-1]
        assert torch.equal(mask.gather(-1, index).sum(dim=-1), mask.sum(dim=-1))  # no member left out


def test_topk_plus_columns_are_none_when_the_sets_take_the_whole_vocabulary():
    public = t([[0.0, -50.0, 3.0, 1.0], [9.0, 9.0, -9.0, 0.0]])
    for top_k in (None, 4, 1000):
        assert mech.topk_plus_columns(public, top_k, 0.01, 3) is None
    assert mech.topk_plus_columns(public, 1, 100.0, 3) is None  # the band reaches every token
    assert mech.topk_plus_columns(public, 1, 0.01, 3).shape == (2, 2)  # row 2 ties at the top


# ------------------------------------------------------------------------------------------
# exponential mechanism


def test_token_log_probs_hand_computed():
    private = t([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    public = t([0.0, 0.0, -10.0])
    # aggregate = [0.5, 0, −10] (C = 1, B = 2); Top-1+: ℓ = 0, band 1 → tokens 0, 1; τ = 0.5
    out = token_log_probs(private, public, clip_norm=1.0, temperature=0.5, top_k=1)
    z = math.log(math.exp(1.0) + 1.0)
    expected = torch.tensor([1.0 - z, -z, -math.inf], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=0, atol=EXACT_ATOL)
    assert out[2].item() == -math.inf


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_log_probs_is_the_float64_computation_for_every_input_dtype(dtype):
    gen = seeded(1)
    private = (torch.randn(3, 4, 17, generator=gen) * 5).to(dtype)
    public = (torch.randn(3, 17, generator=gen) * 5).to(dtype)
    out = token_log_probs(private, public, clip_norm=0.7, temperature=1.3, top_k=5)
    ref = token_log_probs(private.double(), public.double(), clip_norm=0.7, temperature=1.3, top_k=5)
    assert out.dtype == torch.float64 and out.shape == (3, 17)
    assert torch.equal(out, ref)  # upcasting is exact, so the results are identical
    total = torch.logsumexp(out, dim=-1)
    torch.testing.assert_close(total, torch.zeros(3, dtype=torch.float64), rtol=0, atol=EXACT_ATOL)


@pytest.mark.parametrize("top_k", [1, 3, 40, None])
def test_token_log_probs_equal_the_dense_formula(top_k):
    # the implementation computes on the Top-k+ columns only; compare with the dense formula
    gen = seeded(12)
    private, public = torch.randn(4, 3, 64, generator=gen) * 4, torch.randn(4, 64, generator=gen) * 4
    support = topk_plus_mask(public, top_k, 0.8, 3)
    dense = torch.log_softmax((dclip_aggregate(private, public, 0.8) / 1.1).masked_fill(~support, -math.inf), dim=-1)
    out = token_log_probs(private, public, clip_norm=0.8, temperature=1.1, top_k=top_k)
    assert torch.equal(out > -math.inf, support)
    torch.testing.assert_close(out[support], dense[support], rtol=0, atol=EXACT_ATOL)


def test_empty_leading_dimension():
    private, public = torch.zeros(0, 3, 7), torch.zeros(0, 7)
    result = neighbour_log_probs(private, public, clip_norm=1.0, temperature=1.0, top_k=2)
    assert result.actual.shape == (0, 7) and result.neighbours.shape == (0, 3, 7)
    assert sample_tokens(result.actual, seeded()).shape == (0,)


def test_token_log_probs_stable_for_huge_logits_and_tiny_temperature():
    private = t([[1e4, -1e4, 0.0], [3e4, 3e4, 3e4]], torch.float64)
    public = t([2e4, 1e4, -3e4], torch.float64)
    out = token_log_probs(private, public, clip_norm=5.0, temperature=1e-3, top_k=None)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(torch.logsumexp(out, -1), torch.tensor(0.0, dtype=torch.float64), rtol=0, atol=EXACT_ATOL)


def test_naive_clipping_mode_uses_naive_aggregate_over_the_full_vocabulary():
    gen = seeded(2)
    private, public = torch.randn(3, 6, generator=gen) * 4, torch.randn(6, generator=gen) * 4
    out = token_log_probs(private, public, clip_norm=1.5, temperature=0.8, top_k=None, clipping=Clipping.NAIVE)
    expected = torch.log_softmax(naive_clip_aggregate(private, 1.5) / 0.8, dim=-1)
    torch.testing.assert_close(out, expected, rtol=0, atol=EXACT_ATOL)
    with pytest.raises(ValueError, match="top_k must be None"):
        token_log_probs(private, public, clip_norm=1.5, temperature=0.8, top_k=3, clipping="naive")


# ------------------------------------------------------------------------------------------
# neighbours


@pytest.mark.parametrize("clipping", [Clipping.DIFFERENCE, Clipping.NAIVE])
def test_neighbour_log_probs_match_explicit_recomputation(clipping):
    gen = seeded(3)
    private = torch.randn(2, 5, 11, generator=gen) * 3
    public = torch.randn(2, 11, generator=gen) * 3
    top_k = 3 if clipping is Clipping.DIFFERENCE else None
    kwargs = dict(clip_norm=0.9, temperature=0.7, top_k=top_k, clipping=clipping)
    result = neighbour_log_probs(private, public, **kwargs)
    assert isinstance(result, NeighbourLogProbs)
    assert result.neighbours.shape == (2, 5, 11) and result.batch_size == 5
    assert torch.equal(result.actual, token_log_probs(private, public, **kwargs))
    assert torch.equal(result.support, topk_plus_mask(public, top_k, 0.9, 5))
    for j in range(5):
        nulled = private.clone()
        nulled[:, j, :] = public
        torch.testing.assert_close(result.neighbours[:, j, :], token_log_probs(nulled, public, **kwargs), rtol=0, atol=EXACT_ATOL)


def test_neighbour_of_a_null_reference_is_the_actual_distribution():
    public = t([1.0, 0.0, -1.0, 2.0])
    private = torch.stack([public, public + t([3.0, -3.0, 0.0, 0.5])])
    result = neighbour_log_probs(private, public, clip_norm=1.0, temperature=1.0, top_k=2)
    assert torch.equal(result.neighbours[0], result.actual)  # nulling an already-null row changes nothing
    assert not torch.equal(result.neighbours[1], result.actual)


def test_neighbour_log_probs_result_is_frozen_and_validated():
    result = neighbour_log_probs(t([[0.0, 1.0]]), t([0.0, 0.0]), clip_norm=1.0, temperature=1.0, top_k=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.actual = result.actual  # type: ignore[misc]
    with pytest.raises(ValueError, match="neighbours must have shape"):
        NeighbourLogProbs(result.actual, result.actual, result.support)


# ------------------------------------------------------------------------------------------
# configuration


def test_mechanism_config_guarantees_come_from_the_sensitivity_calculator():
    config = MechanismConfig(clip_norm=0.6, temperature=1.2, top_k=50, batch_size=7)
    delta = linf_sensitivity(0.6, 7, Clipping.DIFFERENCE, Adjacency.REPLACE_BY_NULL)
    assert config.sensitivity == delta
    assert config.epsilon0 == 2 * delta / 1.2
    assert config.rho_token == pytest.approx(0.6**2 / (2 * 7**2 * 1.2**2), rel=FORMULA_RTOL)  # paper Eq. (rho-token)
    assert config.rho_token == pytest.approx(config.epsilon0**2 / 8, rel=FORMULA_RTOL)  # bounded range → zCDP
    naive = MechanismConfig(clip_norm=0.6, temperature=1.2, top_k=None, batch_size=7, clipping="naive")
    assert naive.epsilon0 == pytest.approx(2 * config.epsilon0, rel=FORMULA_RTOL)  # paper Prop. 3: factor 2


def test_mechanism_config_is_frozen_and_normalises_types():
    config = MechanismConfig(clip_norm=1, temperature=2, top_k=None, batch_size=3)
    assert isinstance(config.clip_norm, float) and isinstance(config.temperature, float)
    assert config.clipping is Clipping.DIFFERENCE
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.clip_norm = 2.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(clip_norm=0.0), "clip_norm"),
        (dict(clip_norm=-1.0), "clip_norm"),
        (dict(clip_norm=math.inf), "clip_norm"),
        (dict(clip_norm=math.nan), "clip_norm"),
        (dict(clip_norm="1"), "clip_norm"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(batch_size=0), "batch_size"),
        (dict(batch_size=2.0), "batch_size"),
        (dict(clipping="bogus"), "clipping"),
        (dict(clipping="naive", top_k=5), "top_k must be None"),
    ],
)
def test_mechanism_config_rejects_bad_values(kwargs, message):
    base = dict(clip_norm=1.0, temperature=1.0, top_k=10, batch_size=4)
    with pytest.raises(ValueError, match=message):
        MechanismConfig(**{**base, **kwargs})


def test_mechanism_config_methods_check_the_accounted_batch_size():
    config = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=2, batch_size=3)
    private, public = torch.zeros(3, 5), torch.arange(5.0)
    assert torch.equal(config.token_log_probs(private, public), token_log_probs(private, public, clip_norm=1.0, temperature=1.0, top_k=2))
    assert torch.equal(config.neighbour_log_probs(private, public).actual, config.token_log_probs(private, public))
    with pytest.raises(ValueError, match="batch_size=3"):
        config.token_log_probs(torch.zeros(4, 5), public)
    with pytest.raises(ValueError, match="batch_size=3"):
        config.neighbour_log_probs(torch.zeros(2, 5), public)


# ------------------------------------------------------------------------------------------
# validation of tensors


STEP = dict(clip_norm=1.0, temperature=1.0, top_k=2)
GOOD_PRIVATE, GOOD_PUBLIC = torch.zeros(3, 5), torch.zeros(5)


@pytest.mark.parametrize(
    ("private", "public", "kwargs", "message"),
    [
        (torch.zeros(3, 4), GOOD_PUBLIC, STEP, "same vocabulary size"),
        (torch.zeros(2, 3, 5), torch.zeros(3, 5), STEP, "same leading shape"),
        (torch.zeros(5), GOOD_PUBLIC, STEP, "at least 2 dimension"),
        (torch.zeros(0, 5), GOOD_PUBLIC, STEP, "at least one reference row"),
        (torch.zeros(3, 0), torch.zeros(0), STEP, "non-empty vocabulary"),
        (torch.tensor([[0.0, math.nan, 0, 0, 0]]), GOOD_PUBLIC, STEP, "private_logits must be finite; found NaN"),
        (GOOD_PRIVATE, torch.tensor([0.0, 0, math.inf, 0, 0]), STEP, "public_logits must be finite; found infinite"),
        (GOOD_PRIVATE, torch.tensor([0.0, 0, -math.inf, 0, 0]), STEP, "public_logits must be finite"),
        (torch.zeros(3, 5, dtype=torch.int64), GOOD_PUBLIC, STEP, "floating-point"),
        ([[0.0] * 5], GOOD_PUBLIC, STEP, "torch.Tensor"),
        (GOOD_PRIVATE, GOOD_PUBLIC, {**STEP, "clip_norm": 0.0}, "clip_norm"),
        (GOOD_PRIVATE, GOOD_PUBLIC, {**STEP, "temperature": 0.0}, "temperature"),
        (GOOD_PRIVATE, GOOD_PUBLIC, {**STEP, "temperature": -1.0}, "temperature"),
        (GOOD_PRIVATE, GOOD_PUBLIC, {**STEP, "top_k": 0}, "top_k"),
        (GOOD_PRIVATE, GOOD_PUBLIC, {**STEP, "clipping": "clamp"}, "clipping"),
    ],
)
@pytest.mark.parametrize("fn", [token_log_probs, neighbour_log_probs])
def test_step_functions_reject_bad_input(fn, private, public, kwargs, message):
    with pytest.raises(ValueError, match=message):
        fn(private, public, **kwargs)


def test_aggregates_and_mask_reject_bad_input():
    with pytest.raises(ValueError, match="clip_norm"):
        dclip_aggregate(GOOD_PRIVATE, GOOD_PUBLIC, -1.0)
    with pytest.raises(ValueError, match="same vocabulary"):
        dclip_aggregate(GOOD_PRIVATE, torch.zeros(6), 1.0)
    with pytest.raises(ValueError, match="finite"):
        naive_clip_aggregate(torch.tensor([[math.nan]]), 1.0)
    with pytest.raises(ValueError, match="at least one reference row"):
        naive_clip_aggregate(torch.zeros(0, 3), 1.0)
    with pytest.raises(ValueError, match="recenter"):
        naive_clip_aggregate(GOOD_PRIVATE, 1.0, recenter="yes")
    with pytest.raises(ValueError, match="batch_size"):
        topk_plus_mask(GOOD_PUBLIC, 2, 1.0, 0)
    with pytest.raises(ValueError, match="top_k"):
        topk_plus_mask(GOOD_PUBLIC, -1, 1.0, 2)
    with pytest.raises(ValueError, match="public_logits must be finite"):
        topk_plus_mask(torch.tensor([0.0, math.nan]), 1, 1.0, 2)


# ------------------------------------------------------------------------------------------
# purity and devices


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_function_mutates_its_inputs(dtype):
    gen = seeded(4)
    private = (torch.randn(2, 3, 9, generator=gen) * 4).to(dtype)
    public = (torch.randn(2, 9, generator=gen) * 4).to(dtype)
    private_copy, public_copy = private.clone(), public.clone()
    versions = (private._version, public._version)
    dclip_aggregate(private, public, 0.5)
    naive_clip_aggregate(private, 0.5, recenter=True)
    topk_plus_mask(public, 2, 0.5, 3)
    token_log_probs(private, public, clip_norm=0.5, temperature=0.9, top_k=2)
    result = neighbour_log_probs(private, public, clip_norm=0.5, temperature=0.9, top_k=2)
    lp = result.actual.clone()
    sample_tokens(result.actual, seeded(5))
    assert torch.equal(private, private_copy) and torch.equal(public, public_copy)
    assert torch.equal(result.actual, lp)
    assert (private._version, public._version) == versions


@pytest.mark.parametrize("device", DEVICES)
def test_results_stay_on_the_input_device(device):
    private = torch.randn(2, 3, 8, generator=seeded(6)).to(device)
    public = torch.randn(2, 8, generator=seeded(7)).to(device)
    result = neighbour_log_probs(private, public, clip_norm=1.0, temperature=1.0, top_k=3)
    for tensor in (
        dclip_aggregate(private, public, 1.0),
        naive_clip_aggregate(private, 1.0),
        topk_plus_mask(public, 3, 1.0, 3),
        token_log_probs(private, public, clip_norm=1.0, temperature=1.0, top_k=3),
        result.actual,
        result.neighbours,
        sample_tokens(result.actual, seeded(8, device)),
    ):
        assert tensor.device.type == device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mismatched_devices_are_rejected():
    with pytest.raises(ValueError, match="same device"):
        token_log_probs(GOOD_PRIVATE.cuda(), GOOD_PUBLIC, **STEP)
    with pytest.raises(ValueError, match="generator is on"):
        sample_tokens(torch.zeros(3, device="cuda"), seeded(0))


# ------------------------------------------------------------------------------------------
# sampling


def test_sample_tokens_shape_dtype_and_reproducibility():
    log_probs = torch.log_softmax(torch.randn(4, 6, 10, generator=seeded(9)), dim=-1)
    first = sample_tokens(log_probs, seeded(10))
    assert first.shape == (4, 6) and first.dtype == torch.int64
    assert torch.equal(first, sample_tokens(log_probs, seeded(10)))


def test_sample_tokens_never_draws_outside_the_support():
    # rows with disjoint one- and two-token supports, many copies: every draw lands in its row's support
    log_probs = torch.full((3, 5), -math.inf, dtype=torch.float64)
    log_probs[0, 4] = 0.0
    log_probs[1, 0] = log_probs[1, 2] = math.log(0.5)
    log_probs[2, 1] = -700.0  # unnormalised log-weights are fine; a tiny weight still wins alone
    tokens = sample_tokens(log_probs.expand(2000, 3, 5), seeded(11))
    assert (tokens[:, 0] == 4).all() and (tokens[:, 2] == 1).all()
    assert set(tokens[:, 1].tolist()) == {0, 2}


def test_sample_tokens_rejects_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        sample_tokens(torch.tensor([0.0, math.nan]), seeded())
    with pytest.raises(ValueError, match=r"\+inf"):
        sample_tokens(torch.tensor([0.0, math.inf]), seeded())
    with pytest.raises(ValueError, match="at least one finite"):
        sample_tokens(torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), seeded())
    with pytest.raises(ValueError, match="torch.Generator"):
        sample_tokens(torch.zeros(3), 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floating-point"):
        sample_tokens(torch.zeros(3, dtype=torch.int64), seeded())


def test_make_generator_warns_on_a_fixed_seed_and_is_os_seeded_otherwise():
    with pytest.warns(SeededGeneratorWarning, match="no privacy guarantee"):
        a = make_generator(123)
    with pytest.warns(SeededGeneratorWarning):
        b = make_generator(123)
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c, d = make_generator(), make_generator()
    assert c.initial_seed() != d.initial_seed()  # 63 random bits each: equal with probability 2**-63
    with pytest.raises(ValueError, match="seed"):
        make_generator(-1)


def test_public_names_are_exported_lazily_except_the_unchecked_kernels():
    kernels = {"gumbel_argmax", "support_log_probs", "topk_plus_support"}  # the engine's hot path: no input checks
    for name in set(mech.__all__) - kernels:
        assert getattr(invink_audit, name) is getattr(mech, name)
        assert name in dir(invink_audit)
    for name in kernels:
        assert name in mech.__all__ and name not in dir(invink_audit)
        with pytest.raises(AttributeError):
            getattr(invink_audit, name)
