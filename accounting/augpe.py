r"""Accounting for AugPE (Xie et al. 2024, "Differentially Private Synthetic Data via Foundation Model APIs 2:
Text", arXiv:2403.01749, Alg. 1): ``T`` adaptively composed Gaussian mechanisms on a nearest-neighbour histogram.

Each iteration adds Gaussian noise of standard deviation ``noise_std`` (σ, in counts) to every count of a histogram
of ℓ2 sensitivity Δ (paper Eq. (eq:hiso-augpe), App. B.3.3, Property prop:augpe-sens; :class:`AugPESensitivity`).
T iterations are :math:`\rho = T\Delta^2/(2\sigma^2)`-zCDP (Bun & Steinke 2016, arXiv:1605.02065, Prop. 1.6 and
Lemma 2.3), what the ledger charges; exactly, they are :math:`\sqrt{T}\Delta/\sigma`-GDP (Dong, Roth & Su 2019,
arXiv:1905.02383, Thm. 2.7, Cor. 3.3; Cor. 2.13 and Balle & Wang 2018, arXiv:1805.06530, Thm. 8 for its (ε, δ)
curve), a valid conversion *for this mechanism* only. Inverses return the safe side (more noise). The sensitivities,
the paper's convention and the official ``--noise_multiplier``: docs/guide/baselines.md (§"AugPE").
"""

from __future__ import annotations

import dataclasses
import enum
import math

from accounting.accountants import DEFAULT_ACCOUNTANT, Accountant, as_accountant
from accounting.conversions import epsilon_to_gdp, epsilon_to_zcdp, gdp_to_epsilon
from accounting.events import ZcdpEvent
from accounting.limits import COUNT_RANGE, RANGES, ParameterRange
from accounting.sensitivity import coerce_enum

__all__ = [
    "AugPEEvent",
    "AugPESensitivity",
    "NOISE_STD_RANGE",
    "augpe_l2_sensitivity",
    "plan_augpe_noise_std",
]

#: The accepted noise standard deviation σ (counts): below 1e-6 the histogram is in the clear; with
#: T ≤ 1e9 and Δ ≤ √2 every ρ = TΔ²/(2σ²) in this range lies in the ledger's ρ range (1e-300, 1e40).
NOISE_STD_RANGE = ParameterRange(1e-6, 1e12)


class AugPESensitivity(enum.Enum):
    """Which ℓ2 sensitivity of the nearest-neighbour histogram the accountant is told (docs/guide/baselines.md,
    §"AugPE", has the table: only ``REPLACE_BY_NULL`` is a guarantee a ledger composes)."""

    REPLACE_BY_NULL = "replace-by-null"  # correct under replace-by-null: √2
    ADD_OR_REMOVE = "add-or-remove"  # correct under add-or-remove: 1
    PAPER = "paper"  # the paper's experiments: 1 under replace-by-null, NOT a valid guarantee (understated by √2)


_L2_SENSITIVITY = {
    # paper Property prop:augpe-sens, replace-by-null: the nulled reference's vote leaves one bin (−1) and the
    # empty text's vote lands in another (+1): ‖(−1, +1)‖₂ = √2
    AugPESensitivity.REPLACE_BY_NULL: math.sqrt(2.0),
    # paper Property prop:augpe-sens, add-or-remove: one vote appears or disappears
    AugPESensitivity.ADD_OR_REMOVE: 1.0,
    # paper App. B.3.3, "Convention in our Experiments": the add-or-remove value under replace-by-null (invalid)
    AugPESensitivity.PAPER: 1.0,
}


def augpe_l2_sensitivity(sensitivity: AugPESensitivity | str = AugPESensitivity.REPLACE_BY_NULL) -> float:
    """ℓ2 sensitivity Δ of the nearest-neighbour histogram (paper Property prop:augpe-sens; table above)."""
    return _L2_SENSITIVITY[coerce_enum(sensitivity, AugPESensitivity)]


