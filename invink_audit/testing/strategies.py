"""Hypothesis strategies for logit tensors, neighbouring reference sets and privacy parameters.

Everything here draws small tensors (CPU by default) meant for property tests of aggregation
functions, truncation sets and token samplers. Values mix integers (which produce exact ties and
exact arithmetic) with arbitrary floats; private rows mix fresh logits, small perturbations of the
public row (so that clipping is sometimes inactive) and exact copies of it (null references).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from hypothesis import strategies as st

from accounting.sensitivity import Adjacency
from invink_audit.mechanism import MechanismConfig

__all__ = [
    "DEFAULT_LOGIT_BOUND",
    "LogitBatch",
    "NeighbourPair",
    "PrivacyBudget",
    "clip_norms",
    "logit_batches",
    "logits",
    "mechanism_configs",
    "neighbour_pairs",
    "neighbour_private_logits",
    "privacy_budgets",
    "temperatures",
    "top_ks",
    "topk_cases",
]

#: default range of generated logit values, [-DEFAULT_LOGIT_BOUND, DEFAULT_LOGIT_BOUND]
DEFAULT_LOGIT_BOUND = 30.0

# spreads of the "near the public row" private rows: 0 gives exact copies (null references)
_SPREADS = (0.0, 1e-3, 0.1, 0.5, 2.0, 8.0)


@dataclasses.dataclass(frozen=True)
class LogitBatch:
    """One decoding step's logits: ``private_logits`` (..., B, V) and ``public_logits`` (..., V)."""

    private_logits: torch.Tensor
    public_logits: torch.Tensor

    def __post_init__(self) -> None:
        p, q = self.private_logits, self.public_logits
        if p.ndim < 2 or p.shape[:-2] != q.shape[:-1] or p.shape[-1] != q.shape[-1]:
            raise ValueError(
                f"private_logits (..., B, V) and public_logits (..., V) do not match: {tuple(p.shape)}, {tuple(q.shape)}"
            )

    @property
    def batch_size(self) -> int:
        """``B``, the number of private rows."""
        return self.private_logits.shape[-2]

    @property
    def vocab_size(self) -> int:
        """``V``."""
        return self.private_logits.shape[-1]


@dataclasses.dataclass(frozen=True)
class NeighbourPair:
    """Two adjacent steps: ``neighbour`` is ``original`` with private row ``index`` nulled per ``adjacency``."""

    original: LogitBatch
    neighbour: LogitBatch
    index: int
    adjacency: Adjacency


