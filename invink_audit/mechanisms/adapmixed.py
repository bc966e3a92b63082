"""AdaPMixED (Flemings, Razaviyayn & Annavaram 2024, "Adaptively Private Next-Token Prediction of
Large Language Models", arXiv:2410.02016; the successor of their PMixED, NAACL 2024, arXiv:2403.15638)
adapted to text generation as in the InvisibleInk paper (§5 "Baselines and Hyperparameters",
App. B.3.2, D.5, E.5): a :class:`~invink_audit.mechanisms.base.Mechanism`.

**Its guarantee is data-dependent** (paper App. B.3.2), and its stop rule leaks. One step: noisy
screening (Gaussian RDP, Mironov 2017, Prop. 7), per-member mixing into a Rényi ball by bisection
(:func:`adapmixed_member_weights`; van Erven & Harremoës 2014, Thm. 13), the replace-by-null spend
(:func:`symmetric_renyi`, :func:`rdp_to_epsilon`: Balle et al. 2020, Thm. 21), the stop rule.

Design: docs/guide/baselines.md (§"AdaPMixED"); accounting: docs/accounting_notes.md §7.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from accounting.limits import check_count
from invink_audit.mechanisms.base import (
    STATE_DTYPE,
    GuaranteeKind,
    Mechanism,
    MechanismGuarantee,
    MechanismStep,
    check_step_shapes,
    check_stateful_step,
)

__all__ = [
    "AdaPMixEDConfig",
    "AdaPMixEDMechanism",
    "adapmixed_member_weights",
    "rdp_to_epsilon",
    "renyi_budget",
    "symmetric_renyi",
]

MODE_SCREENED, MODE_MIXED = 0, 1
_FLOOR = 1e-300
# root finding of the mixing weight (each step is one pass over V per member): regula falsi, then halvings
_BISECTION_STEPS = 12
_REGULA_FALSI_STEPS = 14
#: cells of the spend grid in teacher forcing (:meth:`AdaPMixEDMechanism.forced_step`; spends rounded up)
FORCED_SPEND_CELLS = 4096


def rdp_to_epsilon(rdp: float | torch.Tensor, order: float, delta: float):
    r""":math:`\varepsilon = D + \log(1 - 1/\alpha) - (\log\delta + \log\alpha)/(\alpha - 1)` (Balle et al. 2020,
    Thm. 21; the re-implementation's ``rdp_eps``; tensors element-wise)."""
    return rdp + math.log1p(-1.0 / order) - (math.log(delta) + math.log(order)) / (order - 1.0)


def renyi_budget(epsilon: float, order: float, delta: float) -> float:
    """The largest RDP spend at ``order`` whose :func:`rdp_to_epsilon` is at most ``epsilon``."""
    return epsilon - math.log1p(-1.0 / order) + (math.log(delta) + math.log(order)) / (order - 1.0)


def _renyi(lp: torch.Tensor, lq: torch.Tensor, order: float) -> torch.Tensor:
    r""":math:`D_\alpha(P\|Q) = \frac1{\alpha-1}\log\sum_y p^\alpha q^{1-\alpha}` from log-probabilities (last dim)."""
    both = torch.isfinite(lp)
    terms = torch.where(both, order * lp + (1.0 - order) * lq, torch.full_like(lp, -math.inf))
    out = torch.logsumexp(terms, dim=-1) / (order - 1.0)
    # a token possible under P and impossible under Q makes the divergence infinite
    bad = (torch.isfinite(lp) & ~torch.isfinite(lq)).any(dim=-1)
    return torch.where(bad, torch.full_like(out, math.inf), out.clamp(min=0.0))


def symmetric_renyi(p: torch.Tensor, q: torch.Tensor, order: float) -> torch.Tensor:
    r""":math:`D^{sym}_\alpha(P, Q) = \max(D_\alpha(P\|Q), D_\alpha(Q\|P))` of probability vectors (last dim)
    (paper App. B.3.2)."""
    lp, lq = torch.log(p), torch.log(q)
    return torch.maximum(_renyi(lp, lq, order), _renyi(lq, lp, order))


def adapmixed_member_weights(members: torch.Tensor, public: torch.Tensor, order: float, radius: float) -> torch.Tensor:
    r""":math:`\lambda_i = \max\{\lambda\in[0,1] : D^{sym}_\alpha(p_0, \lambda p_i + (1-\lambda)p_0) \le r\}`, (..., N).

    ``members`` (..., N, V) and ``public`` (..., V) are probability vectors. With
    :math:`m_\lambda = p_0(1 + \lambda(p_i/p_0 - 1))`, both directions are one pass over V:
    :math:`D_\alpha(p_0\|m_\lambda) = \frac1{\alpha-1}\log\sum p_0 (m_\lambda/p_0)^{1-\alpha}` and
    :math:`D_\alpha(m_\lambda\|p_0) = \frac1{\alpha-1}\log\sum p_0 (m_\lambda/p_0)^{\alpha}`. The root of the
    non-decreasing :math:`D^{sym}_\alpha(\lambda) - r` (docs/guide/baselines.md, "AdaPMixED") is bracketed
    in [0, 1], narrowed by 12 halvings (robust where the function is very steep) and then by 14 steps of the Illinois
    variant of regula falsi (superlinear); the returned λ is the bracket's feasible end
    (:math:`D^{sym}_\alpha \le r`, the ball is never left), within ~1e-12 of the root (tested).
    """
    lp0 = torch.log(public).unsqueeze(-2)  # (..., 1, V)
    log_ratio = torch.log(members) - lp0
    ratio_m1 = torch.expm1(log_ratio)  # p_i/p_0 − 1 ≥ −1 (rounds to −1 below ~1e-16: λ = 1 uses log_ratio)

    def excess_of(t: torch.Tensor) -> torch.Tensor:  # t = log(m_λ/p_0)
        forward = torch.logsumexp(lp0 + (1.0 - order) * t, dim=-1)
        reverse = torch.logsumexp(lp0 + order * t, dim=-1)
        return torch.maximum(forward, reverse).clamp(min=0.0) / (order - 1.0) - radius

    def excess(lam: torch.Tensor) -> torch.Tensor:
        return excess_of(torch.log1p(lam.unsqueeze(-1) * ratio_m1))

    ones = torch.ones(members.shape[:-1], dtype=STATE_DTYPE, device=members.device)
    inside = excess_of(log_ratio) <= 0  # λ = 1: the member itself
    lo, hi = torch.zeros_like(ones), ones.clone()
    # bisection first: the excess can be very steep near λ = 1 (a member with a token of probability
    # ~1e-44 where p_0 has mass), where a secant step would crawl; then regula falsi on the small bracket
    for _ in range(_BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        ok = excess(mid) <= 0
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    g_lo, g_hi = excess(lo), excess(hi)
    g_hi = torch.where(torch.isfinite(g_hi), g_hi, torch.full_like(g_hi, 1e300))
    side = torch.zeros_like(ones)  # which end was kept last (Illinois halves the other end's value)
    for _ in range(_REGULA_FALSI_STEPS):
        mid = (lo * g_hi - hi * g_lo) / (g_hi - g_lo)
        mid = torch.where(torch.isfinite(mid) & (mid > lo) & (mid < hi), mid, 0.5 * (lo + hi))
        g_mid = excess(mid)
        ok = g_mid <= 0
        g_hi = torch.where(ok & (side > 0), 0.5 * g_hi, g_hi)
        g_lo = torch.where(~ok & (side < 0), 0.5 * g_lo, g_lo)
        lo, g_lo = torch.where(ok, mid, lo), torch.where(ok, g_mid, g_lo)
        hi, g_hi = torch.where(ok, hi, mid), torch.where(ok, g_hi, g_mid)
        side = torch.where(ok, torch.ones_like(side), -torch.ones_like(side))
    return torch.where(inside, ones, lo)


@dataclasses.dataclass(frozen=True)
class AdaPMixEDConfig:
    """Parameters of :class:`AdaPMixEDMechanism` (defaults: docs/guide/baselines.md, "AdaPMixED").
    ``epsilon``/``delta``: the budget of the stop rule (a data-dependent guarantee)."""

    batch_size: int
    epsilon: float
    delta: float = 1e-6
    temperature: float = 1.0
    renyi_order: float = 15.0
    beta: float = 0.3
    screen_top_k: int = 60
    screen_threshold: float = 4.5
    screen_noise: float = 0.01
    screen_mixing: float = 1e-4
    screen_samples: int = 512

    def __post_init__(self):
        check_count("batch_size", self.batch_size)
        for name in ("epsilon", "temperature", "beta", "screen_threshold", "screen_noise"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive finite number; got {v!r}")
        if not 0.0 < float(self.delta) < 1.0:
            raise ValueError(f"delta must be in (0, 1); got {self.delta!r}")
        if not (isinstance(self.renyi_order, (int, float)) and math.isfinite(self.renyi_order) and self.renyi_order > 1):
            raise ValueError(f"renyi_order must be a finite number > 1; got {self.renyi_order!r}")
        if not 0.0 <= float(self.screen_mixing) <= 1.0:
            raise ValueError(f"screen_mixing must be in [0, 1]; got {self.screen_mixing!r}")
        for name in ("screen_top_k", "screen_samples"):
            check_count(name, getattr(self, name))

    @property
    def screening_cost(self) -> float:
        r""":math:`\alpha\lambda_s^2/(N^2\sigma^2)`: the Gaussian screening's RDP at order α, every step."""
        return self.renyi_order * (self.screen_mixing / (self.batch_size * self.screen_noise)) ** 2

    @property
    def radius(self) -> float:
        r""":math:`\alpha\beta`: the Rényi ball of every mixed member around :math:`p_0`."""
        return self.renyi_order * self.beta

    @property
    def budget(self) -> float:
        """The largest RDP spend at ``renyi_order`` within ``epsilon`` (:func:`renyi_budget`)."""
        return renyi_budget(self.epsilon, self.renyi_order, self.delta)


class AdaPMixEDMechanism(Mechanism):
    """AdaPMixED adapted to generation (module docstring). Modes: 0 = screened (public), 1 = mixed; it can halt."""

    name = "adapmixed"
    num_modes = 2
    mode_names = ("screened", "mixed")
    can_halt = True

    def __init__(self, config: AdaPMixEDConfig):
        if not isinstance(config, AdaPMixEDConfig):
            raise ValueError(f"config must be an AdaPMixEDConfig; got {type(config).__name__}")
        self.config = config

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    # state: sampled [spend_R]; exact [spend_R, spend_R'_1..spend_R'_B]
    def state_size(self, *, exact: bool) -> int:
        return 1 + self.batch_size if exact else 1

    def aux_size(self, *, exact: bool, at_start: bool) -> int:
        if at_start:
            return 0
        k = self.config.screen_top_k
        return k * (self.config.screen_samples if exact else 1)

    def spend(self, state: torch.Tensor) -> torch.Tensor:
        return state[:, 0]

    # -- pieces --------------------------------------------------------------------------

    def _screen_statistic(self, mean_members: torch.Tensor, p0: torch.Tensor, index: torch.Tensor, normals: torch.Tensor):
        r""":math:`D^{sym}_\alpha` of the renormalised public top-k and the noisy screened mixture.

        ``mean_members`` (..., V) (one per dataset), ``p0`` (..., V) broadcastable to it, ``index``
        (G, k) the public top-k columns, ``normals`` standard normals broadcastable to (..., k)."""
        cfg = self.config
        mix = cfg.screen_mixing * mean_members + (1.0 - cfg.screen_mixing) * p0
        lead = mix.shape[:-1]
        idx = index.view(index.shape[0], *([1] * (len(lead) - 1)), index.shape[-1]).expand(*lead, index.shape[-1])
        mix_k = mix.gather(-1, idx)
        pub_k = p0.expand_as(mix).gather(-1, idx)
        noisy = mix_k + cfg.screen_noise * normals
        prv = (noisy / noisy.sum(dim=-1, keepdim=True)).abs().clamp(min=_FLOOR)
        prv = prv / prv.sum(dim=-1, keepdim=True)
        pub = (pub_k / pub_k.sum(dim=-1, keepdim=True)).clamp(min=_FLOOR)
        return symmetric_renyi(pub.expand_as(prv), prv, cfg.renyi_order)

    def _mixed(self, members: torch.Tensor, p0: torch.Tensor):
        """Mixed members (G, N, V) and their mean (G, V)."""
        cfg = self.config
        lam = adapmixed_member_weights(members, p0, cfg.renyi_order, cfg.radius)
        mixed = lam.unsqueeze(-1) * members + (1.0 - lam.unsqueeze(-1)) * p0.unsqueeze(-2)
        return mixed, mixed.mean(dim=-2), lam

    def _mixing_cost(self, mixed: torch.Tensor, p: torch.Tensor, p0: torch.Tensor) -> torch.Tensor:
        r"""Replace-by-null data-dependent cost :math:`\max_i D^{sym}_\alpha(p_{-i}, p)`,
        :math:`p_{-i} = p + (p_0 - \bar p_i)/N` (paper App. E.5), shape ``p.shape[:-1]``."""
        n = mixed.shape[-2]
        total = mixed.sum(dim=-2, keepdim=True)
        # (Σ_{j≠i} p̄_j + p_0)/N; the difference is ≥ 0 in exact arithmetic (clamped against rounding)
        p_minus = ((total - mixed).clamp(min=0.0) + p0.unsqueeze(-2)) / n
        return symmetric_renyi(p_minus, p.unsqueeze(-2).expand_as(p_minus), self.config.renyi_order).amax(dim=-1)

    # -- the step --------------------------------------------------------------------------

    def step(self, private, public, state, aux, *, exact, neighbours) -> MechanismStep:
        check_stateful_step(private, public, self.batch_size, exact=exact, neighbours=neighbours)
        cfg = self.config
        v = private.shape[-1]
        tau = cfg.temperature
        members = torch.softmax(private.to(STATE_DTYPE) / tau, dim=-1)  # (G, N, V)
        p0 = torch.softmax(public.to(STATE_DTYPE) / tau, dim=-1)  # (G, V)
        log_p0 = torch.log(p0)
        k = min(cfg.screen_top_k, v)
        index = torch.topk(p0, k, dim=-1).indices  # public: free
        mixed, p, _ = self._mixed(members, p0)
        if not exact:
            return self._step_sampled(members, p0, log_p0, index, mixed, p, state, aux)
        return self._step_exact(members, p0, log_p0, index, mixed, state, aux, neighbours=neighbours)

    def _step_sampled(self, members, p0, log_p0, index, mixed, p, state, aux) -> MechanismStep:
        """The sampled state: one screening draw for ``R`` (its ``k`` normals from ``aux``), spend ``[spend_R]``."""
        cfg = self.config
        g, k = members.shape[0], index.shape[-1]
        s_cost = cfg.screening_cost
        neg = torch.full((g, 1), -math.inf, dtype=STATE_DTYPE, device=members.device)
        normals = torch.special.ndtri(aux[:, :k].to(STATE_DTYPE))
        screened = self._screen_statistic(members.mean(dim=-2), p0, index, normals) > cfg.screen_threshold
        cost = s_cost + torch.where(screened, torch.zeros_like(p[:, 0]), self._mixing_cost(mixed, p, p0))
        halt = (state[:, 0] + cost) > cfg.budget
        chosen = torch.where(screened[:, None], log_p0, torch.log(p))
        blank = torch.full_like(chosen, -math.inf)
        log_probs = torch.cat(
            [
                torch.where((screened & ~halt)[:, None], chosen, blank),
                torch.where((~screened & ~halt)[:, None], chosen, blank),
                torch.where(halt[:, None], torch.zeros_like(neg), neg),
            ],
            dim=-1,
        )
        return MechanismStep(log_probs, carry={"cost_screened": torch.full_like(cost, s_cost), "cost": cost})

    def _step_exact(self, members, p0, log_p0, index, mixed, state, aux, *, neighbours) -> MechanismStep:
        """The exact state: every dataset d = R, R'_1..R'_N, with its own screening probability, mixture, cost
        and spend."""
        cfg = self.config
        g, n, k = members.shape[0], members.shape[1], index.shape[-1]
        budget = cfg.budget
        s_cost = cfg.screening_cost
        eye = torch.eye(n, dtype=torch.bool, device=members.device)
        # d = R'_j: member j is the public distribution (mixing leaves it public)
        mixed_all = torch.cat(
            [mixed.unsqueeze(1), torch.where(eye[None, :, :, None], p0[:, None, None, :], mixed.unsqueeze(1))], dim=1
        )  # (G, 1+N, N, V)
        p_all = mixed_all.mean(dim=-2)  # (G, 1+N, V)
        members_all = torch.cat(
            [members.unsqueeze(1), torch.where(eye[None, :, :, None], p0[:, None, None, :], members.unsqueeze(1))], dim=1
        )
        mean_all = members_all.mean(dim=-2)  # (G, 1+N, V)
        m = cfg.screen_samples
        normals = torch.special.ndtri(aux[:, : m * k].to(STATE_DTYPE)).view(g, 1, m, k)
        stat = self._screen_statistic(mean_all.unsqueeze(2), p0[:, None, None, :], index, normals)  # (G, 1+N, M)
        screened_count = (stat > cfg.screen_threshold).sum(dim=-1).to(STATE_DTYPE)
        pi = (screened_count + 0.5) / (m + 1.0)  # add-half smoothing: never 0 or 1
        mix_cost = torch.stack([self._mixing_cost(mixed_all[:, d], p_all[:, d], p0) for d in range(1 + n)], dim=1)
        spend = state  # (G, 1+N)
        halt_s = (spend + s_cost) > budget
        halt_m = (spend + s_cost + mix_cost) > budget
        log_pi, log_1mpi = torch.log(pi), torch.log1p(-pi)
        lp0 = log_p0.unsqueeze(1)
        screened_block = torch.where(halt_s.unsqueeze(-1), torch.full_like(p_all, -math.inf), log_pi.unsqueeze(-1) + lp0)
        mixed_block = torch.where(halt_m.unsqueeze(-1), torch.full_like(p_all, -math.inf), log_1mpi.unsqueeze(-1) + torch.log(p_all))
        stop_p = pi * halt_s.to(STATE_DTYPE) + (1.0 - pi) * halt_m.to(STATE_DTYPE)
        stop_col = torch.log(stop_p).unsqueeze(-1)
        out_all = torch.cat([screened_block, mixed_block, stop_col], dim=-1)  # (G, 1+N, 2V+1)
        return MechanismStep(
            out_all[:, 0],
            out_all[:, 1:] if neighbours else None,
            carry={"cost_screened": torch.full_like(spend, s_cost), "cost": s_cost + mix_cost},
        )

    # teacher forcing: the released token's marginal over the screening and the data-dependent spend ------------

    def forced_state(self, count: int, device=None) -> torch.Tensor:
        """The forward recursion's start for ``count`` texts (:meth:`forced_step`): all mass at spend 0, on a grid
        of :data:`FORCED_SPEND_CELLS` + 1 cells of ``budget / FORCED_SPEND_CELLS``."""
        state = torch.zeros((count, FORCED_SPEND_CELLS + 1), dtype=STATE_DTYPE, device=device)
        state[:, 0] = 1.0
        return state

    def forced_step(self, private, public, state, tokens, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        r"""The released next-token distribution given the forced prefix, marginal over the screening outcome and
        the running data-dependent spend s, and the state after ``tokens``.

        A forward (HMM filtering) recursion (Rabiner 1989, Eq. (20)) over :math:`w_t(s) = P(s \mid x_{<t})`:
        :math:`P(y \mid x_{<t}) = \sum_s w_t(s)\,[\pi_t 1\{s + c_s \le b\}\,p_0(y) + (1 - \pi_t) 1\{s + c_s + m_t \le
        b\}\,\bar p(y)]`, with π the screening probability (estimated from ``screen_samples`` draws of the
        Gaussian screening, add-half smoothed, as the exact (audit) mode does; ``generator`` draws them),
        :math:`c_s` the screening cost, :math:`m_t` the mixing cost and b the budget; the rest of the mass is the
        stop outcome, which releases no token. Spends are rounded **up** to the grid, so a path stops no later
        than the mechanism's (each step's spend errs high by at most one cell, so probabilities err low; π is an
        estimate, so the distribution is exact only up to π's sampling error). Returns
        log-probabilities (G, V) and the state (G, cells + 1).
        """
        check_step_shapes(private, public, self.batch_size)
        cfg = self.config
        g, k, cells = state.shape[0], min(cfg.screen_top_k, private.shape[-1]), FORCED_SPEND_CELLS
        members = torch.softmax(private.to(STATE_DTYPE) / cfg.temperature, dim=-1)
        p0 = torch.softmax(public.to(STATE_DTYPE) / cfg.temperature, dim=-1)
        index = torch.topk(p0, k, dim=-1).indices
        mixed, p, _ = self._mixed(members, p0)
        normals = torch.randn((g, cfg.screen_samples, k), generator=generator, dtype=STATE_DTYPE, device=p0.device)
        stat = self._screen_statistic(members.mean(dim=-2, keepdim=True), p0[:, None], index, normals)  # (G, M)
        pi = ((stat > cfg.screen_threshold).sum(dim=-1).to(STATE_DTYPE) + 0.5) / (cfg.screen_samples + 1.0)
        costs = torch.stack([torch.full_like(pi, cfg.screening_cost), cfg.screening_cost + self._mixing_cost(mixed, p, p0)], dim=1)
        if cfg.budget > 0:  # (G, 2): cells of a screened / mixed step
            shifts = torch.ceil(costs / (cfg.budget / cells)).clamp(max=cells + 1).long()
        else:  # no budget (ε below the filter's δ term): every path stops before its first token, as the mechanism
            shifts = torch.full(costs.shape, cells + 1, dtype=torch.long, device=costs.device)
        j = torch.arange(cells + 1, device=state.device)
        weights = torch.stack([pi, 1.0 - pi], dim=1)[:, :, None] * state[:, None] * (j + shifts[:, :, None] <= cells)
        logs = torch.stack([torch.log(p0), torch.log(p)], dim=1)  # (G, 2, V)
        log_probs = torch.logsumexp(weights.sum(dim=-1).log()[:, :, None] + logs, dim=1)
        emitted = weights * logs.gather(2, tokens[:, None, None].expand(-1, 2, 1)).exp()
        source = j - shifts[:, :, None]  # cell j of the new state comes from cell j − shift
        new = torch.where(source >= 0, emitted.gather(2, source.clamp(min=0)), 0.0).sum(dim=1)
        total = new.sum(dim=-1, keepdim=True)
        return log_probs, torch.where(total > 0, new / total.clamp(min=1e-300), 0.0)

    def advance(self, step, state, outcomes, aux, *, exact):
        vocab = (step.log_probs.shape[-1] - 1) // 2
        mixed = (outcomes // vocab) == MODE_MIXED
        stop_out = outcomes == 2 * vocab
        cost = torch.where(
            (mixed & ~stop_out).unsqueeze(-1) if exact else (mixed & ~stop_out),
            step.carry["cost"],
            step.carry["cost_screened"],
        )
        new = torch.where(stop_out.unsqueeze(-1), state, state + (cost if exact else cost.unsqueeze(-1)))
        return new, torch.zeros_like(stop_out)

    def guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        cfg = self.config
        if not math.isclose(float(delta), cfg.delta, rel_tol=1e-12):
            raise ValueError(f"the stop rule was set for delta={cfg.delta!r}; got {delta!r}")
        return MechanismGuarantee(
            kind=GuaranteeKind.DATA_DEPENDENT,
            mechanism=self.name,
            epsilon=float(cfg.epsilon),
            delta=float(cfg.delta),
            max_new_tokens=int(max_new_tokens),
            composition="renyi-filter",
            renyi_order=float(cfg.renyi_order),
            renyi_budget=cfg.budget,
            description=(
                f"AdaPMixED: DATA-DEPENDENT running RDP at order {cfg.renyi_order:g}, stopped at "
                f"eps={cfg.epsilon:g} (delta={cfg.delta:g}); holds only for the dataset it ran on"
            ),
            details={**dataclasses.asdict(cfg), "screening_cost": cfg.screening_cost, "radius": cfg.radius, "renyi_budget": cfg.budget},
        )

    def describe(self) -> dict:
        return {"mechanism": self.name, **dataclasses.asdict(self.config)}
