"""The mechanism interface: what the engine and the auditor need from a private decoding step.

:class:`Mechanism` turns one step's ``B`` private rows ``(G, B, V)`` and public row ``(G, V)`` into
log-probabilities over the step's **outcomes** (a token in one of ``num_modes`` modes, or a stop),
carries a per-text state (**sampled** for generation, **exact** for audits: every replace-by-null
neighbour's distribution from the same logits), and states its guarantee (:meth:`Mechanism.guarantee`:
a-priori, or data-dependent, never a PASS). Example: ``examples/custom_mechanism.py``.

Design: docs/guide/baselines.md (§"The mechanism interface"); the engine's side: docs/design/engine.md.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import math
from typing import Any

import torch

from accounting.claims import PrivacyClaim, StepClaim
from accounting.events import ZcdpEvent

__all__ = [
    "GuaranteeKind",
    "Mechanism",
    "MechanismGuarantee",
    "MechanismStep",
    "check_stateful_step",
    "check_step_shapes",
    "laplace_cdf_log",
    "laplace_quantile",
]

#: dtype of every mechanism state and of every log-probability a mechanism returns.
STATE_DTYPE = torch.float64


class GuaranteeKind(enum.Enum):
    """Whether a guarantee is fixed before the run (a-priori) or computed from the data (data-dependent)."""

    A_PRIORI = "a-priori"
    DATA_DEPENDENT = "data-dependent"


@dataclasses.dataclass(frozen=True)
class MechanismGuarantee:
    r"""The privacy guarantee a mechanism's accountant gives for one text of at most ``max_new_tokens`` tokens,
    and a release's guarantee (:meth:`invink_audit.generation.ReleaseConfig.guarantee`, AugPE's): the same record.

    * ``kind``: :class:`GuaranteeKind`;
    * ``epsilon``, ``delta``: the (ε, δ)-DP statement (a-priori: certified for every dataset;
      data-dependent: the budget the stop rule enforces on the dataset it runs on);
    * ``rho_sequence``: a-priori zCDP of one text (``None`` for data-dependent guarantees);
    * ``composition``: how the per-step costs compose: ``"bounded-range"`` (``max_new_tokens``
      adaptively composed :math:`\varepsilon_0`-bounded-range steps, InvisibleInk, paper Theorem 2 (thm:accounting)),
      ``"zcdp"`` (a sequence-level ρ, e.g. Amin et al.'s per-private-token accounting) or
      ``"renyi-filter"`` (a running Rényi spend at one order, stopped at a budget: AdaPMixED);
    * ``step_epsilon0``, ``step_rho``: the per-step claim of the distribution the auditor checks
      exactly at every step (InvisibleInk: the token's; Amin et al.: the exponential mechanism's given a
      private step), ``None`` when the accountant makes no per-step claim;
    * ``renyi_order``, ``renyi_budget``: for ``"renyi-filter"``: the order α and the largest spend
      :math:`D_\alpha` the stop rule allows;
    * ``description``: one line for reports; ``details``: the accountant's parameters;
    * ``void_reason``: why a release does not carry this guarantee although its figures are computed (a fixed
      seed makes the texts reproducible; AugPE's paper convention is no valid guarantee); ``None``: it holds.
    """

    kind: GuaranteeKind
    mechanism: str
    epsilon: float
    delta: float
    max_new_tokens: int
    composition: str
    rho_sequence: float | None = None
    step_epsilon0: float | None = None
    step_rho: float | None = None
    renyi_order: float | None = None
    renyi_budget: float | None = None
    description: str = ""
    details: dict = dataclasses.field(default_factory=dict)
    void_reason: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GuaranteeKind):
            object.__setattr__(self, "kind", GuaranteeKind(self.kind))
        if self.composition not in ("bounded-range", "zcdp", "renyi-filter"):
            raise ValueError(f"composition must be 'bounded-range', 'zcdp' or 'renyi-filter'; got {self.composition!r}")
        if self.kind is GuaranteeKind.A_PRIORI and self.rho_sequence is None:
            raise ValueError("an a-priori guarantee needs rho_sequence")
        if self.composition == "renyi-filter" and (self.renyi_order is None or self.renyi_budget is None):
            raise ValueError("a renyi-filter guarantee needs renyi_order and renyi_budget")
        if (self.step_epsilon0 is None) != (self.step_rho is None):
            raise ValueError("give both step_epsilon0 and step_rho, or neither")

    @property
    def a_priori(self) -> bool:
        return self.kind is GuaranteeKind.A_PRIORI

    @property
    def holds(self) -> bool:
        """Whether the release carries this guarantee (``False`` with a :attr:`void_reason`)."""
        return self.void_reason is None

    def privacy_claim(self) -> PrivacyClaim:
        """This guarantee as an :class:`accounting.PrivacyClaim` for texts of at most ``max_new_tokens`` draws, its ε at
        δ the reported figures: ``"bounded-range"``, per step (ε0-range and ρ-zCDP; the sequence figures compose them);
        ``"zcdp"``, the sequence-level ρ (an (ε, δ) claim without it), with the per-step claim of the checked component
        kept as its step part; ``"renyi-filter"``, the budget at its order, data-dependent (the filter's stop rule bounds
        each path's sum, Feldman & Zrnic 2021, Thm. 3.1). An ε read back as NaN (unknown) is no report."""
        step = StepClaim() if self.step_epsilon0 is None else StepClaim(self.step_epsilon0, self.step_rho)
        reported = {} if math.isnan(self.epsilon) else {"reported_epsilon": self.epsilon, "reported_delta": self.delta}
        fields = {"data_dependent": not self.a_priori, "source": self.description or self.mechanism, **reported}
        if self.composition == "bounded-range":
            return PrivacyClaim(self.max_new_tokens, step, **fields)
        if self.composition == "renyi-filter":
            return PrivacyClaim(self.max_new_tokens, step, renyi={self.renyi_order: self.renyi_budget}, **fields)
        if self.rho_sequence is None:
            return PrivacyClaim(self.max_new_tokens, step, epsilon=self.epsilon, delta=self.delta, **fields)
        return PrivacyClaim(self.max_new_tokens, step, rho=self.rho_sequence, **fields)

    def label(self) -> str:
        """``"(ε, δ) a-priori"`` or ``"(ε, δ) DATA-DEPENDENT"``: the wording every report uses."""
        tag = "a-priori" if self.a_priori else "DATA-DEPENDENT (holds only for the dataset it was computed on)"
        return f"({self.epsilon:.4g}, {self.delta:.3g})-DP, {tag}"

    def to_json(self) -> dict:
        """The guarantee as a release's records and summary write it (``void_reason`` only when void).

        InvisibleInk's (a bounded-range guarantee whose ``details`` name all of :data:`PLANNER_FIGURES`' parameters)
        keeps the planner's figures, as its records have held them since their first version: ε, δ,
        ``rho_sequence``, ``rho_token`` (= ``step_rho``), ``epsilon0`` (= ``step_epsilon0``), the accountant, C, B, τ,
        top-k and T. Every other guarantee: mechanism, kind, ε, δ, ``rho_sequence``, T, composition, description."""
        if self.composition == "bounded-range" and all(name in self.details for name in _PLANNER_DETAILS):
            figures = {**self.details, "epsilon": self.epsilon, "delta": self.delta, "rho_sequence": self.rho_sequence,
                       "rho_token": self.step_rho, "epsilon0": self.step_epsilon0, "max_new_tokens": self.max_new_tokens}
            data = {name: figures[name] for name in PLANNER_FIGURES}
        else:
            data = {"mechanism": self.mechanism, "kind": self.kind.value, "epsilon": self.epsilon, "delta": self.delta,
                    "rho_sequence": self.rho_sequence, "max_new_tokens": self.max_new_tokens,
                    "composition": self.composition, "description": self.description}  # fmt: skip
        if self.void_reason is not None:
            data["void_reason"] = self.void_reason
        return data

    def record_fields(self) -> dict:
        """What an output record or summary writes: ``{"guarantee": {...}}``, or for a void guarantee
        ``{"guarantee": None, "guarantee_void_reason": ...}`` (no ε that a reader could take at face value)."""
        if self.void_reason is not None:
            return {"guarantee": None, "guarantee_void_reason": self.void_reason}
        return {"guarantee": self.to_json()}


#: The figures of InvisibleInk's records, in their order (:meth:`MechanismGuarantee.to_json`).
PLANNER_FIGURES = ("epsilon", "delta", "rho_sequence", "rho_token", "epsilon0", "accountant", "clip_norm", "batch_size",
                   "temperature", "top_k", "max_new_tokens")  # fmt: skip
_PLANNER_DETAILS = ("accountant", "clip_norm", "batch_size", "temperature", "top_k")


@dataclasses.dataclass
class MechanismStep:
    """What :meth:`Mechanism.step` returns for ``G`` texts.

    * ``log_probs`` (G, W) float64: the distribution of the step's outcome under ``R`` (given the state);
    * ``neighbours`` (G, B, W) float64 or ``None``: the same under every replace-by-null neighbour
      ``R'_j`` (exact state, ``neighbours=True`` only);
    * ``check_actual`` (G, V'), ``check_neighbours`` (G, B, V'): the distributions whose per-step claim
      (:attr:`MechanismGuarantee.step_epsilon0`, ``step_rho``) the auditor checks exactly, when they differ from
      the outcome distributions (Amin et al.: the exponential mechanism given a private step); ``None``:
      the outcome distributions themselves;
    * ``carry``: whatever :meth:`Mechanism.advance` needs from this step (opaque to the engine).
    """

    log_probs: torch.Tensor
    neighbours: torch.Tensor | None = None
    check_actual: torch.Tensor | None = None
    check_neighbours: torch.Tensor | None = None
    carry: Any = None


class Mechanism(abc.ABC):
    """A private decoding step with per-text state (docs/guide/baselines.md, "The mechanism interface").

    Subclasses set ``name``, ``num_modes``, ``mode_names`` and ``can_halt``, and implement
    :attr:`batch_size`, :meth:`state_size`, :meth:`aux_size`, :meth:`initial_state`, :meth:`step`,
    :meth:`advance` and :meth:`guarantee`. Everything runs on the logits' device, in float64, with no
    host synchronisation (the engine transfers the drawn outcomes once per step).
    """

    name: str = "mechanism"
    num_modes: int = 1
    mode_names: tuple[str, ...] = ("token",)
    can_halt: bool = False

    @property
    @abc.abstractmethod
    def batch_size(self) -> int:
        """``B``, the number of private rows per text."""

    def num_outcomes(self, vocab_size: int) -> int:
        """``W = num_modes · V`` (+ 1 for the stop outcome when the mechanism can halt)."""
        return self.num_modes * vocab_size + (1 if self.can_halt else 0)

    def stop_outcome(self, vocab_size: int) -> int | None:
        """The outcome that ends a text without a token (budget spent), or ``None``."""
        return self.num_modes * vocab_size if self.can_halt else None

    def state_size(self, *, exact: bool) -> int:
        """Length of each text's state vector (0: stateless)."""
        return 0

    def aux_size(self, *, exact: bool, at_start: bool) -> int:
        """Auxiliary uniforms per text drawn from the text's own stream at the start and at every step."""
        return 0

    def initial_state(self, aux: torch.Tensor, *, exact: bool) -> torch.Tensor:
        """(G, state_size) float64 from ``aux`` (G, aux_size(at_start=True)) uniforms in (0, 1)."""
        return torch.zeros((aux.shape[0], self.state_size(exact=exact)), dtype=STATE_DTYPE, device=aux.device)

    @abc.abstractmethod
    def step(
        self,
        private: torch.Tensor,
        public: torch.Tensor,
        state: torch.Tensor,
        aux: torch.Tensor,
        *,
        exact: bool,
        neighbours: bool,
    ) -> MechanismStep:
        """The outcome distribution of one step for ``G`` texts (``neighbours`` needs ``exact``)."""

    def advance(
        self, step: MechanismStep, state: torch.Tensor, outcomes: torch.Tensor, aux: torch.Tensor, *, exact: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The states after the drawn ``outcomes`` (G,) and whether each text stops *after* its
        outcome (a stop rule that is a function of released outcomes, e.g. ``r`` private tokens)."""
        return state, torch.zeros(outcomes.shape, dtype=torch.bool, device=outcomes.device)

    def spend(self, state: torch.Tensor) -> torch.Tensor | None:
        """(G,) the running data-dependent spend of each text (its accountant's unit), or ``None``."""
        return None

    @abc.abstractmethod
    def guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        """The guarantee of one text of at most ``max_new_tokens`` tokens, at ``delta``."""

    def release_guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        """The guarantee as a release's records write it (:meth:`guarantee`; InvisibleInk adds B for its planner form)."""
        return self.guarantee(max_new_tokens, delta)

    def ledger_event(self, guarantee: MechanismGuarantee):
        """The privacy event a ledger is charged, once, for a release with ``guarantee`` (this mechanism's): an
        a-priori zCDP release of its ``rho_sequence`` (:class:`accounting.ZcdpEvent`). A data-dependent guarantee
        (a stop rule's spend, computed from the references) has none: ``ValueError``."""
        if not guarantee.a_priori:
            raise ValueError(
                f"{self.name}'s guarantee is data-dependent (its spend is computed from the references), "
                "not an a-priori guarantee a ledger can compose: run it without a ledger"
            )
        return ZcdpEvent(guarantee.rho_sequence, guarantee.mechanism)

    def release_settings(self, guarantee: MechanismGuarantee) -> dict:
        """The public parameters a release's records hold as ``run`` (compared on resume): the mechanism
        (:func:`~invink_audit.mechanisms.mechanism_to_json`) and what it claims (a custom mechanism without a config
        dataclass is told apart by its guarantee)."""
        from invink_audit.mechanisms import mechanism_to_json

        g = guarantee
        return {"batch_size": self.batch_size, "max_new_tokens": g.max_new_tokens, "delta": g.delta,
                "mechanism": mechanism_to_json(self),
                "mechanism_guarantee": {"kind": g.kind.value, "epsilon": g.epsilon, "rho_sequence": g.rho_sequence,
                                        "composition": g.composition, "description": g.description}}  # fmt: skip

    def describe(self) -> dict:
        """The mechanism's public parameters, for reports."""
        return {"mechanism": self.name, "batch_size": self.batch_size}

    #: A capability the white-box auditor uses (:func:`~invink_audit.audit.audit_model` ``hardest_case_slot``):
    #: ``hardest_case_logits(public_logits (G, V), neighbour_log_probs (G, V)) -> (G, V)``, the logit row of the
    #: mechanism's worst-case reference for a null slot (InvisibleInk's). ``None``: the mechanism has none.
    hardest_case_logits = None

    def topk_plus_columns(self):
        """A capability the engine's fast path uses: a mechanism whose step is InvisibleInk's (the exponential
        mechanism on difference-clipped logits over the Top-k+ set, no state, one mode) returns its
        :class:`~invink_audit.mechanism.MechanismConfig`, and the engine then computes the private logits on
        those columns only; ``None`` (the default): the engine gives the step the full logits."""
        return None


def check_step_shapes(private: torch.Tensor, public: torch.Tensor, batch_size: int) -> None:
    """``private`` (G, B, V) and ``public`` (G, V) on one device, ``B == batch_size``; raises ``ValueError``."""
    if private.ndim != 3 or public.ndim != 2 or private.shape[0] != public.shape[0] or private.shape[2] != public.shape[1]:
        raise ValueError(
            f"private must be (G, B, V) and public (G, V); got {tuple(private.shape)} and {tuple(public.shape)}"
        )
    if private.shape[1] != batch_size:
        raise ValueError(f"private has {private.shape[1]} reference rows but the mechanism has batch_size={batch_size}")


def check_stateful_step(
    private: torch.Tensor, public: torch.Tensor, batch_size: int, *, exact: bool, neighbours: bool
) -> None:
    """:func:`check_step_shapes`, and for a mechanism with state: neighbour distributions only from the exact state."""
    check_step_shapes(private, public, batch_size)
    if neighbours and not exact:
        raise ValueError("neighbour distributions need the exact state (exact=True)")


# ---------------------------------------------------------------------------------------------
# Laplace helpers (the sparse vector technique's noise)


def laplace_quantile(u: torch.Tensor, loc: float, scale: float) -> torch.Tensor:
    r"""Inverse CDF of Laplace(loc, scale) at ``u`` ∈ (0, 1):
    :math:`\mu - b\,\mathrm{sgn}(u - \tfrac12)\log(1 - 2|u - \tfrac12|)`."""
    c = u - 0.5
    return loc - scale * torch.sign(c) * torch.log1p(-2.0 * c.abs())


def laplace_cdf_log(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    r"""``(log F(x), log(1 − F(x)))`` of Laplace(0, ``scale``), stable in both tails.

    :math:`F(x) = \tfrac12 e^{x/b}` for :math:`x < 0` and :math:`1 - \tfrac12 e^{-x/b}` otherwise.
    """
    neg = x < 0
    z = -x.abs() / scale  # <= 0
    small = math.log(0.5) + z  # log of the smaller tail, log(½ e^{-|x|/b})
    big = torch.log1p(-0.5 * torch.exp(z))  # log(1 − ½ e^{-|x|/b})
    return torch.where(neg, small, big), torch.where(neg, big, small)
