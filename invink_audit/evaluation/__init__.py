"""Utility evaluation: what a privacy budget buys.

* :func:`evaluate`: MAUVE (paper setting and library default, with intervals over k-means seeds and
  bootstrap resamples), perplexity and ΔPPL under a scorer LM, lengths, and train-on-synthetic /
  test-on-real (TSTR) when labels are given (:mod:`.evaluate`);
* :class:`Embedder`: sentence embeddings from PyPI-shipped models (all-mpnet-base-v2 by default,
  all-MiniLM-L6-v2 as the fast option), hash-checked and cached (:mod:`.embeddings`);
* :func:`write_evaluation_report`: Markdown, JSON and plots (:mod:`.report`);
* reference points (public-only floor, non-private ceiling) and sweeps: :mod:`.reference_points`,
  :mod:`.sweep`;
* :func:`off_genre`: why a text is not in the genre of its data (a chatbot's preamble, a refusal, a
  link, a list, talk about the task), and :func:`off_genre_share` with its interval (:mod:`.genre`).

Evaluation reports are **not private**: they are computed from the real texts in the clear.
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
