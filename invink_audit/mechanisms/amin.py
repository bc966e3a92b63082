"""Amin et al. 2024 ("Private prediction for large-scale synthetic text generation", EMNLP Findings,
arXiv:2407.12108) as a :class:`~invink_audit.mechanisms.base.Mechanism`, under replace-by-null adjacency.

One step: recentred naive clipping (InvisibleInk paper Eq. (8) (eq:amin-avg)), a sparse-vector step that
picks a public or a private token (AboveThreshold, Dwork & Roth 2014, Alg. 1), the exponential mechanism
for a private one (paper Eq. (2) (eq:expo-mech)); stop after ``r`` private tokens. :class:`AminAccounting`:
a-priori ρ_seq = r(ρ_em + ρ_svt) (paper Theorem 2 (thm:accounting); Dwork & Roth 2014, Thm. 3.23, with
Lyu, Su & Li 2017's noise split; Bun & Steinke 2016, Prop. 1.4), under :class:`AminSensitivity`
``REPLACE_BY_NULL`` (2C/B, 2/B: paper Property 9 (prop:amin-sens)) or ``PAPER`` (C/B, 1/B, understated).

Design: docs/guide/baselines.md (§"Amin et al. 2024"); accounting: docs/accounting_notes.md §7.
"""

from __future__ import annotations

import dataclasses
import enum
import math

import torch

from accounting.accountants import bounded_range_epsilon
from accounting.conversions import br_to_zcdp, epsilon_to_zcdp, zcdp_to_epsilon
from accounting.limits import check_count
from accounting.sensitivity import Adjacency, Clipping, linf_sensitivity
from invink_audit.mechanisms.base import (
    STATE_DTYPE,
    GuaranteeKind,
    Mechanism,
    MechanismGuarantee,
    MechanismStep,
    check_step_shapes,
    check_stateful_step,
    laplace_cdf_log,
    laplace_quantile,
)

__all__ = [
    "AminAccounting",
    "AminConfig",
    "AminInfeasibleError",
    "AminMechanism",
    "AminSensitivity",
    "amin_clipped_contributions",
    "amin_svt_distance",
    "plan_amin",
]

#: quantile grid of the SVT threshold's posterior in exact (audit) mode: midpoint rule over the prior's
#: quantiles. The integrand behaves like sqrt(1 − u) in the prior's upper tail, so the error is
#: O(n^-1.5): ~1e-4 relative on P(private) at 2048 points (``tests/test_baselines_amin.py``), far below
#: any statistical error of an audit; the sampled (deployed) mechanism draws real Laplace noise.
DEFAULT_POSTERIOR_GRID = 2048

MODE_PUBLIC, MODE_PRIVATE = 0, 1


class AminSensitivity(enum.Enum):
    """Which sensitivities the accountant is told (docs/guide/baselines.md, "Amin et al. 2024")."""

    REPLACE_BY_NULL = "replace-by-null"  # correct: aggregate 2C/B, SVT query 2/B
    PAPER = "paper"  # the paper's experiments: C/B and 1/B under replace-by-null (understated by 2)


class AminInfeasibleError(ValueError):
    """No clip norm reaches the budget: the SVT alone costs more than the budget allows per private token
    (the paper's "infeasible" cells, Table 2 (tab:result))."""


