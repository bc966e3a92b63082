r"""Reusable property checkers for private-decoding mechanisms (docs/guide/testing-kit.md): ``assert_*`` check one
input and raise ``AssertionError`` with a witness; ``check_*`` drive them over a hypothesis strategy (call them from
a plain test function, not inside another ``@given`` test). Neighbours are built explicitly
(:func:`~invink_audit.testing.strategies.neighbour_private_logits`) and the function under test re-run on them,
never the mechanism's own shortcut; divergences are computed from their definitions in float64.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from accounting.claims import PrivacyClaim, StepClaim
from accounting.limits import check_order
from accounting.sensitivity import Adjacency
from invink_audit.audit.whitebox import tolerance_for
from invink_audit.testing import strategies as _s
from invink_audit.testing.reference import reference_private_topk_sets

__all__ = [
    "ATTAINMENT_TOLERANCE",
    "DEFAULT_ALPHAS",
    "DEFAULT_SIGNIFICANCE",
    "MIN_EXPECTED_COUNT",
    "PRIVACY_ATOL",
    "SENSITIVITY_ATOL",
    "SENSITIVITY_RTOL",
    "GoodnessOfFit",
    "SensitivityWitness",
    "StepClaim",
    "TokenPrivacyReport",
    "assert_linf_sensitivity",
    "assert_linf_sensitivity_attained",
    "assert_sampler_matches",
    "assert_token_privacy",
    "assert_topk_superset",
    "check_linf_sensitivity",
    "check_token_privacy",
    "check_topk_superset",
    "claim_adjacency",
    "goodness_of_fit",
    "log_ratio_span",
    "max_linf_change",
    "renyi_divergence",
]

#: relative slack on an ℓ∞ bound: float64 rounding of a mean of a few clipped rows is ~1e-16 relative.
SENSITIVITY_RTOL = 1e-9
#: absolute slack on an ℓ∞ bound (logits of magnitude <= 1e3 round at ~1e-13 in float64).
SENSITIVITY_ATOL = 1e-9
#: a sensitivity bound counts as attained when an input moves the aggregate by >= bound - this.
ATTAINMENT_TOLERANCE = 1e-6
#: absolute slack on privacy-loss spans and Rényi divergences of float64 distributions (``tolerance_for(float64)``;
#: the checkers' default slack is :func:`~invink_audit.audit.whitebox.tolerance_for` the distributions' dtype).
PRIVACY_ATOL = tolerance_for(torch.float64)
#: Rényi orders checked by default (from near 1, where D_α → KL, to large, where D_α → D_∞).
DEFAULT_ALPHAS = (1.01, 1.1, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0, 1000.0)
#: default significance level of the sampler's goodness-of-fit test (false-alarm probability).
DEFAULT_SIGNIFICANCE = 1e-3
#: bins with a smaller expected count are pooled before the G-test (Cochran's rule of thumb).
MIN_EXPECTED_COUNT = 5.0

AggregateFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _apply_settings(test, max_examples: int | None, shrink: bool):
    """Overlay ``max_examples`` / no-shrinking on the active hypothesis profile."""
    overrides: dict = {}
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    if not shrink:
        overrides["phases"] = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
    return settings(**overrides)(test) if overrides else test


# --------------------------------------------------------------------------------------------
# ℓ∞ sensitivity


@dataclasses.dataclass(frozen=True)
class SensitivityWitness:
    """The largest ℓ∞ change found: ``change`` = ‖f(R) − f(R'_index)‖∞ (max over leading dims too)."""

    change: float
    index: int
    adjacency: Adjacency


def max_linf_change(
    aggregate_fn: AggregateFn,
    private_logits: torch.Tensor,
    public_logits: torch.Tensor,
    *,
    adjacency: Adjacency = Adjacency.REPLACE_BY_NULL,
) -> SensitivityWitness:
    """max over neighbours ``j`` of ‖f(R) − f(R'_j)‖∞, with ``f = aggregate_fn(private, public)`` (the module
    docstring)."""
    adjacency = Adjacency(adjacency)
    base = aggregate_fn(private_logits, public_logits).to(torch.float64)
    best = SensitivityWitness(-math.inf, -1, adjacency)
    for j in range(private_logits.shape[-2]):
        neighbour = _s.neighbour_private_logits(private_logits, public_logits, j, adjacency=adjacency)
        moved = aggregate_fn(neighbour, public_logits).to(torch.float64)
        change = float((base - moved).abs().max())
        if change > best.change:
            best = SensitivityWitness(change, j, adjacency)
    return best


def assert_linf_sensitivity(
    aggregate_fn: AggregateFn,
    private_logits: torch.Tensor,
    public_logits: torch.Tensor,
    *,
    bound: float,
    adjacency: Adjacency = Adjacency.REPLACE_BY_NULL,
    rtol: float = SENSITIVITY_RTOL,
    atol: float = SENSITIVITY_ATOL,
) -> SensitivityWitness:
    """Assert ‖f(R) − f(R'_j)‖∞ <= ``bound`` (up to ``rtol``/``atol``) for every neighbour ``j`` of this input."""
    witness = max_linf_change(aggregate_fn, private_logits, public_logits, adjacency=adjacency)
    if witness.change > bound * (1 + rtol) + atol:
        raise AssertionError(
            f"ℓ∞ sensitivity bound violated under {witness.adjacency.value} adjacency: nulling row "
            f"{witness.index} moves the aggregate by {witness.change!r} > bound {bound!r}"
        )
    return witness


def check_linf_sensitivity(
    aggregate_fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    sensitivity_fn: Callable[[float, int], float],
    *,
    adjacency: Adjacency = Adjacency.REPLACE_BY_NULL,
    batches: st.SearchStrategy[_s.LogitBatch] | None = None,
    clip_norms: st.SearchStrategy[float] | None = None,
    max_examples: int | None = None,
    shrink: bool = True,
    rtol: float = SENSITIVITY_RTOL,
    atol: float = SENSITIVITY_ATOL,
) -> None:
    """Hypothesis-driven :func:`assert_linf_sensitivity`.

    ``aggregate_fn(private_logits, public_logits, clip_norm)`` is the function under test and
    ``sensitivity_fn(clip_norm, batch_size)`` its claimed sensitivity, e.g.
    ``functools.partial(accounting.linf_sensitivity, clipping=..., adjacency=...)``.
    """
    batches = batches if batches is not None else _s.logit_batches()
    clip_norms = clip_norms if clip_norms is not None else _s.clip_norms()

    @given(batches, clip_norms)
    def run(batch, clip_norm):
        assert_linf_sensitivity(
            lambda p, q: aggregate_fn(p, q, clip_norm),
            batch.private_logits,
            batch.public_logits,
            bound=sensitivity_fn(clip_norm, batch.batch_size),
            adjacency=adjacency,
            rtol=rtol,
            atol=atol,
        )

    _apply_settings(run, max_examples, shrink)()


def assert_linf_sensitivity_attained(
    aggregate_fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor],
    sensitivity_fn: Callable[[float, int], float],
    *,
    adjacency: Adjacency = Adjacency.REPLACE_BY_NULL,
    tolerance: float = ATTAINMENT_TOLERANCE,
    batches: st.SearchStrategy[_s.LogitBatch] | None = None,
    clip_norms: st.SearchStrategy[float] | None = None,
    max_examples: int | None = None,
) -> tuple[_s.LogitBatch, float, SensitivityWitness]:
    """Search (``hypothesis.find``) for an input whose ℓ∞ change is within ``tolerance`` of the claimed bound.

    Shows that a claimed sensitivity is not loose. Returns ``(batch, clip_norm, witness)``; raises
    ``AssertionError`` with the best ratio found when no such input turns up.
    """
    batches = batches if batches is not None else _s.logit_batches()
    clip_norms = clip_norms if clip_norms is not None else _s.clip_norms()
    best = {"ratio": -math.inf}

    def change(batch, clip_norm) -> SensitivityWitness:
        return max_linf_change(
            lambda p, q: aggregate_fn(p, q, clip_norm), batch.private_logits, batch.public_logits, adjacency=adjacency
        )

    def attains(example) -> bool:
        batch, clip_norm = example
        bound = sensitivity_fn(clip_norm, batch.batch_size)
        witness = change(batch, clip_norm)
        best["ratio"] = max(best["ratio"], witness.change / bound)
        return witness.change >= bound - tolerance

    # no shrinking: any input within tolerance of the bound is a witness, and shrinking is slow.
    limit = {} if max_examples is None else {"max_examples": max_examples}
    try:
        batch, clip_norm = find(st.tuples(batches, clip_norms), attains,
                                settings=settings(phases=[Phase.explicit, Phase.reuse, Phase.generate], **limit))
    except NoSuchExample as err:
        raise AssertionError(
            f"no input attains the claimed ℓ∞ sensitivity within {tolerance} under {Adjacency(adjacency).value} "
            f"adjacency; the largest change found was {best['ratio']:.6g} x the bound"
        ) from err
    return batch, clip_norm, change(batch, clip_norm)


