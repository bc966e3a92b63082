"""The InvisibleInk mechanism for one decoding step, in torch (paper §4, Algorithm 1).

:func:`dclip_aggregate` (paper Eq. (aggregated-logits)), :func:`topk_plus_mask` (Algorithm 1's Top-k+ set),
:func:`token_log_probs` and :func:`neighbour_log_probs` (the step's distribution under R and under every
replace-by-null neighbour), :func:`sample_tokens`, :class:`MechanismConfig`: pure functions, float64 inside.
Privacy: Δ from :func:`accounting.linf_sensitivity` (paper Property 1); ε0 = 2Δ/τ bounded range per token
(Durfee & Rogers 2019), hence Δ²/(2τ²)-zCDP (paper Eq. (rho-token), Theorem 2; Cesar & Rogers 2021).

Design: docs/guide/concepts.md (§"In code: one step"); privacy: docs/accounting_notes.md §1.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import numbers
import secrets
import warnings

import torch

from accounting.accountants import bounded_range_epsilon
from accounting.conversions import br_to_zcdp
from accounting.events import GenerationEvent
from accounting.limits import check_count, check_positive
from accounting.sensitivity import Adjacency, Clipping, coerce_enum, linf_sensitivity

__all__ = [
    "ACCUMULATION_DTYPE",
    "DEFAULT_TOP_K",
    "MAX_SEED",
    "MechanismConfig",
    "NeighbourLogProbs",
    "SeededGeneratorWarning",
    "check_seed",
    "dclip_aggregate",
    "gumbel_argmax",
    "derive_key",
    "make_generator",
    "naive_clip_aggregate",
    "neighbour_log_probs",
    "run_key",
    "sample_tokens",
    "support_log_probs",
    "token_log_probs",
    "top_k_log_softmax",
    "topk_plus_columns",
    "topk_plus_mask",
    "topk_plus_support",
]

#: dtype of every intermediate and of every floating-point result of this module.
ACCUMULATION_DTYPE = torch.float64

# The Top-k+ threshold is lowered by this many float64 machine epsilons of (|ℓ_k| + band), so that
# rounding in ``ℓ_k - band`` can never drop a token that the exact-arithmetic superset argument
# (paper Eq. (topkplus)) puts in the set. The set only grows, and it is public, so it costs no
# privacy. 4 eps bounds the two roundings (of C/B and of the subtraction) with room to spare.
_THRESHOLD_SLACK_EPS = 4.0

# Uniform draws are clamped into [2**-1000, 1 - 2**-53] before the Gumbel transform, so that the
# noise -log(-log U) is always finite (within [-6.6, 36.8]): a token with log-probability -inf then
# always scores -inf and can never be drawn, and no row can score -inf (or NaN) everywhere.
# float64 torch.rand draws are multiples of 2**-53 in [0, 1), so only an exact 0 (probability
# 2**-53 per entry) is moved.
_UNIFORM_RANGE = (2.0**-1000, 1.0 - 2.0**-53)


class SeededGeneratorWarning(UserWarning):
    """A fixed seed was used: outputs are reproducible, and therefore carry no privacy guarantee."""


# --------------------------------------------------------------------------------------------
# validation helpers: the accounting package's checks (one message vocabulary, accounting/_validation.py)

_check_clip_norm = functools.partial(check_positive, "clip_norm")
_check_temperature = functools.partial(check_positive, "temperature")
_check_batch_size = functools.partial(check_count, "batch_size")
_check_clipping = functools.partial(coerce_enum, enum_type=Clipping)


def _check_top_k(top_k) -> int | None:
    if top_k is None:
        return None
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1 or None (full vocabulary); got {top_k!r}")
    return int(top_k)


def _check_tensor(name: str, tensor, *, min_ndim: int) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
    if not tensor.is_floating_point():
        raise ValueError(f"{name} must have a floating-point dtype; got {tensor.dtype}")
    if tensor.ndim < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimension(s); got shape {tuple(tensor.shape)}")
    if tensor.shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty vocabulary (last) dimension; got shape {tuple(tensor.shape)}")
    return tensor


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        return
    # one reduction pass, no dtype conversion: NaN propagates to min and max, ±inf shows in them
    low, high = torch.aminmax(tensor)
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return
    kind = "NaN" if bool(torch.isnan(low) | torch.isnan(high)) else "infinite"
    raise ValueError(f"{name} must be finite; found {kind} values")


def _check_public(public_logits) -> torch.Tensor:
    public = _check_tensor("public_logits", public_logits, min_ndim=1)
    _check_finite("public_logits", public)
    return public


def _check_pair(private_logits, public_logits) -> tuple[torch.Tensor, torch.Tensor]:
    private = _check_tensor("private_logits", private_logits, min_ndim=2)
    public = _check_tensor("public_logits", public_logits, min_ndim=1)
    if private.shape[-2] < 1:
        raise ValueError(
            f"private_logits must hold at least one reference row (B >= 1); got shape {tuple(private.shape)}"
        )
    if private.shape[-1] != public.shape[-1]:
        raise ValueError(
            "private_logits and public_logits must have the same vocabulary size; got "
            f"{private.shape[-1]} and {public.shape[-1]}"
        )
    if private.shape[:-2] != public.shape[:-1]:
        raise ValueError(
            "private_logits (..., B, V) and public_logits (..., V) must have the same leading shape; got "
            f"{tuple(private.shape)} and {tuple(public.shape)}"
        )
    if private.device != public.device:
        raise ValueError(
            f"private_logits and public_logits must be on the same device; got {private.device} and {public.device}"
        )
    _check_finite("private_logits", private)
    _check_finite("public_logits", public)
    return private, public


# --------------------------------------------------------------------------------------------
# configuration

#: Top-k of the Top-k+ set when none is given (generate, audits, bench): the paper's best setting
#: (§5, App. E: k = 100 with τ ≈ 1.1).
DEFAULT_TOP_K = 100


@dataclasses.dataclass(frozen=True)
class MechanismConfig:
    r"""Parameters of one InvisibleInk decoding step, validated at construction.

    ``batch_size`` is ``B``, the number of *private* references per generated text (the model runs
    ``B + 1`` rows per token: B private and one public). ``top_k=None`` samples from the full
    vocabulary. ``clipping`` defaults to difference clipping (InvisibleInk); ``Clipping.NAIVE``
    (Amin et al. 2024, no recentering) is provided for baselines and audits, and only over the full
    vocabulary (Top-k+ is defined for difference clipping: paper §4). The a-priori per-token guarantees:
    :attr:`sensitivity`, :attr:`epsilon0`, :attr:`rho_token`.
    """

    clip_norm: float
    temperature: float
    top_k: int | None
    batch_size: int
    clipping: Clipping = Clipping.DIFFERENCE

    def __post_init__(self) -> None:
        object.__setattr__(self, "clip_norm", _check_clip_norm(self.clip_norm))
        object.__setattr__(self, "temperature", _check_temperature(self.temperature))
        object.__setattr__(self, "top_k", _check_top_k(self.top_k))
        object.__setattr__(self, "batch_size", _check_batch_size(self.batch_size))
        object.__setattr__(self, "clipping", _check_clipping(self.clipping))
        if self.clipping is Clipping.NAIVE and self.top_k is not None:
            raise ValueError(
                f"top_k must be None with clipping={self.clipping.value!r}: Top-k+ is defined for difference "
                f"clipping only; got top_k={self.top_k!r}"
            )

    @classmethod
    def from_event(cls, event, *, top_k: int | None) -> MechanismConfig:
        """The mechanism that realises a privacy event (:class:`accounting.GenerationEvent`: its clip
        norm, B, τ and clipping; the adjacency must be replace-by-null, the relation this mechanism's
        sensitivity is computed under). ``top_k`` is not part of the event: the Top-k+ set does not
        change the guarantee (paper Theorem 2)."""
        if event.adjacency is not Adjacency.REPLACE_BY_NULL:
            raise ValueError(f"the mechanism is accounted under replace-by-null adjacency; the event has {event.adjacency.value!r}")
        return cls(
            clip_norm=event.clip_norm, temperature=event.temperature, top_k=top_k, batch_size=event.batch_size,
            clipping=event.clipping,
        )  # fmt: skip

    def event(self, max_new_tokens: int):
        """The privacy event of one text of at most ``max_new_tokens`` tokens from each batch
        (:class:`accounting.GenerationEvent`, replace-by-null): what a ledger is charged for a release."""
        return GenerationEvent(self.clip_norm, self.batch_size, self.temperature, max_new_tokens, 1, self.clipping)

    @property
    def sensitivity(self) -> float:
        """ℓ∞ sensitivity Δ of the aggregate under replace-by-null adjacency (``accounting.linf_sensitivity``;
        paper Property 1): every per-token guarantee follows from it."""
        return linf_sensitivity(self.clip_norm, self.batch_size, self.clipping, Adjacency.REPLACE_BY_NULL)

    @property
    def epsilon0(self) -> float:
        r""":math:`\varepsilon_0 = 2\Delta/\tau`: per-token bounded-range (and pure-DP) parameter (McSherry & Talwar
        2007; Durfee & Rogers 2019, arXiv:1905.04273; ``accounting.bounded_range_epsilon``, its one computation)."""
        return bounded_range_epsilon(self.sensitivity, self.temperature)

    @property
    def rho_token(self) -> float:
        r""":math:`\rho_{tok} = \varepsilon_0^2/8 = \Delta^2/(2\tau^2)` zCDP per token (paper Eq. (11), eqn:rho-token,
        Theorem 2 (thm:accounting); Cesar & Rogers 2021, arXiv:2004.07223; ``accounting.br_to_zcdp``, the one place the
        conversion is written)."""
        return br_to_zcdp(self.epsilon0)

    def _options(self, private_logits) -> dict:
        """This config's step options, after checking that ``B`` equals ``batch_size``."""
        if isinstance(private_logits, torch.Tensor) and private_logits.ndim >= 2:
            if private_logits.shape[-2] != self.batch_size:
                raise ValueError(
                    f"private_logits has {private_logits.shape[-2]} reference rows but the config was accounted "
                    f"for batch_size={self.batch_size}"
                )
        return dict(clip_norm=self.clip_norm, temperature=self.temperature, top_k=self.top_k, clipping=self.clipping)

    def token_log_probs(self, private_logits: torch.Tensor, public_logits: torch.Tensor) -> torch.Tensor:
        """:func:`token_log_probs` with this config; also checks that ``B`` equals ``batch_size``."""
        return token_log_probs(private_logits, public_logits, **self._options(private_logits))

    def neighbour_log_probs(self, private_logits: torch.Tensor, public_logits: torch.Tensor) -> NeighbourLogProbs:
        """:func:`neighbour_log_probs` with this config; also checks that ``B`` equals ``batch_size``."""
        return neighbour_log_probs(private_logits, public_logits, **self._options(private_logits))