@dataclasses.dataclass(frozen=True)
class AminAccounting:
    r"""The a-priori accountant of Amin et al.: :math:`\rho_{seq} = r(\rho_{em} + \rho_{svt})` (module docstring)."""

    clip_norm: float
    batch_size: int
    temperature: float
    svt_noise: float
    max_private_tokens: int
    sensitivity: AminSensitivity = AminSensitivity.REPLACE_BY_NULL

    def __post_init__(self):
        for name in ("clip_norm", "temperature", "svt_noise"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive finite number; got {v!r}")
        for name in ("batch_size", "max_private_tokens"):
            check_count(name, getattr(self, name))
        object.__setattr__(self, "sensitivity", AminSensitivity(self.sensitivity))

    @property
    def aggregate_sensitivity(self) -> float:
        r""":math:`\Delta` of the recentred naive aggregate: 2C/B (replace-by-null, paper Property 9 (prop:amin-sens))
        or C/B (the zero-out value the paper's experiments use)."""
        adjacency = Adjacency.REPLACE_BY_NULL if self.sensitivity is AminSensitivity.REPLACE_BY_NULL else Adjacency.ZERO_OUT
        return linf_sensitivity(self.clip_norm, self.batch_size, Clipping.NAIVE, adjacency)

    @property
    def query_sensitivity(self) -> float:
        r""":math:`\Delta_q` of the SVT distance: 2/B (replace-by-null) or 1/B (the paper's experiments)."""
        return (2.0 if self.sensitivity is AminSensitivity.REPLACE_BY_NULL else 1.0) / self.batch_size

    @property
    def epsilon_em(self) -> float:
        r"""Bounded-range parameter of one private token, :math:`2\Delta/\tau` (McSherry & Talwar 2007)."""
        return bounded_range_epsilon(self.aggregate_sensitivity, self.temperature)

    @property
    def rho_em(self) -> float:
        r""":math:`\rho_{em} = \Delta^2/(2\tau^2) = \varepsilon_{em}^2/8` (Cesar & Rogers 2021; paper Theorem 2 (thm:accounting))."""
        return br_to_zcdp(self.epsilon_em)

    @property
    def epsilon_svt(self) -> float:
        r""":math:`\varepsilon_{svt} = 2\Delta_q/\sigma` per AboveThreshold run (Dwork & Roth 2014, Thm. 3.23)."""
        return 2.0 * self.query_sensitivity / self.svt_noise

    @property
    def rho_svt(self) -> float:
        r""":math:`\varepsilon_{svt}^2/2` zCDP (pure DP ⇒ zCDP, Bun & Steinke 2016, Prop. 1.4) = :math:`2\Delta_q^2/\sigma^2`."""
        return self.epsilon_svt**2 / 2.0

    @property
    def rho_sequence(self) -> float:
        r""":math:`r(\rho_{em} + \rho_{svt})`: zCDP of one text (adaptive composition, Bun & Steinke 2016, Lemma 2.3)."""
        return self.max_private_tokens * (self.rho_em + self.rho_svt)

    def epsilon(self, delta: float) -> float:
        """(ε, δ) of one text from :attr:`rho_sequence` (Canonne, Kamath & Steinke 2020, Prop. 12; errs upwards)."""
        return float(zcdp_to_epsilon(self.rho_sequence, delta, "cks"))


def plan_amin(
    *,
    epsilon: float,
    delta: float,
    max_private_tokens: int,
    batch_size: int,
    temperature: float = 1.0,
    svt_noise: float = 0.3,
    sensitivity: AminSensitivity | str = AminSensitivity.REPLACE_BY_NULL,
) -> AminAccounting:
    r"""The largest clip norm whose :attr:`AminAccounting.rho_sequence` certifies (ε, δ) (CKS conversion).

    :math:`\rho = \rho_{cks}(\varepsilon, \delta)` (``accounting.epsilon_to_zcdp``, the largest ρ that
    certifies ε: the safe end), :math:`\rho_{em} = \rho/r - \rho_{svt}`,
    :math:`\Delta = \tau\sqrt{2\rho_{em}}`, :math:`C = \Delta B / f` with f = 2 (replace-by-null) or 1
    (the paper's convention) — the re-implementation's ``get_clip``. Raises
    :class:`AminInfeasibleError` when :math:`\rho_{svt} \ge \rho/r` (no clip norm works).
    """
    mode = AminSensitivity(sensitivity)
    rho = float(epsilon_to_zcdp(epsilon, delta, "cks"))
    probe = AminAccounting(1.0, batch_size, temperature, svt_noise, max_private_tokens, mode)
    per_token = rho / max_private_tokens
    rho_em = per_token - probe.rho_svt
    if not rho_em > 0:
        raise AminInfeasibleError(
            f"infeasible: the sparse-vector step alone costs rho_svt={probe.rho_svt:.4g} per private token but the "
            f"budget allows {per_token:.4g} (epsilon={epsilon:g}, delta={delta:g}, r={max_private_tokens}, "
            f"B={batch_size}, sigma={svt_noise:g}, {mode.value} sensitivities)"
        )
    delta_agg = temperature * math.sqrt(2.0 * rho_em)
    factor = 2.0 if mode is AminSensitivity.REPLACE_BY_NULL else 1.0
    clip = delta_agg * batch_size / factor
    acc = AminAccounting(clip, batch_size, temperature, svt_noise, max_private_tokens, mode)
    # rounding: never certify more than rho (shrink by one ulp-scale step if needed)
    while acc.rho_sequence > rho:
        clip = math.nextafter(clip, 0.0)
        acc = AminAccounting(clip, batch_size, temperature, svt_noise, max_private_tokens, mode)
    return acc


@dataclasses.dataclass(frozen=True)
class AminConfig:
    """Parameters of :class:`AminMechanism` (docs/guide/baselines.md, "Amin et al. 2024"; defaults: the
    re-implementation's)."""

    clip_norm: float
    batch_size: int
    temperature: float = 1.0
    public_temperature: float = 1.0
    svt_threshold: float = 0.7
    svt_noise: float = 0.3
    max_private_tokens: int = 100
    sensitivity: AminSensitivity = AminSensitivity.REPLACE_BY_NULL
    posterior_grid: int = DEFAULT_POSTERIOR_GRID

    def __post_init__(self):
        acc = self.accounting  # validates the shared fields
        del acc
        v = self.public_temperature
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"public_temperature must be a positive finite number; got {v!r}")
        if isinstance(self.svt_threshold, bool) or not isinstance(self.svt_threshold, (int, float)) or not math.isfinite(self.svt_threshold):
            raise ValueError(f"svt_threshold must be a finite number; got {self.svt_threshold!r}")
        check_count("posterior_grid", self.posterior_grid, minimum=16)
        object.__setattr__(self, "sensitivity", AminSensitivity(self.sensitivity))

    @property
    def accounting(self) -> AminAccounting:
        return AminAccounting(
            self.clip_norm, self.batch_size, self.temperature, self.svt_noise, self.max_private_tokens, self.sensitivity
        )

    @classmethod
    def planned(cls, *, epsilon: float, delta: float, batch_size: int, max_private_tokens: int, **kwargs) -> "AminConfig":
        """A config whose clip norm is planned by :func:`plan_amin` for (ε, δ)."""
        shared = {name: kwargs[name] for name in ("temperature", "svt_noise", "sensitivity") if name in kwargs}
        acc = plan_amin(epsilon=epsilon, delta=delta, max_private_tokens=max_private_tokens, batch_size=batch_size,
                        **shared)
        return cls(clip_norm=acc.clip_norm, batch_size=batch_size, max_private_tokens=max_private_tokens, **kwargs)


