"""Conversions between ρ-zCDP, μ-Gaussian DP and (ε, δ)-DP.

:class:`ConversionMethod`: ``bun-steinke`` (Bun & Steinke 2016, arXiv:1605.02065, Prop. 1.3), ``cks``
(Canonne, Kamath & Steinke 2020, arXiv:2004.00010, Prop. 12; the paper's and the reference package's
choice), ``rdp`` (dp-accounting's ``RdpAccountant``, an independent cross-check); :func:`zcdp_to_epsilon`,
:func:`zcdp_to_delta`, :func:`epsilon_to_zcdp`, and ε0-BR → ρ (:func:`br_to_zcdp`). Rényi bounds at stated orders
→ (ε, δ): :func:`rdp_to_epsilon`, :func:`rdp_to_delta` (the same Prop. 12, minimised over the orders given). Results are rounded to
the safe side. Never use the Gaussian profile with μ = √(2ρ) (Balle & Wang 2018) as a zCDP conversion.

μ-GDP (Dong, Roth & Su 2022, JRSS-B, arXiv:1905.02383), for μ-GDP mechanisms only (composed Gaussians):
:func:`gdp_to_delta`, :func:`gdp_to_epsilon` (errs high), :func:`epsilon_to_gdp` (errs low).

Design: docs/accounting_notes.md §3.
"""

from __future__ import annotations

import enum
import math

import numpy as np
from scipy import optimize, special

from accounting._validation import check_delta, check_nonnegative, check_order
from accounting.sensitivity import coerce_enum

__all__ = [
    "ConversionMethod",
    "br_to_zcdp",
    "br_to_zcdp_total",
    "epsilon_to_gdp",
    "epsilon_to_zcdp",
    "gdp_to_delta",
    "gdp_to_epsilon",
    "rdp_to_delta",
    "rdp_to_epsilon",
    "zcdp_to_delta",
    "zcdp_to_epsilon",
]


class ConversionMethod(enum.Enum):
    """How a ρ-zCDP guarantee is turned into (ε, δ)."""

    BUN_STEINKE = "bun-steinke"
    CKS = "cks"
    RDP = "rdp"


def br_to_zcdp(epsilon0: float) -> float:
    r"""ρ of one ε0-bounded-range step: :math:`\rho = \varepsilon_0^2/8` (Cesar & Rogers 2021,
    arXiv:2004.07223, Lemma 3.2). The one place this conversion is written: InvisibleInk's per-token
    :math:`\rho_{tok} = \varepsilon_0^2/8 = C^2/(2B^2\tau^2)` (paper Theorem 2, thm:accounting) and every accountant use it.
    Computed as ε0·ε0/8, so a huge ε0 gives ``inf`` rather than ``OverflowError``."""
    e0 = float(epsilon0)
    return e0 * e0 / 8.0


def br_to_zcdp_total(epsilon0s) -> float:
    r""":math:`\sum_t \varepsilon_{0,t}^2/8`: the ρ of a sequence of bounded-range steps, each by
    :func:`br_to_zcdp`, composed additively (zCDP composition, Bun & Steinke 2016, arXiv:1605.02065,
    Lemma 2.3)."""
    return float(np.sum(np.asarray(epsilon0s, dtype=np.float64) ** 2)) / 8.0


def _up(x: float) -> float:
    return math.nextafter(x, math.inf) if math.isfinite(x) and x != 0.0 else x


# --- Canonne–Kamath–Steinke ------------------------------------------------------------------------

# log-spaced grid of (alpha - 1) used to bracket the minimiser before a bounded Brent refinement
_CKS_LOG_AM1_GRID = np.linspace(math.log(1e-4), math.log(1e7), 1201)


def _prop12_log_delta(alpha, rdp, epsilon: float):
    """log δ of CKS Prop. 12 for a Rényi bound ``rdp`` at order ``alpha`` (vectorised)."""
    am1 = alpha - 1.0
    return am1 * (rdp - epsilon) - np.log(alpha) + am1 * np.log1p(-1.0 / alpha)


