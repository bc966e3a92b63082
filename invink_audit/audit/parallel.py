"""A white-box audit's independent texts shared by several processes (``torchrun`` / ``accelerate launch``).

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.parallel").
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from invink_audit.distributed import Cluster, current_cluster
from invink_audit.mechanism import run_key

__all__ = ["TextShare", "merge_recorded"]


class TextShare:
    """This process's share of ``num_texts`` audit texts."""

    def __init__(self, num_texts: int, cluster: Cluster | None = None) -> None:
        self.cluster = cluster if cluster is not None else current_cluster()
        self.num_texts = num_texts
        self.ids = list(range(self.cluster.rank, num_texts, self.cluster.world_size))
        self._tensors: dict[torch.device, torch.Tensor] = {}

    def global_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Plan indices of the engine's request indices ``local`` (this process's texts)."""
        ids = self._tensors.get(local.device)
        if ids is None:
            ids = self._tensors[local.device] = torch.tensor(self.ids, dtype=torch.int64, device=local.device)
        return ids[local.to(torch.int64)]

    def key(self, generator: torch.Generator) -> int:
        """The run key, drawn by rank 0 from ``generator`` and the same on every process."""
        return self.cluster.broadcast(run_key(generator) if self.cluster.is_main else None)

    def total(self, value):
        """A count (int) or a counter (dict of counts) summed over the processes, on every process."""
        if not self.cluster.distributed:
            return value
        parts = self.cluster.gather(value)
        if self.cluster.is_main:
            if isinstance(value, dict):
                summed = {}
                for part in parts:
                    for k, v in part.items():
                        summed[k] = summed.get(k, 0) + v
            else:
                summed = sum(parts)
        return self.cluster.broadcast(summed if self.cluster.is_main else None)

    def merge(self, recorded):
        """The record of all processes' texts, on every process (the record itself for one process)."""
        if not self.cluster.distributed:
            return recorded
        parts = self.cluster.gather(recorded)
        merged = None
        if self.cluster.is_main:
            world = self.cluster.world_size
            merged = merge_recorded(parts, [list(range(r, self.num_texts, world)) for r in range(world)])
        return self.cluster.broadcast(merged)


def _padded_max(arrays, fill: float) -> np.ndarray:
    """The elementwise maximum of per-position arrays, each padded with ``fill`` to the longest."""
    steps = max(a.shape[0] for a in arrays)
    return np.maximum.reduce([np.pad(a, [(0, steps - a.shape[0])] + [(0, 0)] * (a.ndim - 1), constant_values=fill)
                              for a in arrays])


def merge_recorded(parts, owners):
    """One :class:`~invink_audit.audit.whitebox.RecordedAudit` from per-process records: text ``i``'s rows
    from the process whose ``owners`` list holds it; check counts and failures summed; per-position
    maxima combined (positions a process never reached count as its initial values: 0, or −∞ for δ)."""
    first = parts[0]
    per_text = {}
    for name in ("log_prob_actual", "log_prob_neighbours", "is_sums", "lengths", "tokens"):
        merged = getattr(first, name).copy()
        for part, texts in zip(parts, owners):
            merged[texts] = getattr(part, name)[texts]
        per_text[name] = merged
    failures = {k: sum(p.failures[k] for p in parts) for k in first.failures}

    def worst(name):
        return max((getattr(p, name) for p in parts), key=lambda w: w["value"])

    return dataclasses.replace(
        first,
        **per_text,
        num_step_checks=sum(p.num_step_checks for p in parts),
        failures=failures,
        within_tolerance={k: sum(p.within_tolerance[k] for p in parts) for k in first.within_tolerance},
        max_loss_range_per_step=_padded_max([p.max_loss_range_per_step for p in parts], 0.0),
        max_renyi_ratio_per_step=_padded_max([p.max_renyi_ratio_per_step for p in parts], 0.0),
        max_delta_excess_per_step=_padded_max([p.max_delta_excess_per_step for p in parts], -np.inf),
        worst_range=worst("worst_range"),
        worst_renyi=worst("worst_renyi"),
        check_seconds=sum(p.check_seconds for p in parts),
    )
