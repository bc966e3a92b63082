r"""One InvisibleInk release as a privacy event: the single record its guarantee is computed from (in the spirit of
dp-accounting's ``DpEvent``; the planner's :class:`~accounting.Plan` and the ledger's :class:`~accounting.Release`
expose theirs as ``.event``).

Per token an exponential mechanism on scores of ℓ∞ sensitivity Δ (:func:`accounting.linf_sensitivity`; paper
Property 1, prop:ourclip-sensitivity) at temperature τ is ε0-bounded-range, ε0 = 2Δ/τ (Durfee & Rogers 2019,
arXiv:1905.04273), ρ_tok = ε0²/8 (:func:`accounting.conversions.br_to_zcdp`); a text composes T steps (paper
Theorem 2, thm:accounting), disjoint batches compose in parallel (paper Corollary 11, coro:parallel-batches), and a
privacy unit touching k batches composes its k texts adaptively (Dwork & Roth 2014, Thm. 3.16; for ε0-BR steps
Dong, Durfee & Rogers 2020, Thm. 3; zCDP: k·ρ, Bun & Steinke 2016, Lemma 2.3): k × ``texts_per_batch`` × T steps.
The argument: docs/accounting_notes.md §2.
"""

from __future__ import annotations

import dataclasses

from accounting.accountants import (
    DEFAULT_ACCOUNTANT,
    EPSILON_ROUNDING,
    Accountant,
    as_accountant,
    bounded_range_epsilon,
    composed_epsilon,
)
from accounting.conversions import br_to_zcdp, zcdp_to_epsilon
from accounting.limits import RANGES
from accounting.sensitivity import Adjacency, Clipping, coerce_enum, linf_sensitivity

__all__ = ["GenerationEvent", "ZcdpEvent", "event_from_json", "forwarded_property"]


def forwarded_property(via: str, name: str, doc: str) -> property:
    """A read-only property that reads ``name`` from the record's ``via`` attribute: a record that stores its
    event (or plan) shows the event's figures without keeping a second copy that could disagree."""
    return property(lambda self: getattr(getattr(self, via), name), doc=doc)


@dataclasses.dataclass(frozen=True)
class GenerationEvent:
    """The public parameters that determine one release's privacy (never anything from the data)."""

    clip_norm: float
    batch_size: int
    temperature: float
    max_new_tokens: int
    texts_per_batch: int = 1
    clipping: Clipping = Clipping.DIFFERENCE
    adjacency: Adjacency = Adjacency.REPLACE_BY_NULL
    #: batches one privacy unit's references may fall in, one slot each (module docstring); 1: per reference
    unit_contributions: int = 1

    def __post_init__(self) -> None:
        for name in ("clip_norm", "batch_size", "temperature", "max_new_tokens", "texts_per_batch", "unit_contributions"):
            RANGES[name].check(name, getattr(self, name))
        object.__setattr__(self, "clipping", coerce_enum(self.clipping, Clipping))
        object.__setattr__(self, "adjacency", coerce_enum(self.adjacency, Adjacency))

    @property
    def sensitivity(self) -> float:
        """ℓ∞ sensitivity Δ of the aggregated logits (:func:`accounting.linf_sensitivity`)."""
        return linf_sensitivity(self.clip_norm, self.batch_size, self.clipping, self.adjacency)

    @property
    def epsilon0(self) -> float:
        """Per-token bounded range ε0 = 2Δ/τ."""
        return bounded_range_epsilon(self.sensitivity, self.temperature)

    @property
    def rho_token(self) -> float:
        """Per-token zCDP ρ_tok = ε0²/8."""
        return br_to_zcdp(self.epsilon0)

    @property
    def num_steps(self) -> int:
        """Token steps charged: T per text, times the texts drawn from each batch (batches parallel), times the
        batches one privacy unit may touch (module docstring)."""
        return self.max_new_tokens * self.texts_per_batch * self.unit_contributions

    @property
    def rho_sequence(self) -> float:
        """zCDP of the release: num_steps · ρ_tok."""
        return self.num_steps * self.rho_token

    def epsilon(self, delta: float, accountant: Accountant | str = DEFAULT_ACCOUNTANT) -> float:
        """Certified ε at ``delta`` of the release: num_steps adaptively composed ε0-BR steps (paper Theorem 2,
        thm:accounting) under ``accountant``, rounded up (:func:`accounting.composed_epsilon`). The planner, the
        ledger's single release and every mechanism report this one value."""
        return composed_epsilon(delta, self.epsilon0, self.num_steps, accountant)


@dataclasses.dataclass(frozen=True)
class ZcdpEvent:
    """A release its mechanism accounts in zCDP as a whole: ``rho`` for every text of it (disjoint batches compose
    in parallel, paper Corollary 11, coro:parallel-batches), e.g. Amin et al. 2024's sparse-vector and exponential
    mechanism steps (:class:`invink_audit.mechanisms.AminMechanism`: r private tokens of ρ_em + ρ_svt each).
    ``mechanism`` names it in the ledger. The ledger composes it with the other releases by adding ρ (Bun &
    Steinke 2016, Lemma 2.3; a filter under adaptive choice, see :mod:`accounting.ledger`). ``unit_contributions``:
    the batches one privacy unit may touch, one text each, so the unit's ρ is k·``rho`` (the same lemma)."""

    rho: float
    mechanism: str
    unit_contributions: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "rho", RANGES["rho"].check("rho", self.rho))
        RANGES["unit_contributions"].check("unit_contributions", self.unit_contributions)
        if not isinstance(self.mechanism, str) or not self.mechanism.strip():
            raise ValueError(f"mechanism must be a non-empty string; got {self.mechanism!r}")

    @property
    def rho_sequence(self) -> float:
        """zCDP of the release per privacy unit (the ledger's term): k·ρ."""
        return self.unit_contributions * self.rho

    def epsilon(self, delta: float, accountant: Accountant | str = DEFAULT_ACCOUNTANT) -> float:
        """Certified ε at ``delta``: ρ converted by the accountant's zCDP conversion (CKS for ``br-adaptive``,
        which has no tighter rule for a release that is not a sequence of bounded-range steps), rounded up
        as :func:`accounting.composed_epsilon` rounds."""
        return zcdp_to_epsilon(self.rho_sequence, delta, as_accountant(accountant).zcdp_conversion) * (1.0 + EPSILON_ROUNDING)

    def to_json(self) -> dict:
        """The ledger's record (``unit_contributions`` only when not 1: older records stay as they were)."""
        units = {} if self.unit_contributions == 1 else {"unit_contributions": self.unit_contributions}
        return {"kind": "zcdp", "mechanism": self.mechanism, "rho": self.rho, **units}


def event_from_json(data: dict) -> GenerationEvent | ZcdpEvent:
    """The event of a flat ledger record: ``"kind": "zcdp"`` for a :class:`ZcdpEvent`, else (no ``kind``, every
    record before it existed) a :class:`GenerationEvent` from its parameters; other keys are ignored."""
    kind = data.get("kind", "bounded-range")
    if kind == "zcdp":
        return ZcdpEvent(data.get("rho"), data.get("mechanism"), data.get("unit_contributions", 1))
    if kind != "bounded-range":
        raise ValueError(f"unknown release kind {kind!r}; expected 'bounded-range' or 'zcdp'")
    return GenerationEvent(**{f.name: data[f.name] for f in dataclasses.fields(GenerationEvent) if f.name in data})
