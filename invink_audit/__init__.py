"""invink-audit: plan, run and audit differentially private LLM text generation (InvisibleInk).

Submodules are imported lazily so that ``invink-audit plan`` and other torch-free commands start fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> submodule that defines it (filled in as the subpackages land)
_LAZY: dict[str, str] = {
    # the InvisibleInk mechanism, one decoding step (issue 3)
    **dict.fromkeys(
        (
            "ACCUMULATION_DTYPE",
            "MechanismConfig",
            "NeighbourLogProbs",
            "SeededGeneratorWarning",
            "dclip_aggregate",
            "make_generator",
            "naive_clip_aggregate",
            "neighbour_log_probs",
            "sample_tokens",
            "token_log_probs",
            "topk_plus_mask",
        ),
        "invink_audit.mechanism",
    ),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'invink_audit' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(__all__)
