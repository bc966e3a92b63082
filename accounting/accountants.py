"""Accountants for exponential-mechanism decoding: ε0-bounded-range tokens composed over T steps.

Each token is ε0 = 2Δ/τ bounded-range (Durfee & Rogers 2019, arXiv:1905.04273), hence ε0²/8-zCDP (Cesar &
Rogers 2021, Lemma 3.2; the paper's ρ_tok = C²/(2B²τ²), paper Theorem 2, thm:accounting), composed over at
most T tokens. :data:`ACCOUNTANTS`: ``br-adaptive`` (default; Dong, Durfee & Rogers 2020, arXiv:1909.13830,
via :mod:`accounting.bounded_range`, never looser than ``cks``), ``cks`` (T·ρ_tok, Bun & Steinke 2016,
Lemma 2.3, converted by Canonne–Kamath–Steinke 2020), ``bun-steinke``, ``rdp``; pure ε-DP steps composed optimally
(Kairouz, Oh & Viswanath 2015). Design: docs/accounting_notes.md §1–§4; choosing one: docs/guide/planning.md.
"""

from __future__ import annotations

import enum
import math

import numpy as np
from scipy import special

from accounting import bounded_range
from accounting._validation import check_count, check_delta, check_nonnegative, check_positive
from accounting.sensitivity import coerce_enum
from accounting.conversions import ConversionMethod, br_to_zcdp, br_to_zcdp_total, zcdp_to_delta, zcdp_to_epsilon

__all__ = [
    "Accountant",
    "ACCOUNTANTS",
    "as_accountant",
    "DEFAULT_ACCOUNTANT",
    "bounded_range_epsilon",
    "composed_epsilon",
    "composed_delta",
    "max_epsilon0",
    "fits_budget",
    "pure_composed_delta",
    "pure_composed_epsilon",
]

#: Above this many composed steps the br-adaptive DP is skipped and its CKS bound is used instead (the
#: programme's cost grows about as T^1.7: ~1 s at T = 500, ~10 s per ε query at T = 3000).
BR_MAX_STEPS = 3_000


class Accountant(enum.StrEnum):
    """The accountants (a string enum: a member equals, formats and serialises as its name, so records
    that hold one read and write as before)."""

    BR_ADAPTIVE = "br-adaptive"
    CKS = "cks"
    BUN_STEINKE = "bun-steinke"
    RDP = "rdp"

    @property
    def conversion(self) -> ConversionMethod | None:
        """The zCDP conversion this accountant uses (None for br-adaptive)."""
        return None if self is Accountant.BR_ADAPTIVE else ConversionMethod(self.value)

    @property
    def zcdp_conversion(self) -> ConversionMethod:
        """The conversion this accountant applies to a zCDP ρ (a filter's sum, a zCDP release, a plan's first
        guess): its own, CKS for br-adaptive (whose bounded-range rule needs a sequence of ε0-BR steps)."""
        return ConversionMethod.CKS if self is Accountant.BR_ADAPTIVE else ConversionMethod(self.value)


ACCOUNTANTS: tuple[str, ...] = tuple(a.value for a in Accountant)
DEFAULT_ACCOUNTANT = Accountant.BR_ADAPTIVE


def as_accountant(value) -> Accountant:
    """``value`` as an :class:`Accountant` (a member or its name); a clear ``ValueError`` otherwise."""
    return coerce_enum(value, Accountant, "accountant")


def bounded_range_epsilon(sensitivity: float, temperature: float) -> float:
    r"""Per-token bounded range ε0 = 2Δ/τ of the exponential mechanism (Durfee & Rogers 2019, §3)."""
    return 2.0 * check_positive("sensitivity", sensitivity) / check_positive("temperature", temperature)


def _composition(epsilon0, num_steps) -> tuple[float, np.ndarray | None]:
    """(ρ, per-step array or None): the array only when the br-adaptive programme could use it.

    A single ε0 with ``num_steps`` steps costs ρ = T ε0²/8 in closed form, so no O(T) array is built
    beyond ``BR_MAX_STEPS`` steps (T = 10^9 would take 8 GB; pinned by
    ``tests/test_accounting_limits.py::test_epsilon_for_a_billion_tokens_needs_no_o_t_memory``).
    """
    if np.ndim(epsilon0) == 0:
        e0 = check_positive("epsilon0", epsilon0)
        n = check_count("num_steps", num_steps)
        rho = n * (e0 * e0) / 8.0  # float product: overflows to inf (reported as ε = inf), never raises
        return rho, (np.full(n, e0) if n <= BR_MAX_STEPS else None)
    e0s = bounded_range.epsilon0_array(epsilon0, num_steps)
    return br_to_zcdp_total(e0s), e0s


def _up(x: float) -> float:
    return math.nextafter(x, math.inf) if math.isfinite(x) else x


def _br_usable(e0s: np.ndarray | None, rho: float) -> bool:
    return e0s is not None and e0s.size <= BR_MAX_STEPS and math.isfinite(rho) and bounded_range.affordable(e0s)