def _prop12_epsilon(alpha, rdp, log_inv_delta: float):
    """ε of CKS Prop. 12 for a Rényi bound ``rdp`` at order ``alpha`` (vectorised)."""
    return rdp + np.log1p(-1.0 / alpha) + (log_inv_delta - np.log(alpha)) / (alpha - 1.0)


def _cks_neg_rho_at(am1: np.ndarray, epsilon: float, log_inv_delta: float) -> np.ndarray:
    """−(ε − c(α))/α where ε(α) = αρ + c(α) is the CKS curve (vectorised, α = 1 + am1)."""
    alpha = 1.0 + am1
    c = np.log1p(-1.0 / alpha) + (log_inv_delta - np.log(alpha)) / am1
    return -(epsilon - c) / alpha


@np.errstate(over="ignore", invalid="ignore")
def _minimise_over_alpha(fn) -> float:
    """min over α > 1 of a unimodal-in-practice function of (α − 1); any α is a valid bound.

    Orders at which the function overflows evaluate to ±inf and are simply not chosen (no warning).
    """
    values = fn(np.exp(_CKS_LOG_AM1_GRID))
    i = int(np.nanargmin(values))
    best = float(values[i])
    lo = _CKS_LOG_AM1_GRID[max(i - 1, 0)]
    hi = _CKS_LOG_AM1_GRID[min(i + 1, len(_CKS_LOG_AM1_GRID) - 1)]
    if hi > lo:
        res = optimize.minimize_scalar(
            lambda u: float(fn(np.array([math.exp(u)]))[0]),
            bounds=(lo, hi),
            method="bounded",
            options={"xatol": 1e-12},
        )
        if math.isfinite(res.fun) and res.fun < best:
            best = float(res.fun)
    return best


def _cks_epsilon(rho: float, delta: float) -> float:
    """ε of CKS Prop. 12 for ρ-zCDP (D_α ≤ αρ), minimised over α = 1 + am1."""
    log_inv_delta = -math.log(delta)
    return max(0.0, _minimise_over_alpha(lambda am1: _prop12_epsilon(1.0 + am1, (1.0 + am1) * rho, log_inv_delta)))


def _cks_delta(rho: float, epsilon: float) -> float:
    """δ of CKS Prop. 12 for ρ-zCDP; log δ → 0 as α → 1, so δ ≤ 1: clamped before exponentiating (huge ρ)."""
    log_delta = _minimise_over_alpha(lambda am1: _prop12_log_delta(1.0 + am1, (1.0 + am1) * rho, epsilon))
    return math.exp(min(0.0, log_delta))


# --- dp-accounting RDP ---------------------------------------------------------------------------


def _rdp_accountant(rho: float):
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant

    accountant = rdp_privacy_accountant.RdpAccountant()
    with np.errstate(over="ignore", invalid="ignore"):  # huge ρ: orders that overflow are never chosen
        accountant.compose(dp_event.ZCDpEvent(rho))
    return accountant


# --- public API ----------------------------------------------------------------------------------


def zcdp_to_epsilon(rho: float, delta: float, method: ConversionMethod | str = "cks") -> float:
    r"""The ε of an (ε, δ)-DP guarantee implied by ρ-zCDP (module docstring gives the sources).

    ``rho = 0`` gives ε = 0; ``rho = inf`` gives ε = inf. The result errs upwards (safe).
    """
    rho = check_nonnegative("rho", rho, allow_inf=True)
    delta = check_delta("delta", delta)
    method = coerce_enum(method, ConversionMethod, "method")
    if rho == 0.0:
        return 0.0
    if math.isinf(rho):
        return math.inf
    if method is ConversionMethod.BUN_STEINKE:
        eps = rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))
    elif method is ConversionMethod.CKS:
        eps = _cks_epsilon(rho, delta)
    else:
        eps = float(_rdp_accountant(rho).get_epsilon(delta))
    return _up(eps)


