"""Statistics of the privacy auditor: divergence estimators, confidence bounds, tests, verdicts.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.stats", §3–§5, "Verdicts").
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import special, stats

from accounting.limits import check_delta, check_order
from invink_audit.evaluation.stats import Interval

__all__ = [
    "Verdict",
    "TestResult",
    "dkw_radius",
    "anderson_mean_bounds",
    "empirical_bernstein_mean_bounds",
    "log_mean_bounds",
    "renyi_monte_carlo",
    "renyi_importance_sampling",
    "RenyiEstimate",
    "hockey_stick_delta",
    "DeltaCurve",
    "clopper_pearson",
    "clopper_pearson_limits",
    "epsilon_lower_bound",
    "p_value_from_lower_bound",
    "holm",
    "decide_verdict",
    "check_significance",
    "delta_band",
]

#: smallest significance level the p-value bisection resolves (p-values below it are reported as it)
MIN_P_VALUE = 1e-300


def check_significance(significance) -> float:
    """The significance level as a float in (0, 1); ``ValueError`` otherwise."""
    return check_delta("significance", significance)


_check_alpha = functools.partial(check_order, "alpha (Rényi order)")


def _as_samples(name: str, values, *, allow_posinf: bool = False) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError(f"{name} must contain at least one sample; got an empty array")
    if np.isnan(arr).any():
        raise ValueError(f"{name} must not contain NaN")
    if np.isneginf(arr).any() or (not allow_posinf and np.isposinf(arr).any()):
        raise ValueError(f"{name} must be finite; got {arr[~np.isfinite(arr)][:3]!r}")
    return arr


class Verdict(enum.Enum):
    """Outcome of an audit at a stated significance level."""

    PASS = "PASS"
    VIOLATION = "VIOLATION"
    INCONCLUSIVE = "INCONCLUSIVE"

    @staticmethod
    def worst(verdicts) -> Verdict:
        """VIOLATION if any is, else INCONCLUSIVE if any is, else PASS (also for none)."""
        return max(verdicts, key=(Verdict.PASS, Verdict.INCONCLUSIVE, Verdict.VIOLATION).index, default=Verdict.PASS)


# ---------------------------------------------------------------------------------------------
# confidence bounds on means


def dkw_radius(n: int, significance: float, *, two_sided: bool = True) -> float:
    r"""DKW radius η with :math:`P(\sup_x |F_n-F| > \eta) \le \beta` (Massart 1990, Thm. 1).

    Two-sided: :math:`\eta=\sqrt{\log(2/\beta)/(2n)}`. One-sided (Massart's Thm. 1 comment, valid
    when :math:`\beta \le 1/2`): :math:`\eta=\sqrt{\log(1/\beta)/(2n)}`; for β > 1/2 the two-sided
    radius is returned (larger, hence still valid).
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1; got {n!r}")
    beta = check_significance(significance)
    if two_sided or beta > 0.5:
        return math.sqrt(math.log(2.0 / beta) / (2.0 * n))
    return math.sqrt(math.log(1.0 / beta) / (2.0 * n))


def _anderson_log_weights(n: int, eta: float) -> np.ndarray:
    """Weights of the sorted samples in Anderson's lower bound: 1/n each, top η of mass removed."""
    # mass of the i-th smallest sample (1-based) is the overlap of [(i-1)/n, i/n] with [0, 1-eta]
    lo = np.arange(n) / n
    hi = np.arange(1, n + 1) / n
    w = np.clip(np.minimum(hi, 1.0 - eta) - lo, 0.0, None)
    with np.errstate(divide="ignore"):
        return np.log(w)