@dataclasses.dataclass(frozen=True)
class NeighbourLogProbs:
    """Next-token log-probabilities under ``R`` and under every replace-by-null neighbour ``R'_j``.

    * ``actual``: (..., V) float64, the mechanism's distribution under ``R``;
    * ``neighbours``: (..., B, V) float64, ``neighbours[..., j, :]`` is the distribution under ``R'_j``
      (reference ``j`` replaced by the empty string, whose logits are exactly the public row);
    * ``support``: (..., V) bool, the Top-k+ set shared by all of them (it depends on the public
      logits only); every log-probability outside it is ``-inf``.
    """

    actual: torch.Tensor
    neighbours: torch.Tensor
    support: torch.Tensor

    def __post_init__(self) -> None:
        a, n, s = self.actual, self.neighbours, self.support
        if n.ndim != a.ndim + 1 or n.shape[:-2] != a.shape[:-1] or n.shape[-1] != a.shape[-1]:
            raise ValueError(
                f"neighbours must have shape (..., B, V) for actual (..., V); got {tuple(n.shape)} and {tuple(a.shape)}"
            )
        if s.shape != a.shape or s.dtype != torch.bool:
            raise ValueError(f"support must be a bool tensor of shape {tuple(a.shape)}; got {s.dtype} {tuple(s.shape)}")

    @property
    def batch_size(self) -> int:
        """``B``, the number of neighbours (one per private reference)."""
        return self.neighbours.shape[-2]


