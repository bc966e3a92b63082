"""Utility evaluation: what a privacy budget buys (:func:`evaluate`, :class:`Embedder`, reports, reference points,
sweeps, the off-genre rule). Evaluation reports are **not private**: they are computed from the real texts in the
clear. Guide: docs/guide/evaluating.md.
"""

from __future__ import annotations

from invink_audit import lazy_exports

_LAZY = {
    **dict.fromkeys(("EvaluationConfig", "EvaluationResult", "TextSet", "evaluate", "read_text_set"), ".evaluator"),
    **dict.fromkeys(("DEFAULT_EMBEDDING_MODEL", "EMBEDDING_MODELS", "Embedder", "embedding_model_dir"), ".embeddings"),
    **dict.fromkeys(("LIBRARY_SETTING", "PAPER_SETTING", "MauveSetting", "mauve_interval", "mauve_score"), ".mauve_metric"),
    **dict.fromkeys(("delta_ppl_interval", "score_perplexity"), ".perplexity"),
    **dict.fromkeys(("Interval", "percentile_interval", "wald_interval"), ".stats"),
    **dict.fromkeys(("TstrResult", "train_on_synthetic_test_on_real"), ".tstr"),
    **dict.fromkeys(("evaluation_markdown", "write_evaluation_report"), ".report"),
    **dict.fromkeys(("generate_reference_points",), ".reference_points"),
    **dict.fromkeys(("OffGenre", "off_genre", "off_genre_share"), ".genre"),
    **dict.fromkeys(("SweepConfig", "run_sweep"), ".sweep"),
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
