r"""InvisibleInk (paper §4, Algorithm 1) as a :class:`~invink_audit.mechanisms.base.Mechanism`.

A thin wrapper over :class:`invink_audit.mechanism.MechanismConfig`: stateless, one mode, no stop
rule. The engine recognises it and runs its own fast path (Top-k+ columns only, bitwise the
behaviour of ``Engine(model, config)``); this class gives the same step to generic callers (the
synthetic auditor, the tests, a team comparing its own mechanism against ours).

Accounting (a-priori): each token is the exponential mechanism on the DClip aggregate with ℓ∞
sensitivity :math:`\Delta = C/B` (paper Property 1), so :math:`\varepsilon_0 = 2\Delta/\tau`-bounded
range and :math:`\rho_{tok} = \Delta^2/(2\tau^2)`-zCDP (paper Theorem 2 (thm:accounting)); T tokens compose
adaptively (``br-adaptive`` accountant, Dong, Durfee & Rogers 2020).
"""

from __future__ import annotations

from accounting import Accountant, as_accountant
from invink_audit.mechanism import MechanismConfig
from invink_audit.mechanisms.base import GuaranteeKind, Mechanism, MechanismGuarantee, MechanismStep, check_step_shapes

__all__ = ["InvisibleInk", "as_mechanism"]


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
        from accounting import GenerationEvent

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