def composed_delta(epsilon: float, epsilon0, num_steps: int | None = None, accountant="br-adaptive") -> float:
    """δ(ε) of composing ε0-BR steps (one ε0 with ``num_steps``, or an array of per-step ε0)."""
    epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True)
    acc = as_accountant(accountant)
    rho, e0 = _composition(epsilon0, num_steps)
    if math.isinf(epsilon):
        return 0.0
    cks = zcdp_to_delta(rho, epsilon, "cks")
    if acc is Accountant.BR_ADAPTIVE:
        if not _br_usable(e0, rho):
            return cks
        return min(cks, bounded_range.br_adaptive_delta(epsilon, e0).upper)
    return cks if acc is Accountant.CKS else zcdp_to_delta(rho, epsilon, acc.conversion)


#: Relative upward rounding of every reported ε (:func:`composed_epsilon`): any recomputation of a spend, in
#: whatever order of floating-point operations, comes out no larger than the reported value.
EPSILON_ROUNDING = 1e-12


def composed_epsilon(delta: float, epsilon0, num_steps: int | None = None, accountant="br-adaptive") -> float:
    """Certified ε at ``delta`` of composing ε0-BR steps, rounded up by :data:`EPSILON_ROUNDING` (``inf`` when
    ρ overflows). Every reported ε of a release comes from here (:meth:`accounting.GenerationEvent.epsilon`)."""
    return _composed_epsilon(delta, epsilon0, num_steps, accountant) * (1.0 + EPSILON_ROUNDING)


def _composed_epsilon(delta: float, epsilon0, num_steps: int | None, accountant) -> float:
    delta = check_delta("delta", delta)
    acc = as_accountant(accountant)
    rho, e0 = _composition(epsilon0, num_steps)
    if acc is not Accountant.BR_ADAPTIVE:
        return zcdp_to_epsilon(rho, delta, acc.conversion)
    # ε0-BR steps are ε0-DP, so Σ ε0 with δ = 0 is valid too (basic composition, Dwork & Roth 2014,
    # Thm. 3.16); it is the smaller of the two for huge ε0, and it keeps the DP's search window at
    # O(T) lattice points there (the CKS value alone put it at 1e10 points for ε0 = 2e10)
    basic = math.fsum(e0) if e0 is not None else math.inf
    start = min(zcdp_to_epsilon(rho, delta, "cks"), _up(basic))
    if not math.isfinite(start) or not _br_usable(e0, rho):
        return start
    return min(start, bounded_range.br_adaptive_epsilon(delta, e0, start=start))


#: Above this many composed pure-ε steps the exact binomial sum is replaced by its zCDP bound (T ε²/2-zCDP).
PURE_MAX_STEPS = 100_000


def pure_composed_delta(epsilon: float, epsilon_step: float, num_steps: int) -> float:
    r"""δ(ε) of ``num_steps`` adaptively composed ``epsilon_step``-DP steps, the optimal composition (Kairouz, Oh &
    Viswanath 2015, ICML, arXiv:1311.0776, Thm. 3.3): with :math:`e = \varepsilon_{step}`, k steps,
    :math:`\delta = (1+e^{e})^{-k}\sum_{i} \binom{k}{i} \big(e^{(k-i)e} - e^{\varepsilon + ie}\big)_+`, the hockey-stick
    divergence of k randomised responses. Computed in log space; above :data:`PURE_MAX_STEPS` steps the CKS bound of
    :math:`k e^2/2`-zCDP (Bun & Steinke 2016, arXiv:1605.02065, Prop. 1.4; Lemma 2.3) instead (errs high)."""
    epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True)
    e = check_nonnegative("epsilon_step", epsilon_step)
    k = check_count("num_steps", num_steps)
    if math.isinf(epsilon) or epsilon >= k * e:
        return 0.0
    if k > PURE_MAX_STEPS:
        return zcdp_to_delta(k * e * e / 2.0, epsilon, "cks")
    i = np.arange(k + 1, dtype=np.float64)
    i = i[epsilon + i * e < (k - i) * e]
    log_binom = special.gammaln(k + 1.0) - special.gammaln(i + 1.0) - special.gammaln(k - i + 1.0)
    terms = log_binom + (k - i) * e + np.log(-np.expm1(epsilon + i * e - (k - i) * e)) - k * np.logaddexp(0.0, e)
    return min(1.0, _up(math.exp(float(special.logsumexp(terms)))))


def pure_composed_epsilon(delta: float, epsilon_step: float, num_steps: int) -> float:
    """The smallest ε with :func:`pure_composed_delta` ≤ ``delta`` (its sources), by bisection on [0, k ε_step] kept on
    the feasible side: errs high, by at most a relative 1e-12."""
    delta = check_delta("delta", delta)
    e = check_nonnegative("epsilon_step", epsilon_step)
    k = check_count("num_steps", num_steps)
    if k > PURE_MAX_STEPS:
        return min(zcdp_to_epsilon(k * e * e / 2.0, delta, "cks"), _up(k * e))
    lo, hi = 0.0, k * e
    if pure_composed_delta(lo, e, k) <= delta:
        return 0.0
    while hi - lo > 1e-12 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if pure_composed_delta(mid, e, k) <= delta else (mid, hi)
    return hi