# --------------------------------------------------------------------------------------------
# Top-k+ superset


def assert_topk_superset(
    mask: torch.Tensor,
    private_logits: torch.Tensor,
    public_logits: torch.Tensor,
    *,
    top_k: int | None,
    clip_norm: float,
    tolerance: float = 0.0,
) -> None:
    r"""Assert that ``mask`` (..., V) contains every top-k set of every :math:`\phi_i^{clip}` (paper §4).

    :math:`\phi_i^{clip} = \phi_{pub} + \mathrm{clip}_C(\phi_i - \phi_{pub})/B` is computed in exact
    rational arithmetic and every tie-break is covered (a token tied at the k-th value is in some
    top-k set). ``tolerance > 0`` ignores tokens that a perturbation of that size would remove
    (see :func:`~invink_audit.testing.reference.reference_private_topk_sets`).
    """
    if mask.dtype != torch.bool or mask.shape != public_logits.shape:
        raise AssertionError(f"mask must be a bool tensor of shape {tuple(public_logits.shape)}; got {mask.dtype} {tuple(mask.shape)}")
    vocab_size = public_logits.shape[-1]
    flat_mask = mask.reshape(-1, vocab_size).tolist()
    flat_public = public_logits.to(torch.float64).reshape(-1, vocab_size).tolist()
    flat_private = private_logits.to(torch.float64).reshape(-1, *private_logits.shape[-2:]).tolist()
    for n, (row_mask, pub, priv) in enumerate(zip(flat_mask, flat_public, flat_private, strict=True)):
        inside = {y for y, keep in enumerate(row_mask) if keep}
        for i, topk in reference_private_topk_sets(priv, pub, top_k, clip_norm, tolerance=tolerance).items():
            missing = sorted(topk - inside)
            if missing:
                raise AssertionError(
                    f"truncation set is not a superset of the private top-{top_k} set of row {i} "
                    f"(leading index {n}): tokens {missing} missing; public logits {pub}, private row {priv[i]}, "
                    f"clip_norm {clip_norm!r}"
                )