@dataclasses.dataclass(frozen=True)
class AugPEEvent:
    r"""One AugPE release as a privacy event: ``iterations`` (T) noisy histograms, each with Gaussian noise of
    standard deviation ``noise_std`` (σ, counts) on every count, accounted with ``sensitivity``. The event is the
    record: Δ, ρ, μ and ε are derived from these three fields (module docstring gives the formulas)."""

    noise_std: float
    iterations: int
    sensitivity: AugPESensitivity = AugPESensitivity.REPLACE_BY_NULL

    def __post_init__(self) -> None:
        object.__setattr__(self, "noise_std", NOISE_STD_RANGE.check("noise_std", self.noise_std))
        object.__setattr__(self, "iterations", COUNT_RANGE.check("iterations", self.iterations))
        object.__setattr__(self, "sensitivity", coerce_enum(self.sensitivity, AugPESensitivity))

    @property
    def valid(self) -> bool:
        """False for the paper's convention (``PAPER``): its figures are not a valid guarantee."""
        return self.sensitivity is not AugPESensitivity.PAPER

    @property
    def l2_sensitivity(self) -> float:
        """Δ the accountant is told (:func:`augpe_l2_sensitivity`)."""
        return augpe_l2_sensitivity(self.sensitivity)

    @property
    def noise_multiplier(self) -> float:
        """σ/Δ: dp-accounting's ``GaussianDpEvent(noise_multiplier)`` of one iteration, the official implementation's
        ``--noise_multiplier`` (``dpsda/dp_counter.py``, ``dp_nn_histogram``: its Δ = √k = 1)."""
        return self.noise_std / self.l2_sensitivity

    @property
    def rho(self) -> float:
        r""":math:`\rho = T\Delta^2/(2\sigma^2)` (Bun & Steinke 2016, Prop. 1.6 and Lemma 2.3)."""
        return self.iterations * self.l2_sensitivity**2 / (2.0 * self.noise_std**2)

    @property
    def rho_replace_by_null(self) -> float:
        """ρ that the same noise actually spends under replace-by-null (Δ = √2): for ``PAPER`` twice :attr:`rho`."""
        return self.iterations * augpe_l2_sensitivity(AugPESensitivity.REPLACE_BY_NULL) ** 2 / (2.0 * self.noise_std**2)

    @property
    def mu(self) -> float:
        r"""GDP parameter :math:`\mu = \sqrt{T}\,\Delta/\sigma` (Dong, Roth & Su 2019, Thm. 2.7, Cor. 3.3)."""
        return math.sqrt(self.iterations) * self.l2_sensitivity / self.noise_std

    def epsilon(self, delta: float, accountant: Accountant | str = DEFAULT_ACCOUNTANT) -> float:
        """ε at ``delta`` of ρ, converted and rounded up as :meth:`accounting.ZcdpEvent.epsilon` does (the accountant's
        zCDP conversion, CKS for ``br-adaptive``): the figure the ledger charges."""
        return ZcdpEvent(self.rho, "augpe").epsilon(delta, accountant)

    def gaussian_epsilon(self, delta: float) -> float:
        """The exact ε at ``delta`` of T composed Gaussian mechanisms (μ-GDP,
        :func:`~accounting.conversions.gdp_to_epsilon`, which errs high)."""
        return gdp_to_epsilon(self.mu, delta)

    def describe(self) -> str:
        """One line for reports; the paper's convention says it is not a guarantee."""
        head = f"AugPE: T={self.iterations} Gaussian histograms, noise std {self.noise_std:.6g}, rho={self.rho:.6g}"
        if self.valid:
            return f"{head} zCDP ({self.sensitivity.value}, l2 sensitivity {self.l2_sensitivity:.6g})"
        return (f"{head} as the paper accounts it (l2 sensitivity 1 under replace-by-null): NOT A VALID GUARANTEE; "
                f"replace-by-null spends rho={self.rho_replace_by_null:.6g}")  # fmt: skip

    def zcdp_event(self) -> ZcdpEvent:
        """The ledger's record of this release (:class:`accounting.ZcdpEvent` of :attr:`rho`). The ledger composes
        replace-by-null guarantees, so only ``REPLACE_BY_NULL`` has one: ``PAPER`` is not a guarantee, and an
        add-or-remove ρ does not bound a replace-by-null neighbour (that one moves two votes)."""
        if self.sensitivity is not AugPESensitivity.REPLACE_BY_NULL:
            why = "an add-or-remove guarantee does not compose with the ledger's replace-by-null releases"
            if self.sensitivity is AugPESensitivity.PAPER:
                why = "the paper's convention is not a valid guarantee"
            raise ValueError(f"sensitivity={self.sensitivity.value!r} cannot be charged to a ledger: {why}; "
                             "use AugPESensitivity.REPLACE_BY_NULL")  # fmt: skip
        return ZcdpEvent(self.rho, f"augpe (T={self.iterations}, noise_std={self.noise_std:.6g}, replace-by-null)")

    def to_json(self) -> dict:
        return {"noise_std": self.noise_std, "iterations": self.iterations, "sensitivity": self.sensitivity.value,
                "l2_sensitivity": self.l2_sensitivity, "rho": self.rho, "valid": self.valid}  # fmt: skip


