"""Audits of AugPE's histogram release (invink_audit.audit.augpe, invink_audit.audit.targets.HistogramTarget): the exact white-box check against brute-force
counts and a numerically integrated Rényi divergence, and the black-box canary audit's release, score, power and
false-positive rate. Figures: docs/guide/auditing.md ("Auditing AugPE")."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from accounting import AugPEEvent, AugPESensitivity, plan_augpe_noise_std
from invink_audit.audit.stats import Verdict
from invink_audit.augpe import noisy_counts
from invink_audit.audit.augpe import (
    CanaryEmbeddings,
    HistogramCheck,
    exact_histogram_check,
    histogram_canary_audit,
    neighbour_histograms,
    true_epsilon,
    worst_case_canary,
)
from invink_audit.audit.targets import HistogramTarget

#: the black-box settings of the self-test rows: a claim of ε = 2 at δ = 1e-6 (exact μ-GDP), T = 3, 10^4 trials
CLAIMED_EPSILON, DELTA, ITERATIONS, NUM_BATCHES = 2.0, 1e-6, 3, 10_000
#: absolute tolerance of the numerically integrated Rényi divergence (quad's error is ~1e-10 here)
QUAD_ATOL = 1e-7


def event_for(sensitivity, epsilon=CLAIMED_EPSILON, iterations=ITERATIONS) -> AugPEEvent:
    """The claim quoting ``epsilon`` at δ = 1e-6 with ``sensitivity`` (σ planned by the exact μ-GDP curve)."""
    sigma = plan_augpe_noise_std(epsilon, DELTA, iterations, sensitivity, exact_gaussian=True)
    return AugPEEvent(sigma, iterations, sensitivity)


def brute_force_counts(references, candidates) -> np.ndarray:
    """Counts of nearest candidates, pair by pair in pure Python (the first minimum kept)."""
    counts = [0] * len(candidates)
    for r in np.asarray(references).tolist():
        distances = [sum((a - b) ** 2 for a, b in zip(r, c)) for c in np.asarray(candidates).tolist()]
        counts[distances.index(min(distances))] += 1
    return np.array(counts)


def random_embeddings(seed, n=30, k=7, d=6):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)), rng.normal(size=(k, d)), rng.normal(size=d)


@pytest.mark.parametrize("seed", range(4))
def test_neighbour_histograms_are_the_brute_force_counts(seed):
    references, candidates, null = random_embeddings(seed)
    counts, neighbours = neighbour_histograms(references, candidates, null)
    assert counts.tolist() == brute_force_counts(references, candidates).tolist()
    for j in range(references.shape[0]):
        dataset = references.copy()
        dataset[j] = null
        assert neighbours[j].tolist() == brute_force_counts(dataset, candidates).tolist()


@pytest.mark.parametrize("seed", range(4))
def test_exact_check_on_random_embeddings(seed):
    """Δ = √2 passes with ratio ≤ 1; Δ = 1 (the paper's convention, and add-or-remove on replace-by-null data) is
    refuted with ratio exactly 2 whenever a nulled reference and the empty text vote for different candidates."""
    references, candidates, null = random_embeddings(seed)
    counts, neighbours = neighbour_histograms(references, candidates, null)
    moved = np.sum((neighbours - counts) ** 2, axis=1)
    assert set(moved.tolist()) <= {0, 2} and moved.max() == 2  # one vote moves, or none
    correct = exact_histogram_check(references, candidates, null, event_for(AugPESensitivity.REPLACE_BY_NULL))
    assert correct.verdict is Verdict.PASS and correct.failures == 0
    assert correct.ratio == pytest.approx(1.0, rel=1e-12) and correct.max_l2_shift == pytest.approx(math.sqrt(2))
    assert [list(row) for row in correct.squared_shifts] == [[int(m)] * ITERATIONS for m in moved]
    for sensitivity in (AugPESensitivity.PAPER, AugPESensitivity.ADD_OR_REMOVE):
        check = exact_histogram_check(references, candidates, null, event_for(sensitivity))
        assert check.verdict is Verdict.VIOLATION, sensitivity
        assert check.ratio == pytest.approx(2.0, rel=1e-12) and check.ratio_per_iteration == pytest.approx(2.0, rel=1e-12)
        assert check.worst_neighbour == int(np.argmax(moved))
        assert check.failures == int(np.count_nonzero(moved)) * ITERATIONS * len(check.alphas)
        assert "(exact, no sampling)" in check.reason


def test_exact_divergence_against_numerical_integration():
    """D_α(N(h, σ²I) ‖ N(h', σ²I)) = α‖h − h'‖²/(2σ²) (Mironov 2017, Prop. 7) against quad of ∫p^α q^(1−α) along
    h − h' (the other directions integrate to 1), for the worst-case canary's shift √2."""
    data = worst_case_canary(others_per_candidate=3)
    references = np.vstack([data.canary, data.others])
    event = event_for(AugPESensitivity.REPLACE_BY_NULL, iterations=1)
    check = exact_histogram_check(references, data.candidates, data.null, event)
    sigma, shift = event.noise_std, check.max_l2_shift
    assert shift == pytest.approx(math.sqrt(2.0))
    for row in check.renyi_table():
        a = row["alpha"]

        def integrand(x, a=a):
            return math.exp(a * stats.norm.logpdf(x, shift, sigma) + (1 - a) * stats.norm.logpdf(x, 0.0, sigma))

        value, _ = integrate.quad(integrand, -40 * sigma, 40 * sigma, points=[0.0, shift], limit=200)
        assert math.log(value) / (a - 1) == pytest.approx(row["realised"], abs=QUAD_ATOL)
        assert row["claimed"] == pytest.approx(a * event.rho)


def test_composition_over_iterations_with_their_own_candidates():
    """Candidates of each iteration: the canary's vote moves at iteration 0 only. The composed ratio of the paper's
    claim is 2/3, but its per-iteration claim is exceeded 2× at iteration 0: a VIOLATION; the correct one passes."""
    data = worst_case_canary(others_per_candidate=2)
    references = np.vstack([data.canary, data.others])
    one_near = np.vstack([np.zeros(4), 10.0 + 10.0 * np.eye(4)[1:]])  # every text nearest to the origin: no shift
    sets = [data.candidates, one_near, one_near]
    paper = exact_histogram_check(references, sets, data.null, event_for(AugPESensitivity.PAPER))
    assert set(paper.squared_shifts) == {(2, 0, 0), (0, 0, 0)} and paper.squared_shifts[0] == (2, 0, 0)
    assert paper.ratio == pytest.approx(2 / 3) and paper.ratio_per_iteration == pytest.approx(2.0)
    assert paper.verdict is Verdict.VIOLATION
    correct = exact_histogram_check(references, sets, data.null, event_for(AugPESensitivity.REPLACE_BY_NULL))
    assert correct.verdict is Verdict.PASS and correct.ratio == pytest.approx(1 / 3)


def test_no_vote_moves_refutes_nothing():
    """Every reference and the empty text vote for the same candidate: shift 0, the paper's claim is not refuted by
    these embeddings, and the audit says so (PASS, with the convention still named invalid)."""
    rng = np.random.default_rng(7)
    candidates = np.eye(3) * 10.0
    references = candidates[0] + 0.1 * rng.normal(size=(12, 3))
    null = candidates[0] + np.array([0.2, -0.1, 0.0])
    check = exact_histogram_check(references, candidates, null, event_for(AugPESensitivity.PAPER))
    assert check.verdict is Verdict.PASS and check.ratio == 0.0 and check.max_l2_shift == 0.0 and check.failures == 0
    assert "refutes no claim and confirms none" in check.reason and "not a valid guarantee" in check.reason
    correct = exact_histogram_check(references, candidates, null, event_for(AugPESensitivity.REPLACE_BY_NULL))
    assert "not a valid guarantee" not in correct.reason
    assert check.to_json()["verdict"] == "PASS"


def test_exact_check_rejects_bad_input():
    references, candidates, null = random_embeddings(0)
    event = event_for(AugPESensitivity.REPLACE_BY_NULL)
    with pytest.raises(ValueError, match="AugPEEvent"):
        exact_histogram_check(references, candidates, null, {"rho": 1.0})
    with pytest.raises(ValueError, match="null_embedding must be one finite embedding of 6"):
        exact_histogram_check(references, candidates, null[:3], event)
    with pytest.raises(ValueError, match="one candidate matrix per iteration"):
        exact_histogram_check(references, [candidates, candidates], null, event)
    with pytest.raises(ValueError, match="reference_embeddings must be a non-empty"):
        exact_histogram_check(np.zeros((0, 6)), candidates, null, event)
    with pytest.raises(ValueError, match="alphas"):
        exact_histogram_check(references, candidates, null, event, alphas=(1.0,))
    with pytest.raises(ValueError, match="squared_shifts"):
        HistogramCheck(event, ((2,),))  # one iteration's shifts for a T = 3 claim
    with pytest.raises(ValueError, match="num_candidates must be at least 2"):
        worst_case_canary(num_candidates=1)


def test_target_releases_noisy_counts_and_scores_them_exactly():
    """The target's releases are noisy_counts' own, bit for bit (iteration by iteration, trial by trial on the same
    generator), and its score is the exact log-likelihood ratio, clamped counts included (a threshold that
    clamps about half of them), against scipy's Gaussian densities and masses."""
    data = worst_case_canary(others_per_candidate=2)
    sigma, threshold, iterations = 1.5, 2.0, 2
    target = HistogramTarget(data, noise_std=sigma, iterations=iterations, threshold=threshold, seed=3)
    batches = [["the canary"], [""], [""], ["the canary"], ["the canary"]]
    target.generate(batches)
    llr = target.log_likelihood_ratios(batches, 0)
    rng = np.random.default_rng(3)
    expected = np.zeros(len(batches))
    for t, (h, h_out) in enumerate(zip(target.with_canary, target.without)):
        for i, b in enumerate(batches):
            y = noisy_counts(h if b[0] else h_out, sigma, threshold, rng)
            assert np.array_equal(target.released[t][i], y)
            positive = y > 0
            dens = stats.norm.logpdf(y + threshold, h, sigma) - stats.norm.logpdf(y + threshold, h_out, sigma)
            mass = stats.norm.logcdf(threshold, h, sigma) - stats.norm.logcdf(threshold, h_out, sigma)
            expected[i] += np.where(positive, dens, mass).sum()
    assert any((r == 0).any() for r in target.released) and any((r > 0).any() for r in target.released)
    np.testing.assert_allclose(llr, expected, rtol=1e-10, atol=1e-12)
    assert target.true_mu == pytest.approx(math.sqrt(2 * iterations) / sigma)
    with pytest.raises(ValueError, match="last generate call"):
        target.log_likelihood_ratios(batches[:2], 0)


def test_target_rejects_bad_input():
    data = worst_case_canary()
    with pytest.raises(ValueError, match="CanaryEmbeddings"):
        HistogramTarget(np.eye(3), noise_std=1.0, iterations=1)
    with pytest.raises(ValueError, match="noise_std"):
        HistogramTarget(data, noise_std=0.0, iterations=1)
    with pytest.raises(ValueError, match="canary must be one finite embedding"):
        CanaryEmbeddings(np.eye(3), np.ones(2), np.ones(3), np.eye(3))
    with pytest.raises(ValueError, match="target must be a HistogramTarget"):
        histogram_canary_audit(data, event_for(AugPESensitivity.PAPER))


def _audit(sensitivity, seed, *, num_batches=NUM_BATCHES, significance=0.05):
    claim = event_for(sensitivity)
    target = HistogramTarget(worst_case_canary(), noise_std=claim.noise_std, iterations=ITERATIONS, seed=10_000 + seed)
    return histogram_canary_audit(target, claim, seed=seed, num_batches=num_batches, significance=significance), target


def test_black_box_never_refutes_the_correct_claim():
    """Δ = √2 claimed and attained (the worst-case canary: true μ = claimed μ, true ε = claimed ε = 2): never a
    VIOLATION, and the GDP estimate of ε is within 20% of the claim."""
    for seed in range(4):
        report, target = _audit(AugPESensitivity.REPLACE_BY_NULL, seed)
        assert report.verdict is Verdict.INCONCLUSIVE, report.reason
        assert true_epsilon(target, DELTA) == pytest.approx(CLAIMED_EPSILON, rel=1e-6)
        assert abs(report.gdp["epsilon"]["estimate"] / CLAIMED_EPSILON - 1) <= 0.2
        assert report.epsilon_lower_bound <= report.ceiling + 1e-12


def test_black_box_refutes_the_paper_convention():
    """The paper's Δ = 1 under replace-by-null, claimed ε = 2 at δ = 1e-6 (T = 3, σ = 3.86); the true μ is √2× the
    claimed (true ε = 2.93). Measured: VIOLATION in 99 of 100 seeds at 10^4 trials (docs/guide/auditing.md);
    required here: at least 8 of 10."""
    violations = 0
    for seed in range(10):
        report, target = _audit(AugPESensitivity.PAPER, seed)
        violations += report.verdict is Verdict.VIOLATION
        assert target.true_mu == pytest.approx(math.sqrt(2.0) * event_for(AugPESensitivity.PAPER).mu)
    assert violations >= 8


def test_false_positive_rate_at_the_boundary_of_a_correct_claim():
    """The correct claim where it is exactly tight (true μ = claimed μ): VIOLATION in at most a fraction
    `significance` of 100 independent audits (2,000 trials each; measured: 0 of 100 here, and 0 of 100 at 10^4)."""
    significance, runs = 0.05, 100
    violations = sum(_audit(AugPESensitivity.REPLACE_BY_NULL, 100 + seed, num_batches=2_000, significance=significance)[0]
                     .verdict is Verdict.VIOLATION for seed in range(runs))
    assert violations <= significance * runs


def test_selftest_rows():
    """The self-test's AugPE rows: exactly, the correct accounting PASSES and the paper's is a VIOLATION (ratio 2 on
    both self-test datasets); black-box, the paper's is a VIOLATION and the correct one is not; the Markdown names
    the exact ratio."""
    from invink_audit.audit.selftest import (
        AUGPE_ROWS,
        SelfTestResult,
        augpe_blackbox_rows,
        augpe_entries,
        selftest_markdown,
    )

    entries = {e.mechanism: e for e in augpe_entries()}
    assert set(entries) == set(AUGPE_ROWS) and all(e.passed for e in entries.values())
    assert entries["augpe-correct"].verdict == "PASS" and entries["augpe-paper-sensitivity"].verdict == "VIOLATION"
    for source in entries["augpe-paper-sensitivity"].sources:
        assert source["realised_over_claimed_rho"] == pytest.approx(2.0) and source["step_failures"]["renyi"] > 0
    assert all(s["realised_over_claimed_rho"] <= 1.0 for s in entries["augpe-correct"].sources)
    rows = {r["mechanism"]: r for r in augpe_blackbox_rows(seed=0)}
    assert rows["augpe-paper-sensitivity"]["verdict"] == "VIOLATION" and rows["augpe-correct"]["verdict"] == "INCONCLUSIVE"
    assert rows["augpe-correct"]["true_epsilon"] == pytest.approx(rows["augpe-correct"]["claimed_epsilon"], rel=1e-6)
    assert rows["augpe-paper-sensitivity"]["true_epsilon"] > 1.4 * rows["augpe-paper-sensitivity"]["claimed_epsilon"]
    result = SelfTestResult(tuple(entries.values()), {"passed": True, "num_outputs": 1, "covered": 1, "intervals": 1,
                                                      "level": 0.95, "max_abs_error_importance_sampling": 0.0},
                            (), 0.0, tuple(rows.values()))
    md = selftest_markdown(result)
    assert "realised/claimed ρ 2 (exact)" in md and "VIOLATION with the paper's Δ = 1" in md
    assert [d["blackbox"][0]["verdict"] for d in result.to_json()] == ["INCONCLUSIVE", "VIOLATION"]
