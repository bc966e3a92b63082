r"""Statistics of a black-box audit beyond one Clopper–Pearson point: the perfect-attack ceiling, a
Gaussian-DP fit over all thresholds, and sequential stopping at scheduled looks.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.tradeoff").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats as scipy_stats

from accounting.conversions import gdp_to_epsilon
from accounting.limits import check_count
from invink_audit.audit import stats
from invink_audit.evaluation.stats import Interval, bootstrap_interval

__all__ = [
    "GdpFit",
    "PrivacyProfile",
    "ProfileBound",
    "SequentialResult",
    "SequentialTest",
    "fit_gdp",
    "perfect_attack_ceiling",
    "sequential_bound",
]


def perfect_attack_ceiling(positives: int, negatives: int, *, delta: float, significance: float) -> float:
    """The ε lower bound of a perfect attack on ``positives`` + ``negatives`` trials (TPR = 1, FPR = 0):
    no test on these trials certifies more (:func:`invink_audit.audit.stats.epsilon_lower_bound`)."""
    return stats.epsilon_lower_bound(positives, positives, 0, negatives, delta=delta, significance=significance)


#: δ' points of a curve claim (:meth:`PrivacyProfile.of`): from the quoted δ to 1/2, log-spaced
PROFILE_POINTS = 32


@dataclasses.dataclass(frozen=True)
class ProfileBound:
    """How far a (TP, FP) pair refutes a :class:`PrivacyProfile` (docs/auditing_notes.md, tradeoff). ``power_margin``:
    the Clopper–Pearson lower limit of the TPR minus the largest TPR the claim allows at the upper limit of the FPR (> 0
    refutes); ``delta``: the δ' whose line binds there, with the pair's ε lower bound at δ' and the claim's ε(δ')
    (``margin`` = their difference, > 0 exactly when ``power_margin`` is)."""

    power_margin: float
    margin: float
    delta: float
    epsilon_lower_bound: float
    claimed_epsilon: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PrivacyProfile:
    """A privacy claim as its (ε(δ'), δ') pairs (docs/auditing_notes.md, tradeoff), the quoted (ε, δ) first. Build
    it with :meth:`point` (a claim known only at one δ: today's single-point test) or :meth:`of` (a curve: the
    release's accountant at every δ')."""

    deltas: tuple[float, ...]
    epsilons: tuple[float, ...]

    def __post_init__(self) -> None:
        d, e = np.asarray(self.deltas, dtype=float), np.asarray(self.epsilons, dtype=float)
        if d.ndim != 1 or d.size == 0 or d.shape != e.shape:
            raise ValueError(f"need as many epsilons as deltas (at least one); got {d.size} and {e.size}")
        if not np.all((d >= 0) & (d < 1)) or np.any(np.isnan(e)) or np.any(e < 0):
            raise ValueError("deltas must lie in [0, 1) and epsilons be >= 0 (inf allowed)")

    @classmethod
    def point(cls, epsilon: float, delta: float) -> PrivacyProfile:
        """A claim quoted at one (ε, δ) only."""
        return cls((float(delta),), (float(epsilon),))

    @classmethod
    def of(cls, epsilon_at: Callable[[float], float], delta: float, *, num_points: int = PROFILE_POINTS) -> PrivacyProfile:
        """The curve ``epsilon_at(δ')`` (e.g. ``lambda d: event.epsilon(d)``, the release's accountant) at
        ``num_points`` δ' from the quoted ``delta`` to 1/2."""
        check_count("num_points", num_points)
        if not 0 < delta < 0.5:
            raise ValueError(f"delta must be in (0, 0.5); got {delta!r}")
        deltas = np.geomspace(delta, 0.5, num_points) if num_points > 1 else np.array([delta])
        return cls(tuple(float(d) for d in deltas), tuple(float(epsilon_at(float(d))) for d in deltas))

    @property
    def is_point(self) -> bool:
        """Whether the claim is known at its quoted (ε, δ) only (no curve)."""
        return len(self.deltas) == 1

    @property
    def epsilon(self) -> float:
        """The quoted ε (at :attr:`delta`)."""
        return self.epsilons[0]

    @property
    def delta(self) -> float:
        return self.deltas[0]

    def bounds(self, true_positives, positives: int, false_positives, negatives: int, *, significance: float) -> list[ProfileBound]:
        """One :class:`ProfileBound` per (TP, FP) pair (arrays of counts on ``positives`` / ``negatives``
        trials): Clopper–Pearson limits at β/2 each, as :func:`invink_audit.audit.stats.epsilon_lower_bound`
        (which this equals at each δ'), against every δ' of the claim at once."""
        beta = stats.check_significance(significance)
        tp, fp = np.atleast_1d(np.asarray(true_positives, dtype=float)), np.atleast_1d(np.asarray(false_positives, dtype=float))
        if positives < 1 or negatives < 1 or tp.shape != fp.shape:
            raise ValueError("need at least one trial on each side and one false-positive count per true-positive count")
        tpr_lb = stats.clopper_pearson_limits(tp, positives, beta)[0][:, None]
        fpr_ub = stats.clopper_pearson_limits(fp, negatives, beta)[1][:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            d, e = np.asarray(self.deltas)[None], np.asarray(self.epsilons)[None]
            direct = np.where((tpr_lb - d > 0) & (fpr_ub > 0), np.log((tpr_lb - d) / fpr_ub), 0.0)
            mirror = np.where((1 - fpr_ub - d > 0) & (1 - tpr_lb > 0), np.log((1 - fpr_ub - d) / (1 - tpr_lb)), 0.0)
            lb = np.maximum(np.maximum(direct, mirror), 0.0)  # (pairs, δ')
            # the largest TPR the claim allows at FPR ≤ fpr_ub: the lowest of its lines (both directions)
            allowed = np.clip(np.minimum(np.exp(e) * fpr_ub + d, 1.0 - np.exp(-e) * (1.0 - fpr_ub - d)), 0.0, 1.0)
        binding = np.argmin(allowed, axis=1)
        rows = np.arange(lb.shape[0])
        power = tpr_lb[:, 0] - allowed[rows, binding]
        margin = (lb - e)[rows, binding]
        return [ProfileBound(float(p), float(m), float(self.deltas[j]), float(b), float(self.epsilons[j]))
                for p, m, j, b in zip(power, margin, binding, lb[rows, binding])]


@dataclasses.dataclass(frozen=True)
class GdpFit:
    """μ of the Gaussian-DP trade-off curve fitted to the scores (an estimate with its bootstrap
    interval), the ε at ``delta`` it implies, and how many thresholds entered the fit. ``separated``: the
    scores separate perfectly, so μ is a floor set by the trial count (only more trials show more)."""

    mu: Interval
    epsilon: Interval
    delta: float
    thresholds: int
    separated: bool = False

    def to_json(self) -> dict:
        kind = ("floor set by the trial count (the scores separate perfectly), not a bound" if self.separated
                else "estimate (GDP fit), not a bound")
        return {"mu": self.mu.to_json(), "epsilon": self.epsilon.to_json(), "delta": self.delta,
                "thresholds": self.thresholds, "separated": self.separated, "kind": kind}


def _probit_mu(positive: np.ndarray, negative: np.ndarray) -> tuple[float, int]:
    """Median over the informative thresholds (at least one rate strictly between 0 and 1) of
    Φ⁻¹(TPR) − Φ⁻¹(FPR), each rate continuity-corrected to (k + ½)/(n + 1) so that it is never 0 or 1
    (a perfectly separating threshold then gives a finite, n-limited figure instead of ∞)."""
    thresholds = np.unique(np.concatenate([positive, negative]))
    # trials at or above each threshold, by binary search in the sorted scores (O(n log n))
    hits = positive.size - np.searchsorted(np.sort(positive), thresholds, side="left")
    false = negative.size - np.searchsorted(np.sort(negative), thresholds, side="left")
    # uninformative: every trial flagged on both sides, or none on either
    informative = ~(((hits == positive.size) & (false == negative.size)) | ((hits == 0) & (false == 0)))
    tpr = (hits[informative] + 0.5) / (positive.size + 1)
    fpr = (false[informative] + 0.5) / (negative.size + 1)
    if tpr.size == 0:
        return 0.0, 0
    values = scipy_stats.norm.ppf(tpr) - scipy_stats.norm.ppf(fpr)
    return max(0.0, float(np.median(values))), int(tpr.size)


def fit_gdp(
    positive: Sequence[float],
    negative: Sequence[float],
    *,
    delta: float,
    confidence: float = 0.95,
    num_bootstrap: int = 200,
    rng: np.random.Generator | None = None,
) -> GdpFit:
    """Fit μ-GDP to the scores of the trials with the canary (``positive``) and without (``negative``)
    (docs/auditing_notes.md, tradeoff); a percentile bootstrap over trials for μ and for the ε(δ) it implies. When the
    scores separate perfectly, ``separated`` is set: the fit is then limited by the trial count (the
    continuity correction), a floor rather than an estimate of μ. The ε ends come from
    :func:`accounting.conversions.gdp_to_epsilon` (errs high by at most a relative 1e-9: an estimate either way)."""
    pos, neg = np.asarray(positive, dtype=float), np.asarray(negative, dtype=float)
    if pos.size < 2 or neg.size < 2:
        raise ValueError(f"need at least 2 trials of each kind; got {pos.size} and {neg.size}")
    rng = rng if rng is not None else np.random.default_rng(0)
    mu_iv = bootstrap_interval((pos, neg), lambda p, n: _probit_mu(p, n)[0], confidence, num_resamples=num_bootstrap,
                               rng=rng, method="bootstrap over trials")  # fmt: skip
    eps = [gdp_to_epsilon(m, delta) for m in (mu_iv.estimate, mu_iv.lower, mu_iv.upper)]
    return GdpFit(mu_iv, Interval(eps[0], eps[1], eps[2], confidence, "ε(δ) of the μ interval"), delta,
                  _probit_mu(pos, neg)[1], separated=bool(pos.min() > neg.max()))


@dataclasses.dataclass(frozen=True)
class SequentialResult:
    """What :func:`sequential_bound` decided: the bound at the quoted δ at the look where it stopped (at
    that look's significance), the trials it used, each look's (trials, significance, bound), why it
    stopped, and the claim's curve tested at that look (:class:`ProfileBound`; ``margin`` > 0: VIOLATION)."""

    epsilon_lower_bound: float
    trials_used: int
    looks: tuple[tuple[int, float, float], ...]
    stopped: str
    profile: ProfileBound | None = None

    def to_json(self) -> dict:
        return {"epsilon_lower_bound": self.epsilon_lower_bound, "trials_used": self.trials_used,
                "looks": [list(x) for x in self.looks], "stopped": self.stopped,
                "profile": None if self.profile is None else self.profile.to_json()}


class SequentialTest:
    """The looks of :func:`sequential_bound` one at a time, for an audit that generates its evaluation
    trials look by look (and so stops generating when the verdict cannot change). ``is_positive``: every
    evaluation trial's coin, known before any is generated; :attr:`schedule`: (trials, significance) per
    look. ``profile``: the claim's curve (:class:`PrivacyProfile`, quoted at (``claimed_epsilon``,
    ``delta``)); default the quoted point alone."""

    def __init__(self, is_positive: Sequence[bool], *, claimed_epsilon: float, delta: float, significance: float,
                 num_looks: int = 4, profile: PrivacyProfile | None = None) -> None:
        self.positive = np.asarray(is_positive, dtype=bool)
        n = self.positive.size
        if n < 2:
            raise ValueError(f"need at least 2 evaluation trials; got {n}")
        check_count("num_looks", num_looks)
        self.beta = stats.check_significance(significance)
        self.claim, self.delta = float(claimed_epsilon), float(delta)
        self.profile = profile if profile is not None else PrivacyProfile.point(self.claim, self.delta)
        if (self.profile.epsilon, self.profile.delta) != (self.claim, self.delta):
            raise ValueError(f"the profile is quoted at (ε, δ) = ({self.profile.epsilon}, {self.profile.delta}), "
                             f"not the claim's ({self.claim}, {self.delta})")
        marks = sorted({max(2, int(math.ceil(n / 2 ** (num_looks - i)))) for i in range(1, num_looks + 1)})
        # look i of L spends β/2^(L−i+1): β/2 at the last, Σ < β whatever the stopping rule (union bound);
        # a single look spends all of β
        self.schedule = ((n, self.beta),) if num_looks == 1 else tuple(
            (m, self.beta / 2 ** (len(marks) - i)) for i, m in enumerate(marks))
        self.looks: list[tuple[int, float, float]] = []
        self.points: list[ProfileBound] = []
        self.stopped: str | None = None

    def _point(self, tp: int, fp: int, p: int, q: int, level: float) -> ProfileBound:
        if not (p and q):
            return ProfileBound(-1.0, -math.inf, self.delta, 0.0, self.claim)
        return self.profile.bounds([tp], p, [fp], q, significance=level)[0]

    def look(self, detected: Sequence[bool]) -> str | None:
        """Decide at the next look from the detections of its first ``m`` trials: "violation", "futile",
        "all" (the last look), or None (go on)."""
        m, level = self.schedule[len(self.looks)]
        hit, pos = np.asarray(detected, dtype=bool)[:m], self.positive[:m]
        if hit.size < m:
            raise ValueError(f"this look needs the detections of {m} trials; got {hit.size}")
        tp, fp, p, q = int((hit & pos).sum()), int((hit & ~pos).sum()), int(pos.sum()), int((~pos).sum())
        bound = stats.epsilon_lower_bound(tp, p, fp, q, delta=self.delta, significance=level) if p and q else 0.0
        self.looks.append((m, level, bound))
        self.points.append(self._point(tp, fp, p, q, level))
        last = len(self.looks) == len(self.schedule)
        if self.points[-1].power_margin > 0:
            self.stopped = "violation"
        elif last:
            self.stopped = "all"
        else:
            # the best any later look could show: every remaining positive detected, no remaining negative
            # flagged, at the last look's significance (the largest of the later ones)
            p_all, q_all = int(self.positive.sum()), int((~self.positive).sum())
            best = self._point(tp + int(self.positive[m:].sum()), fp, p_all, q_all, self.beta / 2)
            self.stopped = "futile" if best.power_margin <= 0 else None
        return self.stopped

    def result(self) -> SequentialResult:
        if not self.looks:
            return SequentialResult(0.0, 0, (), self.stopped or "all")
        at = len(self.looks) - 1 if self.stopped == "violation" else max(range(len(self.looks)), key=lambda i: self.points[i].power_margin)
        bound = self.looks[-1][2] if self.stopped == "violation" else max(x[2] for x in self.looks)
        return SequentialResult(bound, self.looks[-1][0], tuple(self.looks), self.stopped or "all", self.points[at])


def sequential_bound(
    detected: Sequence[bool],
    is_positive: Sequence[bool],
    *,
    claimed_epsilon: float,
    delta: float,
    significance: float,
    num_looks: int = 4,
    profile: PrivacyProfile | None = None,
) -> SequentialResult:
    """Clopper–Pearson bounds at ``num_looks`` growing prefixes of the evaluation trials (in their
    order, e.g. batch order), each at significance β/2^{L-i+1} (docs/auditing_notes.md, tradeoff); stops at the first
    look that refutes the claim ("violation": its bound exceeds ``claimed_epsilon``, or the ``profile``'s
    ε(δ') at some δ') or after which the trials seen so far with a perfect attack on the rest cannot refute
    it at the last look's significance ("futile"), else after the last look ("all")."""
    hit = np.asarray(detected, dtype=bool)
    if hit.size != np.asarray(is_positive).size:
        raise ValueError(f"need one detection per trial; got {hit.size} for {np.asarray(is_positive).size} trials")
    test = SequentialTest(is_positive, claimed_epsilon=claimed_epsilon, delta=delta, significance=significance,
                          num_looks=num_looks, profile=profile)
    while test.look(hit) is None:
        pass
    return test.result()
