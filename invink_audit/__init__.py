"""invink-audit: plan, run and audit differentially private LLM text generation (InvisibleInk).

Submodules are imported lazily so that ``invink-audit plan`` and other torch-free commands start fast.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> submodule that defines it (filled in as the subpackages land)
_LAZY: dict[str, str] = {
    # the InvisibleInk mechanism, one decoding step (checked entry points only: the engine's unchecked hot-path
    # kernels, gumbel_argmax, support_log_probs and topk_plus_support, stay in invink_audit.mechanism)
    **dict.fromkeys(
        (
            "ACCUMULATION_DTYPE",
            "DEFAULT_TOP_K",
            "MAX_SEED",
            "MechanismConfig",
            "NeighbourLogProbs",
            "SeededGeneratorWarning",
            "check_seed",
            "dclip_aggregate",
            "derive_key",
            "make_generator",
            "naive_clip_aggregate",
            "neighbour_log_probs",
            "run_key",
            "sample_tokens",
            "token_log_probs",
            "top_k_log_softmax",
            "topk_plus_columns",
            "topk_plus_mask",
        ),
        "invink_audit.mechanism",
    ),
    # generation backend
    **dict.fromkeys(("LoadedModel", "build_tiny_model", "load_model"), "invink_audit.models"),
    **dict.fromkeys(("PRESETS", "PromptTemplate", "TextRequest", "encode_request", "get_preset"), "invink_audit.prompts"),
    **dict.fromkeys(("Partition", "ReferencesFile", "partition_references", "read_references"), "invink_audit.data"),
    **dict.fromkeys(("DecodeStep", "Engine"), "invink_audit.engine"),
    **dict.fromkeys(("ForwardStats", "RowForward"), "invink_audit.forward"),
    **dict.fromkeys(
        (
            "GeneratedText",
            "GenerationConfig",
            "GenerationHooks",
            "GenerationResult",
            "ModelSpec",
            "PromptSpec",
            "OutputInUseError",
            "ReleaseConfig",
            "generate",
            "read_generation_output",
        ),
        "invink_audit.generation",
    ),
    # empirical privacy auditor
    **dict.fromkeys(("quick_audit", "audit_model", "blackbox_audit", "run_selftest", "load_spec", "run_spec"), "invink_audit.audit"),
}

__all__ = ["__version__", *_LAZY]


def lazy_exports(package: str, lazy: dict[str, str], *names: str):
    """The module ``__getattr__`` and ``__dir__`` (PEP 562) of ``package``, whose public names (``lazy``: name ->
    submodule, relative to ``package`` or absolute) are imported on first use; ``names``: its other public names."""

    def __getattr__(name: str):
        module = lazy.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module, package), name)

    return __getattr__, lambda: sorted([*names, *lazy])


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, "__version__")