def anderson_mean_bounds(
    log_values,
    significance: float,
    *,
    log_lower: float = -math.inf,
    log_upper: float = math.inf,
) -> tuple[float, float]:
    r"""Anderson–DKW bounds on :math:`\log \mathbb E[X]` from samples of :math:`\log X`.

    Samples must lie in ``[exp(log_lower), exp(log_upper)]`` (``log_lower=-inf`` means X ≥ 0). Both
    bounds hold *simultaneously* with probability ≥ 1 − ``significance`` (two-sided DKW radius).
    The upper bound is ``+inf`` when ``log_upper`` is infinite: a mean has no upper confidence bound
    without an upper range. Works in log space, so ranges like :math:`e^{700}` do not overflow.

    Source: Anderson (1969), "Confidence limits for the expected value of an arbitrary bounded
    random variable with a continuous distribution function"; DKW with Massart's constant.
    """
    logs = _as_samples("log_values", log_values, allow_posinf=True)
    if logs.min() < log_lower - 1e-12 or logs.max() > log_upper + 1e-12:
        raise ValueError(
            f"samples must lie in [exp({log_lower!r}), exp({log_upper!r})]; "
            f"got log-range [{logs.min()!r}, {logs.max()!r}]"
        )
    n = logs.size
    eta = min(dkw_radius(n, significance), 1.0)
    srt = np.sort(logs)
    lw = _anderson_log_weights(n, eta)

    def terms(weights: np.ndarray, end: float) -> np.ndarray:
        """The sorted samples with log-weights ``weights`` (sum 1 − η) plus mass η at ``end`` of the range."""
        with np.errstate(invalid="ignore"):
            weighted = np.where(np.isneginf(weights), -math.inf, srt + weights)
        return np.append(weighted, end + math.log(eta) if eta > 0 else -math.inf)

    lower_terms = terms(lw, log_lower)
    lower = float(special.logsumexp(lower_terms)) if np.isfinite(lower_terms).any() else -math.inf
    if not math.isfinite(log_upper):
        return lower, math.inf
    # upper: mass eta at the upper end, bottom eta of the samples removed (mirror of the lower bound)
    return lower, min(float(special.logsumexp(terms(lw[::-1], log_upper))), log_upper)


def empirical_bernstein_mean_bounds(
    log_values, significance: float, *, log_lower: float, log_upper: float
) -> tuple[float, float]:
    r"""Maurer–Pontil empirical-Bernstein bounds on :math:`\log \mathbb E[X]`, X in [a, b].

    arXiv:0907.3740, Thm. 4, applied to :math:`(X-a)/(b-a) \in [0,1]` on each side at β/2, so the
    pair holds simultaneously with probability ≥ 1 − β:
    :math:`|\bar X - \mathbb E X| \le \sqrt{2V_n\log(4/\beta)/n} + 7(b-a)\log(4/\beta)/(3(n-1))`,
    with :math:`V_n` the unbiased sample variance. Needs n ≥ 2 and a finite range.
    """
    logs = _as_samples("log_values", log_values, allow_posinf=False)
    beta = check_significance(significance)
    if not (math.isfinite(log_upper) and log_upper >= log_lower):
        raise ValueError(f"log_upper must be finite and >= log_lower; got {log_upper!r}")
    n = logs.size
    if n < 2:
        return log_lower, log_upper
    # scale by the upper end so the values are in [0, 1]; a is exp(log_lower - log_upper)
    scaled = np.exp(logs - log_upper)
    a = math.exp(log_lower - log_upper) if math.isfinite(log_lower) else 0.0
    x = (scaled - a) / (1.0 - a) if a < 1.0 else np.zeros_like(scaled)
    mean = float(x.mean())
    var = float(x.var(ddof=1))
    u = math.log(4.0 / beta)
    half = math.sqrt(2.0 * var * u / n) + 7.0 * u / (3.0 * (n - 1))
    lo_x, hi_x = max(0.0, mean - half), min(1.0, mean + half)

    def back(v: float) -> float:
        val = a + (1.0 - a) * v
        return log_upper + math.log(val) if val > 0 else -math.inf

    return max(back(lo_x), log_lower), back(hi_x)


def log_mean_bounds(
    log_values,
    significance: float,
    *,
    log_lower: float = -math.inf,
    log_upper: float = math.inf,
) -> tuple[float, float, str]:
    """Bounds on ``log E[X]``: the tighter of Anderson–DKW and empirical Bernstein, each at β/2.

    With an infinite ``log_upper`` (no known range) only Anderson's lower bound applies (at β).
    Returns ``(lower, upper, method)``.
    """
    beta = check_significance(significance)
    if not math.isfinite(log_upper):
        lo, hi = anderson_mean_bounds(log_values, beta, log_lower=log_lower, log_upper=log_upper)
        return lo, hi, "anderson-dkw"
    lo_a, hi_a = anderson_mean_bounds(
        log_values, beta / 2, log_lower=log_lower, log_upper=log_upper
    )
    lo_b, hi_b = empirical_bernstein_mean_bounds(
        log_values, beta / 2, log_lower=log_lower, log_upper=log_upper
    )
    return max(lo_a, lo_b), min(hi_a, hi_b), "anderson-dkw+empirical-bernstein"