def fits_budget(epsilon: float, delta: float, epsilon0: float, num_steps: int, accountant) -> bool:
    """Whether ``num_steps`` ε0-BR tokens are (ε, δ)-DP under ``accountant`` (fast path for searches)."""
    acc = as_accountant(accountant)
    rho = num_steps * br_to_zcdp(epsilon0)
    if not math.isfinite(rho):
        return False
    if zcdp_to_delta(rho, epsilon, acc.zcdp_conversion) <= delta:
        return True
    if acc is not Accountant.BR_ADAPTIVE or num_steps > BR_MAX_STEPS:
        return False
    return bounded_range.br_upper_fast(epsilon, epsilon0, num_steps, delta) <= delta


def max_epsilon0(epsilon: float, delta: float, num_steps: int, accountant="br-adaptive", *, rtol: float = 1e-4) -> float:
    r"""The largest per-token ε0 such that ``num_steps`` ε0-BR tokens are (ε, δ)-DP.

    For the zCDP accountants this is :math:`\sqrt{8\rho_{seq}/T}` with ρ_seq the (lower-end) inverse of
    the conversion. For ``br-adaptive`` it is found by Brent's method on the certified upper δ,
    starting from the CKS value (always feasible); the result is the largest ε0 *verified* feasible,
    within relative ``rtol`` of the boundary: it never overspends.
    """
    epsilon = check_positive("epsilon", epsilon)
    delta = check_delta("delta", delta)
    acc = as_accountant(accountant)
    num_steps = check_count("num_steps", num_steps)
    conversion = acc.zcdp_conversion
    from accounting.conversions import epsilon_to_zcdp

    rho_seq = epsilon_to_zcdp(epsilon, delta, conversion)
    base = math.sqrt(8.0 * rho_seq / num_steps)
    if not math.isfinite(base):
        raise ValueError(f"epsilon={epsilon!r} is too large to plan for (per-token range {base!r})")
    # guard the floating-point round trip rho -> epsilon0 -> rho; the step grows geometrically, so the
    # loop ends after a few iterations whatever the error (a fixed 1e-12 step could run for ever)
    shrink = 1e-12
    for _ in range(200):
        if base <= 0 or zcdp_to_epsilon(num_steps * br_to_zcdp(base), delta, conversion) <= epsilon:
            break
        base *= 1.0 - shrink
        shrink = min(2.0 * shrink, 0.5)
    else:  # pragma: no cover - 200 halvings reach 0
        raise RuntimeError(f"internal error: no feasible epsilon0 for epsilon={epsilon!r}")
    if base <= 0:
        raise ValueError(f"epsilon={epsilon!r} is too small: the per-token range underflows to 0")
    if acc is not Accountant.BR_ADAPTIVE or num_steps > BR_MAX_STEPS:
        return base

    # plan against a hair less than ε, so that the ε search of composed_epsilon (which stops within a
    # relative 1e-10 of the boundary) never reports more than ε for the planned ε0
    target = epsilon * (1.0 - 1e-8)

    def excess(e0: float) -> float:
        upper = bounded_range.br_upper_fast(target, e0, num_steps, delta)
        return math.log(max(upper, 1e-300)) - math.log(delta)

    lo, f_lo = base, excess(base)
    if f_lo > 0:  # the DP alone is looser than CKS here: CKS remains the certified answer
        return base
    # No ε0 above ``ceiling`` is feasible: one step played at t = ε0 − s (the others at t = 0, loss 0)
    # has δ(ε) >= p_t (1 − e^(ε − t)) >= (1 − e^(−s))² at ε0 = ε + 2s, and that exceeds δ for
    # s = −log(1 − √δ) (docs/accounting_notes.md §4 for p_t). A bound that reports
    # such an ε0 feasible has lost its precision (ε / h beyond ~1e15): fall back to CKS, always valid.
    ceiling = epsilon + 2.0 * -math.log1p(-math.sqrt(delta))
    hi = base * 1.08
    f_hi = excess(hi)
    for _ in range(2000):
        if not (f_hi <= 0):  # infeasible (NaN counts as infeasible: never plan on it)
            break
        if hi > ceiling:
            return base
        lo, f_lo = hi, f_hi
        hi *= 1.08
        f_hi = excess(hi)
    else:  # pragma: no cover - 1.08**2000 > 1e66 exceeds any ceiling
        return base
    if not math.isfinite(f_hi):  # a NaN upper bound: keep the verified point
        return lo
    # Illinois regula falsi on log δ_upper(ε0), a smooth increasing function; returns a verified point
    return bounded_range.last_feasible(excess, lo, hi, f_lo, f_hi, rtol=rtol, iterations=60)