def zcdp_to_delta(rho: float, epsilon: float, method: ConversionMethod | str = "cks") -> float:
    r"""The δ at which ρ-zCDP implies (ε, δ)-DP (module docstring gives the sources).

    For Bun–Steinke, inverting Prop. 1.3 gives :math:`\delta = \exp(-(\varepsilon-\rho)^2/(4\rho))`
    for ε > ρ and 1 otherwise. ``rho = 0`` gives δ = 0. The result errs upwards (safe).
    """
    rho = check_nonnegative("rho", rho, allow_inf=True)
    epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True)
    method = coerce_enum(method, ConversionMethod, "method")
    if rho == 0.0 or math.isinf(epsilon):
        return 0.0
    if math.isinf(rho):
        return 1.0
    if method is ConversionMethod.BUN_STEINKE:
        delta = math.exp(-((epsilon - rho) ** 2) / (4.0 * rho)) if epsilon > rho else 1.0
    elif method is ConversionMethod.CKS:
        delta = _cks_delta(rho, epsilon)
    else:
        try:
            delta = float(_rdp_accountant(rho).get_delta(epsilon))
        except (ValueError, OverflowError):
            # dp-accounting takes log1p(-exp(-r)) and fails when a tiny ρ rounds r to 0; CKS is the same
            # bound minimised over every order (not a finite grid), so it is a valid δ for this ρ
            delta = _cks_delta(rho, epsilon)
    return min(1.0, _up(delta))


def _shrink_until_feasible(rho: float, spends, epsilon: float) -> float:
    """Lower ``rho`` until ``spends(rho) <= epsilon`` (a floating-point guard on an inverse).

    The relative step starts at one ulp (2^-52) and doubles, so the loop ends after at most ~55 evaluations
    however far off ``rho`` is (a fixed step never ended for ε near 1e308; hang probes:
    ``tests/test_accounting_limits.py``), and the result is at most a factor (1 + 2·step) below the
    boundary: the safe side.
    """
    if not math.isfinite(rho):
        raise ValueError(f"epsilon={epsilon!r} is too large for this conversion (rho={rho!r})")
    shrink = 2.0**-52
    while rho > 0.0 and spends(rho) > epsilon:
        rho *= 1.0 - shrink
        shrink = min(2.0 * shrink, 0.5)
        if rho < 1e-300:
            return 0.0
    return rho


def epsilon_to_zcdp(epsilon: float, delta: float, method: ConversionMethod | str = "cks") -> float:
    r"""The largest ρ whose ``method`` conversion gives at most ``epsilon`` at ``delta``.

    Bun–Steinke inverts in closed form, :math:`\rho = (\sqrt{\log(1/\delta)+\varepsilon} -
    \sqrt{\log(1/\delta)})^2`; CKS and RDP are inverted by bisection on the monotone map ρ ↦ ε(ρ).
    The result is the *lower* end (it never spends more than ``epsilon``); ``epsilon = inf`` gives inf.
    """
    epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True)
    delta = check_delta("delta", delta)
    method = coerce_enum(method, ConversionMethod, "method")
    if epsilon == 0.0:
        return 0.0
    if math.isinf(epsilon):
        return math.inf

    def spends(rho: float) -> float:
        return zcdp_to_epsilon(rho, delta, method)

    log_inv_delta = math.log(1.0 / delta)
    if method is ConversionMethod.CKS:
        # ε_cks(ρ) = min_α [αρ + c(α)] is a minimum of lines in ρ, so the largest feasible ρ is
        # max_α (ε − c(α))/α; every α gives a feasible ρ, the maximiser the exact inverse.
        rho = max(0.0, -_minimise_over_alpha(lambda am1: _cks_neg_rho_at(am1, epsilon, log_inv_delta)))
        return _shrink_until_feasible(rho, spends, epsilon)
    # Bun–Steinke closed form: exact up to rounding for that method, a starting bracket for RDP
    lo = (math.sqrt(log_inv_delta + epsilon) - math.sqrt(log_inv_delta)) ** 2
    if method is ConversionMethod.BUN_STEINKE:
        return _shrink_until_feasible(lo, spends, epsilon)  # floating point at the closed form's edge
    if spends(lo) <= epsilon:
        hi = 2.0 * lo
        while spends(hi) <= epsilon:
            lo, hi = hi, 2.0 * hi
    else:  # dp-accounting's finite grid of orders can be looser than Bun–Steinke (tiny epsilon)
        lo, hi = 0.0, lo
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        lo, hi = (mid, hi) if spends(mid) <= epsilon else (lo, mid)
        if hi - lo <= 1e-13 * hi:
            break
    return lo