def _in_noise_range(sigma: float) -> float:
    """σ raised to :data:`NOISE_STD_RANGE`'s lower end (more noise: safe); above its upper end, a ``ValueError``."""
    if not math.isfinite(sigma) or sigma > NOISE_STD_RANGE.high:
        raise ValueError(f"the budget needs a noise std of {sigma!r}, above {NOISE_STD_RANGE.high:g}: epsilon is too small")
    return max(sigma, NOISE_STD_RANGE.low)


def plan_augpe_noise_std(
    epsilon: float,
    delta: float,
    iterations: int,
    sensitivity: AugPESensitivity | str = AugPESensitivity.REPLACE_BY_NULL,
    accountant: Accountant | str = DEFAULT_ACCOUNTANT,
    *,
    exact_gaussian: bool = False,
) -> float:
    r"""The noise std σ for which ``iterations`` histograms are (ε, δ)-DP: the safe (upper) side.

    zCDP (default, what a ledger charges): :math:`\sigma = \Delta\sqrt{T/(2\rho^*)}` with ρ* the largest ρ the
    accountant's zCDP conversion allows (:func:`accounting.conversions.epsilon_to_zcdp`, its lower end).
    ``exact_gaussian=True``: the largest μ with δ(ε; μ) ≤ δ (:func:`~accounting.conversions.epsilon_to_gdp`, on the
    feasible side), :math:`\sigma = \sqrt{T}\Delta/\mu`. Either σ is then raised until the event's own ε (the same
    function reports it) is at most ``epsilon``.
    """
    epsilon = RANGES["epsilon"].check("epsilon", epsilon)
    delta = RANGES["delta"].check("delta", delta)
    iterations = COUNT_RANGE.check("iterations", iterations)
    sensitivity = coerce_enum(sensitivity, AugPESensitivity)
    acc = as_accountant(accountant)
    if not isinstance(exact_gaussian, bool):
        raise ValueError(f"exact_gaussian must be a bool; got {exact_gaussian!r}")
    rho_star = epsilon_to_zcdp(epsilon, delta, acc.zcdp_conversion)
    if not rho_star > 0.0:
        raise ValueError(f"epsilon={epsilon!r} at delta={delta!r} allows no zCDP budget (rho rounds to 0)")
    delta_l2 = augpe_l2_sensitivity(sensitivity)
    if exact_gaussian:
        mu = epsilon_to_gdp(epsilon, delta)
        sigma = _in_noise_range(math.sqrt(iterations) * delta_l2 / mu)
    else:
        sigma = _in_noise_range(delta_l2 * math.sqrt(iterations / (2.0 * rho_star)))

    def spends(s: float) -> float:
        event = AugPEEvent(s, iterations, sensitivity)
        return event.gaussian_epsilon(delta) if exact_gaussian else event.epsilon(delta, acc)

    step = 2.0**-52  # floating-point guard: grows geometrically, so it ends in a few steps
    while spends(sigma) > epsilon:
        sigma = _in_noise_range(sigma * (1.0 + step))
        step = min(2.0 * step, 0.5)
    return sigma