def p_value_from_lower_bound(
    lower_bound_at: Callable[[float], float], null_value: float
) -> float:
    r"""One-sided p-value of :math:`H_0: \theta \le` ``null_value`` from a family of lower bounds.

    ``lower_bound_at(beta)`` must be a (1 − β)-lower confidence bound, non-increasing in the
    confidence 1 − β. The p-value is the smallest β (found by bisection in log β, erring upwards,
    i.e. conservative) at which the lower bound exceeds ``null_value``; 1 when it never does.
    """
    if not lower_bound_at(1.0 - 1e-12) > null_value:
        return 1.0
    if lower_bound_at(MIN_P_VALUE) > null_value:
        return MIN_P_VALUE
    lo, hi = math.log(MIN_P_VALUE), math.log(1.0 - 1e-12)  # bound(exp(lo)) <= null < bound(exp(hi))
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        if lower_bound_at(math.exp(mid)) > null_value:
            hi = mid
        else:
            lo = mid
    return min(1.0, math.exp(hi))


# ---------------------------------------------------------------------------------------------
# Rényi divergence


@dataclass(frozen=True)
class RenyiEstimate:
    r"""An estimate of :math:`D_\alpha(P\|P')` with its interval and the test against a claim."""

    alpha: float
    estimator: str  # "monte-carlo" or "importance-sampling"
    num_samples: int
    interval: Interval
    claimed: float | None = None
    p_value: float | None = None  # H0: D_alpha <= claimed, alternative: exceeds

    def __post_init__(self):
        _check_alpha(self.alpha)
        if self.estimator not in ("monte-carlo", "importance-sampling"):
            raise ValueError(f"estimator must be 'monte-carlo' or 'importance-sampling'; got {self.estimator!r}")


def _renyi_estimate(samples: np.ndarray, alpha: float, significance: float, *, log_lower: float, upper: float,
                    estimator: str, claimed: float | None) -> RenyiEstimate:
    r"""The estimate from samples s whose :math:`e^{(\alpha-1)s}` has mean :math:`e^{(\alpha-1)D_\alpha}` (the
    moment identity of :func:`renyi_monte_carlo` and :func:`renyi_importance_sampling`, docs/auditing_notes.md
    §3–4), ``upper`` an a-priori bound on each (exceeded, the claim is false: only the lower bound stands)."""
    log_y, n = (alpha - 1.0) * samples, samples.size
    log_upper = math.inf if samples.max() > upper else (alpha - 1.0) * upper
    point = float(special.logsumexp(log_y) - math.log(n))
    lo, hi, method = log_mean_bounds(
        log_y, significance, log_lower=log_lower, log_upper=log_upper
    )
    # D_α = log E[Y] / (α − 1); a divergence is >= 0 (the integrand's mean is >= 1 for these estimators' targets)
    d_lo, d_pt = max(0.0, lo / (alpha - 1.0)), point / (alpha - 1.0)
    d_hi = max(hi / (alpha - 1.0), d_lo)
    interval = Interval(d_pt, d_lo, d_hi, 1.0 - significance, method)
    p_value = None
    if claimed is not None:
        null_log = (alpha - 1.0) * float(claimed)

        def lower_at(beta: float) -> float:
            return log_mean_bounds(log_y, beta, log_lower=log_lower, log_upper=log_upper)[0]

        p_value = 1.0 if math.isinf(claimed) else p_value_from_lower_bound(lower_at, null_log)
    return RenyiEstimate(alpha, estimator, n, interval, claimed, p_value)


def renyi_monte_carlo(
    losses,
    alpha: float,
    significance: float,
    *,
    loss_upper: float = math.inf,
    claimed: float | None = None,
) -> RenyiEstimate:
    r"""Plain Monte Carlo estimate of :math:`D_\alpha(P\|P')` from privacy losses ``L(x), x ~ P``.

    :math:`\hat D = \frac{1}{\alpha-1}\log \frac1n\sum_i e^{(\alpha-1)L_i}` (docs/auditing_notes.md §3; consistent,
    biased downwards for small n by Jensen). Interval: Anderson–DKW on :math:`Y=e^{(\alpha-1)L}\ge 0`;
    its lower end needs no assumption, its upper end needs an a-priori bound ``loss_upper`` on L
    (e.g. :math:`T\varepsilon_0` under the claimed per-token range) and is ``inf`` otherwise; with a
    finite range the empirical-Bernstein bound is also used (each at β/2). Losses may be ``+inf``
    (a token impossible under P'), which makes the divergence infinite.
    ``p_value`` tests :math:`H_0: D_\alpha \le` ``claimed``.
    """
    a = _check_alpha(alpha)
    beta = check_significance(significance)
    arr = _as_samples("losses", losses, allow_posinf=True)
    return _renyi_estimate(arr, a, beta, log_lower=-math.inf, upper=float(loss_upper), estimator="monte-carlo",
                           claimed=claimed)


