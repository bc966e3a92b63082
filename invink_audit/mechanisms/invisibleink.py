r"""InvisibleInk (paper §4, Algorithm 1) as a :class:`~invink_audit.mechanisms.base.Mechanism`.

A thin wrapper over :class:`invink_audit.mechanism.MechanismConfig`: stateless, one mode, no stop
rule. The engine recognises it and runs its own fast path (Top-k+ columns only, bitwise the
behaviour of ``Engine(model, config)``); this class gives the same step to generic callers (the
synthetic auditor, the tests, a team comparing its own mechanism against ours).

Accounting (a-priori, :meth:`InvisibleInk.guarantee`): each token is ε0-bounded range with Δ = C/B (paper
Property 1; the figures: :class:`~invink_audit.mechanism.MechanismConfig`, paper Theorem 2 (thm:accounting)), and T
tokens compose adaptively (``br-adaptive`` accountant, Dong, Durfee & Rogers 2020).

Capability :meth:`InvisibleInk.hardest_case_logits`: the logit row of the auditor's hardest-case canary.
"""

from __future__ import annotations

import dataclasses

import torch

from accounting import Accountant, GenerationEvent, as_accountant, plan_clip_norm
from accounting.sensitivity import Clipping
from invink_audit.mechanism import MechanismConfig
from invink_audit.mechanisms.base import GuaranteeKind, Mechanism, MechanismGuarantee, MechanismStep, check_step_shapes

__all__ = ["HARDEST_PUBLIC_PROBABILITY", "InvisibleInk", "as_mechanism"]

#: probability, under the neighbour, of the up-weighted outcome in the worst ε0-BR pair (docs/accounting_notes.md §8)
HARDEST_PUBLIC_PROBABILITY = 0.45
_HARDEST_PUSH = 4.0  # multiples of C: any push > C is clipped to exactly ±C by DClip


