r"""A generator's privacy claim, one record in the form it was made; every other figure derives from it.

:class:`StepClaim`: what each step (one draw of a token) satisfies: pure ε, an ε0 bounded range, ρ-zCDP, Rényi
bounds at stated orders. :class:`PrivacyClaim`: a text of at most ``steps`` draws, stated either per step (a
:class:`StepClaim`, composed over the steps by the accountant) or at sequence level in exactly one form: ρ-zCDP,
Rényi bounds ``{α: bound}``, (ε, δ)-DP or μ-GDP, with its :class:`~accounting.Adjacency`; its figures come from
:mod:`accounting`'s own conversions. Design: docs/accounting_notes.md (§"Claims").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from accounting._validation import check_count, check_delta, check_nonnegative, check_order, check_positive
from accounting.accountants import (
    PURE_MAX_STEPS,
    composed_delta,
    composed_epsilon,
    pure_composed_delta,
    pure_composed_epsilon,
)
from accounting.bounded_range import br_adaptive_delta
from accounting.conversions import (
    gdp_to_delta,
    gdp_to_epsilon,
    rdp_to_delta,
    rdp_to_epsilon,
    zcdp_to_delta,
    zcdp_to_epsilon,
)
from accounting.sensitivity import Adjacency, coerce_enum

__all__ = ["PrivacyClaim", "RESOLVABLE_SHARE", "StepClaim"]

#: a check forgiven as rounding (above its claim by at most the numerics' tolerance) leaves a PASS standing only when
#: the tolerance is at most this share of the smallest per-step level the claim states (:meth:`StepClaim.unresolved_by`)
RESOLVABLE_SHARE = 0.01


def _monotone_renyi(bounds: Mapping[float, float], alpha: float) -> float:
    r"""The bound at ``alpha`` implied by bounds at stated orders: :math:`D_\alpha` is non-decreasing in α (van Erven
    & Harremoës 2014, IEEE Trans. IT 60(7), Thm. 3), so the smallest bound stated at an order ≥ α."""
    return min((b for a, b in bounds.items() if a >= alpha), default=math.inf)


def _down(epsilon: float) -> float:
    """``epsilon`` lowered by a relative 1e-8 (undoes the conversions' upward rounding: an ε lower bound errs low)."""
    return epsilon * (1.0 - 1e-8)


def _last_above(delta_of, delta: float, hi: float, *, rtol: float = 1e-7) -> float:
    """The largest ε in [0, ``hi``] with ``delta_of(ε)`` > ``delta`` (``delta_of`` non-increasing), by bisection kept on
    that side: errs low, by at most a relative ``rtol``; 0 when none is."""
    lo = 0.0
    if delta_of(lo) <= delta:
        return 0.0
    while hi - lo > rtol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return lo


@dataclasses.dataclass(frozen=True)
class StepClaim:
    r"""What a mechanism claims of each step, every level ``math.inf`` where it claims nothing: ``epsilon0``, a bounded
    range of the privacy loss (Durfee & Rogers 2019, Def. 3.1); ``rho``, zCDP, :math:`D_\alpha \le \alpha\rho` at every
    order (Bun & Steinke 2016, Def. 1.1); ``renyi``, ``{α: bound}``, :math:`D_\alpha \le` bound at those orders only;
    ``epsilon``, pure ε-DP, :math:`|\log p(y) - \log p'(y)| \le \varepsilon` on the union support.
    Rényi bounds hold in both directions (a symmetric neighbouring relation)."""

    epsilon0: float = math.inf
    rho: float = math.inf
    renyi: Mapping[float, float] = dataclasses.field(default_factory=dict)
    epsilon: float = math.inf

    def __post_init__(self):
        check_positive("epsilon0", self.epsilon0, allow_inf=True)
        check_positive("rho", self.rho, allow_inf=True)
        check_positive("epsilon", self.epsilon, allow_inf=True)
        renyi = {check_order("alpha", a): check_positive("renyi bound", b, allow_inf=True) for a, b in dict(self.renyi).items()}
        object.__setattr__(self, "renyi", renyi)

    @classmethod
    def of(cls, claim) -> StepClaim:
        """From a :class:`StepClaim`, or the :attr:`PrivacyClaim.step` of anything :meth:`PrivacyClaim.of` reads."""
        return claim if isinstance(claim, StepClaim) else PrivacyClaim.of(claim).step

    @property
    def claims(self) -> bool:
        """Whether anything is claimed of a step."""
        levels = (self.epsilon0, self.rho, self.epsilon, *self.renyi.values())
        return any(map(math.isfinite, levels))

    def renyi_bound(self, alpha: float) -> float:
        r"""The claimed bound on :math:`D_\alpha` of a step that the audit checks at α (``inf``: none at this order)."""
        return min(float(alpha) * self.rho, self.renyi.get(float(alpha), math.inf))

    def implied_renyi(self, alpha: float) -> float:
        r"""Every bound on :math:`D_\alpha` of a step the claim implies: :meth:`renyi_bound`; a stated order ≥ α
        (monotonicity in α, van Erven & Harremoës 2014, Thm. 3); an ε0 range, :math:`\alpha\varepsilon_0^2/8` (Cesar &
        Rogers 2021, arXiv:2004.07223, Lemma 3.2); pure ε, :math:`\min(\alpha\varepsilon^2/2, \varepsilon)` (Bun &
        Steinke 2016, arXiv:1605.02065, Prop. 1.4, and :math:`D_\alpha \le D_\infty \le \varepsilon`)."""
        a = check_order("alpha", alpha)
        pure = min(a * self.epsilon * self.epsilon / 2.0, self.epsilon)
        return min(self.renyi_bound(a), _monotone_renyi(self.renyi, a), a * self.epsilon0 * self.epsilon0 / 8.0, pure)

    def orders(self, alphas: Sequence[float]) -> tuple[float, ...]:
        """The orders of ``alphas`` (all of them under a zCDP claim) and of ``renyi`` that the claim bounds."""
        return tuple(sorted({float(a) for a in alphas if self.renyi_bound(a) < math.inf} | set(self.renyi)))

    def unresolved_by(self, tolerance: float, alphas: Sequence[float]) -> float | None:
        """The smallest per-step level this claim states (ε, ε0, and its Rényi bounds at :meth:`orders` of ``alphas``)
        when ``tolerance`` is over :data:`RESOLVABLE_SHARE` of it: rounding of that size cannot be told from a leak,
        so no PASS may rest on an excess forgiven by it. ``None``: the tolerance is small enough (or nothing is
        claimed)."""
        levels = (self.epsilon, self.epsilon0, *(self.renyi_bound(a) for a in self.orders(alphas)))
        smallest = min((x for x in levels if math.isfinite(x)), default=math.inf)
        return None if tolerance <= RESOLVABLE_SHARE * smallest else smallest


#: The sequence-level forms of a claim (at most one per claim).
SEQUENCE_FORMS = ("rho", "renyi", "epsilon", "mu")


@dataclasses.dataclass(frozen=True)
class PrivacyClaim:
    r"""What a generator claims for one text of at most ``steps`` draws (T), in the form it was made.

    Either per step, ``step`` (:class:`StepClaim`, composed over T by the accountant), or at sequence level in exactly
    one form: ``rho`` (ρ-zCDP), ``renyi`` (``{α: bound}``), ``epsilon`` with ``delta`` ((ε, δ)-DP; δ = 0: pure), ``mu``
    (μ-GDP, Dong, Roth & Su 2022). A sequence-level claim may keep a ``step`` part too (checked at every step, e.g. a
    component's bound); its figures then derive from the sequence form alone.
    ``adjacency``: :class:`~accounting.Adjacency` (replace-by-null or add-remove); ``data_dependent``: an ex-post claim
    (a Rényi filter's budget, AdaPMixED), never certified; ``reported_epsilon`` at ``reported_delta``: the ε the
    generator itself prints, to be checked against :meth:`epsilon_at`; ``source``: one line for reports.
    """

    steps: int
    step: StepClaim = dataclasses.field(default_factory=StepClaim)
    rho: float | None = None
    renyi: Mapping[float, float] | None = None
    epsilon: float | None = None
    delta: float | None = None
    mu: float | None = None
    adjacency: Adjacency = Adjacency.REPLACE_BY_NULL
    data_dependent: bool = False
    reported_epsilon: float | None = None
    reported_delta: float | None = None
    source: str = ""

    def __post_init__(self):
        check_count("steps", self.steps)
        if not isinstance(self.step, StepClaim):
            raise ValueError(f"step must be a StepClaim; got {type(self.step).__name__}")
        if (self.epsilon is None) != (self.delta is None):
            raise ValueError(f"an (epsilon, delta) claim needs both; got epsilon={self.epsilon!r}, delta={self.delta!r}")
        given = [name for name in SEQUENCE_FORMS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"a claim is stated at sequence level in one form (rho, renyi, epsilon and delta, or mu); "
                             f"got {' and '.join(given)}")
        if not given and not self.step.claims:
            raise ValueError("a claim states a per-step bound (step=StepClaim(...)) or one sequence-level form (rho, "
                             "renyi, epsilon and delta, mu); got neither")
        if self.epsilon is not None:
            check_nonnegative("epsilon", self.epsilon)
            if self.delta != 0:
                check_delta("delta", self.delta)
        for name in ("rho", "mu"):
            if getattr(self, name) is not None:
                check_nonnegative(name, getattr(self, name))
        if self.renyi is not None:
            if not dict(self.renyi):
                raise ValueError("renyi must state at least one order; got {}")
            bounds = {check_order("alpha", a): check_nonnegative("renyi bound", b) for a, b in dict(self.renyi).items()}
            object.__setattr__(self, "renyi", bounds)
        object.__setattr__(self, "adjacency", coerce_enum(self.adjacency, Adjacency))
        if self.adjacency is Adjacency.ZERO_OUT:
            raise ValueError("a claim's adjacency is 'replace-by-null' or 'add-remove'; got 'zero-out' (a relation of the "
                             "aggregated logits, accounting.linf_sensitivity)")
        if not isinstance(self.data_dependent, bool):
            raise ValueError(f"data_dependent must be a bool; got {self.data_dependent!r}")
        if (self.reported_epsilon is None) != (self.reported_delta is None):
            raise ValueError(f"a reported epsilon needs its delta; got reported_epsilon={self.reported_epsilon!r}, "
                             f"reported_delta={self.reported_delta!r}")
        if self.reported_epsilon is not None:
            check_nonnegative("reported_epsilon", self.reported_epsilon, allow_inf=True)
            check_delta("reported_delta", self.reported_delta)

    # --- the forms users type ---------------------------------------------------------------------

    @classmethod
    def per_step(cls, steps: int, *, epsilon0: float = math.inf, rho: float = math.inf, renyi=None,
                 epsilon: float = math.inf, **fields) -> PrivacyClaim:
        """Per-step bounds (:class:`StepClaim`), composed over ``steps`` draws: ``PrivacyClaim.per_step(steps=T,
        renyi={2.0: 1.0})``."""
        return cls(steps, StepClaim(epsilon0, rho, renyi or {}, epsilon), **fields)

    @classmethod
    def zcdp(cls, rho: float, *, steps: int, **fields) -> PrivacyClaim:
        """A text is ρ-zCDP."""
        return cls(steps, rho=rho, **fields)

    @classmethod
    def rdp(cls, renyi: Mapping[float, float], *, steps: int, **fields) -> PrivacyClaim:
        """A text's Rényi divergence is at most ``renyi[α]`` at each stated order α."""
        return cls(steps, renyi=renyi, **fields)

    @classmethod
    def approx_dp(cls, epsilon: float, delta: float, *, steps: int, **fields) -> PrivacyClaim:
        """A text is (ε, δ)-DP (δ = 0: pure ε-DP)."""
        return cls(steps, epsilon=epsilon, delta=delta, **fields)

    @classmethod
    def gdp(cls, mu: float, *, steps: int, **fields) -> PrivacyClaim:
        """A text is μ-GDP."""
        return cls(steps, mu=mu, **fields)

    @classmethod
    def of(cls, claim) -> PrivacyClaim:
        """A :class:`PrivacyClaim` as is; anything with a ``privacy_claim()`` method (``invink_audit``'s
        ``MechanismGuarantee`` and white-box ``Claim``) through it."""
        if isinstance(claim, PrivacyClaim):
            return claim
        convert = getattr(claim, "privacy_claim", None)
        if convert is None:
            raise ValueError(f"a claim is a PrivacyClaim, a MechanismGuarantee or a white-box Claim; "
                             f"got {type(claim).__name__}")
        return convert()

    # --- derived figures --------------------------------------------------------------------------

    @property
    def form(self) -> str:
        """``"per-step"`` or the sequence-level form's field name (``"rho"``, ``"renyi"``, ``"epsilon"``, ``"mu"``)."""
        return next((name for name in SEQUENCE_FORMS if getattr(self, name) is not None), "per-step")

    @property
    def a_priori(self) -> bool:
        """Whether the claim holds for every dataset (not :attr:`data_dependent`)."""
        return not self.data_dependent

    def sequence_renyi(self, alpha: float) -> float:
        r"""The bound on a text's :math:`D_\alpha` (both directions) the claim implies (``inf``: none).

        Per step: :math:`T\cdot` :meth:`StepClaim.implied_renyi` (adaptive composition of Rényi DP, Mironov 2017,
        arXiv:1702.07476, Prop. 1; of zCDP, :math:`T\alpha\rho`, Bun & Steinke 2016, Lemma 2.3; bounded range
        :math:`T\alpha\varepsilon_0^2/8`, Cesar & Rogers 2021; pure ε, :math:`T\min(\alpha\varepsilon^2/2, \varepsilon)`,
        Bun & Steinke Prop. 1.4). Sequence level: zCDP :math:`\alpha\rho`; Rényi, the smallest bound stated at an order
        ≥ α (monotonicity); μ-GDP :math:`\alpha\mu^2/2` (the Gaussian pair's divergence; μ-GDP pairs are
        post-processings of it, Dong, Roth & Su 2022, Thm. 2.10); pure ε, :math:`\min(\alpha\varepsilon^2/2,
        \varepsilon)`; (ε, δ) with δ > 0: none."""
        a = check_order("alpha", alpha)
        form = self.form
        if form == "per-step":
            return self.steps * self.step.implied_renyi(a)
        if form == "rho":
            return a * self.rho
        if form == "renyi":
            return _monotone_renyi(self.renyi, a)
        if form == "mu":
            return a * self.mu * self.mu / 2.0
        return min(a * self.epsilon * self.epsilon / 2.0, self.epsilon) if self.delta == 0 else math.inf

    def _per_step_figures(self, rdp, zcdp, bounded_range, pure) -> float:
        """The tightest of the per-step forms' composed figures (each a valid bound; ``inf`` where none is stated)."""
        s, t = self.step, self.steps
        figures = [math.inf]
        if math.isfinite(s.epsilon0):
            figures.append(bounded_range(s.epsilon0, t))
        if math.isfinite(s.rho):
            figures.append(zcdp(t * s.rho))
        if any(map(math.isfinite, s.renyi.values())):
            figures.append(rdp({a: t * b for a, b in s.renyi.items()}))
        if math.isfinite(s.epsilon):
            figures.append(pure(s.epsilon, t))
        return min(figures)

    def epsilon_at(self, delta: float) -> float:
        """The ε at ``delta`` the claim certifies (``inf``: none), by :mod:`accounting`'s conversions, each erring high:
        per step, the tightest of :func:`~accounting.composed_epsilon` (ε0, br-adaptive; Dong, Durfee & Rogers 2020),
        :func:`~accounting.zcdp_to_epsilon` of Tρ (CKS 2020), :func:`~accounting.rdp_to_epsilon` of T·bound (CKS Prop. 12
        over the stated orders), :func:`~accounting.pure_composed_epsilon` (Kairouz, Oh & Viswanath 2015); sequence level:
        zCDP and Rényi the same conversions, μ-GDP :func:`~accounting.gdp_to_epsilon`, (ε, δ) its ε where ``delta`` ≥
        its δ."""
        delta = check_delta("delta", delta)
        form = self.form
        if form == "per-step":
            return self._per_step_figures(
                rdp=lambda b: rdp_to_epsilon(b, delta), zcdp=lambda rho: zcdp_to_epsilon(rho, delta),
                bounded_range=lambda e0, t: composed_epsilon(delta, e0, t),
                pure=lambda e, t: pure_composed_epsilon(delta, e, t))  # fmt: skip
        if form == "rho":
            return zcdp_to_epsilon(self.rho, delta)
        if form == "renyi":
            return rdp_to_epsilon(self.renyi, delta)
        if form == "mu":
            return gdp_to_epsilon(self.mu, delta)
        return float(self.epsilon) if delta >= self.delta else math.inf

    def epsilon_lower_at(self, delta: float) -> float:
        r"""A lower bound on the ε at ``delta`` of the worst mechanism the claim admits: a report below it is wrong
        given the claim (between it and :meth:`epsilon_at` a report rests on more than the claim states). A per-step
        claim stating several forms: the largest of the forms' worst mechanisms that meet all of them
        (:meth:`_per_step_lower`; 0 where none does).

        - Rényi/zCDP (per step or sequence): the Gaussian mechanism with ρ = min(ρ, min_α bound_α/α) meets every stated
          bound (:math:`D_\alpha = \alpha\rho`, Bun & Steinke 2016, Lemma 2.4) and composes to
          :math:`\sqrt{2T\rho}`-GDP; its ε is exact, :func:`~accounting.gdp_to_epsilon` (Dong, Roth & Su 2022, Cor.
          2.13; Balle & Wang 2018, Thm. 8); μ-GDP the same with μ.
        - per-step pure ε: T randomised responses, the optimal composition (Kairouz, Oh & Viswanath 2015, Thm. 3.3;
          :func:`~accounting.pure_composed_delta`), up to :data:`~accounting.accountants.PURE_MAX_STEPS` steps.
        - per-step ε0 range: the largest ε whose br-adaptive lower bracket (Dong, Durfee & Rogers 2020, the
          :class:`~accounting.bounded_range.DeltaBracket` ``lower``) is over ``delta``.
        - (ε, δ): the 4-outcome mechanism every (ε, δ)-DP mechanism post-processes (Kairouz, Oh & Viswanath 2015, Thm.
          2.1): :math:`\delta(\varepsilon') = \delta + (1-\delta)(e^\varepsilon - e^{\varepsilon'})/(1+e^\varepsilon)`
          for ε' ≤ ε, so at δ' ≥ δ, :math:`\varepsilon' = \log(e^\varepsilon - (\delta'-\delta)(1+e^\varepsilon)/(1-\delta))_+`;
          ``inf`` at δ' < δ (its atom of mass δ).
        Each is lowered by a relative 1e-8 (the upward rounding of the conversions it reuses)."""
        delta = check_delta("delta", delta)
        form = self.form
        if form == "epsilon":
            if delta < self.delta:
                return math.inf
            e = math.exp(self.epsilon) - (delta - self.delta) * (1.0 + math.exp(self.epsilon)) / (1.0 - self.delta)
            return _down(math.log(e)) if e > 1.0 else 0.0
        if form in ("rho", "renyi", "mu"):
            rho = self.rho if form == "rho" else min(b / a for a, b in self.renyi.items()) if form == "renyi" else 0.0
            return _down(gdp_to_epsilon(self.mu if form == "mu" else math.sqrt(2.0 * rho), delta))
        return self._per_step_lower(delta)

    def _per_step_lower(self, delta: float) -> float:
        """:meth:`epsilon_lower_at` of a per-step claim: the largest ε among the single-form worst mechanisms that meet
        every other stated bound too: the Gaussian only where no ε or ε0 is stated; T ε0-BR steps where the stated ρ ≥
        ε0²/8, Rényi bounds ≥ αε0²/8 (Cesar & Rogers 2021, Lemma 3.2) and ε ≥ ε0 (a BR step is ε0-DP); T randomised
        responses where ε0 ≥ 2ε (their loss is ±ε), ρ ≥ ε²/2 and Rényi bounds ≥ min(αε²/2, ε) (Bun & Steinke 2016,
        Prop. 1.4)."""
        s, t = self.step, self.steps

        def meets(rho: float, renyi, epsilon: float, epsilon0: float) -> bool:  # up to a relative 1e-12 (rounding)
            implied = [(s.rho, rho), (s.epsilon, epsilon), (s.epsilon0, epsilon0), *((b, renyi(a)) for a, b in s.renyi.items())]
            return all(stated >= level * (1.0 - 1e-12) for stated, level in implied)

        gaussian = min(s.rho, min((b / a for a, b in s.renyi.items()), default=math.inf))
        lower = [0.0]
        if math.isfinite(gaussian) and math.isinf(s.epsilon) and math.isinf(s.epsilon0):
            lower.append(gdp_to_epsilon(math.sqrt(2.0 * t * gaussian), delta))
        e0, e = s.epsilon0, s.epsilon
        if math.isfinite(e0) and meets(e0 * e0 / 8.0, lambda a: a * e0 * e0 / 8.0, e0, e0):
            lower.append(_last_above(lambda x: br_adaptive_delta(x, e0, t).lower, delta, t * e0))
        if math.isfinite(e) and t <= PURE_MAX_STEPS and meets(e * e / 2.0, lambda a: min(a * e * e / 2.0, e), e, 2.0 * e):
            lower.append(_last_above(lambda x: pure_composed_delta(x, e, t), delta, t * e))
        return _down(max(lower))

    def delta_at(self, epsilon: float) -> float:
        """The δ at ``epsilon`` the claim certifies (1: none), by the conversions :meth:`epsilon_at` names
        (:func:`~accounting.composed_delta`, :func:`~accounting.zcdp_to_delta`, :func:`~accounting.rdp_to_delta`,
        :func:`~accounting.pure_composed_delta`, :func:`~accounting.gdp_to_delta`); (ε, δ): its δ where ``epsilon`` ≥
        its ε, else 1. Each errs high."""
        epsilon = check_nonnegative("epsilon", epsilon, allow_inf=True)
        form = self.form
        if form == "per-step":
            return min(1.0, self._per_step_figures(
                rdp=lambda b: rdp_to_delta(b, epsilon), zcdp=lambda rho: zcdp_to_delta(rho, epsilon),
                bounded_range=lambda e0, t: composed_delta(epsilon, e0, t),
                pure=lambda e, t: pure_composed_delta(epsilon, e, t)))  # fmt: skip
        if form == "rho":
            return zcdp_to_delta(self.rho, epsilon)
        if form == "renyi":
            return rdp_to_delta(self.renyi, epsilon)
        if form == "mu":
            return gdp_to_delta(self.mu, epsilon)
        return float(self.delta) if epsilon >= self.epsilon else 1.0

    def describe(self) -> str:
        """One line: the form, T, adjacency, kind and source."""
        form = self.form
        value = getattr(self, form) if form != "per-step" else self.step
        stated = {"per-step": "per step {!r}", "rho": "{!r}-zCDP", "renyi": "Renyi {!r}", "mu": "{!r}-GDP",
                  "epsilon": "({!r}, " + repr(self.delta) + ")-DP"}[form].replace("{!r}", repr(value))  # fmt: skip
        kind = "DATA-DEPENDENT" if self.data_dependent else "a-priori"
        return f"{stated}, T={self.steps}, {self.adjacency.value}, {kind}" + (f": {self.source}" if self.source else "")
