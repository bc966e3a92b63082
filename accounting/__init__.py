"""Privacy accounting for InvisibleInk decoding (torch-free: numpy, scipy, dp-accounting)."""

from accounting.sensitivity import (
    Adjacency,
    Clipping,
    clip_norm_for_sensitivity,
    linf_sensitivity,
    sensitivity_factor,
)

__all__ = [
    "Adjacency",
    "Clipping",
    "clip_norm_for_sensitivity",
    "linf_sensitivity",
    "sensitivity_factor",
]