# --- Rényi DP at stated orders --------------------------------------------------------------------


def _rdp_bounds(bounds) -> tuple[np.ndarray, np.ndarray]:
    """The stated orders and bounds of ``{α: bound}`` as arrays (every α > 1, every bound >= 0 or inf)."""
    items = dict(bounds).items()
    if not items:
        raise ValueError("renyi bounds must state at least one order; got {}")
    orders = [check_order("alpha", a) for a, _ in items]
    values = [check_nonnegative("renyi bound", b, allow_inf=True) for _, b in items]
    return np.asarray(orders), np.asarray(values)


def rdp_to_delta(bounds, epsilon: float) -> float:
    r"""δ(ε) implied by Rényi bounds :math:`D_\alpha \le b_\alpha` at the stated orders (``{α: b}``), minimised over
    them: Canonne, Kamath & Steinke 2020 (arXiv:2004.00010), Prop. 12, :math:`\delta = \frac{e^{(\alpha-1)(b-\varepsilon)}}
    {\alpha}(1-\tfrac1\alpha)^{\alpha-1}` (also Balle et al. 2020, arXiv:1905.09982, Thm. 21), and
    :math:`\delta(\varepsilon) \le \delta(0) = TV \le \sqrt{1-e^{-b}}` (KL ≤ D_α; Bretagnolle & Huber 1979), as
    dp-accounting's ``compute_delta`` does. Errs upwards."""
    orders, values = _rdp_bounds(bounds)
    epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True)
    if math.isinf(epsilon) or not values.any():
        return 0.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        log_delta = np.minimum(_prop12_log_delta(orders, values, epsilon), 0.5 * np.log(-np.expm1(-values)))
    return min(1.0, _up(math.exp(min(0.0, float(np.nanmin(log_delta))))))


def rdp_to_epsilon(bounds, delta: float) -> float:
    r"""The ε at ``delta`` implied by Rényi bounds ``{α: b}`` (:func:`rdp_to_delta`'s sources), minimised over the
    stated orders: :math:`\varepsilon = b + \log(1-\tfrac1\alpha) - \frac{\log\delta + \log\alpha}{\alpha-1}`, and 0
    where :math:`\delta \ge \sqrt{1-e^{-b}}`. Errs upwards."""
    orders, values = _rdp_bounds(bounds)
    delta = check_delta("delta", delta)
    with np.errstate(over="ignore", invalid="ignore"):
        eps = np.where(delta * delta + np.expm1(-values) > 0, 0.0, _prop12_epsilon(orders, values, -math.log(delta)))
    return _up(max(0.0, float(np.nanmin(eps))))


# --- μ-Gaussian DP ---------------------------------------------------------------------------------

#: Relative upward rounding of the root in :func:`gdp_to_epsilon`: many times δ(ε)'s few ulps of rounding error.
_GDP_ROUNDING = 1e-9
#: Above this relative closeness of the two terms of δ(ε) the bound μ·φ(m) replaces their difference.
_CANCELLATION = 1e-6


def _gdp_log_delta(mu: float, epsilon: float) -> float:
    """log δ(ε) of μ-GDP (:func:`gdp_to_delta`), log Φ(a) + log(1 − e^ε Φ(b)/Φ(a)) with a − b = μ; −inf for μ = 0.

    Where the two terms nearly cancel (ratio above 1 − 1e-6: tiny μ), the difference would lose its digits;
    there it returns the upper bound δ ≤ Φ(a) − Φ(b) ≤ μ·φ(m), m the distance of [b, a] from 0 (errs high).
    """
    if mu == 0.0 or math.isinf(epsilon):
        return -math.inf
    if math.isinf(mu):
        return 0.0
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    log_phi_a = float(special.log_ndtr(a))
    ratio = math.exp(min(0.0, epsilon + float(special.log_ndtr(b)) - log_phi_a))
    if ratio <= 1.0 - _CANCELLATION:
        return log_phi_a + math.log1p(-ratio)
    m = 0.0 if b <= 0.0 <= a else min(abs(a), abs(b))
    return min(0.0, math.log(mu) - 0.5 * m * m - 0.5 * math.log(2.0 * math.pi))


