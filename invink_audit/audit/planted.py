"""The self-test's planted bugs: :class:`~invink_audit.mechanisms.Mechanism` subclasses, InvisibleInk with one
property broken, each passing :class:`~invink_audit.testing.MechanismContract` except for that property.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.planted").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from invink_audit.mechanism import MechanismConfig, top_k_log_softmax
from invink_audit.mechanisms import InvisibleInk, MechanismGuarantee, MechanismStep

__all__ = ["DataDependentBudget", "PlantedBug", "PrivateTopK", "auto_token_budget"]


class PlantedBug(InvisibleInk):
    """InvisibleInk running ``config`` whose accountant was told ``accounted``: a planted bug when they differ
    (its guarantee is the one ``accounted`` gives, under the bug's ``name``)."""

    def __init__(self, name: str, config: MechanismConfig, accounted: MechanismConfig):
        super().__init__(config)
        self.name, self.accounted = name, accounted

    def guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        """What the (wrong) accountant says: InvisibleInk's guarantee (paper Theorem 2) for ``accounted``."""
        told = InvisibleInk(self.accounted, accountant=self.accountant).guarantee(max_new_tokens, delta)
        return dataclasses.replace(told, mechanism=self.name)


class PrivateTopK(PlantedBug):
    """The top-k set of the aggregated private logits (each dataset its own top-k: a token can jump out of the
    support under a neighbour), accounted as InvisibleInk's Top-k+ with the same k."""

    def __init__(self, accounted: MechanismConfig):
        super().__init__("private-top-k", dataclasses.replace(accounted, top_k=None), accounted)

    def step(self, private, public, state, aux, *, exact, neighbours) -> MechanismStep:
        out = super().step(private, public, state, aux, exact=exact, neighbours=neighbours)
        k = self.accounted.top_k
        return MechanismStep(top_k_log_softmax(out.log_probs, k),
                             None if out.neighbours is None else top_k_log_softmax(out.neighbours, k))

    def topk_plus_columns(self) -> None:
        return None


def auto_token_budget(reference_lengths: Sequence[int], *, default: int = 1) -> int:
    """The reference package's ``max_toks="auto"``: mean + 2·std of the non-empty references' lengths.

    A data-dependent hyperparameter (BRIEF.md, "behaviour not to repeat"); here only for the planted bug.
    ``default`` when every reference is null.
    """
    lengths = [x for x in reference_lengths if x > 0]
    if not lengths:
        return default
    return max(1, int(np.mean(lengths) + 2 * np.std(lengths)))


class DataDependentBudget(PlantedBug):
    """The reference package's data-dependent budget: T = :func:`auto_token_budget` of the references' lengths
    (given: the mechanism was tuned on the data), a stop outcome drawn once a text has T outcomes (under a
    neighbour R'_j, its own T_j), and a guarantee stated for T whatever ``max_new_tokens`` is asked. State: the
    text's outcomes so far."""

    can_halt = True

    def __init__(self, config: MechanismConfig, reference_lengths: Sequence[int]):
        super().__init__("data-dependent-budget", config, config)
        lengths = [int(x) for x in reference_lengths]
        if len(lengths) != config.batch_size:
            raise ValueError(f"reference_lengths must have batch_size={config.batch_size} entries; got {lengths!r}")
        self.budget = auto_token_budget(lengths)
        self.neighbour_budgets = [auto_token_budget(lengths[:j] + [0] + lengths[j + 1:]) for j in range(len(lengths))]

    def state_size(self, *, exact: bool) -> int:
        return 1

    def step(self, private, public, state, aux, *, exact, neighbours) -> MechanismStep:
        out = super().step(private, public, state, aux, exact=exact, neighbours=neighbours)
        count = state[:, 0]  # (G,)
        log_probs = _with_stop(out.log_probs, count == self.budget)
        if out.neighbours is None:
            return MechanismStep(log_probs)
        budgets = torch.tensor(self.neighbour_budgets, dtype=state.dtype, device=state.device)
        return MechanismStep(log_probs, _with_stop(out.neighbours, count[:, None] == budgets))

    def advance(self, step, state, outcomes, aux, *, exact):
        return state + 1, torch.zeros(outcomes.shape, dtype=torch.bool, device=outcomes.device)

    def guarantee(self, max_new_tokens: int, delta: float) -> MechanismGuarantee:
        """The guarantee for the budget computed from the data (``max_new_tokens`` ignored: the bug)."""
        return super().guarantee(self.budget, delta)

    def topk_plus_columns(self) -> None:
        return None


def _with_stop(log_probs: torch.Tensor, stop_now: torch.Tensor) -> torch.Tensor:
    """``log_probs`` (..., V) with the stop outcome appended: the whole mass where ``stop_now`` (its shape
    without V), none elsewhere."""
    stop = torch.where(stop_now, 0.0, -math.inf).to(log_probs.dtype).unsqueeze(-1)
    return torch.cat([log_probs.masked_fill(stop_now.unsqueeze(-1), -math.inf), stop], dim=-1)
