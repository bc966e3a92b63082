r"""One InvisibleInk release as a privacy event: the single record its guarantee is computed from.

In the spirit of dp-accounting's ``DpEvent``: a small frozen description of what was run, with the
privacy parameters derived from it in one place. The planner's :class:`~accounting.Plan` and the ledger's
:class:`~accounting.Release` expose theirs as ``.event``.

Per token the mechanism is an exponential mechanism on scores of ℓ∞ sensitivity Δ
(:func:`accounting.linf_sensitivity`: C/B for difference clipping under replace-by-null, paper
Property 1, prop:ourclip-sensitivity) at temperature τ, so it is ε0-bounded-range with ε0 = 2Δ/τ (Durfee & Rogers 2019,
arXiv:1905.04273) and ρ_tok = ε0²/8-zCDP (:func:`accounting.conversions.br_to_zcdp`); a text of at most
T tokens composes T such steps (paper Theorem 2, thm:accounting), and the texts of disjoint batches compose in parallel
(paper Corollary 11, coro:parallel-batches), so a release costs ``texts_per_batch`` × T steps whatever its number of batches.
"""

from __future__ import annotations

import dataclasses

from accounting.accountants import bounded_range_epsilon
from accounting.conversions import br_to_zcdp
from accounting.limits import RANGES
from accounting.sensitivity import Adjacency, Clipping, _coerce, linf_sensitivity

__all__ = ["GenerationEvent"]


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

    def __post_init__(self) -> None:
        for name in ("clip_norm", "batch_size", "temperature", "max_new_tokens", "texts_per_batch"):
            RANGES[name].check(name, getattr(self, name))
        object.__setattr__(self, "clipping", _coerce(self.clipping, Clipping))
        object.__setattr__(self, "adjacency", _coerce(self.adjacency, Adjacency))

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
        """Token steps charged: T per text, times the texts drawn from each batch (batches parallel)."""
        return self.max_new_tokens * self.texts_per_batch

    @property
    def rho_sequence(self) -> float:
        """zCDP of the release: num_steps · ρ_tok."""
        return self.num_steps * self.rho_token
