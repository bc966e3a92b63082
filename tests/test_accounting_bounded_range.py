"""The br-adaptive accountant: certified bracket checked against independent computations."""

import math

import numpy as np
import pytest

from accounting import br_adaptive_delta, composed_delta, zcdp_to_delta
from accounting.bounded_range import br_adaptive_epsilon

BRUTE_GRID = 81  # t values per step in the brute-force adversary
BRUTE_REL_GAP = 2e-2  # brute force on a grid of 81 t's is within 2% of the certified upper bound


def _p(t, eps0):
    return (math.exp(eps0) - np.exp(t)) / math.expm1(eps0)


def _brute_force(epsilon, eps0, steps, grid=BRUTE_GRID):
    """Optimal adaptive adversary by exhaustive search over a t-grid at every node of the outcome tree.

    Independent of the DP: no lattice in x, no convexity, no closed-form shortcuts; it evaluates
    E[(1 - e^{eps - L})_+] for every adaptive strategy (the best t at each node) directly.
    """
    ts = np.linspace(0.0, eps0, grid)

    def value(remaining_budget, k):
        if k == 0:
            return np.maximum(-np.expm1(remaining_budget), 0.0)
        # remaining_budget: array; for each choose the best t (adaptive: per node)
        x = np.asarray(remaining_budget)[..., None]
        hi = value(x - ts, k - 1)  # loss t
        lo = value(x - ts + eps0, k - 1)  # loss t - eps0
        p = _p(ts, eps0)
        return np.max(p * hi + (1 - p) * lo, axis=-1)

    return float(value(np.array(epsilon), steps))


@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize(("epsilon", "eps0"), [(0.1, 0.5), (0.5, 0.5), (0.3, 1.0), (1.0, 1.0), (0.05, 0.2)])
def test_bracket_contains_brute_force(steps, epsilon, eps0):
    bracket = br_adaptive_delta(epsilon, eps0, steps, lattice_steps=32)
    brute = _brute_force(epsilon, eps0, steps)
    # the brute-force adversary is a valid strategy: the certified upper bound must dominate it
    assert brute <= bracket.upper * (1 + 1e-9)
    assert bracket.lower <= bracket.upper
    assert bracket.upper <= brute * (1 + BRUTE_REL_GAP) + 1e-12


def test_single_step_closed_form():
    # T = 1: delta(eps) = max_t p_t (1 - e^{eps - t})_+ exactly (DDR 2020, Lemma 3.2)
    eps0, epsilon = 0.8, 0.2
    ts = np.linspace(0, eps0, 200001)
    exact = float(np.max(_p(ts, eps0) * np.maximum(-np.expm1(epsilon - ts), 0)))
    bracket = br_adaptive_delta(epsilon, eps0, 1, lattice_steps=64)
    assert bracket.lower <= exact * (1 + 1e-9)
    assert exact <= bracket.upper * (1 + 1e-9)
    assert bracket.upper == pytest.approx(exact, rel=1e-3)


def _nonadaptive_delta(epsilon: float, epsilon0: float, num_steps: int, *, grid: int = 2001) -> float:
    r"""DDR 2020 Theorem 3: optimal δ(ε) of the *non-adaptive* composition of T ε0-BR mechanisms.

    .. math:: \delta(\varepsilon) = \max_{t\in[0,\varepsilon_0]} \sum_{i=0}^{T} \binom{T}{i}
              p_t^{T-i}(1-p_t)^{i}\,\big(1 - e^{\varepsilon - (T t - i\varepsilon_0)}\big)_+ .

    The maximum over ``t`` is taken on a grid plus a bounded refinement, so the value returned is a
    lower bound on the non-adaptive optimum (an oracle: the adaptive upper bound must never be below it).
    """
    from scipy import optimize, stats

    i = np.arange(num_steps + 1)

    def value(t: float) -> float:
        p = (math.exp(epsilon0) - math.exp(t)) / math.expm1(epsilon0)
        p = min(max(p, 0.0), 1.0)
        loss = num_steps * t - i * epsilon0
        weights = stats.binom.pmf(i, num_steps, 1.0 - p)
        return float(np.sum(weights * np.maximum(-np.expm1(epsilon - loss), 0.0)))

    ts = np.linspace(0.0, epsilon0, grid)
    vals = np.array([value(t) for t in ts])
    j = int(np.argmax(vals))
    best = float(vals[j])
    lo, hi = ts[max(j - 1, 0)], ts[min(j + 1, grid - 1)]
    if hi > lo:
        res = optimize.minimize_scalar(lambda t: -value(t), bounds=(lo, hi), method="bounded")
        best = max(best, -float(res.fun))
    return best