def gdp_to_delta(mu: float, epsilon: float) -> float:
    r"""δ(ε) of μ-GDP: :math:`\Phi(-\varepsilon/\mu + \mu/2) - e^\varepsilon\Phi(-\varepsilon/\mu - \mu/2)`
    (Dong, Roth & Su 2022, JRSS-B, Cor. 2.13; the analytic Gaussian mechanism, Balle & Wang 2018,
    arXiv:1805.06530, Thm. 8). μ = 0 (nothing learned) gives 0, μ = ∞ (no privacy) gives 1 at every finite ε,
    ε = ∞ gives 0. Computed in log space; never below the curve (where its terms cancel it errs high)."""
    mu = check_nonnegative("mu", mu, allow_inf=True)
    epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True)
    return math.exp(_gdp_log_delta(mu, epsilon))


def gdp_to_epsilon(mu: float, delta: float) -> float:
    r"""The smallest ε with :func:`gdp_to_delta` ``(mu, ε) ≤ delta`` (Dong, Roth & Su 2022, Cor. 2.13); μ = 0 gives 0,
    μ = ∞ gives ∞. **Errs high** (never understates ε), the side an accountant and a claim curve need (AugPE's
    :meth:`~accounting.AugPEEvent.gaussian_epsilon`; the black-box GDP fit takes it as an estimate); an auditor's
    lower bound on ε must not come from it. Brent's root in :math:`[0, \mu^2/2 + \mu\sqrt{2\log(1/\delta)}]` (the
    zCDP bound of the same Gaussian, ρ = μ²/2: Bun & Steinke 2016, Prop. 1.3, always feasible), rounded up by a
    relative 1e-9 and kept only where δ(ε) ≤ ``delta`` holds, else the bracket's upper end."""
    mu = check_nonnegative("mu", mu, allow_inf=True)
    delta = check_delta("delta", delta)
    if mu == 0.0 or math.isinf(mu):
        return mu
    log_target = math.log(delta)

    def excess(epsilon: float) -> float:
        return _gdp_log_delta(mu, epsilon) - log_target

    if excess(0.0) <= 0.0:
        return 0.0
    hi = mu * mu / 2.0 + mu * math.sqrt(2.0 * math.log(1.0 / delta))
    while excess(hi) > 0.0:  # pragma: no cover - the zCDP bound is always feasible; a guard on rounding
        hi *= 2.0
    root = optimize.brentq(excess, 0.0, hi, xtol=1e-14, rtol=1e-14, maxiter=500)
    epsilon = max(root, 0.0) * (1.0 + _GDP_ROUNDING)
    return min(epsilon, hi) if excess(epsilon) <= 0.0 else hi


def epsilon_to_gdp(epsilon: float, delta: float) -> float:
    """The largest μ with :func:`gdp_to_delta` ``(μ, epsilon) ≤ delta``, to a relative 1e-12 (ε = ∞ gives ∞). **Errs
    low** (never overstates μ: a noise planned from it is never too small): a bisection kept on the feasible side,
    from μ = √(2ρ*), ρ* the CKS inverse (:func:`epsilon_to_zcdp`; a Gaussian is μ²/2-zCDP, so it is feasible)."""
    epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True)
    delta = check_delta("delta", delta)
    if math.isinf(epsilon):
        return math.inf
    log_target = math.log(delta)

    def feasible(mu: float) -> bool:
        return _gdp_log_delta(mu, epsilon) <= log_target

    lo = math.sqrt(2.0 * epsilon_to_zcdp(epsilon, delta))
    while not feasible(lo):  # pragma: no cover - a valid conversion's μ is feasible; a guard on rounding
        lo *= 0.5
    hi = 2.0 * lo if lo > 0.0 else 1.0
    while feasible(hi):
        lo, hi = hi, 2.0 * hi
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if feasible(mid) else (lo, mid)
    return lo