@dataclasses.dataclass(frozen=True)
class PrivacyBudget:
    """An (ε, δ) target, validated: ``epsilon > 0`` finite, ``0 < delta < 1``."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.epsilon) and self.epsilon > 0):
            raise ValueError(f"epsilon must be a positive finite number; got {self.epsilon!r}")
        if not (0 < self.delta < 1):
            raise ValueError(f"delta must be in (0, 1); got {self.delta!r}")


def neighbour_private_logits(
    private_logits: torch.Tensor,
    public_logits: torch.Tensor,
    index: int,
    *,
    adjacency: Adjacency = Adjacency.REPLACE_BY_NULL,
) -> torch.Tensor:
    """Neighbour ``index`` of ``private_logits`` (..., B, V), a new tensor (inputs are not modified).

    Replace-by-null: the row becomes the public row (the empty reference's logits are exactly the
    public logits; paper App. B.1, replace-by-null adjacency). Zero-out: the row becomes 0 (App. B.1,
    zero-out adjacency). Add-remove: the row is removed, (..., B - 1, V).
    """
    adjacency = Adjacency(adjacency)
    batch_size = private_logits.shape[-2]
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < batch_size:
        raise ValueError(f"index must be an integer in [0, {batch_size}); got {index!r}")
    if adjacency is Adjacency.ADD_REMOVE:
        return torch.cat([private_logits[..., :index, :], private_logits[..., index + 1:, :]], dim=-2)
    out = private_logits.clone()
    if adjacency is Adjacency.REPLACE_BY_NULL:
        out[..., index, :] = public_logits.to(out.dtype)
    else:
        out[..., index, :] = 0
    return out


def logits(
    shape: tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    min_value: float = -DEFAULT_LOGIT_BOUND,
    max_value: float = DEFAULT_LOGIT_BOUND,
    device: torch.device | str = "cpu",
) -> st.SearchStrategy[torch.Tensor]:
    """Finite logit tensors of ``shape`` and ``dtype`` with values in ``[min_value, max_value]``.

    Values are a mix of integers (exact ties, exact arithmetic) and arbitrary floats, rounded to
    ``dtype`` (float16 / bfloat16 / float32 / float64).
    """
    if not (math.isfinite(min_value) and math.isfinite(max_value) and min_value <= max_value):
        raise ValueError(f"need finite min_value <= max_value; got {min_value!r}, {max_value!r}")
    size = math.prod(shape)
    integers = st.integers(math.ceil(min_value), math.floor(max_value)).map(float)
    floats = st.floats(min_value, max_value, allow_nan=False, allow_infinity=False)
    element = st.one_of(integers, floats) if math.ceil(min_value) <= math.floor(max_value) else floats
    return st.lists(element, min_size=size, max_size=size).map(
        lambda values: torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype=dtype, device=device)
    )


@st.composite
def logit_batches(
    draw,
    *,
    batch_sizes: st.SearchStrategy[int] = st.integers(1, 6),
    vocab_sizes: st.SearchStrategy[int] = st.integers(1, 10),
    leading_shapes: st.SearchStrategy[tuple[int, ...]] = st.just(()),
    dtypes: st.SearchStrategy[torch.dtype] = st.just(torch.float32),
    max_abs_logit: float = DEFAULT_LOGIT_BOUND,
    device: torch.device | str = "cpu",
) -> LogitBatch:
    """A :class:`LogitBatch` with B from ``batch_sizes``, V from ``vocab_sizes``, leading dims from ``leading_shapes``.

    Each private row is, independently, fresh logits, the public row plus a perturbation of a drawn
    spread, or an exact copy of the public row.
    """
    batch_size, vocab_size, lead, dtype = draw(batch_sizes), draw(vocab_sizes), tuple(draw(leading_shapes)), draw(dtypes)
    public = draw(logits(lead + (vocab_size,), dtype=torch.float64, min_value=-max_abs_logit, max_value=max_abs_logit))
    rows = []
    for _ in range(batch_size):
        if draw(st.booleans()):
            rows.append(draw(logits(lead + (vocab_size,), dtype=torch.float64, min_value=-max_abs_logit, max_value=max_abs_logit)))
        else:
            spread = draw(st.sampled_from(_SPREADS))
            offset = draw(logits(lead + (vocab_size,), dtype=torch.float64, min_value=-spread, max_value=spread))
            rows.append((public + offset).clamp(-max_abs_logit, max_abs_logit))
    private = torch.stack(rows, dim=-2)
    return LogitBatch(private.to(dtype=dtype, device=device), public.to(dtype=dtype, device=device))


@st.composite
def neighbour_pairs(draw, *, adjacency: Adjacency = Adjacency.REPLACE_BY_NULL, **batch_kwargs) -> NeighbourPair:
    """A :class:`NeighbourPair`: a :func:`logit_batches` draw and its neighbour at a drawn index."""
    batch = draw(logit_batches(**batch_kwargs))
    index = draw(st.integers(0, batch.batch_size - 1))
    private = neighbour_private_logits(batch.private_logits, batch.public_logits, index, adjacency=adjacency)
    return NeighbourPair(batch, LogitBatch(private, batch.public_logits), index, Adjacency(adjacency))


def clip_norms(min_value: float = 1e-3, max_value: float = 20.0) -> st.SearchStrategy[float]:
    """Clip norms ``C`` in ``[min_value, max_value]``, with a few exact dyadic values mixed in."""
    nice = [c for c in (0.0625, 0.25, 0.5, 1.0, 2.0, 4.0) if min_value <= c <= max_value]
    floats = st.floats(min_value, max_value, allow_nan=False, allow_infinity=False)
    return st.one_of(st.sampled_from(nice), floats) if nice else floats


def temperatures(min_value: float = 0.05, max_value: float = 5.0) -> st.SearchStrategy[float]:
    """Sampling temperatures ``τ`` in ``[min_value, max_value]``."""
    return st.one_of(st.just(1.0), st.floats(min_value, max_value, allow_nan=False, allow_infinity=False)).filter(
        lambda t: min_value <= t <= max_value
    )


def top_ks(max_value: int = 12) -> st.SearchStrategy[int | None]:
    """``top_k`` values: ``None`` (full vocabulary) or an integer in ``[1, max_value]``."""
    return st.one_of(st.none(), st.integers(1, max_value))


@st.composite
def mechanism_configs(
    draw,
    *,
    batch_sizes: st.SearchStrategy[int] = st.integers(1, 6),
    clip_norms: st.SearchStrategy[float] = clip_norms(),  # defaults use the module-level strategies
    temperatures: st.SearchStrategy[float] = temperatures(),
    top_ks: st.SearchStrategy[int | None] = top_ks(),
) -> MechanismConfig:
    """A valid :class:`~invink_audit.mechanism.MechanismConfig` (difference clipping)."""
    return MechanismConfig(clip_norm=draw(clip_norms), temperature=draw(temperatures), top_k=draw(top_ks),
                           batch_size=draw(batch_sizes))


def privacy_budgets(
    *,
    min_epsilon: float = 0.01,
    max_epsilon: float = 20.0,
    min_delta: float = 1e-12,
    max_delta: float = 1e-3,
) -> st.SearchStrategy[PrivacyBudget]:
    """(ε, δ) targets; δ is drawn log-uniformly-ish as ``10**u`` with ``u`` uniform."""
    if not (0 < min_epsilon <= max_epsilon and math.isfinite(max_epsilon)):
        raise ValueError(f"need 0 < min_epsilon <= max_epsilon < inf; got {min_epsilon!r}, {max_epsilon!r}")
    if not (0 < min_delta <= max_delta < 1):
        raise ValueError(f"need 0 < min_delta <= max_delta < 1; got {min_delta!r}, {max_delta!r}")
    epsilons = st.floats(min_epsilon, max_epsilon, allow_nan=False, allow_infinity=False)
    exponents = st.floats(math.log10(min_delta), math.log10(max_delta), allow_nan=False, allow_infinity=False)
    deltas = exponents.map(lambda u: min(max(10.0**u, min_delta), max_delta))
    return st.builds(PrivacyBudget, epsilons, deltas)


def _tight_topk_batch(draw, batch_size, vocab_size, lead, clip_norm):
    """Near-worst case of the superset argument: row 0 pulls the top-k down by C/B and lifts token y by C/B."""
    top_k = draw(st.integers(1, vocab_size - 1))
    unit = clip_norm / batch_size
    level = draw(st.one_of(st.just(0.0), st.floats(-10.0, 10.0, allow_nan=False)))
    # y sits a fraction f of the band 2C/B below ℓ_k: it is in row 0's top-k for every f <= 1
    fraction = draw(st.one_of(st.just(1.0), st.floats(0.5, 1.0, allow_nan=False)))
    order = draw(st.permutations(range(vocab_size)))
    public = torch.full((vocab_size,), level - 4 * unit, dtype=torch.float64)
    offset = torch.full((vocab_size,), -2 * clip_norm, dtype=torch.float64)
    for rank in range(top_k):
        public[order[rank]] = level
    y = order[top_k]
    public[y] = level - fraction * 2 * unit
    offset[y] = 2 * clip_norm
    rows = [public + offset] + [public.clone() for _ in range(batch_size - 1)]
    private = torch.stack(rows, dim=-2).expand(*lead, batch_size, vocab_size).clone()
    return private, public.expand(*lead, vocab_size).clone(), top_k


@st.composite
def topk_cases(
    draw,
    *,
    batch_sizes: st.SearchStrategy[int] = st.integers(1, 6),
    vocab_sizes: st.SearchStrategy[int] = st.integers(1, 10),
    leading_shapes: st.SearchStrategy[tuple[int, ...]] = st.just(()),
    dtypes: st.SearchStrategy[torch.dtype] = st.just(torch.float32),
    clip_norms: st.SearchStrategy[float] = clip_norms(),
) -> tuple[LogitBatch, float, int | None]:
    """``(batch, clip_norm, top_k)`` for truncation-set properties, two thirds of them adversarial.

    ``top_k`` is ``None`` (full vocabulary) or an integer in ``[1, V]``, mostly below ``V``. Three
    kinds of case, drawn with equal probability:

    * generic: :func:`logit_batches`;
    * scaled: drawn in units of the clipped contribution ``C/B``: public logits in ``[-6, 6]·C/B``
      (integers included, so values fall exactly on ``ℓ_k - m·C/B`` boundaries) and private rows
      at offsets in ``[-2C, 2C]`` from the public row, so that clipping often saturates;
    * tight: the worst case of the superset argument (paper §4, Eq. (topkplus)): one row lowers the
      public top-k by ``C/B`` and lifts a token sitting a fraction ``f ∈ [1/2, 1]`` of ``2C/B``
      below ``ℓ_k`` by ``C/B``, putting it in that row's top-k. Any band narrower than ``2C/B``
      misses it for ``f`` close to 1.

    Logits drawn independently of ``C`` rarely land where a superset is tight.
    """
    clip_norm = draw(clip_norms)
    kind = draw(st.sampled_from(["generic", "scaled", "tight"]))
    batch_size, vocab_size, lead, dtype = draw(batch_sizes), draw(vocab_sizes), tuple(draw(leading_shapes)), draw(dtypes)
    if kind == "tight" and vocab_size >= 2:
        private, public, top_k = _tight_topk_batch(draw, batch_size, vocab_size, lead, clip_norm)
        return LogitBatch(private.to(dtype), public.to(dtype)), clip_norm, top_k
    if kind == "scaled":
        shape = lead + (vocab_size,)
        unit = clip_norm / batch_size
        public = draw(logits(shape, dtype=torch.float64, min_value=-6.0, max_value=6.0)) * unit
        rows = [
            public + draw(logits(shape, dtype=torch.float64, min_value=-2.0, max_value=2.0)) * clip_norm
            for _ in range(batch_size)
        ]
        batch = LogitBatch(torch.stack(rows, dim=-2).to(dtype), public.to(dtype))
    else:
        batch = draw(logit_batches(batch_sizes=st.just(batch_size), vocab_sizes=st.just(vocab_size),
                                   leading_shapes=st.just(lead), dtypes=st.just(dtype)))
    top_k = draw(st.one_of(st.none(), st.integers(1, vocab_size), st.integers(1, max(1, vocab_size - 1))))
    return batch, clip_norm, top_k