def renyi_importance_sampling(
    stepwise_divergence_sums,
    alpha: float,
    significance: float,
    *,
    sum_upper: float,
    claimed: float | None = None,
) -> RenyiEstimate:
    r"""Geometric-mixture importance-sampling estimate of :math:`D_\alpha(P\|P')` (docs/auditing_notes.md §4).

    Input: for texts sampled token by token from :math:`g_t \propto p_t^\alpha p_t'^{1-\alpha}`, the
    sums :math:`S = \sum_t D_\alpha(p_t\|p'_t)` of the *exact* per-step divergences along each text.
    Then :math:`e^{(\alpha-1)D_\alpha(P\|P')} = \mathbb E_{G_\alpha}[e^{(\alpha-1)S}]`, and the
    integrand lies in :math:`[1, e^{(\alpha-1)s_{\max}}]` with ``sum_upper`` :math:`= s_{\max}` an
    a-priori bound on S (e.g. :math:`T\alpha\rho_{tok}` under the claim, every per-step term being
    checked exactly by the auditor). Interval: tighter of Anderson–DKW and empirical Bernstein.
    ``S = +inf`` (a support mismatch on the path) makes the divergence infinite.
    """
    a = _check_alpha(alpha)
    beta = check_significance(significance)
    arr = _as_samples("stepwise_divergence_sums", stepwise_divergence_sums, allow_posinf=True)
    if (arr < -1e-9).any():
        raise ValueError(f"stepwise_divergence_sums must be >= 0 (sums of divergences); got min {arr.min()!r}")
    arr = np.maximum(arr, 0.0)
    s_up = float(sum_upper)
    if math.isnan(s_up) or s_up < 0:
        raise ValueError(f"sum_upper must be >= 0; got {sum_upper!r}")
    return _renyi_estimate(arr, a, beta, log_lower=0.0, upper=s_up, estimator="importance-sampling", claimed=claimed)


# ---------------------------------------------------------------------------------------------
# hockey-stick divergence δ(ε)


@dataclass(frozen=True)
class DeltaCurve:
    r"""Estimates of :math:`\delta(\varepsilon)=\mathbb E_P[(1-e^{\varepsilon-L})_+]` on a grid.

    ``pointwise_*``: per-ε bounds (Hoeffding/empirical Bernstein at β/2 each, valid for each ε
    separately); ``band_*``: DKW band valid simultaneously for all ε at level β (use it for tests
    over a grid of ε, no multiplicity correction needed).
    """

    epsilons: tuple[float, ...]
    estimate: tuple[float, ...]
    pointwise_lower: tuple[float, ...]
    pointwise_upper: tuple[float, ...]
    band_lower: tuple[float, ...]
    band_upper: tuple[float, ...]
    significance: float
    num_samples: int


def delta_band(sorted_losses: np.ndarray, eps: float, eta: float) -> tuple[float, float]:
    r"""DKW band for δ(ε): :math:`\delta(\varepsilon)=\int_\varepsilon^\infty S(l)e^{\varepsilon-l}dl`.

    With :math:`|S_n-S|\le\eta` uniformly, integrate :math:`(S_n-\eta)_+` and :math:`\min(1,S_n+\eta)`
    exactly against the density :math:`e^{\varepsilon-l}` on ``[ε, ∞)`` (S_n is a step function).
    """
    n = sorted_losses.size
    # breakpoints above eps
    idx = np.searchsorted(sorted_losses, eps, side="right")  # S_n(l) = (n - idx)/n on [eps, next)
    pts = np.concatenate([[eps], sorted_losses[idx:], [math.inf]])
    # on [pts[m], pts[m+1]) the survival is (n - idx - m)/n
    surv = (n - idx - np.arange(pts.size - 1)) / n
    with np.errstate(over="ignore", invalid="ignore"):
        mass = np.exp(eps - pts[:-1]) - np.exp(eps - pts[1:])  # integral of e^{eps-l} on the piece
    mass = np.nan_to_num(mass, nan=0.0)
    lower = float(np.sum(np.clip(surv - eta, 0.0, None) * mass))
    upper = float(np.sum(np.minimum(1.0, surv + eta) * mass))
    return lower, min(upper, 1.0)


