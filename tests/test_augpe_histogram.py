"""AugPE's DP nearest-neighbour histogram (invink_audit.augpe.histogram): votes against a brute-force loop (ties
included), the sensitivity by enumeration over every reference nulled, the noise, the threshold and the selection."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from accounting import AugPESensitivity, augpe_l2_sensitivity
from invink_audit.augpe import (
    Selection,
    dp_nn_histogram,
    nearest_neighbour_votes,
    noisy_counts,
    select_candidates,
    vote_counts,
)

#: relative tolerance of the empirical noise std over NOISE_DRAWS draws (its standard error is about 0.2%)
NOISE_DRAWS = 200_000
NOISE_STD_RTOL = 0.01


def brute_force_votes(references, candidates):
    """Pure-Python nearest neighbour: squared Euclidean distance pair by pair, the first minimum kept."""
    votes = []
    for r in references.tolist():
        best, best_distance = None, math.inf
        for j, c in enumerate(candidates.tolist()):
            distance = sum((a - b) ** 2 for a, b in zip(r, c))
            if distance < best_distance:  # strict: an equal distance keeps the lower index
                best, best_distance = j, distance
        votes.append(best)
    return np.array(votes)


def brute_force_counts(votes, num_candidates):
    counts = [0] * num_candidates
    for v in votes:
        counts[v] += 1
    return np.array(counts)


def lattice(rng, rows, dims=3, values=3):
    """Points on a small integer lattice: many exact ties, all distances exact in float64."""
    return rng.integers(0, values, size=(rows, dims)).astype(np.float64)


@pytest.mark.parametrize("seed", range(6))
def test_votes_are_the_brute_force_nearest_neighbours(seed):
    rng = np.random.default_rng(seed)
    references, candidates = rng.normal(size=(60, 7)), rng.normal(size=(17, 7))
    votes = nearest_neighbour_votes(references, candidates)
    assert votes.tolist() == brute_force_votes(references, candidates).tolist()
    assert vote_counts(votes, 17).tolist() == brute_force_counts(votes, 17).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_ties_go_to_the_lowest_index(seed):
    rng = np.random.default_rng(100 + seed)
    references, candidates = lattice(rng, 80), lattice(rng, 12)
    candidates[5] = candidates[2]  # duplicates: every reference nearest to them picks 2, never 5
    votes = nearest_neighbour_votes(references, candidates)
    assert votes.tolist() == brute_force_votes(references, candidates).tolist()
    assert 5 not in votes.tolist()
    # a reference exactly between two candidates (distance 1 to both) votes for the lower index
    assert nearest_neighbour_votes([[0.0, 0.0]], [[1.0, 0.0], [0.0, 5.0], [-1.0, 0.0]]).tolist() == [0]
    assert nearest_neighbour_votes([[0.0, 0.0]], [[3.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]).tolist() == [1]


def test_blocks_do_not_change_the_votes(monkeypatch):
    rng = np.random.default_rng(7)
    references, candidates = rng.normal(size=(50, 4)), rng.normal(size=(9, 4))
    whole = nearest_neighbour_votes(references, candidates)
    monkeypatch.setattr("invink_audit.augpe.histogram._BLOCK", 7)
    assert nearest_neighbour_votes(references, candidates).tolist() == whole.tolist()
    assert nearest_neighbour_votes(np.empty((0, 4)), candidates).tolist() == []  # no references, no votes


def _null_neighbour_changes(references, candidates, null):
    """For every reference j: the count change when j is replaced by ``null``, and when j is removed."""
    counts = vote_counts(nearest_neighbour_votes(references, candidates), len(candidates))
    for j in range(len(references)):
        nulled = references.copy()
        nulled[j] = null
        removed = np.delete(references, j, axis=0)
        yield (vote_counts(nearest_neighbour_votes(nulled, candidates), len(candidates)) - counts,
               vote_counts(nearest_neighbour_votes(removed, candidates), len(candidates)) - counts)  # fmt: skip


@pytest.mark.parametrize("kind", ["gaussian", "lattice"])
@pytest.mark.parametrize("seed", range(4))
def test_a_nulled_reference_moves_at_most_one_vote(kind, seed):
    rng = np.random.default_rng(200 + seed)
    make = (lambda rows: rng.normal(size=(rows, 5))) if kind == "gaussian" else (lambda rows: lattice(rng, rows, 5))
    references, candidates, null = make(30), make(11), make(1)[0]  # `null`: the empty text's embedding
    moved_two = False
    for replaced, removed in _null_neighbour_changes(references, candidates, null):
        # paper Property prop:augpe-sens: replace-by-null changes at most two counts, each by at most 1
        assert np.count_nonzero(replaced) <= 2 and np.abs(replaced).max() <= 1 and replaced.sum() == 0
        assert np.linalg.norm(replaced) <= augpe_l2_sensitivity(AugPESensitivity.REPLACE_BY_NULL) + 1e-12
        # ... and add-or-remove exactly one count by 1
        assert np.count_nonzero(removed) == 1 and removed.sum() == -1
        assert np.linalg.norm(removed) <= augpe_l2_sensitivity(AugPESensitivity.ADD_OR_REMOVE)
        moved_two |= np.count_nonzero(replaced) == 2
    assert moved_two  # the sqrt(2) is attained: the paper's convention (1) understates it


@given(st.lists(st.lists(st.integers(-2, 2), min_size=2, max_size=2), min_size=1, max_size=12),
       st.lists(st.lists(st.integers(-2, 2), min_size=2, max_size=2), min_size=1, max_size=6),
       st.lists(st.integers(-2, 2), min_size=2, max_size=2))  # fmt: skip
def test_the_sensitivity_holds_on_every_small_lattice(references, candidates, null):
    references, candidates = np.array(references, float), np.array(candidates, float)
    assert nearest_neighbour_votes(references, candidates).tolist() == brute_force_votes(references, candidates).tolist()
    for replaced, _ in _null_neighbour_changes(references, candidates, np.array(null, float)):
        assert np.count_nonzero(replaced) <= 2 and np.abs(replaced).max() <= 1


def test_noise_is_gaussian_of_the_given_std_and_the_threshold_subtracts():
    counts = np.array([0, 3, 10, 1])
    noisy = noisy_counts(counts, 2.5, 1.5, np.random.default_rng(11))
    z = np.random.default_rng(11).standard_normal(4)
    assert noisy.tolist() == np.maximum(counts + 2.5 * z - 1.5, 0.0).tolist()  # dp_counter.py l. 53-59
    draws = noisy_counts(np.zeros(NOISE_DRAWS), 3.0, 0.0, np.random.default_rng(12))
    # max(Z, 0) for Z ~ N(0, 9): mean 3/sqrt(2 pi), second moment 9/2
    assert draws.mean() == pytest.approx(3.0 / math.sqrt(2 * math.pi), rel=NOISE_STD_RTOL)
    assert np.mean(draws**2) == pytest.approx(4.5, rel=NOISE_STD_RTOL)
    assert (noisy_counts(counts, 1e-9, 0.0, np.random.default_rng(0)) == pytest.approx(counts, abs=1e-6))


def test_the_histogram_is_votes_plus_noise():
    rng = np.random.default_rng(3)
    references, candidates = rng.normal(size=(40, 6)), rng.normal(size=(10, 6))
    counts = brute_force_counts(brute_force_votes(references, candidates), 10)
    released = dp_nn_histogram(references, candidates, 0.7, 0.0, np.random.default_rng(5))
    assert released.tolist() == noisy_counts(counts, 0.7, 0.0, np.random.default_rng(5)).tolist()


def test_rank_keeps_the_largest_counts_ties_to_the_lower_index():
    noisy = np.array([1.0, 5.0, 0.0, 5.0, 2.0, 0.0])
    assert select_candidates(noisy, 3, Selection.RANK, np.random.default_rng(0)).tolist() == [1, 3, 4]
    assert select_candidates(noisy, 6, "rank", np.random.default_rng(0)).tolist() == [1, 3, 4, 0, 2, 5]
    with pytest.raises(ValueError, match="exceeds the 6 candidates"):
        select_candidates(noisy, 7, Selection.RANK, np.random.default_rng(0))


def test_probability_draws_with_replacement_in_proportion():
    noisy = np.array([0.0, 1.0, 3.0, 0.0])
    draws = select_candidates(noisy, 40_000, Selection.PROBABILITY, np.random.default_rng(1))
    frequencies = np.bincount(draws, minlength=4) / draws.size
    assert frequencies[0] == frequencies[3] == 0.0  # a zero count is never drawn
    assert frequencies[2] == pytest.approx(0.75, abs=0.01)
    uniform = select_candidates(np.zeros(4), 40_000, Selection.PROBABILITY, np.random.default_rng(2))
    assert np.bincount(uniform, minlength=4) / 40_000 == pytest.approx([0.25] * 4, abs=0.01)  # all zero: uniform


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: nearest_neighbour_votes([[1.0, 2.0]], [[1.0, 2.0, 3.0]]), "one embedder for both"),
        (lambda: nearest_neighbour_votes([[1.0]], np.empty((0, 1))), "candidate_embeddings must be a non-empty"),
        (lambda: nearest_neighbour_votes([[np.nan]], [[1.0]]), "must be finite"),
        (lambda: nearest_neighbour_votes([1.0, 2.0], [[1.0]]), "2-d array"),
        (lambda: vote_counts([0, 3], 3), "candidate indices in"),
        (lambda: vote_counts([0.5], 3), "candidate indices in"),
        (lambda: noisy_counts([1, 2], 0.0, 0.0, np.random.default_rng(0)), "noise_std must be > 0"),
        (lambda: noisy_counts([1, 2], 1.0, -1.0, np.random.default_rng(0)), "threshold must be >= 0"),
        (lambda: noisy_counts([1, 2], 1.0, 0.0, 42), "numpy.random.Generator"),
        (lambda: select_candidates([1.0, -1.0], 1, "rank", np.random.default_rng(0)), "counts >= 0"),
        (lambda: select_candidates([1.0], 1, "top", np.random.default_rng(0)), "selection must be one of"),
        (lambda: select_candidates([1.0], 0, "rank", np.random.default_rng(0)), "num_selected must be an integer"),
    ],
)
def test_bad_input_is_refused_with_its_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()