# ---------------------------------------------------------------------------------------------
# the step's arithmetic (pure functions, float64, on the logits' device)


def amin_clipped_contributions(logits: torch.Tensor, clip_norm: float) -> torch.Tensor:
    r""":math:`\mathrm{clip}_C(\phi - \max_y \phi(y) + C)` row-wise (recentred naive clipping), float64."""
    x = logits.to(STATE_DTYPE)
    return (x - x.amax(dim=-1, keepdim=True) + clip_norm).clamp_(min=-clip_norm, max=clip_norm)


def amin_svt_distance(private: torch.Tensor, public: torch.Tensor) -> torch.Tensor:
    r"""The SVT query :math:`\|\frac1B\sum_i\mathrm{softmax}(\phi_i) - \mathrm{softmax}(\phi_{pub})\|_1`, (G,)."""
    mean = torch.softmax(private.to(STATE_DTYPE), dim=-1).mean(dim=-2)
    return (mean - torch.softmax(public.to(STATE_DTYPE), dim=-1)).abs().sum(dim=-1)


class AminMechanism(Mechanism):
    """Amin et al. 2024 (module docstring). Modes: 0 = public token, 1 = private token."""

    name = "amin2024"
    num_modes = 2
    mode_names = ("public", "private")
    can_halt = False

    def __init__(self, config: AminConfig):
        if not isinstance(config, AminConfig):
            raise ValueError(f"config must be an AminConfig; got {type(config).__name__}")
        self.config = config
        n = config.posterior_grid
        u = (torch.arange(n, dtype=STATE_DTYPE) + 0.5) / n
        # the prior of the noisy threshold, as equal-weight quantile midpoints (exact mode)
        self._grid = laplace_quantile(u, config.svt_threshold, config.svt_noise)

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    @property
    def accounting(self) -> AminAccounting:
        return self.config.accounting

    # state layout -------------------------------------------------------------------------
    # sampled: [private_count, threshold]
    # exact:   [private_count, log posterior weights of the threshold for R, R'_1..R'_B (each n)]

    def state_size(self, *, exact: bool) -> int:
        return 1 + (1 + self.batch_size) * self.config.posterior_grid if exact else 2

    def aux_size(self, *, exact: bool, at_start: bool) -> int:
        if exact:
            return 0
        return 1 if at_start else 2  # the threshold; per step: the query noise and a fresh threshold

    def initial_state(self, aux: torch.Tensor, *, exact: bool) -> torch.Tensor:
        g = aux.shape[0]
        state = torch.zeros((g, self.state_size(exact=exact)), dtype=STATE_DTYPE, device=aux.device)
        if not exact:
            state[:, 1] = laplace_quantile(aux[:, 0].to(STATE_DTYPE), self.config.svt_threshold, self.config.svt_noise)
        return state  # exact: count 0 and uniform (log 0) weights over the prior's quantile grid

    def _log_weights(self, state: torch.Tensor) -> torch.Tensor:
        return state[:, 1:].view(state.shape[0], 1 + self.batch_size, self.config.posterior_grid)

    # the step ------------------------------------------------------------------------------

    def _terms(self, private, public, neighbours: bool):
        cfg = self.config
        b = cfg.batch_size
        contrib = amin_clipped_contributions(private, cfg.clip_norm)  # (G, B, V)
        total = contrib.sum(dim=-2)
        soft = torch.softmax(private.to(STATE_DTYPE), dim=-1)
        soft_pub = torch.softmax(public.to(STATE_DTYPE), dim=-1)
        soft_sum = soft.sum(dim=-2)
        q = (soft_sum / b - soft_pub).abs().sum(dim=-1)  # (G,)
        em = torch.log_softmax(total / (b * cfg.temperature), dim=-1)
        pub = torch.log_softmax(public.to(STATE_DTYPE) / cfg.public_temperature, dim=-1)
        out = {"q": q, "em": em, "pub": pub}
        if neighbours:
            # R'_j: row j replaced by the public row (paper §3): its clipped contribution and softmax
            c_pub = amin_clipped_contributions(public, cfg.clip_norm).unsqueeze(-2)
            out["em_j"] = torch.log_softmax((total.unsqueeze(-2) - contrib + c_pub) / (b * cfg.temperature), dim=-1)
            mean_j = (soft_sum.unsqueeze(-2) - soft + soft_pub.unsqueeze(-2)) / b
            out["q_j"] = (mean_j - soft_pub.unsqueeze(-2)).abs().sum(dim=-1)  # (G, B)
        return out

    def step(self, private, public, state, aux, *, exact, neighbours) -> MechanismStep:
        check_stateful_step(private, public, self.batch_size, exact=exact, neighbours=neighbours)
        cfg = self.config
        t = self._terms(private, public, neighbours=exact)
        if not exact:
            threshold = state[:, 1]
            noise = laplace_quantile(aux[:, 0].to(STATE_DTYPE), 0.0, 2.0 * cfg.svt_noise)
            private_step = (t["q"] + noise) >= threshold  # AboveThreshold: q + Lap(2σ) ≥ θ̂
            neg = torch.full_like(t["pub"], -math.inf)
            log_probs = torch.cat(
                [torch.where(private_step[:, None], neg, t["pub"]), torch.where(private_step[:, None], t["em"], neg)], dim=-1
            )
            return MechanismStep(log_probs, carry={"private": private_step})
        # exact: P(private | history, d) = E_posterior[1 − F_ν(θ̂ − q_d)] for d = R, R'_1..R'_B
        logw = self._log_weights(state)  # (G, 1+B, n)
        q_all = torch.cat([t["q"].unsqueeze(-1), t["q_j"]], dim=-1)  # (G, 1+B)
        scale = 2.0 * cfg.svt_noise
        log_below, log_above = laplace_cdf_log(self._grid.to(q_all.device) - q_all.unsqueeze(-1), scale)
        norm = torch.logsumexp(logw, dim=-1)
        log_a = torch.logsumexp(logw + log_above, dim=-1) - norm  # (G, 1+B): log P(private)
        log_b = torch.logsumexp(logw + log_below, dim=-1) - norm  # log P(public)
        em_all = torch.cat([t["em"].unsqueeze(-2), t["em_j"]], dim=-2)  # (G, 1+B, V)
        pub = t["pub"].unsqueeze(-2)
        out_all = torch.cat([log_b.unsqueeze(-1) + pub, log_a.unsqueeze(-1) + em_all], dim=-1)  # (G, 1+B, 2V)
        return MechanismStep(
            out_all[:, 0],
            out_all[:, 1:] if neighbours else None,
            check_actual=t["em"],
            check_neighbours=t["em_j"],
            carry={"log_below": log_below},
        )

    # teacher forcing: the released token's marginal over the sparse-vector state -------------------

    def forced_state(self, count: int, device=None) -> torch.Tensor:
        """The forward recursion's start for ``count`` texts (:meth:`forced_step`): no private token yet, the
        threshold at its prior, nothing stopped. Layout (G, r·n + 1): the joint weights of (private tokens so far,
        threshold grid point) and, last, the mass of texts the budget stopped."""
        cfg = self.config
        state = torch.zeros((count, cfg.max_private_tokens * cfg.posterior_grid + 1), dtype=STATE_DTYPE, device=device)
        state[:, : cfg.posterior_grid] = 1.0 / cfg.posterior_grid
        return state

    def forced_step(self, private, public, state, tokens) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The released next-token distribution given the forced prefix, marginal over the mechanism's hidden
        state (public or private step, private tokens left, the noisy threshold), and the state after ``tokens``.

        A forward (HMM filtering) recursion over :math:`W_t(c, \hat\theta) = P(c, \hat\theta \mid x_{<t})`
        (Rabiner 1989, Eq. (20)): the step is private with :math:`P = 1 - F_\nu(\hat\theta - q_t)` (AboveThreshold,
        Dwork & Roth 2014, Alg. 1; ν ~ Lap(2σ)), so :math:`P(y \mid x_{<t}) = A_t\,p_{em}(y) + (1 - A_t - S_t)\,p_{pub}(y)`
        with :math:`A_t` the private share and :math:`S_t` the share stopped by the budget of r private tokens
        (which releases nothing more). After the forced token :math:`x_t`, a public step conditions
        :math:`\hat\theta` on the query staying below; a private one moves its mass to c + 1 with a fresh
        threshold (the prior), or to "stopped" at c + 1 = r. The threshold is integrated on the prior's quantile
        grid (:data:`DEFAULT_POSTERIOR_GRID`, the exact mode's quadrature). ``private`` (G, B, V), ``public``
        (G, V), ``tokens`` (G,); returns log-probabilities (G, V) (all −inf once every path stopped) and the state.
        """
        check_step_shapes(private, public, self.batch_size)
        cfg = self.config
        n, r, g = cfg.posterior_grid, cfg.max_private_tokens, state.shape[0]
        t = self._terms(private, public, neighbours=False)
        weights, stopped = state[:, :-1].view(g, r, n), state[:, -1]
        log_below, log_above = laplace_cdf_log(self._grid.to(state.device) - t["q"][:, None], 2.0 * cfg.svt_noise)
        above = (weights * log_above.exp()[:, None]).sum(dim=-1)  # (G, r): private mass per count
        share = above.sum(dim=-1)
        public_share = (1.0 - stopped - share).clamp(min=0.0)
        log_probs = torch.logaddexp(share.log()[:, None] + t["em"], public_share.log()[:, None] + t["pub"])
        p_em, p_pub = t["em"].gather(1, tokens[:, None]).exp(), t["pub"].gather(1, tokens[:, None]).exp()
        moved = above * p_em  # (G, r): private mass emitting the forced token, to c + 1
        new = weights * log_below.exp()[:, None] * p_pub[:, :, None]
        new[:, 1:] += moved[:, :-1, None] / n
        total = new.sum(dim=(1, 2)) + moved[:, -1]
        ok = total > 0
        out = torch.zeros_like(state)
        out[:, :-1] = torch.where(ok[:, None], new.reshape(g, -1) / total.clamp(min=1e-300)[:, None], 0.0)
        out[:, -1] = torch.where(ok, moved[:, -1] / total.clamp(min=1e-300), 1.0)
        return log_probs, out

    def advance(self, step, state, outcomes, aux, *, exact):
        cfg = self.config
        vocab = step.log_probs.shape[-1] // 2
        private_step = (outcomes // vocab) == MODE_PRIVATE
        new = state.clone()
        new[:, 0] += private_step.to(STATE_DTYPE)
        if exact:
            logw = self._log_weights(new)
            # below: condition every dataset's threshold on its own query staying below; above: fresh prior
            updated = torch.where(private_step[:, None, None], torch.zeros_like(logw), logw + step.carry["log_below"])
            # renormalise (exact: the weights are used through ratios), keeps them in range over long runs
            updated = updated - updated.amax(dim=-1, keepdim=True)
            new[:, 1:] = updated.reshape(state.shape[0], -1)
        else:
            fresh = laplace_quantile(aux[:, 1].to(STATE_DTYPE), cfg.svt_threshold, cfg.svt_noise)
            new[:, 1] = torch.where(private_step, fresh, state[:, 1])
        stop = new[:, 0] >= cfg.max_private_tokens
        return new, stop

    def guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        acc = self.accounting
        cfg = self.config
        label = "correct replace-by-null sensitivities 2C/B, 2/B" if acc.sensitivity is AminSensitivity.REPLACE_BY_NULL else (
            "the paper's convention C/B, 1/B under replace-by-null (understated by 2)"
        )
        return MechanismGuarantee(
            kind=GuaranteeKind.A_PRIORI,
            mechanism=self.name,
            epsilon=acc.epsilon(delta),
            delta=float(delta),
            max_new_tokens=int(max_new_tokens),
            composition="zcdp",
            rho_sequence=acc.rho_sequence,
            step_epsilon0=acc.epsilon_em,
            step_rho=acc.rho_em,
            description=(
                f"Amin et al. 2024: at most r={cfg.max_private_tokens} private tokens, each rho_em={acc.rho_em:.4g} + "
                f"rho_svt={acc.rho_svt:.4g} zCDP ({label}); public tokens free"
            ),
            details={
                "clip_norm": cfg.clip_norm,
                "temperature": cfg.temperature,
                "public_temperature": cfg.public_temperature,
                "svt_threshold": cfg.svt_threshold,
                "svt_noise": cfg.svt_noise,
                "max_private_tokens": cfg.max_private_tokens,
                "sensitivity": acc.sensitivity.value,
                "aggregate_sensitivity": acc.aggregate_sensitivity,
                "query_sensitivity": acc.query_sensitivity,
                "rho_em": acc.rho_em,
                "rho_svt": acc.rho_svt,
            },
        )

    def describe(self) -> dict:
        d = dataclasses.asdict(self.config)
        d["sensitivity"] = self.config.sensitivity.value
        return {"mechanism": self.name, **d}