def check_topk_superset(
    mask_fn: Callable[[torch.Tensor, int | None, float, int], torch.Tensor],
    *,
    cases: st.SearchStrategy[tuple[_s.LogitBatch, float, int | None]] | None = None,
    tolerance: float = 0.0,
    max_examples: int | None = None,
    shrink: bool = True,
) -> None:
    """Hypothesis-driven :func:`assert_topk_superset` for ``mask_fn(public_logits, top_k, clip_norm, batch_size)``.

    ``mask_fn`` sees the public logits only (as a Top-k+ set must, to cost no privacy); the check is
    that its set contains the private top-k sets of every row. ``cases`` draws
    ``(batch, clip_norm, top_k)``; the default, :func:`~invink_audit.testing.strategies.topk_cases`,
    includes adversarial inputs scaled to ``C/B``.
    """
    cases = cases if cases is not None else _s.topk_cases()

    @given(cases)
    def run(case):
        batch, clip_norm, top_k = case
        mask = mask_fn(batch.public_logits, top_k, clip_norm, batch.batch_size)
        assert_topk_superset(
            mask, batch.private_logits, batch.public_logits, top_k=top_k, clip_norm=clip_norm, tolerance=tolerance
        )

    _apply_settings(run, max_examples, shrink)()


# --------------------------------------------------------------------------------------------
# per-token privacy