# --------------------------------------------------------------------------------------------
# aggregation


def _clipped_differences(private: torch.Tensor, public64: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """clip_C(φ_i − φ_pub) for every row, float64, shape (..., B, V) (paper Eq. (ourclip)).

    A new tensor (type promotion upcasts to float64 in the subtraction), clamped in place.
    """
    return torch.sub(private, public64.unsqueeze(-2)).clamp_(min=-clip_norm, max=clip_norm)


def _naive_contributions(private: torch.Tensor, clip_norm: float, recenter: bool) -> torch.Tensor:
    rows = private.to(ACCUMULATION_DTYPE, copy=True)
    if recenter:
        # Amin et al. 2024 (as implemented in the paper's experiments): shift each row so that its
        # maximum is C, then clip. Logits are shift-invariant, so this only changes what is clipped.
        rows.sub_(rows.amax(dim=-1, keepdim=True)).add_(clip_norm)
    return rows.clamp_(min=-clip_norm, max=clip_norm)


def dclip_aggregate(private_logits: torch.Tensor, public_logits: torch.Tensor, clip_norm: float) -> torch.Tensor:
    r"""DClip aggregate :math:`\phi_{pub} + \frac1B \sum_i \mathrm{clip}_C(\phi_i - \phi_{pub})`.

    Paper Eq. (aggregated-logits).

    ``private_logits`` (..., B, V), ``public_logits`` (..., V) → float64 (..., V). Its ℓ∞ sensitivity
    is ``C/B`` under replace-by-null and ``2C/B`` under zero-out adjacency (paper Properties 1
    and 12; :func:`accounting.linf_sensitivity`).
    """
    c = _check_clip_norm(clip_norm)
    private, public = _check_pair(private_logits, public_logits)
    public64 = public.to(ACCUMULATION_DTYPE)
    return public64 + _clipped_differences(private, public64, c).sum(dim=-2) / private.shape[-2]


def naive_clip_aggregate(private_logits: torch.Tensor, clip_norm: float, *, recenter: bool = False) -> torch.Tensor:
    r"""Naive clipping of Amin et al. 2024: :math:`\frac1B \sum_i \mathrm{clip}_C(\phi_i)` (paper Eq. (amin-avg)).

    ``private_logits`` (..., B, V) → float64 (..., V). For baselines and audits. Its ℓ∞ sensitivity
    is ``2C/B`` under replace-by-null (paper Property 9: the paper's experiments give this baseline
    ``C/B`` on purpose) and ``C/B`` under zero-out.

    ``recenter=True`` first shifts each row so that its maximum is ``C`` (Amin et al.'s recentering,
    :math:`\mathrm{clip}_C(\phi_i - \max_y \phi_i(y) + C)`). Replace-by-null sensitivity stays
    ``2C/B``, but under zero-out it becomes ``2C/B`` too (a zero row recentres to the constant ``C``),
    so the zero-out entry of the accounting table does not apply to the recentred variant.
    """
    c = _check_clip_norm(clip_norm)
    private = _check_tensor("private_logits", private_logits, min_ndim=2)
    if private.shape[-2] < 1:
        raise ValueError(
            f"private_logits must hold at least one reference row (B >= 1); got shape {tuple(private.shape)}"
        )
    if not isinstance(recenter, bool):
        raise ValueError(f"recenter must be a bool; got {recenter!r}")
    _check_finite("private_logits", private)
    return _naive_contributions(private, c, recenter).sum(dim=-2) / private.shape[-2]


# --------------------------------------------------------------------------------------------
# Top-k+ truncation


def topk_plus_support(public64: torch.Tensor, top_k: int | None, clip_norm: float, batch_size: int) -> torch.Tensor:
    """:func:`topk_plus_mask` on float64 public logits without input checks or host syncs (engine hot path)."""
    vocab_size = public64.shape[-1]
    if top_k is None or top_k >= vocab_size:
        return torch.ones(public64.shape, dtype=torch.bool, device=public64.device)
    # ℓ_k: the k-th largest public logit, counted with multiplicity.
    kth = torch.topk(public64, top_k, dim=-1, largest=True, sorted=True).values[..., -1:]
    # Each φ_i^clip = φ_pub + clip_C(φ_i − φ_pub)/B lies within C/B of φ_pub (paper §4): the same C/B
    # as the replace-by-null DClip sensitivity, so it is taken from the sensitivity calculator. The
    # k-th largest of φ_i^clip is then ≥ ℓ_k − C/B, and a token needs a further C/B to reach it:
    # band = 2·C/B (paper Eq. (topkplus), Algorithm 1 ExpandedTopVocabulary).
    deviation = linf_sensitivity(clip_norm, batch_size, Clipping.DIFFERENCE, Adjacency.REPLACE_BY_NULL)
    band = 2.0 * deviation
    slack = _THRESHOLD_SLACK_EPS * torch.finfo(ACCUMULATION_DTYPE).eps * (kth.abs() + band)
    return public64 >= kth - band - slack


def topk_plus_mask(public_logits: torch.Tensor, top_k: int | None, clip_norm: float, batch_size: int) -> torch.Tensor:
    r"""The Top-k+ set :math:`\{y : \phi_{pub}(y) \ge \ell_k - 2C/B\}` as a bool mask (..., V).

    Paper §4 and Algorithm 1 (``ExpandedTopVocabulary``). ``batch_size`` is ``B``, the number of
    private references (not ``B + 1``: the reference package's ``2C/(B+1)`` band breaks the
    superset guarantee). ``top_k=None`` or ``top_k >= V`` gives the full vocabulary.

    Guarantee (paper Eq. (topkplus)): for every private row ``i``, every top-k set of
    :math:`\phi_i^{clip} = \phi_{pub} + \mathrm{clip}_C(\phi_i - \phi_{pub})/B` is inside the mask,
    hence so is their union. The set depends on the public logits only.

    Ties: :math:`\ell_k` is the k-th largest public logit counted with multiplicity, and every token
    tied with the threshold is included (the comparison is ``>=``), so the set never depends on a
    tie-breaking order and has at least ``k`` tokens (more when values tie at :math:`\ell_k`, even
    as ``C → 0``). Rounding: the threshold is computed in float64 and lowered by
    ``4·eps64·(|ℓ_k| + 2C/B)`` (~1e-15 relative) so that floating-point rounding never excludes a
    token that exact arithmetic includes.
    """
    c = _check_clip_norm(clip_norm)
    k = _check_top_k(top_k)
    b = _check_batch_size(batch_size)
    public = _check_public(public_logits)
    return topk_plus_support(public.to(ACCUMULATION_DTYPE), k, c, b)


def _support_columns(public64: torch.Tensor, support: torch.Tensor, top_k: int | None) -> torch.Tensor | None:
    """Indices (..., m) of the ``m`` largest public logits, ``m`` the largest Top-k+ set size over the
    leading dims, or None when that is the whole vocabulary.

    They hold every member of every row's set: a member's public logit is at or above the row's
    threshold and a non-member's below it, so each row's members are its largest entries (ties
    included: a token tied with a member is a member). Which tied non-members fill the remaining
    columns does not matter.
    """
    vocab_size = public64.shape[-1]
    if top_k is None or top_k >= vocab_size or support.numel() == 0:
        return None
    width = int(support.sum(dim=-1).max())
    if width >= vocab_size:
        return None
    return torch.topk(public64, width, dim=-1, sorted=False).indices


def topk_plus_columns(
    public_logits: torch.Tensor, top_k: int | None, clip_norm: float, batch_size: int
) -> torch.Tensor | None:
    r"""Column indices (..., m) that hold every token of every row's Top-k+ set (see :func:`topk_plus_mask`).

    ``m`` is the largest set size over the leading dims; the columns are the ``m`` largest public
    logits of each row. Returns ``None`` when the sets need the whole vocabulary (``top_k=None``,
    ``top_k >= V``, or a band wide enough to take every token). Outside the set every probability is
    exactly zero, so the mechanism restricted to these columns (private and public logits gathered
    with the same indices) gives the same distribution; it recomputes the same set on them, because
    the k-th largest public logit is among them.
    """
    c = _check_clip_norm(clip_norm)
    k = _check_top_k(top_k)
    b = _check_batch_size(batch_size)
    public64 = _check_public(public_logits).to(ACCUMULATION_DTYPE)
    return _support_columns(public64, topk_plus_support(public64, k, c, b), k)


# --------------------------------------------------------------------------------------------
# the exponential mechanism


def top_k_log_softmax(scores: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """log-softmax over each row's own ``top_k`` largest scores (ties at the k-th included, as in the Top-k+
    set), exactly -inf elsewhere; the whole row for ``top_k=None`` or ``top_k >= V``. Plain top-k decoding,
    not a private step: the public-only floor of the planning profile, and the private-top-k mutant of the
    self-test (each dataset's own top-k, which is why that mutant leaks)."""
    if top_k is None or top_k >= scores.shape[-1]:
        return torch.log_softmax(scores, dim=-1)
    kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
    return torch.log_softmax(scores.masked_fill(scores < kth, -math.inf), dim=-1)


def _masked_log_softmax(scores: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """log-softmax over the support; exactly -inf where ``outside`` (log_softmax subtracts the max: stable).

    ``scores`` is a temporary of ours and is overwritten.
    """
    return torch.log_softmax(scores.masked_fill_(outside, -math.inf), dim=-1)


def _scores(public64: torch.Tensor, sums: torch.Tensor, batch_size: int, temperature: float) -> torch.Tensor:
    r"""Exponential-mechanism scores :math:`\phi_{pub}/\tau + S/(B\tau) = \bar\phi/\tau`.

    Paper Eq. (aggregated-logits) divided by the temperature.

    ``sums`` (..., V) or (..., B, V) holds the summed clipped contributions; it is a temporary of
    ours and is overwritten (one fused pass). ``public64`` is the base (zeros for naive clipping).
    """
    base = public64 / temperature
    if sums.ndim > public64.ndim:
        base = base.unsqueeze(-2)
    return torch.add(base, sums, alpha=1.0 / (batch_size * temperature), out=sums)


def _validated_step(private_logits, public_logits, clip_norm, temperature, top_k, clipping):
    c = _check_clip_norm(clip_norm)
    tau = _check_temperature(temperature)
    k = _check_top_k(top_k)
    mode = _check_clipping(clipping)
    if mode is Clipping.NAIVE and k is not None:
        raise ValueError(
            f"top_k must be None with clipping={mode.value!r}: Top-k+ is defined for difference clipping only; "
            f"got top_k={top_k!r}"
        )
    private, public = _check_pair(private_logits, public_logits)
    return private, public, c, tau, k, mode


def _contributions(private, public64, clip_norm, mode):
    """Per-row contributions to the sum, their base, and the contribution of a null (public) row."""
    if mode is Clipping.DIFFERENCE:
        # a null reference has logits exactly φ_pub, so its contribution clip_C(0) is exactly 0.
        return _clipped_differences(private, public64, clip_norm), public64, None
    null = torch.clamp(public64, min=-clip_norm, max=clip_norm).unsqueeze(-2)
    return _naive_contributions(private, clip_norm, False), torch.zeros_like(public64), null


def _scatter(values: torch.Tensor, index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    out = torch.full((*values.shape[:-1], vocab_size), -math.inf, dtype=values.dtype, device=values.device)
    return out.scatter_(-1, index, values)


def _step(private, public, clip_norm, temperature, top_k, mode, with_neighbours):
    """Log-probabilities under R (and under every R'_j): the arithmetic of Algorithm 1, lines 3–5.

    Outside the Top-k+ set every log-probability is -inf whatever the logits, so when the set is
    smaller than the vocabulary the arithmetic runs on its columns only (gathered once: they are
    the top-m public logits, m the largest set size over the leading dims) and is scattered back.
    """
    batch_size, vocab_size = private.shape[-2], private.shape[-1]
    public64 = public.to(ACCUMULATION_DTYPE)
    support = topk_plus_support(public64, top_k, clip_norm, batch_size)
    index = _support_columns(public64, support, top_k)
    if index is not None:
        width = index.shape[-1]
        inside = support.gather(-1, index)
        public64 = public64.gather(-1, index)
        private = private.gather(-1, index.unsqueeze(-2).expand(*private.shape[:-1], width))
    else:
        inside = support
    contributions, base, null = _contributions(private, public64, clip_norm, mode)
    total = contributions.sum(dim=-2)
    removed = None
    if with_neighbours:
        # S'_j = S − c_j (+ the null row's contribution for naive clipping), written over c_j in place
        kept = total if null is None else total + null.squeeze(-2)
        removed = torch.sub(kept.unsqueeze(-2), contributions, out=contributions)
    outside = ~inside
    actual = _masked_log_softmax(_scores(base, total, batch_size, temperature), outside)
    neighbours = None
    if removed is not None:
        neighbours = _masked_log_softmax(_scores(base, removed, batch_size, temperature), outside.unsqueeze(-2))
    if index is not None:
        actual = _scatter(actual, index, vocab_size)
        if neighbours is not None:
            neighbours = _scatter(neighbours, index.unsqueeze(-2).expand(*neighbours.shape[:-1], width), vocab_size)
    return actual, neighbours, support


def support_log_probs(
    private: torch.Tensor, public64: torch.Tensor, inside: torch.Tensor, *, clip_norm: float, temperature: float
) -> torch.Tensor:
    r"""Algorithm 1, lines 3–5, on columns already chosen: the engine's hot path (no checks, no host sync).

    ``private`` (..., B, m) and ``public64`` (..., m, float64) are the logits on ``m`` columns that
    hold every row's Top-k+ set, ``inside`` (..., m) marks its members (:func:`topk_plus_support` on
    the same columns); the result is :func:`token_log_probs` on those columns (exactly ``-inf``
    outside the set), bitwise: the same operations in the same order. Callers validate the
    configuration once (:class:`MechanismConfig`) and check finiteness on the device.
    """
    contributions, base, _ = _contributions(private, public64, clip_norm, Clipping.DIFFERENCE)
    total = contributions.sum(dim=-2)
    return _masked_log_softmax(_scores(base, total, private.shape[-2], temperature), ~inside)


def token_log_probs(
    private_logits: torch.Tensor,
    public_logits: torch.Tensor,
    *,
    clip_norm: float,
    temperature: float,
    top_k: int | None,
    clipping: Clipping | str = Clipping.DIFFERENCE,
) -> torch.Tensor:
    r"""Log-probabilities of the next token under InvisibleInk (paper Algorithm 1, lines 3–5).

    :math:`\log \mathrm{softmax}(\bar\phi[V_k^+]/\tau)` with :math:`\bar\phi` = :func:`dclip_aggregate`
    and :math:`V_k^+` = :func:`topk_plus_mask`; float64 (..., V), exactly ``-inf`` outside the Top-k+
    set, computed with a max-subtracting log-softmax (stable for any finite logits).

    ``clipping=Clipping.NAIVE`` uses :func:`naive_clip_aggregate` instead (baselines and audits;
    requires ``top_k=None``).
    """
    private, public, c, tau, k, mode = _validated_step(
        private_logits, public_logits, clip_norm, temperature, top_k, clipping
    )
    return _step(private, public, c, tau, k, mode, with_neighbours=False)[0]


def neighbour_log_probs(
    private_logits: torch.Tensor,
    public_logits: torch.Tensor,
    *,
    clip_norm: float,
    temperature: float,
    top_k: int | None,
    clipping: Clipping | str = Clipping.DIFFERENCE,
) -> NeighbourLogProbs:
    r"""Next-token log-probabilities under ``R`` and under each replace-by-null neighbour ``R'_j``.

    ``R'_j`` replaces reference ``j`` by the empty string, whose logits are exactly the public row
    (paper §3, replace-by-null adjacency), so its step distribution follows from the same logits
    without another forward pass. Vectorised over ``j``: with :math:`S = \sum_i c_i` the sum of
    clipped contributions, the neighbour's aggregate is :math:`\phi_{pub} + (S - c_j)/B` (DClip: a
    null row contributes exactly 0) or :math:`(S - c_j + \mathrm{clip}_C(\phi_{pub}))/B` (naive).
    The Top-k+ set is shared (it depends on the public row only).

    ``result.actual`` is bitwise identical to :func:`token_log_probs` on the same input.
    """
    private, public, c, tau, k, mode = _validated_step(
        private_logits, public_logits, clip_norm, temperature, top_k, clipping
    )
    actual, neighbours, support = _step(private, public, c, tau, k, mode, with_neighbours=True)
    return NeighbourLogProbs(actual=actual, neighbours=neighbours, support=support)


# --------------------------------------------------------------------------------------------
# sampling


class _KeyedGenerator(torch.Generator):
    """A ``torch.Generator`` from :func:`make_generator`, carrying its 128-bit key (from the OS, or the seed),
    and how many runs have drawn from it. torch's CPU generator keeps only 32 bits of a
    seed, so the engine takes its randomness from this key, not from the generator's state (:func:`run_key`).
    The key lives on the object: CUDA generators of some torch builds (2.11) cannot be weakly referenced, so
    a side table keyed by generator would fail there."""

    key: int
    runs: int

    @classmethod
    def make(cls, device: torch.device | str, key: int) -> _KeyedGenerator:
        generator = cls(device=device)
        generator.key, generator.runs = key, 0
        return generator


#: The largest fixed seed: ``torch.Generator.manual_seed`` takes 64 bits.
MAX_SEED = 2**64 - 1


def check_seed(seed) -> int | None:
    """``seed`` when it is ``None`` or an integer in ``[0, MAX_SEED]`` (what ``torch.Generator.manual_seed``
    takes), else a ``ValueError``; every release checks it before anything is loaded or charged."""
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED
    ):
        raise ValueError(f"seed must be an integer in [0, 2**64 - 1] or None; got {seed!r}")
    return seed


def make_generator(seed: int | None = None, *, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device``, seeded from the OS (``secrets``) unless ``seed`` is given.

    A fixed ``seed`` makes the output reproducible and therefore *not private*; it is meant for tests
    and audits, and it emits a :class:`SeededGeneratorWarning` saying so. The generator also carries a
    128-bit key (from the OS, or the seed) for :func:`run_key`: torch's CPU generator keeps only 32
    bits of its seed, too few to key private sampling.
    """
    if seed is None:
        key = secrets.randbits(128)
        generator = _KeyedGenerator.make(device, key)
        generator.manual_seed(key >> 65)
    else:
        check_seed(seed)
        warnings.warn(
            f"sampling with a fixed seed ({seed}) is reproducible: seeded outputs carry no privacy guarantee",
            SeededGeneratorWarning,
            stacklevel=2,
        )
        generator = _KeyedGenerator.make(device, int(seed))
        generator.manual_seed(int(seed))
    return generator


def run_key(generator: torch.Generator) -> int:
    """A fresh 128-bit key for one sampling run, derived from ``generator``.

    For a generator from :func:`make_generator`: BLAKE2b of its 128-bit key and a per-generator run
    counter (each call gives another key; a seeded generator gives the same sequence of keys). For any
    other generator, 128 bits drawn from it, so its entropy is that of its seed (32 bits for torch's CPU
    generator: use :func:`make_generator` for private sampling).
    """
    if not isinstance(generator, _KeyedGenerator):
        words = torch.randint(0, 2**32, (4,), generator=generator, device=generator.device).tolist()
        return sum(int(w) << (32 * i) for i, w in enumerate(words))
    generator.runs += 1
    return derive_key(generator.key, generator.runs)


def derive_key(key: int, *labels: int) -> int:
    """A 128-bit key for ``labels`` under ``key`` (BLAKE2b-128 of their decimal digits): independent
    streams for every (run, text)."""
    text = ":".join(str(int(part)) for part in (key, *labels))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=16).digest(), "little")


def gumbel_argmax(log_probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    r"""The Gumbel-max draw of :func:`sample_tokens` from given uniforms (same shape, float64): no checks.

    ``uniform`` is overwritten (it becomes :math:`-G = \log(-\log U)`). The engine draws each text's
    uniforms from that text's own stream, so a text's tokens do not depend on which texts share its batch.
    """
    # in place on our own draw: U → log(−log U) = −G, so the score log p − log(−log U) is log p + G
    uniform.clamp_(*_UNIFORM_RANGE).log_().neg_().log_()
    return torch.argmax(torch.sub(log_probs, uniform, out=uniform), dim=-1)


def sample_tokens(log_probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    r"""Draw one token per row of ``log_probs`` (..., V) → int64 (...), with the injected ``generator``.

    Gumbel-max sampling: :math:`\arg\max_y (\log p(y) + G_y)` with :math:`G_y = -\log(-\log U_y)`
    i.i.d. standard Gumbel is an exact draw from :math:`p \propto \exp(\log p)` (Gumbel 1954;
    Maddison et al. 2014). ``log_probs`` may be unnormalised log-weights; ``-inf`` entries are never drawn
    (the noise is always finite). Batched over all leading dimensions in one call; stays on the
    input's device. ``generator`` must be on the same device (see :func:`make_generator`).
    """
    lp = _check_tensor("log_probs", log_probs, min_ndim=1)
    if not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator; got {type(generator).__name__}")
    if generator.device.type != lp.device.type:
        raise ValueError(f"generator is on {generator.device} but log_probs is on {lp.device}")
    # one reduction pass: the row maximum is NaN if the row has a NaN, +inf if it has +inf, and
    # -inf if the row has no finite entry (empty support)
    row_max = lp.amax(dim=-1)
    if not bool(torch.isfinite(row_max).all()):
        if bool(torch.isnan(row_max).any()):
            raise ValueError("log_probs must not contain NaN")
        if bool(torch.isposinf(row_max).any()):
            raise ValueError("log_probs must not contain +inf")
        raise ValueError("every row of log_probs must have at least one finite entry (a non-empty support)")
    uniform = torch.rand(lp.shape, dtype=ACCUMULATION_DTYPE, device=lp.device, generator=generator)
    return gumbel_argmax(lp, uniform)
