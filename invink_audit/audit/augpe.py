r"""Audits of AugPE's privacy claim on its DP core, the noisy nearest-neighbour histogram (numpy only).

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.augpe"); measured figures: docs/guide/auditing.md
("Auditing AugPE").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from accounting import AugPEEvent, gdp_to_epsilon, plan_augpe_noise_std
from accounting.limits import check_count, check_order
from invink_audit.audit.batched import LLR_SCORE, batched_canary_audit
from invink_audit.audit.records import BlackBoxReport
from invink_audit.audit.stats import Verdict
from invink_audit.audit.targets import HistogramTarget
from invink_audit.augpe.histogram import nearest_neighbour_votes, vote_counts

__all__ = [
    "CanaryEmbeddings",
    "DEFAULT_ALPHAS",
    "HistogramCheck",
    "exact_histogram_check",
    "histogram_canary_audit",
    "SELFTEST_DELTA",
    "SELFTEST_EPSILON",
    "SELFTEST_ITERATIONS",
    "neighbour_histograms",
    "selftest_claim",
    "selftest_datasets",
    "true_epsilon",
    "worst_case_canary",
]

#: Rényi orders of the exact check's table. For Gaussians D_α/α is the same at every α (Mironov 2017, Prop. 7), so
#: the verdict does not depend on the grid; it is reported as the white-box audits report theirs.
DEFAULT_ALPHAS = (1.5, 2.0, 4.0, 8.0, 16.0, 32.0)

#: A realised/claimed ratio above 1 + this is a violation. Every realised ‖h − h'‖² is an integer (exact in
#: float64); the claim's Δ² = (√2)² is 2 up to one ulp (relative 2.2e-16), far inside this margin.
RATIO_TOLERANCE = 1e-9


def _matrix(name: str, values) -> np.ndarray:
    matrix = np.asarray(values, dtype=np.float64)
    if matrix.ndim != 2 or 0 in matrix.shape or not np.all(np.isfinite(matrix)):
        raise ValueError(f"{name} must be a non-empty, finite 2-d array (texts × dimensions); got shape {matrix.shape}")
    return matrix


def _vector(name: str, values, dims: int) -> np.ndarray:
    vector = np.asarray(values, dtype=np.float64)
    if vector.shape != (dims,) or not np.all(np.isfinite(vector)):
        raise ValueError(f"{name} must be one finite embedding of {dims} dimensions; got shape {vector.shape}")
    return vector


def _iteration_candidates(candidate_embeddings, iterations: int) -> list[np.ndarray]:
    """One candidate matrix per iteration: a 2-d array is every iteration's; a sequence gives one per iteration."""
    if isinstance(candidate_embeddings, np.ndarray) and candidate_embeddings.ndim == 2:
        return [_matrix("candidate_embeddings", candidate_embeddings)] * iterations
    sets = [_matrix(f"candidate_embeddings[{t}]", c) for t, c in enumerate(candidate_embeddings)]
    if len(sets) != iterations:
        raise ValueError(f"give one candidate matrix per iteration ({iterations}) or one 2-d array; got {len(sets)}")
    return sets


def neighbour_histograms(reference_embeddings, candidate_embeddings, null_embedding) -> tuple[np.ndarray, np.ndarray]:
    """The vote counts h of the references (shape (k,)) and h'_j of every replace-by-null neighbour R'_j (row j of a
    (n, k) array: reference j replaced by ``null_embedding``, the empty text's embedding, which votes too).

    Each h'_j is recomputed from the whole neighbouring dataset by the implementation's own
    :func:`~invink_audit.augpe.histogram.nearest_neighbour_votes` and :func:`~invink_audit.augpe.histogram.vote_counts`,
    not derived from the sensitivity argument it checks: O(n²·k·d) work, meant for audit-sized n (hundreds).
    """
    references = _matrix("reference_embeddings", reference_embeddings)
    candidates = _matrix("candidate_embeddings", candidate_embeddings)
    null = _vector("null_embedding", null_embedding, references.shape[1])
    k = candidates.shape[0]
    counts = vote_counts(nearest_neighbour_votes(references, candidates), k)
    neighbours = np.empty((references.shape[0], k), dtype=np.int64)
    for j in range(references.shape[0]):
        dataset = references.copy()
        dataset[j] = null
        neighbours[j] = vote_counts(nearest_neighbour_votes(dataset, candidates), k)
    return counts, neighbours