@pytest.mark.parametrize(("epsilon", "eps0", "steps"), [(1.0, 0.0197, 500), (3.0, 0.1, 100), (0.5, 0.05, 200)])
def test_never_below_nonadaptive_never_above_cks(epsilon, eps0, steps):
    upper = br_adaptive_delta(epsilon, eps0, steps).upper
    nonadaptive = _nonadaptive_delta(epsilon, eps0, steps)  # DDR Theorem 3
    cks = zcdp_to_delta(steps * eps0**2 / 8, epsilon, "cks")
    assert nonadaptive <= upper * (1 + 1e-9)
    assert upper <= cks
    # the accountant itself is min(DP, CKS)
    assert composed_delta(epsilon, eps0, steps, "br-adaptive") == pytest.approx(min(upper, cks))


def test_bracket_shrinks_with_lattice():
    widths = []
    for m in (4, 8, 16, 32):
        b = br_adaptive_delta(1.0, 0.0197, 300, lattice_steps=m)
        widths.append(b.upper - b.lower)
    assert widths == sorted(widths, reverse=True)
    assert widths[-1] < widths[0] / 4


def test_paper_clip_norms_certify_less_epsilon():
    # docs/accounting_notes.md §5: the paper's C (B=7, tau=1.2, T=500, delta=1e-6) certify about 0.89/2.82/4.66/9.41
    expected = {0.08: 0.894, 0.23: 2.823, 0.36: 4.662, 0.66: 9.42}
    for clip_norm, eps in expected.items():
        eps0 = 2 * clip_norm / (7 * 1.2)
        assert br_adaptive_epsilon(1e-6, eps0, 500) == pytest.approx(eps, abs=0.01)


def test_heterogeneous_steps_match_homogeneous_and_round_up():
    eps0 = 0.05
    homogeneous = br_adaptive_delta(0.6, eps0, 60)
    array = br_adaptive_delta(0.6, np.full(60, eps0))
    assert array.upper == pytest.approx(homogeneous.upper, rel=1e-12)
    # steps with a larger epsilon0 can only cost more
    mixed = br_adaptive_delta(0.6, np.r_[np.full(30, eps0), np.full(30, 2 * eps0)])
    assert mixed.upper > homogeneous.upper
    bigger = br_adaptive_delta(0.6, 2 * eps0, 60)
    assert mixed.upper < bigger.upper


def test_epsilon_is_consistent_with_delta():
    eps0, steps, delta = 0.03, 400, 1e-6
    eps = br_adaptive_epsilon(delta, eps0, steps)
    assert br_adaptive_delta(eps, eps0, steps).upper <= delta * (1 + 1e-6)
    assert br_adaptive_delta(eps * 0.99, eps0, steps).lower > delta * 0.999


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epsilon": -1.0, "epsilon0": 0.1, "num_steps": 3}, "epsilon"),
        ({"epsilon": 1.0, "epsilon0": 0.0, "num_steps": 3}, "epsilon0"),
        ({"epsilon": 1.0, "epsilon0": math.nan, "num_steps": 3}, "epsilon0"),
        ({"epsilon": 1.0, "epsilon0": 0.1, "num_steps": 0}, "num_steps"),
        ({"epsilon": 1.0, "epsilon0": [0.1, -1.0]}, "epsilon0"),
        ({"epsilon": 1.0, "epsilon0": 0.1, "num_steps": 3, "lattice_steps": 1}, "lattice_steps"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        br_adaptive_delta(**kwargs)