def renyi_divergence(log_p: torch.Tensor, log_q: torch.Tensor, alpha: float) -> torch.Tensor:
    r"""Exact Rényi divergence :math:`D_\alpha(p \Vert q)` over the last dimension, float64 (...).

    :math:`D_\alpha = \frac{1}{\alpha-1}\log\sum_y p(y)^\alpha q(y)^{1-\alpha}` (paper App. B,
    zCDP definition), summed over the support of ``p``; ``+inf`` when ``p`` puts mass where ``q`` has none.
    ``alpha = inf`` gives :math:`D_\infty = \max_y \log p(y)/q(y)`. Inputs are log-probabilities
    (``-inf`` for zero).
    """
    alpha = check_order("alpha", alpha, allow_inf=True)
    lp, lq = log_p.to(torch.float64), log_q.to(torch.float64)
    on_p, on_q = lp > -math.inf, lq > -math.inf
    escapes = (on_p & ~on_q).any(dim=-1)
    both = on_p & on_q
    if math.isinf(alpha):
        value = torch.where(both, lp - lq, torch.full_like(lp, -math.inf)).amax(dim=-1)
    else:
        terms = torch.where(both, alpha * lp + (1 - alpha) * lq, torch.full_like(lp, -math.inf))
        value = torch.logsumexp(terms, dim=-1) / (alpha - 1)
    return torch.where(escapes, torch.full_like(value, math.inf), value)