def hockey_stick_delta(losses, epsilons: Sequence[float], significance: float) -> DeltaCurve:
    """δ(ε) estimates with pointwise and simultaneous (DKW) bounds from privacy losses ``L(x), x~P``.

    Losses may be ``+inf`` (contributing 1). See :class:`DeltaCurve` for the bounds.
    """
    beta = check_significance(significance)
    arr = _as_samples("losses", losses, allow_posinf=True)
    eps_arr = np.asarray(epsilons, dtype=np.float64).reshape(-1)
    if eps_arr.size == 0 or not np.isfinite(eps_arr).all():
        raise ValueError(f"epsilons must be a non-empty sequence of finite numbers; got {epsilons!r}")
    n = arr.size
    srt = np.sort(arr)
    eta = min(dkw_radius(n, beta), 1.0)
    # Hoeffding at beta/4 per side and Maurer-Pontil at beta/4 per side: two-sided at beta
    h, u = math.sqrt(math.log(4.0 / beta) / (2.0 * n)), math.log(8.0 / beta)
    est, plo, phi, blo, bhi = [], [], [], [], []
    for eps in eps_arr:
        with np.errstate(over="ignore"):
            terms = np.clip(1.0 - np.exp(float(eps) - arr), 0.0, 1.0)
        mean = float(terms.mean())
        eb = math.sqrt(2.0 * terms.var(ddof=1) * u / n) + 7.0 * u / (3.0 * (n - 1)) if n >= 2 else math.inf
        half = min(h, eb)
        est.append(mean)
        plo.append(max(0.0, mean - half))
        phi.append(min(1.0, mean + half))
        lo, hi = delta_band(srt, float(eps), eta)
        blo.append(lo)
        bhi.append(hi)
    return DeltaCurve(
        tuple(float(e) for e in eps_arr), tuple(est), tuple(plo), tuple(phi), tuple(blo),
        tuple(bhi), beta, n,
    )


# ---------------------------------------------------------------------------------------------
# binomial (black box)


