"""The white-box auditor's neighbours per privacy unit (docs/guide/privacy-unit.md): a batch's slots mapped to units,
and a neighbour that replaces *every* slot of one unit by null.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.units").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from invink_audit.mechanism import MechanismConfig
from invink_audit.mechanisms import InvisibleInk, MechanismStep
from invink_audit.mechanisms.base import check_step_shapes

__all__ = ["UnitPlacement"]


class UnitPlacement(InvisibleInk):
    """InvisibleInk whose ``B`` slots hold units' references by ``placement`` (slot → unit, each in ``0 .. B-1``),
    with a neighbour per unit that nulls all of its slots; its claim is InvisibleInk's per-reference guarantee
    for ``config`` (a unit placed twice breaks it)."""

    def __init__(self, config: MechanismConfig, placement: Sequence[int], *, name: str = "unit-placement"):
        super().__init__(config)
        placement = tuple(int(u) for u in placement)
        if len(placement) != config.batch_size or not all(0 <= u < config.batch_size for u in placement):
            raise ValueError(f"placement must give each of the {config.batch_size} slots a unit in 0 .. "
                             f"{config.batch_size - 1}; got {placement}")
        self.placement, self.name = placement, name

    def step(self, private, public, state, aux, *, exact, neighbours) -> MechanismStep:
        check_step_shapes(private, public, self.batch_size)
        slots = private[:, list(self.placement)]  # (G, B, V): each slot its unit's reference
        actual = self.config.token_log_probs(slots, public)
        if not neighbours:
            return MechanismStep(actual)
        per_unit = []
        for unit in range(self.batch_size):  # R'_u: every slot of unit u null (the public row)
            mask = torch.tensor([u == unit for u in self.placement], device=slots.device)
            nulled = torch.where(mask[None, :, None], public[:, None, :], slots)
            per_unit.append(self.config.token_log_probs(nulled, public))
        return MechanismStep(actual, torch.stack(per_unit, dim=1))

    def topk_plus_columns(self) -> None:
        return None  # the engine's fast path would give the slots the source's rows, not the placed ones
