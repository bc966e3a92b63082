r"""AugPE's DP nearest-neighbour histogram and the selection that follows it (numpy only).

Xie et al. 2024 (arXiv:2403.01749), Alg. 1, as the official implementation runs it (``AI-secure/aug-pe`` at
a3f292f; ``dpsda/dp_counter.py``, ``dp_nn_histogram``; its line numbers: docs/guide/baselines.md, §"AugPE"): each
private reference votes for its nearest candidate in Euclidean distance (ties to the **lowest candidate index**;
the paper leaves them "arbitrary"), every count gets Gaussian noise of standard deviation ``noise_std`` σ
(:mod:`accounting.augpe`), counts are thresholded at H, ``max(count − H, 0)``, and ``num_selected`` candidates are
kept (:class:`Selection`).

Privacy. A reference's vote is a function of that reference's embedding and the public candidates only (the
nearest-neighbour search treats each reference alone, whatever floating-point rounding does to near ties), so
replacing one reference by the empty text moves at most one vote: two counts change by at most 1 each, ℓ2
sensitivity √2 (paper Property prop:augpe-sens; tested by enumeration in ``tests/test_augpe_histogram.py``).
Everything after the noise (threshold, selection) is post-processing.
"""

from __future__ import annotations

import enum
import math

import numpy as np

from accounting.limits import check_count, check_nonnegative, check_positive
from accounting.sensitivity import coerce_enum

__all__ = [
    "Selection",
    "dp_nn_histogram",
    "nearest_neighbour_votes",
    "noisy_counts",
    "select_candidates",
    "vote_counts",
]

#: References per block of the nearest-neighbour search: a block's score matrix is BLOCK × candidates doubles.
_BLOCK = 1024


class Selection(enum.Enum):
    """How the next iteration's texts are chosen from the noisy histogram (``main.py`` l. 235–250): ``RANK`` keeps the
    largest noisy counts (the official scripts' ``select_syn_mode=rank``; ties to the lower index, as its stable
    ``sorted``); ``PROBABILITY`` draws with replacement in proportion to them (its ``prob`` mode; Private Evolution's
    Alg. 1, Lin et al. 2024), uniformly when every thresholded count is 0 (the official code stops on an ``assert``;
    a function of the released histogram only)."""

    RANK = "rank"  # the largest noisy counts (official scripts' select_syn_mode=rank)
    PROBABILITY = "probability"  # with replacement, proportional to the noisy counts (select_syn_mode=prob)


def _embedding_matrix(name: str, values, *, allow_empty: bool) -> np.ndarray:
    matrix = np.asarray(values, dtype=np.float64)
    if matrix.ndim != 2 or (matrix.shape[0] == 0 and not allow_empty) or matrix.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-d array (texts × dimensions); got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise ValueError(f"{name} must be finite (an embedding holds NaN or inf)")
    return matrix


def nearest_neighbour_votes(reference_embeddings, candidate_embeddings) -> np.ndarray:
    r"""For each reference, the index of its nearest candidate in Euclidean distance; ties to the lowest index.

    Computed as :math:`\arg\min_j \|c_j\|^2 - 2\langle r, c_j\rangle` (the reference's own :math:`\|r\|^2` does not
    change the order) in float64, in blocks of references. Exact for embeddings whose products are exact in
    float64 (small integers: the tests' ties); for others the rounding decides near ties, still one reference at
    a time (module docstring, "Privacy").
    """
    references = _embedding_matrix("reference_embeddings", reference_embeddings, allow_empty=True)
    candidates = _embedding_matrix("candidate_embeddings", candidate_embeddings, allow_empty=False)
    if references.shape[0] and references.shape[1] != candidates.shape[1]:
        raise ValueError(
            f"references have {references.shape[1]} dimensions but candidates {candidates.shape[1]}: one embedder for both"
        )
    squared_norms = np.einsum("ij,ij->i", candidates, candidates)
    votes = np.empty(references.shape[0], dtype=np.int64)
    for start in range(0, references.shape[0], _BLOCK):
        block = references[start : start + _BLOCK]
        scores = squared_norms[None, :] - 2.0 * (block @ candidates.T)
        votes[start : start + _BLOCK] = np.argmin(scores, axis=1)  # first minimum: the lowest index
    return votes