@dataclasses.dataclass(frozen=True)
class HistogramCheck:
    r"""The exact white-box check of one AugPE claim on fixed embeddings (auditing notes, item 1).

    ``event`` is the claim (its σ is the mechanism's noise, its Δ the sensitivity it is accounted with);
    ``squared_shifts[j][t]`` the realised :math:`\|h - h'_j\|_2^2` of neighbour j at iteration t (an integer). Every
    other figure is derived: the realised ρ of neighbour j is :math:`\sum_t \|h_t - h'_{j,t}\|^2/(2\sigma^2)`
    (Mironov 2017, Prop. 7, summed over independent releases: Mironov 2017, Prop. 1), the claimed one
    :attr:`accounting.AugPEEvent.rho`; their :attr:`ratio` decides the verdict at every α at once.
    """

    event: AugPEEvent
    squared_shifts: tuple[tuple[int, ...], ...]
    alphas: tuple[float, ...] = DEFAULT_ALPHAS

    def __post_init__(self) -> None:
        if not isinstance(self.event, AugPEEvent):
            raise ValueError(f"event must be an accounting.AugPEEvent; got {type(self.event).__name__}")
        shifts = np.asarray(self.squared_shifts, dtype=np.float64)
        if shifts.ndim != 2 or shifts.shape[0] == 0 or shifts.shape[1] != self.event.iterations or np.any(shifts < 0):
            raise ValueError(f"squared_shifts must be (neighbours >= 1) × (T = {self.event.iterations}) numbers >= 0")
        object.__setattr__(self, "alphas", tuple(check_order(f"alphas[{i}]", a) for i, a in enumerate(self.alphas)))
        if not self.alphas:
            raise ValueError("alphas must hold at least one Rényi order")

    @property
    def claimed_rho_per_iteration(self) -> float:
        r""":math:`\Delta_{claim}^2/(2\sigma^2)` (Bun & Steinke 2016, Prop. 1.6)."""
        return self.event.rho / self.event.iterations

    @property
    def realised_rho(self) -> np.ndarray:
        r"""Per neighbour, :math:`\sum_t \|h_t - h'_{j,t}\|^2/(2\sigma^2)`: its exact D_α/α over the T releases."""
        return np.asarray(self.squared_shifts, dtype=np.float64).sum(axis=1) / (2.0 * self.event.noise_std**2)

    @property
    def worst_neighbour(self) -> int:
        """The neighbour (reference index) of the largest realised ρ; ties to the lowest index."""
        return int(np.argmax(self.realised_rho))

    @property
    def max_l2_shift(self) -> float:
        """The largest realised ‖h − h'‖₂ of one iteration: the sensitivity these embeddings attain."""
        return math.sqrt(float(np.max(self.squared_shifts)))

    @property
    def ratio_per_iteration(self) -> float:
        """Largest realised per-iteration divergence over the claimed one (the same at every α)."""
        return float(np.max(self.squared_shifts)) / (2.0 * self.event.noise_std**2) / self.claimed_rho_per_iteration

    @property
    def ratio(self) -> float:
        """Realised ρ of the worst neighbour over the claimed ρ, composed over T (the same at every α)."""
        return float(self.realised_rho[self.worst_neighbour]) / self.event.rho

    @property
    def failures(self) -> int:
        """(neighbour, iteration, α) triples whose exact per-iteration divergence exceeds the claim's."""
        per = np.asarray(self.squared_shifts, dtype=np.float64) / (2.0 * self.event.noise_std**2)
        return int(np.sum(per > self.claimed_rho_per_iteration * (1.0 + RATIO_TOLERANCE))) * len(self.alphas)

    def renyi_table(self) -> list[dict]:
        """Per α: the worst neighbour's exact D_α over the T releases, and the claim's α·ρ."""
        worst = float(self.realised_rho[self.worst_neighbour])
        return [{"alpha": a, "realised": a * worst, "claimed": a * self.event.rho} for a in self.alphas]

    @property
    def verdict(self) -> Verdict:
        """VIOLATION when some neighbour's exact divergence exceeds the claim (per iteration or composed), else PASS."""
        exceeded = max(self.ratio, self.ratio_per_iteration) > 1.0 + RATIO_TOLERANCE
        return Verdict.VIOLATION if exceeded else Verdict.PASS

    @property
    def reason(self) -> str:
        j, worst = self.worst_neighbour, self.squared_shifts[self.worst_neighbour]
        claim = f"the claim's Δ = {self.event.l2_sensitivity:.4g} ({self.event.sensitivity.value})"
        if self.verdict is Verdict.VIOLATION:
            return (f"reference {j} replaced by the empty text moves the histogram by ‖h − h'‖₂ = {math.sqrt(max(worst)):.4g} "
                    f"> {claim}: its exact D_α is {self.ratio:.4g}× the claimed α·ρ = α·{self.event.rho:.4g} at every α; "
                    f"{self.failures} (neighbour, iteration, α) checks fail (exact, no sampling)")
        if self.max_l2_shift == 0.0:
            invalid = "" if self.event.valid else (
                "; the claim is still not a valid guarantee (the paper's convention understates Δ by √2 under "
                "replace-by-null), these embeddings do not exhibit it")
            return ("no neighbour moves a vote on these embeddings (each nulled reference and the empty text vote for the "
                    f"same candidate): the realised divergence is 0, which refutes no claim and confirms none{invalid}")
        return (f"largest realised ‖h − h'‖₂ = {self.max_l2_shift:.4g} ≤ {claim}: the worst neighbour's exact D_α is "
                f"{self.ratio:.4g}× the claimed α·ρ at every α (reference {j})")

    def to_json(self) -> dict:
        return {"event": self.event.to_json(), "verdict": self.verdict.value, "reason": self.reason,
                "worst_neighbour": self.worst_neighbour, "max_l2_shift": self.max_l2_shift, "ratio": self.ratio,
                "ratio_per_iteration": self.ratio_per_iteration, "failures": self.failures,
                "claimed_rho": self.event.rho, "realised_rho": float(self.realised_rho[self.worst_neighbour]),
                "renyi": self.renyi_table()}  # fmt: skip


