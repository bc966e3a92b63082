r"""An independent, pure-Python oracle of one InvisibleInk step, for small vocabularies.

Written straight from the paper (Algorithm 1, Eq. (aggregated-logits), ``ExpandedTopVocabulary``), without torch:
the aggregate and the Top-k+ set are computed in exact rational arithmetic (``fractions.Fraction``;
every float is a rational), the log-softmax with ``math`` and a compensated sum. It shares no code
with :mod:`invink_audit.mechanism`, so agreement between the two is evidence, not tautology. It is
slow (O(B·V) Fractions) and meant for ``V`` up to a few hundred.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

__all__ = [
    "reference_aggregate",
    "reference_private_topk_sets",
    "reference_token_log_probs",
    "reference_topk_plus_set",
]


def _clip(x: Fraction, c: Fraction) -> Fraction:
    return max(-c, min(c, x))


def _rows(values) -> list[list[Fraction]]:
    return [[Fraction(float(v)) for v in row] for row in values]


def reference_aggregate(
    private_logits: Sequence[Sequence[float]], public_logits: Sequence[float], clip_norm: float
) -> list[Fraction]:
    r"""Exact :math:`\phi_{pub} + \frac1B\sum_i \mathrm{clip}_C(\phi_i - \phi_{pub})` for one step
    (paper Eq. (aggregated-logits))."""
    pub = [Fraction(float(v)) for v in public_logits]
    rows = _rows(private_logits)
    c = Fraction(float(clip_norm))
    b = len(rows)
    return [pub[y] + sum(_clip(row[y] - pub[y], c) for row in rows) / b for y in range(len(pub))]


def reference_topk_plus_set(
    public_logits: Sequence[float], top_k: int | None, clip_norm: float, batch_size: int
) -> frozenset[int]:
    r"""Exact :math:`\{y : \phi_{pub}(y) \ge \ell_k - 2C/B\}` (Algorithm 1, ``ExpandedTopVocabulary``)."""
    pub = [Fraction(float(v)) for v in public_logits]
    if top_k is None or top_k >= len(pub):
        return frozenset(range(len(pub)))
    kth = sorted(pub, reverse=True)[top_k - 1]
    threshold = kth - 2 * Fraction(float(clip_norm)) / batch_size
    return frozenset(y for y, v in enumerate(pub) if v >= threshold)


def reference_private_topk_sets(
    private_logits: Sequence[Sequence[float]],
    public_logits: Sequence[float],
    top_k: int | None,
    clip_norm: float,
    *,
    tolerance: float = 0.0,
) -> dict[int, frozenset[int]]:
    r"""Exact top-k sets of every :math:`\phi_i^{clip}`, over all tie-breaks (paper §4): ``{i: set}``.

    :math:`\phi_i^{clip} = \phi_{pub} + \mathrm{clip}_C(\phi_i - \phi_{pub})/B`. With
    ``tolerance = 0`` a token is in some top-k set of a vector iff fewer than ``k`` entries are
    strictly larger than its own. With ``tolerance = t > 0`` only tokens that stay in some top-k set
    under every perturbation of the entries by at most ``t`` are kept, i.e. fewer than ``k`` other
    entries exceed its value minus ``2t`` (for mechanisms that round at the ``t`` level).
    ``top_k=None`` means ``k = V``.
    """
    pub = [Fraction(float(v)) for v in public_logits]
    rows = _rows(private_logits)
    c = Fraction(float(clip_norm))
    margin = 2 * Fraction(float(tolerance))
    b = len(rows)
    k = len(pub) if top_k is None else top_k
    sets: dict[int, frozenset[int]] = {}
    for i, row in enumerate(rows):
        contribution = [pub[y] + _clip(row[y] - pub[y], c) / b for y in range(len(pub))]
        sets[i] = frozenset(
            y
            for y, v in enumerate(contribution)
            if sum(1 for z, w in enumerate(contribution) if z != y and w > v - margin) < k
        )
    return sets


def reference_token_log_probs(
    private_logits: Sequence[Sequence[float]],
    public_logits: Sequence[float],
    *,
    clip_norm: float,
    temperature: float,
    top_k: int | None,
) -> list[float]:
    r"""Log-probabilities of one InvisibleInk step (Algorithm 1, lines 2–5); ``-inf`` outside Top-k+.

    ``private_logits``: B rows of V floats; ``public_logits``: V floats; one step, no leading dims.
    """
    aggregate = reference_aggregate(private_logits, public_logits, clip_norm)
    support = reference_topk_plus_set(public_logits, top_k, clip_norm, len(private_logits))
    scores = {y: float(aggregate[y]) / float(temperature) for y in support}
    top = max(scores.values())
    log_normaliser = top + math.log(math.fsum(math.exp(s - top) for s in scores.values()))
    return [scores[y] - log_normaliser if y in scores else -math.inf for y in range(len(aggregate))]
