r"""Optimal adaptive composition of ε0-bounded-range mechanisms (the ``br-adaptive`` accountant).

Each token is ε0-bounded range (Durfee & Rogers 2019, arXiv:1905.04273, Def. 3.1). Dong, Durfee & Rogers
2020 (ICML 2020, arXiv:1909.13830, Lemma 3.2 and §5): the optimal adaptive δ(ε_g) of T such steps is the
value :math:`V_T(\varepsilon_g)` of a one-dimensional dynamic programme over the remaining budget.
:func:`br_adaptive_delta` returns a certified :class:`DeltaBracket` on a lattice (plan on its upper bound
only; numba kernel, about O(T^1.7 m²)); also :func:`br_adaptive_epsilon`.

Design: docs/accounting_notes.md §4 (the programme, the facts it uses, the bracket's construction).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from numba import njit

from accounting._validation import check_count, check_delta, check_nonnegative, check_positive
from accounting.conversions import br_to_zcdp_total, zcdp_to_epsilon

__all__ = [
    "DeltaBracket",
    "br_adaptive_delta",
    "br_adaptive_delta_curve",
    "DEFAULT_LATTICE_STEPS",
    "br_adaptive_epsilon",
    "default_lattice_steps",
    "epsilon0_array",
    "br_upper_fast",
]

#: Lattice intervals per ε0 (``m``). The upper bound converges as O(1/m²) and the lattice lower bound
#: more slowly; 16 keeps a plan at T = 500 near one second. At the paper's setting the bracket is within
#: a few percent (wider at very small δ); plans use the upper bound only, so a loose lower bound is safe.
DEFAULT_LATTICE_STEPS = 16

# relative inflation of the upper bound per composed step, to absorb floating-point rounding (lattice
# positions x0 + k h carry about one ulp of |x0| each; 1e-9 per step is far above that and costs nothing)
_ROUNDING_SLACK = 1e-9

# cap on sum(n) * max(n) for one run (heterogeneous steps with a large spread of epsilon0 blow it up)
_MAX_LATTICE_WORK = 2.0e6


@dataclasses.dataclass(frozen=True)
class DeltaBracket:
    """A certified bracket ``lower ≤ δ_opt ≤ upper`` of the optimal adaptive δ."""

    lower: float
    upper: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.lower <= self.upper <= 1.0:
            raise ValueError(f"invalid bracket: lower={self.lower!r}, upper={self.upper!r}")


@njit(cache=True)
def _dp_kernel(steps, h, x0, w_out, eta):  # pragma: no cover - compiled
    """Backward DP of docs/accounting_notes.md §4 on the lattice ``x0 + i h``, |i| ≤ w_out at the top.

    ``steps[k]`` is the number of lattice intervals n_k of the step added at level k (level k adds one
    step in front of the k−1 already composed). ``eta`` is the truncation tolerance: lattice points
    whose upper value is ≤ eta above the active window, or within eta of 1 − e^x below it, are frozen
    at a certified bound (docs/accounting_notes.md §4); the final upper bound is inflated by at most T·eta.
    Returns (lower, upper) arrays of length ``2 w_out + 1``.
    """
    T = steps.shape[0]
    total = 0
    nmax = 1
    for k in range(T):
        total += steps[k]
        if steps[k] > nmax:
            nmax = steps[k]
    W = w_out + total
    size = 2 * W + 1
    lo_prev = np.empty(size)
    up_prev = np.empty(size)
    lo_cur = np.empty(size)
    up_cur = np.empty(size)
    # level 0: V_0(x) = (1 - e^x)_+, exact in both bounds; c(x) = V - (1 - e^x) = 0 for x <= 0
    for a in range(size):
        x = x0 + (a - W) * h
        v = -math.expm1(x) if x < 0.0 else 0.0
        lo_prev[a] = v
        up_prev[a] = v
    # active window [a_lo, a_hi] of the previous level: outside it the arrays hold frozen bounds
    a_lo = W - w_out - total
    a_hi = W + w_out + total
    for a in range(size):
        x = x0 + (a - W) * h
        if x <= 0.0:
            a_lo = a
    a_hi = min(a_lo + 1, size - 1)
    reach = 0
    w = W
    for k in range(T):
        n = steps[k]
        reach += n
        w -= n
        eps0 = n * h
        # p_t = (e^eps0 - e^t)/(e^eps0 - 1) = -expm1(t - eps0) / (-expm1(-eps0)) and
        # 1 - p_t = expm1(t)/expm1(eps0) = e^(t-eps0) (-expm1(-t)) / (-expm1(-eps0)): no cancellation for
        # tiny eps0 and no NaN (0 * inf) for huge eps0: every exponent is <= 0
        # (tests/test_accounting_limits.py::test_bounded_range_upper_bound_for_huge_epsilon0)
        nd = -math.expm1(-eps0)
        p = np.empty(n + 1)
        pq = np.empty(n + 1)
        for s in range(n + 1):
            t = s * h
            p[s] = -math.expm1(t - eps0) / nd
            pq[s] = math.exp(t - eps0) * -math.expm1(-t) / nd
        # upper-bound data per interval s: t = (s+1)h at nu = 0 and t = s h at nu = 1, where nu is the
        # position of y = e^{x - t} between the two lattice points (V is convex in y, not in x).
        # p(nu) = (e^eps0 - e^{(s+1)h}/(1 + nu (e^h - 1)))/(e^eps0 - 1) is concave in nu; its tangent at
        # nu = 1/2 bounds it from above. With r = (e^h - 1)/(1 + (e^h - 1)/2) = 2 tanh(h/2):
        # p(1/2) = -expm1(log_u - eps0)/nd, log_u = (s+1)h - log1p((e^h - 1)/2), and
        # p'(1/2) = e^((s+1)h - eps0) r / (1 + (e^h - 1)/2) / nd.
        r = 2.0 * math.tanh(0.5 * h)
        log_q = math.log1p(0.5 * math.expm1(h)) if h < 700.0 else h - math.log(2.0)
        pc = np.empty(n)
        slope = np.empty(n)
        for s in range(n):
            log_u = (s + 1) * h - log_q
            pc[s] = -math.expm1(log_u - eps0) / nd
            slope[s] = math.exp((s + 1) * h - eps0 - log_q) * r / nd
        start = max(a_lo - n, W - w)
        stop = min(a_hi + n, W + w)
        for a in range(start, stop + 1):
            x = x0 + (a - W) * h
            if x >= reach * h:
                lo_cur[a] = 0.0
                up_cur[a] = 0.0
                continue
            if x <= -reach * h:
                v = -math.expm1(x)
                lo_cur[a] = v
                up_cur[a] = v
                continue
            best_lo = 0.0
            for s in range(n + 1):
                val = p[s] * lo_prev[a - s] + pq[s] * lo_prev[a - s + n]
                if val > best_lo:
                    best_lo = val
            best_up = 0.0
            for s in range(n):
                a0 = up_prev[a - s]  # V(x - s h), nu = 1
                a1 = up_prev[a - s - 1]  # V(x - (s+1) h), nu = 0
                b0 = up_prev[a - s + n]
                b1 = up_prev[a - s - 1 + n]
                d1 = a1 - b1
                dd = (a0 - b0) - d1
                sl = slope[s]
                base = pc[s] - 0.5 * sl
                # f(nu) = b1 + nu (b0 - b1) + (base + sl nu) (d1 + nu dd), nu in [0, 1]
                q2 = sl * dd
                q1 = (b0 - b1) + base * dd + sl * d1
                q0 = b1 + base * d1
                f1 = q0 + q1 + q2
                m = q0 if q0 > f1 else f1
                if q2 < 0.0:
                    lam = -q1 / (2.0 * q2)
                    if 0.0 < lam < 1.0:
                        fv = q0 + lam * (q1 + lam * q2)
                        if fv > m:
                            m = fv
                if m > best_up:
                    best_up = m
            if best_lo > 1.0:
                best_lo = 1.0
            if not best_lo >= 0.0:  # NaN guard: a lower bound of 0 is always valid
                best_lo = 0.0
            if not best_up >= 0.0:  # NaN guard: never report a NaN upper bound as small
                best_up = 1.0
            best_up = best_up * (1.0 + 1e-9)
            if best_up > 1.0:
                best_up = 1.0
            if best_up < best_lo:
                best_up = best_lo
            lo_cur[a] = best_lo
            up_cur[a] = best_up
        # running maximum from the right keeps the upper bound non-increasing in x
        for a in range(stop - 1, start - 1, -1):
            if up_cur[a] < up_cur[a + 1]:
                up_cur[a] = up_cur[a + 1]
        # shrink the active window where the values are within eta of their frozen bounds
        new_hi = stop
        while new_hi > start and up_cur[new_hi - 1] <= eta:
            new_hi -= 1
        new_lo = start
        while new_lo < new_hi:
            xn = x0 + (new_lo + 1 - W) * h
            if up_cur[new_lo + 1] + math.expm1(xn) <= eta:
                new_lo += 1
            else:
                break
        a_lo = new_lo
        a_hi = new_hi
        c_hi = up_cur[a_hi]
        x_lo = x0 + (a_lo - W) * h
        c_lo = up_cur[a_lo] + math.expm1(x_lo)
        if c_lo < 0.0:
            c_lo = 0.0
        # frozen bounds where the next levels may read (2 nmax beyond the window, within the array)
        for a in range(max(a_lo - 2 * nmax, 0), a_lo):
            x = x0 + (a - W) * h
            lo_cur[a] = -math.expm1(x)
            v = -math.expm1(x) + c_lo
            up_cur[a] = v if v < 1.0 else 1.0
        for a in range(a_hi + 1, min(a_hi + 2 * nmax, size - 1) + 1):
            lo_cur[a] = 0.0
            up_cur[a] = c_hi
        lo_prev, lo_cur = lo_cur, lo_prev
        up_prev, up_cur = up_cur, up_prev
    lo_out = np.empty(2 * w_out + 1)
    up_out = np.empty(2 * w_out + 1)
    for i in range(2 * w_out + 1):
        a = W - w_out + i
        if a < a_lo:
            x = x0 + (a - W) * h
            lo_out[i] = -math.expm1(x)
            v = -math.expm1(x) + (up_prev[a_lo] + math.expm1(x0 + (a_lo - W) * h))
            up_out[i] = min(max(v, lo_out[i]), 1.0)
        elif a > a_hi:
            lo_out[i] = 0.0
            up_out[i] = up_prev[a_hi]
        else:
            lo_out[i] = lo_prev[a]
            up_out[i] = up_prev[a]
    return lo_out, up_out


# --- Python wrappers ------------------------------------------------------------------------------

#: Truncation tolerance relative to the δ of interest, per composed step (docs/accounting_notes.md §4).
_RELATIVE_ETA = 1e-9


def default_lattice_steps(num_steps: int) -> int:
    """Lattice intervals per ε0 for ``num_steps`` compositions: 16 up to T = 1000, then fewer so the
    O(T^1.5 m²) cost stays bounded (the bound stays certified for every m, only looser)."""
    if num_steps <= 1000:
        return DEFAULT_LATTICE_STEPS
    return max(4, int(round(DEFAULT_LATTICE_STEPS * math.sqrt(1000 / num_steps))))


def affordable(epsilon0s: np.ndarray, lattice_steps: int | None = None) -> bool:
    """Whether the programme for these steps stays within ``_MAX_LATTICE_WORK`` (else use CKS)."""
    if lattice_steps is None:
        lattice_steps = default_lattice_steps(len(epsilon0s))
    ratio = float(np.max(epsilon0s)) / float(np.min(epsilon0s))
    # `not <` also catches inf and NaN (overflow probes: tests/test_accounting_limits.py)
    if not ratio * lattice_steps < _MAX_LATTICE_WORK:
        return False
    n_max = math.ceil(ratio * lattice_steps) + 1
    return len(epsilon0s) * n_max * n_max <= _MAX_LATTICE_WORK


def _steps_array(epsilon0s: np.ndarray, lattice_steps: int) -> tuple[np.ndarray, float]:
    """Per-step lattice widths n_k (ε0 rounded *up* to the lattice) and the lattice step h."""
    if not np.all(np.isfinite(epsilon0s)) or not np.all(epsilon0s > 0):
        raise ValueError(f"every epsilon0 must be finite and > 0; got {epsilon0s!r}")
    h = float(np.min(epsilon0s)) / lattice_steps
    ratio = float(np.max(epsilon0s)) / h
    if not ratio < _MAX_LATTICE_WORK:
        raise ValueError(
            f"the bounded-range programme for epsilon0 from {np.min(epsilon0s):.3g} to {np.max(epsilon0s):.3g} "
            f"needs more than {_MAX_LATTICE_WORK:.3g} lattice steps per step; use the cks accountant"
        )
    n = np.ceil(epsilon0s / h * (1 - 1e-12)).astype(np.int64)
    n = np.maximum(n, 1)
    n += (n * h < epsilon0s).astype(np.int64)  # never round a step's range down
    work = float(np.sum(n)) * float(np.max(n))
    if work > _MAX_LATTICE_WORK:
        raise ValueError(
            f"the bounded-range programme for these {len(n)} steps (epsilon0 from {np.min(epsilon0s):.3g} to "
            f"{np.max(epsilon0s):.3g}) would need {work:.3g} lattice operations per level; use the cks accountant"
        )
    return n, h


def _lattice_steps(lattice_steps, epsilon0s: np.ndarray) -> int:
    """``lattice_steps``, or the default for these (validated, :func:`epsilon0_array`) steps."""
    return check_count("lattice_steps", default_lattice_steps(len(epsilon0s)) if lattice_steps is None else lattice_steps,
                       minimum=2)


def _run(epsilon0s: np.ndarray, lattice_steps: int, x0: float, w_out: int, eta: float):
    if not math.isfinite(x0):  # the kernel's lattice would be NaN: refuse instead of looping on it
        raise ValueError(f"epsilon must be finite; got {x0!r}")
    n, h = _steps_array(epsilon0s, lattice_steps)
    # level k of the kernel adds the k-th step counted from the end
    return _dp_kernel(n[::-1].copy(), h, float(x0), int(w_out), float(eta)), h


def br_adaptive_delta(
    epsilon: float,
    epsilon0: float | np.ndarray,
    num_steps: int | None = None,
    *,
    lattice_steps: int | None = None,
) -> DeltaBracket:
    r"""Certified bracket on the optimal δ(ε) of the adaptive composition of ε0-BR mechanisms.

    DDR 2020 (arXiv:1909.13830) dynamic programme, bounds as in docs/accounting_notes.md §4. ``epsilon0`` is
    one per-step range (with ``num_steps`` steps) or an array of per-step ranges in release order.
    """
    epsilon = check_nonnegative("epsilon", epsilon)
    epsilon0s = epsilon0_array(epsilon0, num_steps)
    lattice_steps = _lattice_steps(lattice_steps, epsilon0s)
    scale = 1.0
    for _ in range(8):
        eta = _RELATIVE_ETA * scale / len(epsilon0s)
        (lo, up), _h = _run(epsilon0s, lattice_steps, epsilon, 0, eta)
        lower, upper = float(lo[0]), float(up[0])
        # the truncation inflates the upper bound by at most T*eta; redo if that is not negligible
        if lower >= 1e-3 * scale or scale < 1e-280:
            break
        scale = max(lower, 1e-300)
    return DeltaBracket(lower=min(lower, upper), upper=upper)


def br_adaptive_delta_curve(
    epsilons_center: float,
    half_width: float,
    epsilon0: float | np.ndarray,
    num_steps: int | None = None,
    *,
    delta_scale: float = 1e-12,
    lattice_steps: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """δ(ε) brackets on the lattice ε ∈ [center − half_width, center + half_width] (step ε0/m).

    Returns ``(epsilons, lower, upper)``. ``delta_scale`` is the smallest δ of interest (it sets the
    truncation tolerance; values far below it carry an absolute error of at most 1e-9·delta_scale).
    """
    epsilon0s = epsilon0_array(epsilon0, num_steps)
    lattice_steps = _lattice_steps(lattice_steps, epsilon0s)
    check_nonnegative("half_width", half_width)
    if not math.isfinite(epsilons_center):
        raise ValueError(f"epsilons_center must be finite; got {epsilons_center!r}")
    n, h = _steps_array(epsilon0s, lattice_steps)
    w_out = int(math.ceil(half_width / h))
    eta = _RELATIVE_ETA * check_positive("delta_scale", delta_scale) / len(epsilon0s)
    (lo, up), h = _run(epsilon0s, lattice_steps, epsilons_center, w_out, eta)
    eps = epsilons_center + h * np.arange(-w_out, w_out + 1)
    return eps, lo, up


def br_adaptive_epsilon(
    delta: float,
    epsilon0: float | np.ndarray,
    num_steps: int | None = None,
    *,
    lattice_steps: int | None = None,
    start: float | None = None,
) -> float:
    r"""Certified ε at which the composition is (ε, δ)-DP: the smallest ε whose *upper* δ bound is ≤ δ.

    Between lattice points the upper curve is interpolated by chords, which bound the convex
    :math:`V_T` from above (docs/accounting_notes.md §4); the result errs upwards. ``start`` is a valid ε to start
    from (default: the CKS conversion of ρ = Σ ε0²/8, which this accountant never exceeds).
    """
    delta = check_delta("delta", delta)
    epsilon0s = epsilon0_array(epsilon0, num_steps)
    lattice_steps = _lattice_steps(lattice_steps, epsilon0s)
    rho = br_to_zcdp_total(epsilon0s)
    hi = zcdp_to_epsilon(rho, delta, "cks") if start is None else float(start)
    if not math.isfinite(hi):  # the CKS bound is already infinite: so is every certified answer
        return math.inf
    span = max(0.25 * hi, 4 * float(epsilon0s.max()))
    for _ in range(20):
        center = max(hi - span / 2, span / 2)
        eps, _lo, up = br_adaptive_delta_curve(
            center, span / 2, epsilon0s, delta_scale=delta, lattice_steps=lattice_steps
        )
        ok = np.nonzero(up <= delta)[0]
        if len(ok) == 0:
            # the whole window is above δ: the CKS value remains valid, search higher
            hi = float(eps[-1]) + span / 2
            continue
        i = int(ok[0])
        if i == 0:
            if eps[0] <= 0.0:
                return 0.0
            span *= 2  # window too high: widen downwards
            hi = float(eps[0]) + span / 4
            continue
        u0, u1 = float(up[i - 1]), float(up[i])
        frac = min(max((u0 - delta) / (u0 - u1), 0.0), 1.0) if u0 > u1 else 1.0
        # V_T is convex in y = e^x: interpolate the upper values linearly in y (a certified bound)
        step = float(eps[i]) - float(eps[i - 1])
        growth = math.expm1(step) if step < 700.0 else math.inf
        chord = min(float(eps[i - 1]) + math.log1p(frac * growth), float(eps[i]))
        result = _refine_epsilon(delta, epsilon0s, float(eps[i - 1]), max(chord, 0.0), lattice_steps)
        return math.nextafter(max(result, 0.0), math.inf)
    return hi


def _refine_epsilon(delta, epsilon0s, infeasible, feasible, lattice_steps, *, rtol=1e-10, iterations=40):
    """Shrink [infeasible, feasible] with single-point runs anchored at the candidate ε (Illinois
    regula falsi on log δ_upper); returns the smallest ε verified to have δ_upper ≤ δ."""
    eta = _RELATIVE_ETA * delta / len(epsilon0s)

    def excess(eps: float) -> float:
        (_lo, up), _h = _run(epsilon0s, lattice_steps, eps, 0, eta)
        return math.log(max(float(up[0]), 1e-300)) - math.log(delta)

    if not feasible > infeasible >= 0.0:
        return feasible
    f_in, f_fe = excess(infeasible), excess(feasible)
    if f_fe > 0:  # lattice anchoring moved the boundary: the chord value stays certified by convexity
        return feasible
    if f_in <= 0:
        return infeasible
    return last_feasible(excess, infeasible, feasible, f_in, f_fe, rtol=rtol, iterations=iterations)


def last_feasible(excess, a, b, f_a, f_b, *, rtol, iterations):
    """Illinois regula falsi on a monotone ``excess`` with opposite signs at ``a`` and ``b``.

    ``excess(x) <= 0`` means feasible. Returns the feasible end of the final bracket, so the answer
    is always a point that was *evaluated* feasible (the safe side), within relative ``rtol`` of the
    boundary unless ``iterations`` run out first.
    """
    side = 0
    for _ in range(iterations):
        if abs(b - a) <= rtol * max(abs(a), abs(b)):
            break
        mid = b - f_b * (b - a) / (f_b - f_a)
        if not min(a, b) < mid < max(a, b):
            mid = 0.5 * (a + b)
        f_mid = excess(mid)
        if (f_mid <= 0) == (f_a <= 0):
            a, f_a = mid, f_mid
            if side == -1:
                f_b *= 0.5
            side = -1
        else:
            b, f_b = mid, f_mid
            if side == 1:
                f_a *= 0.5
            side = 1
    return a if f_a <= 0 else b


def epsilon0_array(epsilon0, num_steps) -> np.ndarray:
    """The per-step ranges as a validated float array (a scalar ε0 repeated ``num_steps`` times, or a sequence)."""
    if np.ndim(epsilon0) == 0:
        e0 = check_positive("epsilon0", epsilon0)
        n = check_count("num_steps", num_steps)
        return np.full(n, e0)
    arr = np.asarray(epsilon0, dtype=float)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"epsilon0 must be a positive number or a non-empty 1-D array; got {epsilon0!r}")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"every epsilon0 must be finite and > 0; got {epsilon0!r}")
    if num_steps is not None and num_steps != arr.size:
        raise ValueError(f"num_steps={num_steps!r} does not match len(epsilon0)={arr.size}")
    return arr


def br_upper_fast(epsilon: float, epsilon0: float, num_steps: int, delta_scale: float) -> float:
    """Upper bound only, one kernel run with the truncation tolerance set from ``delta_scale``."""
    m = default_lattice_steps(num_steps)
    eta = _RELATIVE_ETA * delta_scale / num_steps
    (lo, up), _h = _run(np.full(num_steps, float(epsilon0)), m, epsilon, 0, eta)
    return float(up[0])