def exact_histogram_check(
    reference_embeddings, candidate_embeddings, null_embedding, event: AugPEEvent, *, alphas: Sequence[float] = DEFAULT_ALPHAS
) -> HistogramCheck:
    """The exact check of ``event`` on these embeddings (auditing notes, item 1): every replace-by-null neighbour,
    every iteration (``candidate_embeddings``: one 2-d array for all T iterations, or one per iteration). The
    threshold H and the selection are post-processing and do not enter."""
    if not isinstance(event, AugPEEvent):
        raise ValueError(f"event must be an accounting.AugPEEvent; got {type(event).__name__}")
    shifts = []
    for candidates in _iteration_candidates(candidate_embeddings, event.iterations):
        counts, neighbours = neighbour_histograms(reference_embeddings, candidates, null_embedding)
        shifts.append(np.sum((neighbours - counts[None, :]) ** 2, axis=1))  # integers: exact
    table = np.stack(shifts, axis=1)
    return HistogramCheck(event, tuple(tuple(int(x) for x in row) for row in table), tuple(alphas))


@dataclasses.dataclass(frozen=True)
class CanaryEmbeddings:
    """A canary audit's data: the other references, the canary, the empty text's embedding and the candidates
    (one 2-d array for every iteration, or one per iteration), all public to the auditor."""

    others: np.ndarray
    canary: np.ndarray
    null: np.ndarray
    candidates: object

    def __post_init__(self) -> None:
        others = _matrix("others", self.others)
        object.__setattr__(self, "others", others)
        object.__setattr__(self, "canary", _vector("canary", self.canary, others.shape[1]))
        object.__setattr__(self, "null", _vector("null", self.null, others.shape[1]))

    def counts(self, iterations: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Per iteration, the counts with the canary and with the canary replaced by the empty text."""
        with_canary, without = [], []
        for candidates in _iteration_candidates(self.candidates, iterations):
            k = candidates.shape[0]
            with_canary.append(vote_counts(nearest_neighbour_votes(np.vstack([self.canary, self.others]), candidates), k))
            without.append(vote_counts(nearest_neighbour_votes(np.vstack([self.null, self.others]), candidates), k))
        return with_canary, without


def worst_case_canary(*, others_per_candidate: int = 50, num_candidates: int = 4) -> CanaryEmbeddings:
    """The replace-by-null worst case: the candidates are the basis vectors e_0, …, e_{k−1} of R^k, the canary sits
    on e_0 and the empty text on e_1 (they vote for different candidates: ‖h − h'‖₂ = √2), and the other references
    sit ``others_per_candidate`` on each candidate, so that no count is near the threshold 0 at the noise levels
    audited (the clamp at H, post-processing, would only weaken the audit)."""
    check_count("others_per_candidate", others_per_candidate)
    if check_count("num_candidates", num_candidates) < 2:
        raise ValueError(f"num_candidates must be at least 2 (the canary's and the empty text's); got {num_candidates}")
    basis = np.eye(num_candidates)
    return CanaryEmbeddings(np.repeat(basis, others_per_candidate, axis=0), basis[0], basis[1], basis)


def histogram_canary_audit(
    target: HistogramTarget,
    claim: AugPEEvent,
    *,
    claimed_delta: float = 1e-6,
    num_batches: int = 10_000,
    significance: float = 0.05,
    num_looks: int = 4,
    seed: int | None = None,
) -> BlackBoxReport:
    """The batched canary audit (:func:`invink_audit.audit.batched.batched_canary_audit`: a fair coin per trial from
    ``seed``, the score's threshold chosen on the first quarter, Clopper–Pearson on the rest in ``num_looks``
    sequential looks, the perfect-attack ceiling and the GDP estimate) of ``target`` against ``claim``'s exact μ-GDP
    curve :math:`\\varepsilon(\\delta')` (:meth:`accounting.AugPEEvent.gaussian_epsilon`: exact for a composition of
    Gaussians, Dong, Roth & Su 2019, Cor. 2.13), quoted at ``claimed_delta``. VIOLATION or INCONCLUSIVE: a black box
    never confirms a claim."""
    if not isinstance(target, HistogramTarget) or not isinstance(claim, AugPEEvent):
        raise ValueError("target must be a HistogramTarget and claim an accounting.AugPEEvent")
    curve = claim.gaussian_epsilon
    return batched_canary_audit(
        target, ["(another reference)"], "the canary", batch_size=1, num_batches=num_batches,
        claimed_epsilon=curve(claimed_delta), claimed_delta=claimed_delta, scores=[LLR_SCORE], significance=significance,
        num_looks=num_looks, seed=seed, claimed_profile=curve, mechanism=f"augpe histogram: {claim.describe()}",
    )  # fmt: skip


def true_epsilon(target: HistogramTarget, delta: float) -> float:
    """The target's exact ε at ``delta`` on its canary: μ-GDP of :attr:`HistogramTarget.true_mu` (Dong, Roth & Su
    2019, Cor. 2.13); an upper bound when the clamp at H censors a count, equality otherwise. 0 when the canary
    moves no vote."""
    return gdp_to_epsilon(target.true_mu, delta)


#: The self-test's AugPE claim (:func:`selftest_claim`): ε = 2 at δ = 1e-6 over T = 3 histograms. At ε = 2 the
#: black-box audit refutes the paper's convention in 99 of 100 seeds with 10^4 trials (at ε = 1, 16 of 50:
#: docs/guide/auditing.md, "Auditing AugPE").
SELFTEST_EPSILON, SELFTEST_DELTA, SELFTEST_ITERATIONS = 2.0, 1e-6, 3


def selftest_claim(sensitivity) -> AugPEEvent:
    """The self-test's claim with ``sensitivity``: σ planned so that the exact μ-GDP ε at :data:`SELFTEST_DELTA` is
    :data:`SELFTEST_EPSILON` (:func:`accounting.plan_augpe_noise_std`, ``exact_gaussian=True``)."""
    sigma = plan_augpe_noise_std(SELFTEST_EPSILON, SELFTEST_DELTA, SELFTEST_ITERATIONS, sensitivity, exact_gaussian=True)
    return AugPEEvent(sigma, SELFTEST_ITERATIONS, sensitivity)


def selftest_datasets() -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """The exact check's self-test data, (name, references, candidates, empty text's embedding): ``random`` (40
    Gaussian references and 6 candidates in R^8, seed 0: some neighbours move a vote, some do not) and
    ``worst-case`` (:func:`worst_case_canary` with 5 others per candidate: every reference off e_1 moves one)."""
    rng = np.random.default_rng(0)
    random = ("random", rng.normal(size=(40, 8)), rng.normal(size=(6, 8)), rng.normal(size=8))
    worst = worst_case_canary(others_per_candidate=5)
    return [random, ("worst-case", np.vstack([worst.canary, worst.others]), worst.candidates, worst.null)]