def clopper_pearson_limits(successes, trials, significance: float) -> tuple[np.ndarray, np.ndarray]:
    r"""Clopper–Pearson (1934) limits of binomial proportions k/n, elementwise over arrays of counts: the lower
    :math:`B^{-1}(\beta/2;\, k, n-k+1)` (0 at k = 0) and the upper :math:`B^{-1}(1-\beta/2;\, k+1, n-k)` (1 at
    k = n), B the Beta distribution; each one-sided at β/2. scipy's ``binomtest(k, n).proportion_ci(method="exact")``
    gives the same (tests/test_audit_stats.py) for one count at a time, ~18× slower (a p-value first): too slow for
    one pair per threshold (:meth:`~invink_audit.audit.tradeoff.PrivacyProfile.bounds`)."""
    beta = check_significance(significance)
    k, n = np.asarray(successes, dtype=np.float64), np.asarray(trials, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        lower = np.where(k > 0, stats.beta.ppf(beta / 2, k, n - k + 1), 0.0)
        upper = np.where(k < n, stats.beta.ppf(1 - beta / 2, k + 1, n - k), 1.0)
    return lower, upper


def clopper_pearson(successes: int, trials: int, significance: float) -> Interval:
    """Exact two-sided Clopper–Pearson interval for a binomial proportion (each tail β/2;
    :func:`clopper_pearson_limits`)."""
    for name, v in (("successes", successes), ("trials", trials)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be a non-negative integer; got {v!r}")
    if trials < 1 or successes > trials:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1; got {successes}/{trials}")
    beta = check_significance(significance)
    lower, upper = clopper_pearson_limits(successes, trials, beta)
    return Interval(int(successes) / int(trials), float(lower), float(upper), 1.0 - beta, "clopper-pearson")


def epsilon_lower_bound(
    true_positives: int,
    positives: int,
    false_positives: int,
    negatives: int,
    *,
    delta: float,
    significance: float,
) -> float:
    r"""ε lower bound from a distinguishing test (DP-Sniper / Jagielski et al. 2020 style).

    (ε, δ)-DP implies :math:`\mathrm{TPR} \le e^\varepsilon\,\mathrm{FPR} + \delta` and
    :math:`1-\mathrm{FPR} \le e^\varepsilon (1-\mathrm{TPR}) + \delta` (the complement event), so
    :math:`\varepsilon \ge \log\frac{\underline{\mathrm{TPR}}-\delta}{\overline{\mathrm{FPR}}}` and
    its mirror. Both use only the lower limit of TPR and the upper limit of FPR: one-sided
    Clopper–Pearson limits at β/2 each, so the returned max holds with probability ≥ 1 − β
    (union bound). Returns 0 when no positive bound is certified.
    """
    beta = check_significance(significance)
    if not 0.0 <= float(delta) < 1.0:
        raise ValueError(f"delta must be in [0, 1); got {delta!r}")
    # a two-sided interval at beta has one-sided limits at beta/2
    tpr = clopper_pearson(true_positives, positives, beta)
    fpr = clopper_pearson(false_positives, negatives, beta)
    best = 0.0
    for num, den in ((tpr.lower - delta, fpr.upper), ((1.0 - fpr.upper) - delta, 1.0 - tpr.lower)):
        if num > 0 and den > 0:
            best = max(best, math.log(num / den))
    return best


# ---------------------------------------------------------------------------------------------
# multiple comparisons and verdicts


@dataclass(frozen=True)
class TestResult:
    """One hypothesis test of an audit family: ``H0: quantity <= claimed``."""

    name: str
    p_value: float
    estimate: float
    claimed: float
    rejected: bool = False
    details: dict = field(default_factory=dict)

    def __post_init__(self):
        if not 0.0 <= self.p_value <= 1.0:
            raise ValueError(f"p_value must be in [0, 1]; got {self.p_value!r}")


def holm(p_values: Sequence[float], significance: float) -> list[bool]:
    """Holm (1979) step-down rejections; family-wise error ≤ ``significance`` under any dependence."""
    beta = check_significance(significance)
    p = np.asarray(p_values, dtype=np.float64).reshape(-1)
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"p_values must be in [0, 1]; got {p_values!r}")
    m = p.size
    order = np.argsort(p, kind="stable")
    passed = p[order] <= beta / (m - np.arange(m))  # step down: reject until the first rank that does not pass
    reject = np.zeros(m, dtype=bool)
    reject[order[: m if passed.all() else int(np.argmin(passed))]] = True
    return reject.tolist()


def decide_verdict(
    *,
    exact_failures: int,
    tests: Sequence[TestResult],
    significance: float,
    exact_checks_run: bool,
    min_samples_met: bool = True,
) -> tuple[Verdict, list[TestResult], str]:
    """Verdict of an audit (docs/auditing_notes.md, "Verdicts"); returns (verdict, tests with Holm decisions, reason).

    * VIOLATION: an exact per-step check failed (a deterministic fact, no statistics), or Holm
      rejects some ``H0: quantity <= claimed`` at family-wise level ``significance``.
    * INCONCLUSIVE: no rejection, but the audit cannot support the claim: no exact checks were run
      (a black box only yields lower bounds) or too few samples.
    * PASS otherwise (consistent with the claim): every exact check held and no claim is rejected.
      A point estimate above its claim without significance is consistent with the claim (it is
      named in the reason).
    """
    beta = check_significance(significance)
    rejected = holm([t.p_value for t in tests], beta) if tests else []
    decided = [
        TestResult(t.name, t.p_value, t.estimate, t.claimed, bool(r), dict(t.details))
        for t, r in zip(tests, rejected)
    ]
    n_rej = sum(t.rejected for t in decided)
    if exact_failures > 0:
        return Verdict.VIOLATION, decided, (
            f"{exact_failures} exact per-step check(s) failed; {n_rej} of {len(decided)} statistical "
            f"claims rejected (Holm, family-wise significance {beta:g})"
        )
    if n_rej:
        worst = min((t for t in decided if t.rejected), key=lambda t: t.p_value)
        return (
            Verdict.VIOLATION,
            decided,
            f"{n_rej} of {len(decided)} claims rejected (Holm, family-wise significance {beta:g}); "
            f"smallest p = {worst.p_value:.3g} ({worst.name})",
        )
    if not exact_checks_run:
        return Verdict.INCONCLUSIVE, decided, "no violation detected; a black-box audit cannot confirm a claim"
    if not min_samples_met:
        return Verdict.INCONCLUSIVE, decided, "no violation detected, but too few samples"
    above = [t for t in decided if t.estimate > t.claimed]
    note = (
        f"; {len(above)} point estimate(s) above their claim without significance (e.g. {above[0].name})"
        if above
        else ""
    )
    return Verdict.PASS, decided, (
        f"all exact checks held; no claim rejected among {len(decided)} tests "
        f"(Holm, family-wise significance {beta:g}){note}"
    )
