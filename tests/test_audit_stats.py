"""Statistics of the auditor against independent computations (numerical integration, scipy,
exact enumeration) and coverage at the stated significance level."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sps

from invink_audit.audit import stats

# Coverage tests: R replicates, each interval should miss with probability <= SIG. We accept up to
# the binomial(R, SIG) upper 1e-4 quantile of misses, so a correct (conservative) method fails this
# test with probability < 1e-4 (the tests are seeded, so they are deterministic anyway).
SIG = 0.1
REPLICATES = 300
MAX_MISSES = int(sps.binom.ppf(1 - 1e-4, REPLICATES, SIG))
TOL = 1e-9


def _integrate_survival_lower(x, a, eta):
    """Independent Anderson lower bound: midpoint integration of (S_n - eta)_+ on a fine grid."""
    x = np.sort(np.asarray(x, dtype=float))
    grid = np.linspace(a, x.max(), 400_001)
    mid = 0.5 * (grid[1:] + grid[:-1])
    surv = 1.0 - np.searchsorted(x, mid, side="right") / x.size
    return a + float(np.sum(np.clip(surv - eta, 0, None) * np.diff(grid)))


def _integrate_survival_upper(x, a, b, eta):
    x = np.sort(np.asarray(x, dtype=float))
    grid = np.linspace(a, b, 400_001)
    mid = 0.5 * (grid[1:] + grid[:-1])
    surv = 1.0 - np.searchsorted(x, mid, side="right") / x.size
    return a + float(np.sum(np.minimum(1.0, surv + eta) * np.diff(grid)))


@given(
    st.lists(st.floats(0.0, 5.0), min_size=1, max_size=30),
    st.sampled_from([0.01, 0.1, 0.5]),
)
def test_anderson_bounds_equal_numerical_integration(values, beta):
    a, b = 0.0, 5.0
    log_vals = np.log(np.maximum(values, 1e-300))
    eta = min(stats.dkw_radius(len(values), beta), 1.0)
    lo, hi = stats.anderson_mean_bounds(log_vals, beta, log_lower=math.log(1e-300), log_upper=math.log(b))
    assert math.exp(lo) == pytest.approx(_integrate_survival_lower(values, a, eta), abs=1e-4)
    assert math.exp(hi) == pytest.approx(_integrate_survival_upper(values, a, b, eta), abs=1e-4)
    assert math.exp(lo) <= np.mean(values) + 1e-9 <= math.exp(hi) + 2e-9


def test_anderson_lower_bound_without_upper_range_is_trimmed_mean():
    vals = np.arange(1.0, 101.0)
    lo, hi = stats.anderson_mean_bounds(np.log(vals), 0.05)
    assert hi == math.inf
    eta = stats.dkw_radius(100, 0.05)
    assert math.exp(lo) == pytest.approx(_integrate_survival_lower(vals, 0.0, eta), rel=1e-5)


def _discrete(rng, values, probs, n):
    return rng.choice(values, size=n, p=probs)


@pytest.mark.parametrize("n", [20, 200])
def test_mean_bounds_cover_at_stated_rate(n):
    rng = np.random.default_rng(1)
    values = np.array([1.0, 2.0, 50.0])
    probs = np.array([0.6, 0.35, 0.05])
    true_log_mean = math.log(float(values @ probs))
    misses = {"anderson": 0, "bernstein": 0, "combined": 0}
    for _ in range(REPLICATES):
        logs = np.log(_discrete(rng, values, probs, n))
        lo, hi = stats.anderson_mean_bounds(logs, SIG, log_lower=0.0, log_upper=math.log(50.0))
        misses["anderson"] += not (lo - TOL <= true_log_mean <= hi + TOL)
        lo, hi = stats.empirical_bernstein_mean_bounds(logs, SIG, log_lower=0.0, log_upper=math.log(50.0))
        misses["bernstein"] += not (lo - TOL <= true_log_mean <= hi + TOL)
        lo, hi, _ = stats.log_mean_bounds(logs, SIG, log_lower=0.0, log_upper=math.log(50.0))
        misses["combined"] += not (lo - TOL <= true_log_mean <= hi + TOL)
    assert max(misses.values()) <= MAX_MISSES, misses


def _exact_renyi(p, q, alpha):
    return math.log(np.sum(p**alpha * q ** (1 - alpha))) / (alpha - 1)


def _two_step_chain():
    """A two-token-step 'mechanism' over V=3, with prefix-dependent distributions (adaptive)."""
    p1 = np.array([0.5, 0.3, 0.2])
    q1 = np.array([0.35, 0.4, 0.25])
    p2 = {0: np.array([0.6, 0.2, 0.2]), 1: np.array([0.1, 0.45, 0.45]), 2: np.array([0.3, 0.3, 0.4])}
    q2 = {0: np.array([0.45, 0.3, 0.25]), 1: np.array([0.15, 0.4, 0.45]), 2: np.array([0.3, 0.35, 0.35])}
    return p1, q1, p2, q2


def _enumerate(p1, q1, p2, q2):
    P, Q = [], []
    for a in range(3):
        for b in range(3):
            P.append(p1[a] * p2[a][b])
            Q.append(q1[a] * q2[a][b])
    return np.array(P), np.array(Q)


@pytest.mark.parametrize("alpha", [2.0, 4.0])
def test_renyi_monte_carlo_and_importance_sampling_cover_exact_divergence(alpha):
    """Exact enumeration of a 2-step adaptive chain: both intervals cover D_alpha at the stated rate."""
    rng = np.random.default_rng(7)
    p1, q1, p2, q2 = _two_step_chain()
    P, Q = _enumerate(p1, q1, p2, q2)
    exact = _exact_renyi(P, Q, alpha)
    losses_all = np.log(P / Q)
    loss_upper = float(losses_all.max())
    # geometric mixture per step and the per-step divergence along each path
    g1 = p1**alpha * q1 ** (1 - alpha)
    d1 = math.log(g1.sum()) / (alpha - 1)
    g1 = g1 / g1.sum()
    misses_mc = misses_is = 0
    n = 400
    widths_mc, widths_is = [], []
    for _ in range(REPLICATES):
        idx = rng.choice(9, size=n, p=P)
        mc = stats.renyi_monte_carlo(losses_all[idx], alpha, SIG, loss_upper=loss_upper, claimed=None)
        misses_mc += not mc.interval.contains(exact)
        first = rng.choice(3, size=n, p=g1)
        sums = np.empty(n)
        for a in range(3):
            g2 = p2[a] ** alpha * q2[a] ** (1 - alpha)
            sums[first == a] = d1 + math.log(g2.sum()) / (alpha - 1)
        s_upper = float(sums.max()) + 1.0
        est = stats.renyi_importance_sampling(sums, alpha, SIG, sum_upper=s_upper)
        misses_is += not est.interval.contains(exact)
        widths_mc.append(mc.interval.upper - mc.interval.lower)
        widths_is.append(est.interval.upper - est.interval.lower)
    assert misses_mc <= MAX_MISSES
    assert misses_is <= MAX_MISSES
    # sanity of the estimators themselves (consistency): the IS point estimate is accurate
    assert est.interval.estimate == pytest.approx(exact, abs=0.05)


def test_renyi_infinite_loss_gives_infinite_divergence_and_tiny_p_value():
    losses = np.array([0.1, -0.2, math.inf] * 10)
    est = stats.renyi_monte_carlo(losses, 2.0, 0.05, loss_upper=1.0, claimed=0.5)
    assert est.interval.lower == math.inf
    # the DKW lower bound stays infinite while the radius eta < 1/3 (the fraction of infinite
    # losses): eta = sqrt(log(2/beta) / 60) = 1/3  <=>  beta = 2 exp(-60/9)
    assert est.p_value == pytest.approx(2 * math.exp(-60 / 9), rel=1e-6)


def test_renyi_p_value_is_valid_under_the_null():
    """Under H0 (claim = true divergence), p-values are super-uniform: P(p <= s) <= s."""
    rng = np.random.default_rng(3)
    p1, q1, p2, q2 = _two_step_chain()
    P, Q = _enumerate(p1, q1, p2, q2)
    alpha = 3.0
    exact = _exact_renyi(P, Q, alpha)
    losses_all = np.log(P / Q)
    small = 0
    for _ in range(REPLICATES):
        idx = rng.choice(9, size=200, p=P)
        est = stats.renyi_monte_carlo(losses_all[idx], alpha, SIG, claimed=exact)
        small += est.p_value <= SIG
    assert small <= MAX_MISSES


def test_renyi_detects_a_claim_far_below_the_truth():
    rng = np.random.default_rng(4)
    p, q = np.array([0.9, 0.1]), np.array([0.1, 0.9])
    exact = _exact_renyi(p, q, 2.0)
    idx = rng.choice(2, size=2000, p=p)
    est = stats.renyi_monte_carlo(np.log(p / q)[idx], 2.0, 0.05, claimed=exact / 4)
    assert est.p_value < 1e-6


def _exact_delta(P, Q, eps):
    return float(np.sum(np.clip(P - math.exp(eps) * Q, 0, None)))


def test_delta_curve_covers_exact_hockey_stick_and_band_matches_integration():
    rng = np.random.default_rng(11)
    p1, q1, p2, q2 = _two_step_chain()
    P, Q = _enumerate(p1, q1, p2, q2)
    losses_all = np.log(P / Q)
    eps_grid = [0.0, 0.1, 0.3, 0.6]
    exact = [_exact_delta(P, Q, e) for e in eps_grid]
    misses_point = misses_band = 0
    for _ in range(REPLICATES):
        idx = rng.choice(9, size=300, p=P)
        curve = stats.hockey_stick_delta(losses_all[idx], eps_grid, SIG)
        # pointwise intervals: count a miss per eps (each is at SIG)
        misses_point += any(
            not (lo - TOL <= d <= hi + TOL) for lo, d, hi in zip(curve.pointwise_lower, exact, curve.pointwise_upper)
        )
        misses_band += any(not (lo - TOL <= d <= hi + TOL) for lo, d, hi in zip(curve.band_lower, exact, curve.band_upper))
    assert misses_band <= MAX_MISSES
    # pointwise: union over 4 eps may miss up to 4*SIG; a correct method stays far below
    assert misses_point <= int(sps.binom.ppf(1 - 1e-4, REPLICATES, 4 * SIG))
    # the estimator is the plug-in mean; check it against an independent per-sample formula
    sample = losses_all[rng.choice(9, size=50, p=P)]
    curve = stats.hockey_stick_delta(sample, [0.2], SIG)
    assert curve.estimate[0] == pytest.approx(np.mean([max(0.0, 1 - math.exp(0.2 - l)) for l in sample]))
    # DKW band: direct numerical integration of (S_n - eta)_+ e^{eps-l} on [eps, max]
    eta = stats.dkw_radius(50, SIG)
    grid = np.linspace(0.2, sample.max() + 1e-9, 200_001)
    mid = 0.5 * (grid[1:] + grid[:-1])
    surv = 1.0 - np.searchsorted(np.sort(sample), mid, side="right") / 50
    lower = np.sum(np.clip(surv - eta, 0, None) * np.exp(0.2 - mid) * np.diff(grid))
    assert curve.band_lower[0] == pytest.approx(lower, abs=1e-4)


def test_delta_with_infinite_losses_counts_them_fully():
    curve = stats.hockey_stick_delta([math.inf, 0.0, math.inf, 0.0], [1.0], 0.1)
    assert curve.estimate[0] == pytest.approx(0.5)


#: (k, n, β, lower, upper) of the hand-written scalar Clopper–Pearson this module had (computed before its removal)
OLD_CLOPPER_PEARSON = [(0, 10, 0.05, 0.0, 0.3084971078187607), (3, 10, 0.05, 0.06673951117773447, 0.6524528500599973),
                       (10, 10, 0.05, 0.6915028921812392, 1.0), (17, 40, 0.01, 0.23079054982871228, 0.6373783434032138),
                       (1, 1, 0.3, 0.15, 1.0), (250, 1000, 1e-6, 0.18696036048800804, 0.32120494149208306)]  # fmt: skip


@given(st.integers(0, 40), st.integers(1, 40), st.sampled_from([0.01, 0.05, 0.3]))
def test_clopper_pearson_matches_scipy(k, n, beta):
    k = min(k, n)
    ours = stats.clopper_pearson(k, n, beta)
    ref = sps.binomtest(k, n).proportion_ci(confidence_level=1 - beta, method="exact")
    assert ours.lower == pytest.approx(ref.low, abs=1e-9)
    assert ours.upper == pytest.approx(ref.high, abs=1e-9)
    assert ours.estimate == k / n and ours.confidence == 1 - beta and ours.contains(k / n)


@pytest.mark.parametrize(("k", "n", "beta", "lower", "upper"), OLD_CLOPPER_PEARSON)
def test_clopper_pearson_keeps_its_values_and_the_vectorised_limits_are_the_scalar_ones(k, n, beta, lower, upper):
    iv = stats.clopper_pearson(k, n, beta)
    assert (iv.lower, iv.upper) == pytest.approx((lower, upper), rel=1e-13, abs=1e-300)
    counts = np.array([0, k, n])
    lows, highs = stats.clopper_pearson_limits(counts, n, beta)
    for c, lo, hi in zip(counts, lows, highs):
        scalar = stats.clopper_pearson(int(c), n, beta)
        assert (lo, hi) == (scalar.lower, scalar.upper)


def test_epsilon_lower_bound_is_valid_for_randomized_response():
    """Randomized response is exactly eps-DP: the lower bound may exceed eps at rate <= SIG."""
    rng = np.random.default_rng(5)
    eps = 1.0
    p_true = math.exp(eps) / (1 + math.exp(eps))
    over = 0
    bounds = []
    for _ in range(REPLICATES):
        n = 500
        tp = int(rng.binomial(n, p_true))
        fp = int(rng.binomial(n, 1 - p_true))
        lb = stats.epsilon_lower_bound(tp, n, fp, n, delta=0.0, significance=SIG)
        over += lb > eps
        bounds.append(lb)
    assert over <= MAX_MISSES
    assert np.median(bounds) > 0.5  # and it has power


def test_epsilon_lower_bound_perfect_distinguisher_closed_form():
    n, beta = 100, 0.05
    lb = stats.epsilon_lower_bound(n, n, 0, n, delta=0.0, significance=beta)
    # CP one-sided limits at beta/2: TPR >= (beta/2)^(1/n), FPR <= 1 - (beta/2)^(1/n)
    t = (beta / 2) ** (1 / n)
    assert lb == pytest.approx(math.log(t / (1 - t)), rel=1e-9)


def _holm_reference(p, beta):
    m = len(p)
    order = sorted(range(m), key=lambda i: p[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return [a <= beta for a in adjusted]


@given(st.lists(st.floats(0, 1), min_size=1, max_size=20), st.sampled_from([0.01, 0.05, 0.2]))
def test_holm_equals_adjusted_p_value_reference(p, beta):
    assert stats.holm(p, beta) == _holm_reference(p, beta)
    # Holm rejects everything Bonferroni (each test at beta / m) rejects
    assert all(h or not b for h, b in zip(stats.holm(p, beta), (x <= beta / len(p) for x in p)))


def test_p_value_bisection_matches_hoeffding_closed_form():
    n, gap = 100, 0.2

    def lower_at(beta):  # Hoeffding lower bound of a mean of [0,1] variables with sample mean 0.5
        return 0.5 - math.sqrt(math.log(1 / beta) / (2 * n))

    p = stats.p_value_from_lower_bound(lower_at, 0.5 - gap)
    assert p == pytest.approx(math.exp(-2 * n * gap**2), rel=1e-6)
    assert p >= math.exp(-2 * n * gap**2)  # conservative side


def test_verdict_logic():
    ok = stats.TestResult("a", 0.5, 0.1, 0.2)
    bad = stats.TestResult("b", 1e-9, 0.5, 0.2)
    above = stats.TestResult("c", 0.3, 0.25, 0.2)
    V = stats.Verdict
    assert stats.decide_verdict(exact_failures=0, tests=[ok], significance=0.05, exact_checks_run=True)[0] is V.PASS
    assert stats.decide_verdict(exact_failures=1, tests=[ok], significance=0.05, exact_checks_run=True)[0] is V.VIOLATION
    v, decided, _ = stats.decide_verdict(exact_failures=0, tests=[ok, bad], significance=0.05, exact_checks_run=True)
    assert v is V.VIOLATION and [t.rejected for t in decided] == [False, True]
    v, _, reason = stats.decide_verdict(exact_failures=0, tests=[ok, above], significance=0.05, exact_checks_run=True)
    assert v is V.PASS and "above their claim without significance" in reason
    assert stats.decide_verdict(exact_failures=0, tests=[ok], significance=0.05, exact_checks_run=True, min_samples_met=False)[0] is V.INCONCLUSIVE
    assert stats.decide_verdict(exact_failures=0, tests=[ok], significance=0.05, exact_checks_run=False)[0] is V.INCONCLUSIVE


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: stats.renyi_monte_carlo([0.1], 1.0, 0.05), "alpha"),
        (lambda: stats.renyi_monte_carlo([0.1], 2.0, 1.5), "significance"),
        (lambda: stats.renyi_monte_carlo([], 2.0, 0.05), "at least one"),
        (lambda: stats.renyi_monte_carlo([float("nan")], 2.0, 0.05), "NaN"),
        (lambda: stats.renyi_importance_sampling([-1.0], 2.0, 0.05, sum_upper=1.0), ">= 0"),
        (lambda: stats.clopper_pearson(5, 3, 0.05), "successes"),
        (lambda: stats.dkw_radius(0, 0.05), "n must"),
        (lambda: stats.hockey_stick_delta([0.1], [], 0.05), "epsilons"),
        (lambda: stats.epsilon_lower_bound(1, 2, 1, 2, delta=1.0, significance=0.05), "delta"),
    ],
)
def test_bad_input_is_rejected(call, match):
    with pytest.raises(ValueError, match=match):
        call()