def log_ratio_span(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    r"""Range of the privacy loss :math:`\max_y L(y) - \min_y L(y)`, :math:`L = \log p - \log q`, float64 (...).

    Taken over the common support; ``+inf`` if the supports differ (some token has infinite loss).
    A mechanism is ε-bounded-range iff this is <= ε for every pair of neighbours (Durfee &
    Rogers 2019, arXiv:1905.04273).
    """
    lp, lq = log_p.to(torch.float64), log_q.to(torch.float64)
    on_p, on_q = lp > -math.inf, lq > -math.inf
    differ = (on_p != on_q).any(dim=-1)
    loss = lp - lq
    both = on_p & on_q
    top = torch.where(both, loss, torch.full_like(loss, -math.inf)).amax(dim=-1)
    bottom = torch.where(both, loss, torch.full_like(loss, math.inf)).amin(dim=-1)
    span = top - bottom
    return torch.where(differ, torch.full_like(span, math.inf), span)


@dataclasses.dataclass(frozen=True)
class TokenPrivacyReport:
    """What :func:`assert_token_privacy` measured: the worst span and the worst ``D_α / α`` (both directions)."""

    max_log_ratio_span: float
    max_renyi_over_alpha: float
    worst_alpha: float


def assert_token_privacy(
    actual_log_probs: torch.Tensor,
    neighbour_log_probs: torch.Tensor,
    claim,
    *,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    atol: float | None = None,
) -> TokenPrivacyReport:
    r"""Assert per-token privacy of one step against every neighbour: what ``claim`` states of a step, and only that.

    ``actual_log_probs`` (..., V) is the distribution under ``R``, ``neighbour_log_probs`` (..., M, V) those under
    ``M`` neighbours; ``claim`` a :class:`StepClaim` (range ε0, zCDP ρ, Rényi bounds at given orders, ``math.inf``
    where it claims nothing), a :class:`~invink_audit.mechanisms.MechanismGuarantee` or an audit
    :class:`~invink_audit.audit.whitebox.Claim` (their per-step figures). Checked, in both directions, with slack
    ``atol`` (default: :func:`~invink_audit.audit.whitebox.tolerance_for` the distributions' dtype):

    * identical supports (otherwise some token has infinite privacy loss);
    * bounded range, if claimed: the loss span :func:`log_ratio_span` <= ``epsilon0``;
    * Rényi: :math:`D_\alpha(p\Vert p')` and :math:`D_\alpha(p'\Vert p)` at most the claim, at every order of ``alphas``
      under a zCDP claim (:math:`\alpha\rho`, paper App. B, zCDP definition) and at the orders the claim names,
      computed exactly by :func:`renyi_divergence`.
    """
    if neighbour_log_probs.ndim != actual_log_probs.ndim + 1 or neighbour_log_probs.shape[-1] != actual_log_probs.shape[-1]:
        raise ValueError(
            f"neighbour_log_probs must have shape (..., M, V) for actual (..., V); got "
            f"{tuple(neighbour_log_probs.shape)} and {tuple(actual_log_probs.shape)}"
        )
    step = StepClaim.of(claim)
    if not step.claims:
        raise ValueError(f"the claim bounds nothing of a step ({step}): there is nothing to check")
    atol = tolerance_for(actual_log_probs.dtype) if atol is None else atol
    p = actual_log_probs.unsqueeze(-2).to(torch.float64)
    q = neighbour_log_probs.to(torch.float64)
    if bool(torch.isnan(p).any() | torch.isnan(q).any()):
        raise AssertionError("a distribution holds NaN log-probabilities")
    span = log_ratio_span(p, q)
    if bool(torch.isinf(span).any()):
        raise AssertionError("supports differ between R and a neighbour: some token has infinite privacy loss")
    max_span = float(span.max())
    if max_span > step.epsilon0 + atol:
        raise AssertionError(f"privacy-loss span {max_span!r} exceeds epsilon0 = {step.epsilon0!r} (bounded range)")
    worst, worst_alpha = -math.inf, math.nan
    for alpha in step.orders(alphas):
        divergence = torch.maximum(renyi_divergence(p, q, alpha), renyi_divergence(q, p, alpha))
        top, bound = float(divergence.max()), step.renyi_bound(alpha)
        if top > bound + atol:
            raise AssertionError(f"D_{alpha:g} = {top!r} exceeds its claim {bound!r} ({step})")
        if top / alpha > worst:
            worst, worst_alpha = top / alpha, float(alpha)
    return TokenPrivacyReport(max_span, worst, worst_alpha)


def claim_adjacency(claim) -> Adjacency:
    """The relation ``claim`` is stated under: a :class:`StepClaim` states none (replace-by-null, the kit's default);
    anything :meth:`PrivacyClaim.of` reads, its :attr:`~accounting.PrivacyClaim.adjacency`."""
    return Adjacency.REPLACE_BY_NULL if isinstance(claim, StepClaim) else PrivacyClaim.of(claim).adjacency


def check_token_privacy(
    log_probs_fn: Callable[..., torch.Tensor],
    claim,
    *,
    configs: st.SearchStrategy | None = None,
    batch_sizes: st.SearchStrategy[int] = st.integers(1, 6),
    vocab_sizes: st.SearchStrategy[int] = st.integers(1, 10),
    leading_shapes: st.SearchStrategy[tuple[int, ...]] = st.just(()),
    dtypes: st.SearchStrategy[torch.dtype] = st.just(torch.float32),
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    atol: float | None = None,
    max_examples: int | None = None,
    shrink: bool = True,
) -> None:
    """Hypothesis-driven :func:`assert_token_privacy` of the mechanism's own claim, under its adjacency
    (:func:`claim_adjacency`: neighbour ``j`` has row j replaced by the public row, or removed under add-remove).

    ``log_probs_fn(private_logits (..., B, V), public_logits (..., V))`` → (..., V) log-probabilities of the step
    under test (of distributions too: take their ``log_softmax`` inside), re-run on every explicitly built neighbour
    ``R'_j``; ``claim``: what it claims of a step (as :func:`assert_token_privacy` takes it). With ``configs`` (a
    strategy, e.g. :func:`~invink_audit.testing.strategies.mechanism_configs`), every example draws a config with a
    ``batch_size``, and ``log_probs_fn(private, public, config)`` and ``claim(config)`` take it.
    """

    @st.composite
    def cases(draw):
        config = None if configs is None else draw(configs)
        sizes = batch_sizes if configs is None else st.just(config.batch_size)
        shapes = dict(vocab_sizes=vocab_sizes, leading_shapes=leading_shapes, dtypes=dtypes)
        return config, draw(_s.logit_batches(batch_sizes=sizes, **shapes))

    @given(cases())
    def run(case):
        config, batch = case
        step = log_probs_fn if configs is None else (lambda private, public: log_probs_fn(private, public, config))
        private, public = batch.private_logits, batch.public_logits
        actual = step(private, public)
        claimed = claim if configs is None else claim(config)
        adjacency = claim_adjacency(claimed)
        neighbours = [step(_s.neighbour_private_logits(private, public, j, adjacency=adjacency), public)
                      for j in range(batch.batch_size)]  # fmt: skip
        assert_token_privacy(actual, torch.stack(neighbours, dim=-2), claimed, alphas=alphas, atol=atol)

    _apply_settings(run, max_examples, shrink)()


# --------------------------------------------------------------------------------------------
# sampler goodness of fit


@dataclasses.dataclass(frozen=True)
class GoodnessOfFit:
    """G-test (log-likelihood-ratio) of observed token counts against a distribution."""

    statistic: float
    dof: int
    p_value: float
    num_samples: int
    num_bins: int


def goodness_of_fit(counts: torch.Tensor, log_probs: torch.Tensor) -> GoodnessOfFit:
    r"""G-test of ``counts`` (V,) against ``exp(log_probs)`` (V,) (normalised here).

    :math:`G = 2\sum_b O_b \log(O_b/E_b)`, asymptotically :math:`\chi^2` with (bins − 1) degrees of
    freedom (Wilks 1938). Tokens with expected count < :data:`MIN_EXPECTED_COUNT` are pooled into one
    bin (merged into the smallest remaining bin if still below it). Counts on zero-probability
    tokens are not part of the test: check them separately (:func:`assert_sampler_matches` does).
    """
    from scipy.stats import chi2

    lp = log_probs.to(torch.float64)
    probs = torch.softmax(lp, dim=-1).tolist()
    observed = counts.to(torch.float64).tolist()
    total = sum(observed[y] for y, p in enumerate(probs) if p > 0)
    bins: list[list[float]] = []  # [expected, observed]
    pooled = [0.0, 0.0]
    for y, p in enumerate(probs):
        if p <= 0:
            continue
        expected = p * total
        if expected < MIN_EXPECTED_COUNT:
            pooled[0] += expected
            pooled[1] += observed[y]
        else:
            bins.append([expected, observed[y]])
    if pooled[0] > 0:
        if pooled[0] < MIN_EXPECTED_COUNT and bins:
            smallest = min(bins, key=lambda b: b[0])
            smallest[0] += pooled[0]
            smallest[1] += pooled[1]
        else:
            bins.append(pooled)
    statistic = 2.0 * math.fsum(o * math.log(o / e) for e, o in bins if o > 0)
    dof = len(bins) - 1
    p_value = 1.0 if dof == 0 else float(chi2.sf(statistic, dof))
    return GoodnessOfFit(statistic, dof, p_value, int(total), len(bins))


def assert_sampler_matches(
    sample_fn: Callable[[torch.Tensor, torch.Generator], torch.Tensor],
    log_probs: torch.Tensor,
    *,
    num_samples: int,
    generator: torch.Generator,
    significance: float = DEFAULT_SIGNIFICANCE,
) -> GoodnessOfFit:
    """Assert that ``sample_fn`` draws from ``exp(log_probs)`` (V,).

    ``sample_fn(batched_log_probs (N, V), generator) -> (N,)`` is called once with ``num_samples``
    copies of ``log_probs``. Fails if a zero-probability token is drawn (exactly), or if the
    :func:`goodness_of_fit` p-value is below ``significance`` (so a correct sampler fails with
    probability about ``significance`` over the generator's seed).
    """
    if log_probs.ndim != 1:
        raise ValueError(f"log_probs must be one distribution of shape (V,); got {tuple(log_probs.shape)}")
    if not 0 < significance < 1:
        raise ValueError(f"significance must be in (0, 1); got {significance!r}")
    vocab_size = log_probs.shape[0]
    tokens = sample_fn(log_probs.expand(num_samples, vocab_size), generator)
    if tokens.shape != (num_samples,) or tokens.dtype != torch.int64:
        raise AssertionError(f"sampler must return int64 of shape ({num_samples},); got {tokens.dtype} {tuple(tokens.shape)}")
    if bool(((tokens < 0) | (tokens >= vocab_size)).any()):
        raise AssertionError("sampler returned a token id outside the vocabulary")
    counts = torch.bincount(tokens.cpu(), minlength=vocab_size)
    off_support = counts[log_probs.cpu() == -math.inf]
    if int(off_support.sum()) > 0:
        raise AssertionError(f"sampler drew zero-probability tokens {int(off_support.sum())} times")
    result = goodness_of_fit(counts, log_probs.cpu())
    if result.p_value < significance:
        raise AssertionError(
            f"sampler frequencies do not match the distribution: G = {result.statistic:.4g} on {result.dof} dof, "
            f"p = {result.p_value:.3g} < significance {significance}"
        )
    return result