class InvisibleInk(Mechanism):
    """InvisibleInk with a fixed :class:`~invink_audit.mechanism.MechanismConfig`."""

    name = "invisibleink"
    num_modes = 1
    mode_names = ("private",)
    can_halt = False

    def __init__(self, config: MechanismConfig, *, accountant: Accountant | str = Accountant.BR_ADAPTIVE):
        if not isinstance(config, MechanismConfig):
            raise ValueError(f"config must be a MechanismConfig; got {type(config).__name__}")
        self.config = config
        self.accountant = as_accountant(accountant)

    @classmethod
    def planned(cls, *, epsilon: float, delta: float, max_new_tokens: int, batch_size: int, top_k: int | None,
                temperature: float = 1.0, accountant: Accountant | str = Accountant.BR_ADAPTIVE,
                unit_contributions: int = 1) -> InvisibleInk:
        """InvisibleInk whose clip norm is planned for (ε, δ) over texts of at most T = ``max_new_tokens`` tokens
        (:func:`accounting.plan_clip_norm`: the largest C whose certified ε stays within ``epsilon``, the safe side),
        as :meth:`~invink_audit.mechanisms.AminConfig.planned` plans Amin et al.'s. ``top_k=None``: full vocabulary.
        ``unit_contributions`` k > 1: (ε, δ) is a privacy unit's, which touches k texts (k·T steps composed)."""
        plan = plan_clip_norm(epsilon=epsilon, delta=delta, max_new_tokens=max_new_tokens, batch_size=batch_size,
                              temperature=temperature, accountant=accountant,
                              unit_contributions=unit_contributions)  # fmt: skip
        return cls(MechanismConfig.from_event(plan.event, top_k=top_k), accountant=plan.accountant)

    @property
    def batch_size(self) -> int:
        return self.config.batch_size

    def step(self, private, public, state, aux, *, exact, neighbours) -> MechanismStep:
        check_step_shapes(private, public, self.batch_size)
        if neighbours:
            out = self.config.neighbour_log_probs(private, public)
            return MechanismStep(out.actual, out.neighbours)
        return MechanismStep(self.config.token_log_probs(private, public))

    def guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        """Paper Theorem 2 (thm:accounting): T adaptively composed ε0-BR tokens; ε from the named accountant."""
        cfg = self.config
        event = GenerationEvent(cfg.clip_norm, cfg.batch_size, cfg.temperature, int(max_new_tokens), 1, cfg.clipping)
        eps = event.epsilon(delta, self.accountant)
        return MechanismGuarantee(
            kind=GuaranteeKind.A_PRIORI,
            mechanism=self.name,
            epsilon=eps,
            delta=float(delta),
            max_new_tokens=int(max_new_tokens),
            composition="bounded-range",
            rho_sequence=event.rho_sequence,
            step_epsilon0=cfg.epsilon0,
            step_rho=cfg.rho_token,
            description=(
                f"InvisibleInk: {max_new_tokens} tokens, each eps0={cfg.epsilon0:.4g}-bounded-range "
                f"(C={cfg.clip_norm:.4g}, B={cfg.batch_size}, tau={cfg.temperature:g}), {self.accountant}"
            ),
            details={"clip_norm": cfg.clip_norm, "temperature": cfg.temperature, "top_k": cfg.top_k, "accountant": self.accountant},
        )

    def release_guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        """Paper Algorithm 1's releases record the planner's figures, B among them (:meth:`MechanismGuarantee.to_json`)."""
        g = self.guarantee(max_new_tokens, delta)
        if not self._releases_algorithm_1:
            return g
        return dataclasses.replace(g, details={**g.details, "batch_size": self.config.batch_size})

    @property
    def _releases_algorithm_1(self) -> bool:
        """Paper Algorithm 1 (difference clipping): its releases keep the planner's record form and event."""
        return self.config.clipping is Clipping.DIFFERENCE

    def ledger_event(self, guarantee: MechanismGuarantee):
        """Paper Algorithm 1's :class:`accounting.GenerationEvent` (C, B, τ, T: paper Theorem 2), the event every
        InvisibleInk release has been charged; another clipping: the zCDP event of :meth:`Mechanism.ledger_event`."""
        if not self._releases_algorithm_1:
            return super().ledger_event(guarantee)
        return self.config.event(guarantee.max_new_tokens)

    def release_settings(self, guarantee: MechanismGuarantee) -> dict:
        """Paper Algorithm 1's records keep the planner's settings as ``run`` (C, B, τ, top-k, T, δ, the accountant)."""
        if not self._releases_algorithm_1:
            return super().release_settings(guarantee)
        cfg = self.config
        return {"batch_size": cfg.batch_size, "max_new_tokens": guarantee.max_new_tokens, "temperature": cfg.temperature,
                "top_k": cfg.top_k, "clip_norm": cfg.clip_norm, "delta": guarantee.delta,
                "accountant": self.accountant}  # fmt: skip

    def hardest_case_logits(self, public_logits: torch.Tensor, neighbour_log_probs: torch.Tensor) -> torch.Tensor:
        r"""A capability the white-box auditor uses: the logit row (G, V) of the hardest-case canary, the worst
        case of docs/accounting_notes.md §8 on a real model, for a slot whose reference is null
        (``neighbour_log_probs``: the step's distribution with that slot null, i.e. under the neighbour
        canary → null). Tokens are sorted by that probability; the up group is the most probable prefix whose
        total probability is closest to :data:`HARDEST_PUBLIC_PROBABILITY` (the per-token loss pair
        :math:`(t, t-\varepsilon_0)`, :math:`t\approx0.53\varepsilon_0`, Dong, Durfee & Rogers 2020). The row is
        :math:`\phi_{pub} + 4C` on the group and :math:`\phi_{pub} - 4C` elsewhere, so its clipped difference is
        exactly :math:`\pm C` (DClip, paper Eq. (3), eq:ourclip). A guarantee covers every logit row, so this is a
        valid (adversarial) reference. A mechanism without the capability has no such method (or returns ``None``)."""
        probs = torch.exp(neighbour_log_probs.to(torch.float64))
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        best = torch.argmin((cum - HARDEST_PUBLIC_PROBABILITY).abs(), dim=-1, keepdim=True)  # last index of the group
        ranks = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
        in_group = torch.zeros_like(ranks <= best).scatter(-1, order, ranks <= best)
        sign = torch.where(in_group, 1.0, -1.0).to(public_logits.dtype)
        return public_logits + sign * (_HARDEST_PUSH * self.config.clip_norm)

    def topk_plus_columns(self) -> MechanismConfig:
        """InvisibleInk declares the Top-k+ column capability: the engine runs this config on its fast path."""
        return self.config

    def describe(self) -> dict:
        c = self.config
        return {"mechanism": self.name, "batch_size": c.batch_size, "clip_norm": c.clip_norm, "temperature": c.temperature, "top_k": c.top_k}


def as_mechanism(mechanism) -> Mechanism:
    """A :class:`Mechanism` from a mechanism or a :class:`MechanismConfig` (wrapped as InvisibleInk)."""
    if isinstance(mechanism, Mechanism):
        return mechanism
    if isinstance(mechanism, MechanismConfig):
        return InvisibleInk(mechanism)
    raise ValueError(f"mechanism must be a Mechanism or a MechanismConfig; got {type(mechanism).__name__}")