def vote_counts(votes, num_candidates: int) -> np.ndarray:
    """The histogram H of paper Eq. (eq:hiso-augpe): how many references voted for each candidate (int64)."""
    num_candidates = check_count("num_candidates", num_candidates)
    votes = np.asarray(votes)
    in_range = votes.size == 0 or (votes.dtype.kind in "iu" and votes.min() >= 0 and votes.max() < num_candidates)
    if votes.ndim != 1 or not in_range:
        raise ValueError(f"votes must be candidate indices in [0, {num_candidates}); got {votes!r}")
    return np.bincount(votes.astype(np.int64), minlength=num_candidates).astype(np.int64)


def noisy_counts(counts, noise_std: float, threshold: float, rng: np.random.Generator) -> np.ndarray:
    r"""The released histogram: :math:`\max(H + \mathcal N(0, \sigma^2 I) - H_{thr}, 0)` (``dp_counter.py`` l. 53–59).

    ``noise_std`` σ is the noise's standard deviation in counts (:class:`accounting.AugPEEvent`), ``threshold``
    the official ``--count_threshold`` H (0 keeps every positive noisy count). ``rng`` draws the noise. ``counts``
    may be 2-d, one row per independent release (an audit's trials), drawn in row order.
    """
    counts = np.asarray(counts, dtype=np.float64)
    noise_std = check_positive("noise_std", noise_std)
    threshold = check_nonnegative("threshold", threshold)
    if counts.ndim not in (1, 2) or counts.size == 0:
        raise ValueError(f"counts must be a non-empty 1-d (or 2-d: one row per release) array; got shape {counts.shape}")
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator; got {type(rng).__name__}")
    noisy = counts + noise_std * rng.standard_normal(counts.shape)
    return np.maximum(noisy - threshold, 0.0)


def select_candidates(noisy, num_selected: int, selection: Selection | str, rng: np.random.Generator) -> np.ndarray:
    """Indices of the next iteration's texts from the released histogram ``noisy`` (:class:`Selection`)."""
    noisy = np.asarray(noisy, dtype=np.float64)
    num_selected = check_count("num_selected", num_selected)
    selection = coerce_enum(selection, Selection)
    if noisy.ndim != 1 or noisy.size == 0 or not np.all(np.isfinite(noisy)) or np.any(noisy < 0):
        raise ValueError("noisy must be a non-empty 1-d array of finite counts >= 0 (the thresholded histogram)")
    if selection is Selection.RANK:
        if num_selected > noisy.size:
            raise ValueError(f"num_selected={num_selected} exceeds the {noisy.size} candidates (rank keeps distinct ones)")
        return np.argsort(-noisy, kind="stable")[:num_selected]  # equal counts: the lower index first
    total = math.fsum(noisy.tolist())
    probabilities = noisy / total if total > 0 else np.full(noisy.size, 1.0 / noisy.size)
    return rng.choice(noisy.size, size=num_selected, replace=True, p=probabilities)


def dp_nn_histogram(
    reference_embeddings, candidate_embeddings, noise_std: float, threshold: float, rng: np.random.Generator
) -> np.ndarray:
    """The votes, their counts, the Gaussian noise and the threshold (module docstring). The one function that reads
    the private references' embeddings; what it returns is the mechanism's release."""
    candidates = _embedding_matrix("candidate_embeddings", candidate_embeddings, allow_empty=False)
    votes = nearest_neighbour_votes(reference_embeddings, candidates)
    return noisy_counts(vote_counts(votes, candidates.shape[0]), noise_std, threshold, rng)
