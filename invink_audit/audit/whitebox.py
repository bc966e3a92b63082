"""White-box audit: exact per-step checks and sequence-level privacy-loss estimates.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.whitebox", "Our advantage", §1, §2, §4, §6).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from accounting import composed_delta
from accounting.claims import RESOLVABLE_SHARE, PrivacyClaim, StepClaim
from accounting.events import forwarded_property
from accounting.limits import check_count, check_delta, check_order, check_positive
from invink_audit.audit import stats
from invink_audit.mechanisms.base import MechanismGuarantee

__all__ = [
    "EXACT_TOLERANCE",
    "LOG_PROB_BOUND",
    "Claim",
    "Numerics",
    "RESOLVABLE_SHARE",
    "StepClaim",
    "Direction",
    "WhiteBoxConfig",
    "SamplingPlan",
    "StepQuantities",
    "step_quantities",
    "compact_support",
    "WhiteBoxRecorder",
    "RecordedAudit",
    "tolerance_for",
]

#: Absolute tolerance (nats) of the exact checks on float64 distributions (:func:`tolerance_for`'s floor). Our
#: mechanisms compute in float64, whose rounding on logits of magnitude ≤ 1e3 is ≤ 1e-12; a planted bug moves the
#: checked quantities by far more.
EXACT_TOLERANCE = 1e-9
#: A bound (nats) on |log p| over a step's support, for :func:`tolerance_for`.
LOG_PROB_BOUND = 32.0


def tolerance_for(dtype: torch.dtype, *, log_prob_bound: float = LOG_PROB_BOUND) -> float:
    r"""The tolerance (nats) of the exact per-step checks on distributions computed in ``dtype``:
    :math:`\max(16\,u\,S,\ 10^{-9})`, ``u`` the dtype's unit roundoff (``finfo(dtype).eps / 2``), ``S`` =
    ``log_prob_bound`` (float32: 3.1e-5; bfloat16: 2.0; float64: :data:`EXACT_TOLERANCE`).

    Why: a log-softmax evaluated in a type of unit roundoff u returns each log-probability with an absolute error of
    about :math:`u(|\log p| + \log V)` (the shifted log-sum-exp; Blanchard, Higham & Higham 2021, "Accurately
    computing the log-sum-exp and softmax functions", IMA J. Numer. Anal. 41(4), §2-3), and storing it in the type
    adds :math:`u|\log p|`: at most :math:`2uS` per log-probability. A checked quantity combines four of them (a range
    is :math:`\max r - \min r`, :math:`r = \log p - \log p'`), and a Rényi divergence at an order α ≥ 1.5 amplifies an
    unnormalised error by :math:`\alpha/(\alpha-1) \le 3`: 16uS covers both. Never below :data:`EXACT_TOLERANCE`, the
    float64 floor (a float64 mechanism's own arithmetic before its softmax)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype; got {dtype!r}")
    check_positive("log_prob_bound", log_prob_bound)
    return max(16.0 * torch.finfo(dtype).eps / 2 * log_prob_bound, EXACT_TOLERANCE)


@dataclass(frozen=True)
class Numerics:
    """What the exact per-step checks allow for rounding: ``dtype``, the dtype the audited distributions were
    computed in, and ``tolerance`` (nats): a checked quantity above its claim by at most it is rounding, shown in
    the report and not a failure. :meth:`of` derives it from a torch dtype (:func:`tolerance_for`) or takes the
    user's own."""

    dtype: str = "float64"
    tolerance: float = EXACT_TOLERANCE

    def __post_init__(self):
        if not (math.isfinite(self.tolerance) and self.tolerance >= 0):
            raise ValueError(f"tolerance must be a finite number >= 0; got {self.tolerance!r}")

    @classmethod
    def of(cls, dtype: torch.dtype, tolerance: float | None = None) -> Numerics:
        """The numerics of distributions computed in ``dtype``: its :func:`tolerance_for`, or ``tolerance``."""
        return cls(str(dtype).removeprefix("torch."), tolerance_for(dtype) if tolerance is None else float(tolerance))


_DTYPE = torch.float64


class Direction(enum.Enum):
    """Which divergence: forward :math:`D(P_R\\|P_{R'_j})` or reverse :math:`D(P_{R'_j}\\|P_R)`."""

    FORWARD = "forward"
    REVERSE = "reverse"


@dataclass(frozen=True)
class Claim:
    r"""The claim an audit tests: the audited mechanism's guarantee (:class:`MechanismGuarantee`, its accountant's
    statement for texts of at most T tokens at δ) for ``batch_size`` references; every figure derives from it, and
    it validates as its :class:`accounting.PrivacyClaim` (:meth:`privacy_claim`).

    * ``"bounded-range"`` (InvisibleInk): per step ε0-bounded range and ρ_tok-zCDP (InvisibleInk:
      :math:`\varepsilon_0^2/8 = C^2/(2B^2\tau^2)`, paper Theorem 2); sequence claim
      :math:`D_\alpha \le \alpha T\rho_{tok}`;
    * ``"zcdp"``: the guarantee's sequence ρ, with the per-step claim of the exactly checked component (Amin et al.:
      the exponential mechanism), if any;
    * ``"renyi-filter"``, data-dependent (AdaPMixED): :math:`D_\alpha \le` ``renyi_budget`` at ``renyi_order`` only,
      both directions, for the audited dataset; no per-step claim, never a PASS.
    """

    guarantee: MechanismGuarantee
    batch_size: int

    def __post_init__(self):
        g = self.guarantee
        if not isinstance(g, MechanismGuarantee):
            raise ValueError(f"guarantee must be a MechanismGuarantee; got {type(g).__name__}")
        object.__setattr__(self, "batch_size", check_count("batch_size", self.batch_size))
        check_count("max_new_tokens", g.max_new_tokens)
        check_delta("delta", g.delta)
        if g.step_epsilon0 is not None:  # math.inf: no claim at that level (a bounded range composes ε0: finite)
            check_positive("epsilon0", g.step_epsilon0, allow_inf=g.composition != "bounded-range")
            check_positive("rho_token", g.step_rho, allow_inf=g.composition != "bounded-range")
        if g.composition == "bounded-range" and g.step_epsilon0 is None:
            raise ValueError("a bounded-range claim needs epsilon0 and rho_token")
        if g.composition == "zcdp" and g.rho_sequence is None:
            raise ValueError("a zcdp claim needs the guarantee's rho_sequence")
        if g.composition == "renyi-filter":
            check_order("renyi_order", g.renyi_order)
        elif g.rho_sequence is not None:
            check_positive("rho_sequence", g.rho_sequence)
        self.privacy_claim()  # the per-step levels and the Rényi budget, by accounting.limits

    @classmethod
    def from_mechanism(cls, mechanism, max_new_tokens: int, delta: float = 1e-6) -> Claim:
        """The claim of a :class:`invink_audit.mechanisms.Mechanism` run for at most ``max_new_tokens`` at ``delta``."""
        return cls(mechanism.guarantee(max_new_tokens, delta), mechanism.batch_size)

    epsilon0 = forwarded_property("guarantee", "step_epsilon0", "The per-step bounded-range claim (``None``: none).")
    rho_token = forwarded_property("guarantee", "step_rho", "The per-step zCDP claim (``None``: none).")
    max_new_tokens = forwarded_property("guarantee", "max_new_tokens", "T, the texts' budget.")
    delta = forwarded_property("guarantee", "delta", "δ.")
    composition = forwarded_property("guarantee", "composition", "How the per-step costs compose.")
    renyi_order = forwarded_property("guarantee", "renyi_order", "A Rényi filter's order.")
    renyi_budget = forwarded_property("guarantee", "renyi_budget", "A Rényi filter's budget at its order.")
    a_priori = forwarded_property("guarantee", "a_priori", "Whether the guarantee holds for every dataset.")

    @property
    def kind(self) -> str:
        """``"a-priori"`` or ``"data-dependent"``."""
        return self.guarantee.kind.value

    @property
    def epsilon_claimed(self) -> float | None:
        """The guarantee's ε where the report states it (every claim but an a-priori bounded-range one's)."""
        return None if self.composition == "bounded-range" and self.a_priori else self.guarantee.epsilon

    def privacy_claim(self) -> PrivacyClaim:
        """The guarantee's claim as an :class:`accounting.PrivacyClaim` (:meth:`MechanismGuarantee.privacy_claim`)."""
        return self.guarantee.privacy_claim()

    @property
    def step(self) -> StepClaim:
        """What the claim bounds of each step (:class:`StepClaim`)."""
        return self.privacy_claim().step

    @property
    def step_checks(self) -> bool:
        """Whether the claim bounds each step (range, Rényi, δ checked exactly at every prefix)."""
        return self.step.claims

    @property
    def rho_sequence(self) -> float | None:
        """Sequence-level zCDP of the claim (``None`` for a Rényi-filter claim)."""
        if self.composition == "bounded-range":
            return self.max_new_tokens * self.rho_token
        return self.guarantee.rho_sequence if self.composition == "zcdp" else None

    def renyi(self, alpha: float) -> float:
        r"""The claimed sequence-level Rényi divergence at order α: :math:`\alpha\rho_{seq}`, or for a
        Rényi filter its budget at its order (``inf``, no claim, at other orders)."""
        if self.composition == "renyi-filter":
            return float(self.renyi_budget) if math.isclose(float(alpha), float(self.renyi_order)) else math.inf
        return float(alpha) * self.rho_sequence

    def loss_upper(self) -> float:
        """An a-priori bound on a text's privacy loss (``T·ε0`` for bounded range; ``inf`` otherwise)."""
        return self.max_new_tokens * self.epsilon0 if self.composition == "bounded-range" else math.inf


DEFAULT_ALPHAS = (1.5, 2.0, 4.0, 8.0)
DEFAULT_DELTA_GRID = (1e-1, 1e-2, 1e-3)
#: fractions of ε0 at which the per-step hockey-stick divergence is checked
STEP_EPSILON_FRACTIONS = (0.0, 0.25, 0.5, 0.75)


@dataclass(frozen=True)
class WhiteBoxConfig:
    """What a white-box audit samples and tests.

    ``num_samples`` texts are drawn from ``R`` (forward Monte Carlo; their losses serve every
    neighbour at once) and, with the reverse direction, ``num_samples`` texts from each audited
    ``R'_j``. ``num_is_samples`` texts per (α, neighbour, direction) are drawn from the geometric
    mixture (0 disables importance sampling). ``neighbours``: the indices audited at sequence level
    (``None``: all B); the exact per-step checks always cover all B neighbours, with the tolerance of ``numerics``
    (:class:`Numerics`; float64 distributions by default, ``Numerics.of(torch.float32)`` for float32 ones).
    """

    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    num_samples: int = 400
    num_is_samples: int = 200
    neighbours: tuple[int, ...] | None = None
    directions: tuple[Direction, ...] = (Direction.FORWARD, Direction.REVERSE)
    significance: float = 0.05
    delta_grid: tuple[float, ...] = DEFAULT_DELTA_GRID
    accountants: tuple[str, ...] | None = None  # None: every accountant of `accounting`
    min_samples: int = 50
    numerics: Numerics = Numerics()

    def __post_init__(self):
        alphas = tuple(float(a) for a in self.alphas)
        if not alphas or any(not (math.isfinite(a) and a > 1) for a in alphas):
            raise ValueError(f"alphas must be a non-empty sequence of finite numbers > 1; got {self.alphas!r}")
        object.__setattr__(self, "alphas", tuple(sorted(set(alphas))))
        check_count("num_samples", self.num_samples, minimum=1)
        check_count("num_is_samples", self.num_is_samples, minimum=0)
        check_count("min_samples", self.min_samples, minimum=1)
        if self.neighbours is not None:
            nb = tuple(int(j) for j in self.neighbours)
            if not nb or any(j < 0 for j in nb) or len(set(nb)) != len(nb):
                raise ValueError(f"neighbours must be distinct non-negative indices; got {self.neighbours!r}")
            object.__setattr__(self, "neighbours", nb)
        dirs = tuple(Direction(d) if not isinstance(d, Direction) else d for d in self.directions)
        if not dirs:
            raise ValueError("directions must not be empty")
        object.__setattr__(self, "directions", dirs)
        stats.check_significance(self.significance)
        grid = tuple(float(d) for d in self.delta_grid)
        if any(not 0 < d < 1 for d in grid):
            raise ValueError(f"delta_grid values must be in (0, 1); got {self.delta_grid!r}")
        object.__setattr__(self, "delta_grid", grid)
        if self.accountants is not None:
            object.__setattr__(self, "accountants", tuple(str(a) for a in self.accountants))

    def audited_neighbours(self, batch_size: int) -> tuple[int, ...]:
        if self.neighbours is None:
            return tuple(range(batch_size))
        bad = [j for j in self.neighbours if j >= batch_size]
        if bad:
            raise ValueError(f"neighbours {bad} out of range for batch_size={batch_size}")
        return self.neighbours

    def for_claim(self, claim: Claim) -> tuple[WhiteBoxConfig, list[str]]:
        """The config ``claim`` allows, and notes saying what changed. Importance sampling bounds its integrand
        with the per-step bounded-range claim, so it runs for bounded-range claims only; a Rényi-filter claim
        (AdaPMixED) is about one order, so the α grid is that order."""
        config, notes = self, []
        if claim.composition != "bounded-range" and config.num_is_samples:
            notes.append(
                f"importance sampling disabled ({config.num_is_samples} texts per row requested): its bound needs a "
                f"per-step bounded-range claim and this claim is {claim.composition!r}; plain Monte Carlo only"
            )
            config = replace(config, num_is_samples=0)
        if claim.composition == "renyi-filter" and tuple(config.alphas) != (float(claim.renyi_order),):
            notes.append(f"alphas set to the data-dependent accountant's single order {claim.renyi_order:g}")
            config = replace(config, alphas=(float(claim.renyi_order),))
        return config, notes


# sampling targets
KIND_ACTUAL, KIND_NEIGHBOUR, KIND_MIXTURE_FORWARD, KIND_MIXTURE_REVERSE = 0, 1, 2, 3


@dataclass(frozen=True)
class SamplingPlan:
    """Per-text sampling targets: ``kind`` (0: R, 1: R'_j, 2: forward mixture, 3: reverse mixture),
    ``neighbour`` j (−1 for kind 0) and ``alpha_index`` into the config's alphas (−1 for MC)."""

    kind: np.ndarray
    neighbour: np.ndarray
    alpha_index: np.ndarray

    @property
    def num_texts(self) -> int:
        return int(self.kind.size)

    @classmethod
    def build(cls, config: WhiteBoxConfig, batch_size: int) -> "SamplingPlan":
        """The plan's texts in order: R's, each audited R'_j's (reverse direction), then the mixtures' by
        direction, neighbour and α."""
        audited = config.audited_neighbours(batch_size)
        groups = [(KIND_ACTUAL, -1, -1, config.num_samples)]  # (kind, neighbour, alpha index, texts)
        if Direction.REVERSE in config.directions:
            groups += [(KIND_NEIGHBOUR, j, -1, config.num_samples) for j in audited]
        if config.num_is_samples:
            mixture = {Direction.FORWARD: KIND_MIXTURE_FORWARD, Direction.REVERSE: KIND_MIXTURE_REVERSE}
            groups += [(mixture[d], j, ai, config.num_is_samples)
                       for d in config.directions for j in audited for ai in range(len(config.alphas))]
        kinds, nbs, ais, counts = (np.array(column, dtype=np.int64) for column in zip(*groups))
        return cls(np.repeat(kinds, counts), np.repeat(nbs, counts), np.repeat(ais, counts))


# ---------------------------------------------------------------------------------------------
# exact per-step quantities


@dataclass(frozen=True)
class StepQuantities:
    r"""Exact per-step divergences between :math:`p` (under R) and :math:`p'_j` (under R'_j).

    Shapes: ``loss_range`` (G, B); ``renyi_forward``/``renyi_reverse`` (G, B, A) for
    :math:`D_\alpha(p\|p'_j)` / :math:`D_\alpha(p'_j\|p)`; ``delta_forward``/``delta_reverse``
    (G, B, E) hockey-stick divergences at the given ε; ``forward_infinite``/``reverse_infinite``
    (G, B): a token possible under one and impossible under the other (loss ±∞).
    """

    loss_range: torch.Tensor
    renyi_forward: torch.Tensor
    renyi_reverse: torch.Tensor
    delta_forward: torch.Tensor
    delta_reverse: torch.Tensor
    forward_infinite: torch.Tensor
    reverse_infinite: torch.Tensor


def step_quantities(
    actual: torch.Tensor, neighbours: torch.Tensor, alphas: Sequence[float], epsilons: Sequence[float]
) -> StepQuantities:
    r"""Exact per-step divergences from log-probabilities ``actual`` (G, V) and ``neighbours`` (G, B, V).

    With :math:`r = \log p - \log p'` on the common support:
    :math:`D_\alpha(p\|p') = \frac{1}{\alpha-1}\log\sum_y e^{\log p(y) + (\alpha-1) r(y)}`,
    :math:`D_\alpha(p'\|p) = \frac{1}{\alpha-1}\log\sum_y e^{\log p'(y) - (\alpha-1) r(y)}`
    (Rényi 1961; van Erven & Harremoës 2014, Eq. (1)), infinite on a support mismatch;
    :math:`\delta(\varepsilon) = \sum_y (p(y) - e^\varepsilon p'(y))_+` (the hockey-stick divergence).
    """
    if actual.ndim != 2 or neighbours.ndim != 3 or neighbours.shape[0] != actual.shape[0] or neighbours.shape[2] != actual.shape[1]:
        raise ValueError(
            f"actual must be (G, V) and neighbours (G, B, V); got {tuple(actual.shape)} and {tuple(neighbours.shape)}"
        )
    lp = actual.to(_DTYPE).unsqueeze(-2)  # (G, 1, V)
    lq = neighbours.to(_DTYPE)  # (G, B, V)
    fp = torch.isfinite(lp)
    fq = torch.isfinite(lq)
    both = fp & fq
    forward_infinite = (fp & ~fq).any(-1)
    reverse_infinite = (fq & ~fp).any(-1)
    r = torch.where(both, lp - lq, torch.zeros((), dtype=_DTYPE, device=lq.device))
    neg_inf = torch.full((), -math.inf, dtype=_DTYPE, device=lq.device)
    pos_inf = torch.full((), math.inf, dtype=_DTYPE, device=lq.device)
    r_max = torch.where(both, r, neg_inf).amax(-1)
    r_min = torch.where(both, r, pos_inf).amin(-1)
    loss_range = torch.where(forward_infinite | reverse_infinite, pos_inf, r_max - r_min)
    lp_b = lp.expand_as(lq)
    fwd, rev = [], []
    for a in alphas:
        am1 = float(a) - 1.0
        f = torch.logsumexp(torch.where(both, lp_b + am1 * r, neg_inf), -1) / am1
        b = torch.logsumexp(torch.where(both, lq - am1 * r, neg_inf), -1) / am1
        fwd.append(torch.where(forward_infinite, pos_inf, f))
        rev.append(torch.where(reverse_infinite, pos_inf, b))
    p = torch.exp(lp_b)
    q = torch.exp(lq)
    dfw, drv = [], []
    for e in epsilons:
        ee = math.exp(min(float(e), 700.0))  # no OverflowError: beyond ε = 700 the δ differs by < 1e-300
        dfw.append(torch.clamp(p - ee * q, min=0.0).sum(-1))
        drv.append(torch.clamp(q - ee * p, min=0.0).sum(-1))
    return StepQuantities(
        loss_range=loss_range,
        renyi_forward=torch.stack(fwd, -1).clamp(min=0.0),
        renyi_reverse=torch.stack(rev, -1).clamp(min=0.0),
        delta_forward=torch.stack(dfw, -1),
        delta_reverse=torch.stack(drv, -1),
        forward_infinite=forward_infinite,
        reverse_infinite=reverse_infinite,
    )


def compact_support(
    actual: torch.Tensor, neighbours: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Restrict (G, V) / (G, B, V) log-probabilities to the union of their supports, per row (exact: a token outside
    every support contributes nothing; with a Top-k+ set the checks cost O(G·B·k), not O(G·B·V)). Rows keep ``m``
    columns, the largest union size. Returns ``(actual_c, neighbours_c, index)``, ``index`` (G, m) the kept token
    ids, or the inputs and ``None`` when ``m > V/2``."""
    g, b, v = neighbours.shape
    # one reduction over B instead of a (G, B, V) boolean temporary; log-probabilities are never +inf
    union = (actual > -math.inf) | (neighbours.amax(1) > -math.inf)
    m = int(union.sum(-1).max().item()) if g else 0
    if m == 0 or 2 * m > v:
        return actual, neighbours, None
    idx = torch.topk(union.to(torch.float32), m, dim=-1, sorted=False).indices  # (G, m)
    return actual.gather(1, idx), neighbours.gather(2, idx.unsqueeze(1).expand(g, b, m)), idx


#: the exact per-step checks' failure kinds; "nonfinite": a released distribution holds NaN or +inf
_FAILURE_KINDS = ("support", "range", "renyi", "delta", "nonfinite")


def _finite_log_probs(actual: torch.Tensor, neighbours: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``actual`` (G, V) and ``neighbours`` (G, B, V) with NaN and +inf log-probabilities set to −inf (no
    probability: never drawn, outside every support), and (G, B) whether the pair held any (a finding of its own)."""
    bad = (torch.isnan(actual) | (actual == math.inf)).any(-1, keepdim=True)
    bad = bad | (torch.isnan(neighbours) | (neighbours == math.inf)).any(-1)
    return tuple(torch.nan_to_num(x, nan=-math.inf, posinf=-math.inf, neginf=-math.inf) for x in (actual, neighbours)) + (bad,)


# ---------------------------------------------------------------------------------------------
# the recorder: called once per decoding step by a decode loop (the engine's or a synthetic one)


@dataclass(frozen=True)
class RecordedAudit:
    """Everything a white-box audit measured, moved to numpy (see :func:`analysis.analyse`)."""

    plan: SamplingPlan
    claim: Claim
    config: WhiteBoxConfig
    batch_size: int
    log_prob_actual: np.ndarray  # (N,) log P_R(x)
    log_prob_neighbours: np.ndarray  # (N, B) log P_{R'_j}(x)
    is_sums: np.ndarray  # (N,) sum_t D_alpha(p_t || p'_t) along IS texts (nan for MC texts)
    lengths: np.ndarray  # (N,) number of tokens (incl. a final EOS/STOP)
    tokens: np.ndarray  # (N, max_steps) token ids, -1 after the end
    step_epsilons: tuple[float, ...]
    step_delta_claims: tuple[float, ...]
    num_step_checks: int  # (text, step, neighbour) triples checked
    failures: dict  # kind -> count ("support", "range", "renyi", "delta", "nonfinite")
    max_loss_range_per_step: np.ndarray  # (steps,) max over texts and neighbours
    max_renyi_ratio_per_step: np.ndarray  # (steps, A) max of D_alpha / (alpha rho_tok), both directions
    max_delta_excess_per_step: np.ndarray  # (steps,) max of delta_t(eps) - delta_BR(eps)
    worst_range: dict  # {"value", "text", "step", "neighbour"}
    worst_renyi: dict
    check_seconds: float = 0.0
    extra: dict = field(default_factory=dict)
    within_tolerance: dict = field(default_factory=dict)  # kind -> checks above the claim by at most the tolerance


class WhiteBoxRecorder:
    """Accumulates exact checks and sequence log-probabilities while texts are generated. Once per decoding step
    with the live texts ``text_ids`` (indices into the plan): ``weights = recorder.sampling_log_weights(text_ids,
    actual, neighbours)`` (the exact checks; each text's sampling log-weights), draw ``tokens`` from them, then
    ``recorder.record(text_ids, tokens)``. Texts end where the decode loop says; :meth:`finish` returns a
    :class:`RecordedAudit`."""

    def __init__(
        self,
        plan: SamplingPlan,
        claim: Claim,
        config: WhiteBoxConfig,
        *,
        max_steps: int,
        device: torch.device | str = "cpu",
    ):
        self.plan = plan
        self.claim = claim
        self.config = config
        self.batch_size = claim.batch_size
        self.max_steps = check_count("max_steps", max_steps)
        self.device = torch.device(device)
        n, b = plan.num_texts, claim.batch_size
        dev = self.device
        self._kind = torch.as_tensor(plan.kind, device=dev)
        self._nb = torch.as_tensor(plan.neighbour, device=dev).clamp(min=0)
        self._ai = torch.as_tensor(plan.alpha_index, device=dev).clamp(min=0)
        self._alphas = torch.tensor(config.alphas, dtype=_DTYPE, device=dev)
        self._lp_actual = torch.zeros(n, dtype=_DTYPE, device=dev)
        self._lp_neigh = torch.zeros(n, b, dtype=_DTYPE, device=dev)
        self._is_sum = torch.zeros(n, dtype=_DTYPE, device=dev)
        self._length = torch.zeros(n, dtype=torch.int64, device=dev)
        self._tokens = torch.full((n, self.max_steps), -1, dtype=torch.int64, device=dev)
        # a level the claim does not bound (math.inf; data-dependent mechanisms bound none) is recorded, not checked:
        # δ(ε) then only at ε = 0 against 1, and the "ratios" of an unclaimed order are the raw D_alpha(p_t || p'_t)
        self.step = claim.step
        self.step_epsilons, self.step_delta_claims = (0.0,), (1.0,)
        if math.isfinite(self.step.epsilon0):
            self.step_epsilons = tuple(f * self.step.epsilon0 for f in STEP_EPSILON_FRACTIONS)
            # one-step δ_BR(ε) of an ε0-BR mechanism: the br-adaptive accountant with T = 1
            self.step_delta_claims = tuple(float(composed_delta(float(e), self.step.epsilon0, 1, "br-adaptive"))
                                           for e in self.step_epsilons)
        self._renyi_claim_t = torch.tensor([self.step.renyi_bound(a) for a in config.alphas], dtype=_DTYPE, device=dev)
        self._renyi_scale_t = torch.where(self._renyi_claim_t.isfinite(), self._renyi_claim_t, 1.0)
        self._delta_claim_t = torch.tensor(self.step_delta_claims, dtype=_DTYPE, device=dev)
        self._fail = {k: torch.zeros((), dtype=torch.int64, device=dev) for k in _FAILURE_KINDS}
        self._within = {k: torch.zeros((), dtype=torch.int64, device=dev) for k in _FAILURE_KINDS[1:4]}
        self._num_checks = 0
        # maxima per position in the text (scatter-reduced; no host sync during decoding)
        a = len(config.alphas)
        self._pos_range = torch.zeros(self.max_steps, dtype=_DTYPE, device=dev)
        self._pos_renyi = torch.zeros(self.max_steps, a, dtype=_DTYPE, device=dev)
        self._pos_delta = torch.full((self.max_steps,), -math.inf, dtype=_DTYPE, device=dev)
        self._pos_seen = torch.zeros(self.max_steps, dtype=torch.bool, device=dev)
        # running worst (value, text, position, neighbour)
        self._worst_range = torch.tensor([-1.0, -1, -1, -1], dtype=_DTYPE, device=dev)
        self._worst_renyi = torch.tensor([-1.0, -1, -1, -1], dtype=_DTYPE, device=dev)
        self._pending = None
        self.check_seconds = 0.0

    # -- per step ---------------------------------------------------------------------------
    def sampling_log_weights(
        self,
        text_ids: torch.Tensor,
        actual: torch.Tensor,
        neighbours: torch.Tensor,
        *,
        check_actual: torch.Tensor | None = None,
        check_neighbours: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the exact checks of one step and return each text's sampling log-weights. ``actual`` (G, W),
        ``neighbours`` (G, B, W): the step's outcome log-probabilities under R and every R'_j.
        ``check_actual``/``check_neighbours``: the distributions the per-step claim is about when they are not the
        outcome distributions (Amin et al.'s exponential mechanism given a private step)."""
        if self._pending is not None:
            raise RuntimeError("record() must be called after each sampling_log_weights()")
        if (check_actual is None) != (check_neighbours is None):
            raise ValueError("give both check_actual and check_neighbours, or neither")
        start = time.perf_counter()
        ids = text_ids.to(self.device, torch.int64)
        if neighbours.shape[1] != self.batch_size:
            raise ValueError(f"neighbours has {neighbours.shape[1]} rows; the claim is for batch_size={self.batch_size}")
        actual, neighbours, nonfinite = _finite_log_probs(actual.to(self.device, _DTYPE), neighbours.to(self.device, _DTYPE))
        ca, cn, kept = compact_support(actual, neighbours)
        q = step_quantities(ca, cn, self.config.alphas, self.step_epsilons)
        qc = q
        if check_actual is not None:
            ka, kn, bad = _finite_log_probs(check_actual.to(self.device, _DTYPE), check_neighbours.to(self.device, _DTYPE))
            nonfinite |= bad
            ka, kn, _ = compact_support(ka, kn)
            qc = step_quantities(ka, kn, self.config.alphas, self.step_epsilons)
        self._fail["nonfinite"] += nonfinite.sum()
        self._check_step(q, qc, ids, separate_checks=check_actual is not None)
        rows = torch.arange(ids.numel(), device=self.device)
        weights = self._target_weights(ids, rows, ca, cn)
        if kept is not None:
            weights = torch.full_like(actual, -math.inf).scatter_(1, kept, weights)
        inc = self._is_increments(ids, rows, q)
        self._pending = (ids, actual, neighbours, inc)
        self.check_seconds += time.perf_counter() - start
        return weights

    def weigh(self, text_ids: torch.Tensor, step) -> torch.Tensor:
        """:meth:`sampling_log_weights` of a :class:`~invink_audit.mechanisms.MechanismStep` (its outcome
        distributions under R and every R'_j, and its check distributions where it names them)."""
        return self.sampling_log_weights(text_ids, step.log_probs, step.neighbours, check_actual=step.check_actual,
                                         check_neighbours=step.check_neighbours)

    def _check_step(self, q, qc, ids: torch.Tensor, *, separate_checks: bool) -> None:
        """The exact checks of one step (supports on ``q``; range, Rényi and δ on ``qc``), counted (an excess over
        the claim within the numerics' tolerance counted apart, not as a failure), and the maxima per position and
        the running worst prefixes updated (device tensors, no host sync)."""
        tol = self.config.numerics.tolerance
        support_fail = q.forward_infinite | q.reverse_infinite
        if separate_checks and self.step.claims:
            support_fail = support_fail | qc.forward_infinite | qc.reverse_infinite
        renyi = torch.maximum(qc.renyi_forward, qc.renyi_reverse)  # (G, B, A)
        claimed = self._renyi_claim_t.isfinite()
        unclaimed = torch.full_like(qc.loss_range, -math.inf)
        delta_excess = torch.maximum(qc.delta_forward, qc.delta_reverse) - self._delta_claim_t.view(1, 1, -1)
        excess = {
            "range": qc.loss_range - self.step.epsilon0 if math.isfinite(self.step.epsilon0) else unclaimed,
            "renyi": torch.where(claimed, renyi - self._renyi_claim_t, -math.inf).amax(-1),
            "delta": delta_excess.amax(-1),
        }
        self._fail["support"] += support_fail.sum()
        for kind, over in excess.items():
            self._fail[kind] += (over > tol).sum()
            self._within[kind] += ((over > 0) & (over <= tol)).sum()
        g, b = q.loss_range.shape
        self._num_checks += g * b
        pos = self._length[ids]
        ratio = renyi / self._renyi_scale_t  # (G, B, A)
        self._pos_range.scatter_reduce_(0, pos, qc.loss_range.amax(-1), "amax")
        self._pos_renyi.scatter_reduce_(0, pos.unsqueeze(-1).expand(-1, ratio.shape[-1]), ratio.amax(1), "amax")
        self._pos_delta.scatter_reduce_(0, pos, delta_excess.amax(dim=(1, 2)), "amax")
        self._pos_seen[pos] = True
        self._worst_range = _running_worst(self._worst_range, qc.loss_range, ids, pos)
        self._worst_renyi = _running_worst(self._worst_renyi, ratio.amax(-1), ids, pos)

    def _target_weights(self, ids: torch.Tensor, rows: torch.Tensor, ca: torch.Tensor, cn: torch.Tensor) -> torch.Tensor:
        """Each live text's sampling log-weights on the compacted support: R, its R'_j, or a geometric mixture."""
        kind = self._kind[ids]
        nb = self._nb[ids]
        alpha = self._alphas[self._ai[ids]].unsqueeze(-1)
        lq = cn[rows, nb]  # (G, m)
        weights = torch.where((kind == KIND_NEIGHBOUR).unsqueeze(-1), lq, ca)
        mix_f = _geometric_mixture(ca, lq, alpha)
        mix_r = _geometric_mixture(lq, ca, alpha)
        weights = torch.where((kind == KIND_MIXTURE_FORWARD).unsqueeze(-1), mix_f, weights)
        return torch.where((kind == KIND_MIXTURE_REVERSE).unsqueeze(-1), mix_r, weights)

    def _is_increments(self, ids: torch.Tensor, rows: torch.Tensor, q) -> torch.Tensor:
        """Importance-sampling increments: this step's exact D_α of each mixture text's pair, in its direction."""
        kind = self._kind[ids]
        nb = self._nb[ids]
        ai = self._ai[ids]
        d_f = q.renyi_forward[rows, nb, ai]
        d_r = q.renyi_reverse[rows, nb, ai]
        return torch.where(kind == KIND_MIXTURE_FORWARD, d_f, torch.where(kind == KIND_MIXTURE_REVERSE, d_r, torch.zeros_like(d_f)))

    def record(self, text_ids: torch.Tensor, tokens: torch.Tensor) -> None:
        if self._pending is None:
            raise RuntimeError("record() called without a preceding sampling_log_weights()")
        start = time.perf_counter()
        ids, actual, neighbours, inc = self._pending
        if text_ids.numel() != ids.numel():
            raise ValueError("record() must receive the same texts as sampling_log_weights()")
        tok = tokens.to(self.device, torch.int64).reshape(-1)
        rows = torch.arange(ids.numel(), device=self.device)
        self._lp_actual[ids] += actual[rows, tok]
        self._lp_neigh[ids] += neighbours[rows, :, tok]
        self._is_sum[ids] += inc
        pos = self._length[ids]
        if bool((pos >= self.max_steps).any()):
            raise ValueError(f"a text exceeded max_steps={self.max_steps}")
        self._tokens[ids, pos] = tok
        self._length[ids] += 1
        self._pending = None
        self.check_seconds += time.perf_counter() - start

    # -- end --------------------------------------------------------------------------------
    def finish(self) -> RecordedAudit:
        if self._pending is not None:
            raise RuntimeError("finish() called between sampling_log_weights() and record()")
        is_sums = np.where(self.plan.kind >= KIND_MIXTURE_FORWARD, self._is_sum.cpu().numpy(), np.nan)
        seen = int(self._pos_seen.sum().item())

        def worst(state):
            v = state.cpu().tolist()
            return {"value": float(v[0]), "text": int(v[1]), "step": int(v[2]), "neighbour": int(v[3])}

        return RecordedAudit(
            plan=self.plan,
            claim=self.claim,
            config=self.config,
            batch_size=self.batch_size,
            log_prob_actual=self._lp_actual.cpu().numpy(),
            log_prob_neighbours=self._lp_neigh.cpu().numpy(),
            is_sums=is_sums,
            lengths=self._length.cpu().numpy(),
            tokens=self._tokens.cpu().numpy(),
            step_epsilons=self.step_epsilons,
            step_delta_claims=self.step_delta_claims,
            num_step_checks=self._num_checks,
            failures={k: int(v.item()) for k, v in self._fail.items()},
            within_tolerance={k: int(v.item()) for k, v in self._within.items()},
            max_loss_range_per_step=self._pos_range[:seen].cpu().numpy(),
            max_renyi_ratio_per_step=self._pos_renyi[:seen].cpu().numpy(),
            max_delta_excess_per_step=self._pos_delta[:seen].cpu().numpy(),
            worst_range=worst(self._worst_range),
            worst_renyi=worst(self._worst_renyi),
            check_seconds=self.check_seconds,
        )


def _running_worst(state: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Update (value, text, position, neighbour) with the largest entry of ``values`` (G, B)."""
    b = values.shape[1]
    flat = values.reshape(-1)
    idx = torch.argmax(flat)
    row = idx // b
    cand = torch.stack([flat[idx], ids[row].to(_DTYPE), pos[row].to(_DTYPE), (idx % b).to(_DTYPE)])
    return torch.where(cand[0] > state[0], cand, state)


def _geometric_mixture(lp: torch.Tensor, lq: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    r"""Unnormalised log-weights of :math:`g \propto p^\alpha q^{1-\alpha}` (docs/auditing_notes.md §4).

    Where ``p > 0 = q`` the mixture is infinite (the divergence is); such rows put all their mass
    uniformly on those tokens, which is where the infinite loss lives.
    """
    fp, fq = torch.isfinite(lp), torch.isfinite(lq)
    both = fp & fq
    neg_inf = torch.full((), -math.inf, dtype=lp.dtype, device=lp.device)
    w = torch.where(both, alpha * torch.where(both, lp, 0.0) + (1.0 - alpha) * torch.where(both, lq, 0.0), neg_inf)
    infinite = fp & ~fq
    any_inf = infinite.any(-1, keepdim=True)
    return torch.where(any_inf, torch.where(infinite, torch.zeros_like(w), neg_inf), w)
