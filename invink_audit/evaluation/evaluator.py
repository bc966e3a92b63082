r"""One evaluation of synthetic texts against real texts: MAUVE (two settings), perplexity and ΔPPL, lengths, and
TSTR when labels are given; every figure an :class:`~invink_audit.evaluation.stats.Interval`. An evaluation is **not
private**: it reads the real texts in the clear (docs/guide/evaluating.md).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import numpy as np

from accounting.limits import check_count, check_delta
from invink_audit.data import check_unicode
from invink_audit.evaluation.embeddings import DEFAULT_EMBEDDING_MODEL, EMBEDDING_MODELS, Embedder
from invink_audit.evaluation.genre import off_genre_share
from invink_audit.evaluation.mauve_metric import LIBRARY_SETTING, PAPER_SETTING, MauveResult, mauve_interval
from invink_audit.evaluation.perplexity import delta_ppl_interval, score_perplexity
from invink_audit.evaluation.stats import DEFAULT_CONFIDENCE, Interval, wald_interval
from invink_audit.evaluation.tstr import NOT_INTERPRETABLE, TstrResult, train_on_synthetic_test_on_real
from invink_audit.not_private import mark_not_private

__all__ = [
    "EVALUATION_PRIVACY_NOTICE", "MIN_TEXTS", "EvaluationConfig", "EvaluationResult", "TextSet", "evaluate", "read_text_set",
    "small_sample_warnings",
]

#: The ``privacy_notice`` of every evaluation record (reports, sweep rows).
EVALUATION_PRIVACY_NOTICE = (
    "NOT PRIVATE: computed from the real texts in the clear; keep with the data, never publish with a release"
)

#: ``progress(stage, total)`` returns a callable taking the number of items just done.
ProgressFactory = Callable[[str, int], Callable[[int], None]]
LABEL_SEPARATOR = " | "


@dataclasses.dataclass(frozen=True)
class TextSet:
    """Texts to evaluate, with optional labels (one string per text, label columns joined by
    :data:`LABEL_SEPARATOR`), and, for this project's generation output, each text's generated token
    count and finish reason (``eos`` or ``length``)."""

    texts: tuple[str, ...]
    labels: tuple[str, ...] | None = None
    num_tokens: tuple[int, ...] | None = None
    finish_reasons: tuple[str, ...] | None = None
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "texts", tuple(self.texts))
        for i, text in enumerate(self.texts):
            if not isinstance(text, str):
                raise ValueError(f"texts[{i}] must be a string; got {type(text).__name__}")
        for name in ("labels", "num_tokens", "finish_reasons"):
            value = getattr(self, name)
            if value is not None:
                value = tuple(value)
                if len(value) != len(self.texts):
                    raise ValueError(f"{name} has {len(value)} entries for {len(self.texts)} texts")
                object.__setattr__(self, name, value)

    def subset(self, indices: Sequence[int]) -> TextSet:
        pick = lambda values: None if values is None else tuple(values[i] for i in indices)  # noqa: E731
        return TextSet(
            texts=pick(self.texts),
            labels=pick(self.labels),
            num_tokens=pick(self.num_tokens),
            finish_reasons=pick(self.finish_reasons),
            source=self.source,
        )


def _label_value(record: Mapping, column: str, where: str) -> str:
    if column in record:
        value = record[column]
    elif isinstance(record.get("labels"), Mapping) and column in record["labels"]:
        value = record["labels"][column]
    else:
        raise ValueError(f"{where}: label field {column!r} missing (looked at the record and its 'labels' object)")
    if value is None:
        return ""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"{where}: label field {column!r} must be a string or number; got {type(value).__name__}")
    check_unicode(value, f"{where}: label field {column!r}")
    return value


def read_text_set(path: str | Path, *, column: str = "text", label_columns: Sequence[str] = ()) -> TextSet:
    """Read texts (and labels) from a ``.csv`` or ``.jsonl`` file: any such file, or the output of
    ``invink-audit generate`` (whose records' ``num_tokens`` and ``finish_reason`` are kept).

    In JSON Lines, a label column is read from the record or from its ``labels`` object. CSV files are
    read by :func:`invink_audit.data.read_labelled_references` (same encodings and error rules).
    """
    from invink_audit.data import jsonl_records, read_labelled_references, read_references, text_lines

    path = Path(path)
    columns = tuple(label_columns)
    if not path.is_file():
        raise ValueError(f"file not found: {str(path)!r}")
    if path.suffix.lower() == ".csv":
        if columns:
            refs = read_labelled_references(path, column=column, label_columns=columns)
            labels = tuple(LABEL_SEPARATOR.join(m[c] for c in columns) for m in refs.labels)
            return TextSet(texts=refs.texts, labels=labels, source=str(path))
        return TextSet(texts=tuple(read_references(path, column=column)), source=str(path))
    if path.suffix.lower() not in (".jsonl", ".ndjson"):
        raise ValueError(f"{str(path)!r} must be a .csv or .jsonl file")
    texts, labels, tokens, reasons = [], [], [], []
    lines = text_lines(path)  # a line that is not UTF-8, or too long to be a text: the file and its line
    for where, record, value in jsonl_records(path, lines, column, "name the text field with --column"):
        texts.append(value)
        if columns:
            labels.append(LABEL_SEPARATOR.join(_label_value(record, c, where) for c in columns))
        tokens.append(record.get("num_tokens") if isinstance(record.get("num_tokens"), int) else None)
        reasons.append(record.get("finish_reason") if isinstance(record.get("finish_reason"), str) else None)
    if not texts:
        raise ValueError(f"{str(path)!r} holds no records")
    return TextSet(
        texts=tuple(texts),
        labels=tuple(labels) if columns else None,
        num_tokens=tuple(tokens) if all(t is not None for t in tokens) else None,
        finish_reasons=tuple(reasons) if all(r is not None for r in reasons) else None,
        source=str(path),
    )


@dataclasses.dataclass(frozen=True)
class EvaluationConfig:
    """Settings of an evaluation, validated at construction.

    * ``embedding_model``: ``mpnet`` (the paper's, default) or ``minilm`` (fast);
    * ``mauve_seeds``, ``mauve_bootstrap``: k-means seeds for the estimate and bootstrap replicates for
      the interval (:func:`~invink_audit.evaluation.mauve_metric.mauve_interval`);
    * ``max_real``: real texts for MAUVE and perplexity (a seeded sample); ``None``: as many as there are
      synthetic texts (the paper uses equal numbers, App. D.4);
    * ``scorer``: the perplexity model (:func:`invink_audit.models.load_model`; ``None`` the embedded
      SmolLM2); ``perplexity=False`` skips perplexity;
    * ``embedding_cache``, ``perplexity_cache``: keep each text's embedding and perplexity on disk (owner-only, by
      text hash: docs/guide/evaluating.md, §"Caches"); ``False``: nothing derived from the texts is kept;
      ``perplexity_cache=None`` (default) follows ``embedding_cache``; ``cache_dir``: where (default
      :func:`invink_audit.models.cache_dir`);
    * ``tstr_test_fraction``: share of the labelled real texts held out to test TSTR (the rest train the ceiling);
      ``tstr_bootstrap``: its bootstrap replicates (each retrains the classifiers).
    """

    embedding_model: str = DEFAULT_EMBEDDING_MODEL
    mauve_seeds: int = 5
    mauve_bootstrap: int = 20
    confidence: float = DEFAULT_CONFIDENCE
    max_real: int | None = None
    scorer: str | None = None
    perplexity: bool = True
    ppl_max_tokens: int = 512
    embedding_cache: bool = True
    perplexity_cache: bool | None = None
    cache_dir: str | None = None
    embedding_dtype: str = "auto"
    tstr_test_fraction: float = 0.5
    tstr_bootstrap: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.embedding_model not in EMBEDDING_MODELS:
            raise ValueError(f"embedding_model must be one of {sorted(EMBEDDING_MODELS)}; got {self.embedding_model!r}")
        for name, least in (
            ("mauve_seeds", 1), ("mauve_bootstrap", 0), ("ppl_max_tokens", 1), ("seed", 0), ("tstr_bootstrap", 1)
        ):
            check_count(name, getattr(self, name), minimum=least)
        check_count("max_real", self.max_real, minimum=2, allow_none=True)
        check_delta("confidence", self.confidence)
        check_delta("tstr_test_fraction", self.tstr_test_fraction)

    def make_embedder(self) -> Embedder:
        """The :class:`Embedder` these settings describe (model, dtype, cache on or off, cache directory)."""
        root = None if self.cache_dir is None else Path(self.cache_dir)
        return Embedder(self.embedding_model, dtype=self.embedding_dtype, cache=self.embedding_cache, cache_root=root)

    def open_perplexity_cache(self):
        """The per-text perplexity cache (:func:`~invink_audit.evaluation.perplexity.perplexity_cache`), or
        ``None`` when nothing may be kept (``perplexity_cache``, or ``embedding_cache`` when it is ``None``)."""
        from invink_audit.evaluation.perplexity import perplexity_cache

        keep = self.embedding_cache if self.perplexity_cache is None else self.perplexity_cache
        return perplexity_cache(None if self.cache_dir is None else Path(self.cache_dir)) if keep else None


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    """The measurements of one evaluation (all after the fact; nothing here is a privacy guarantee)."""

    mauve: MauveResult
    mauve_c5: MauveResult
    perplexity_synthetic: Interval | None
    perplexity_real: Interval | None
    delta_ppl: Interval | None
    length_synthetic: Interval
    length_real: Interval
    generated_tokens: Interval | None
    eos_share: float | None
    tstr: TstrResult | None
    num_synthetic: int
    num_real: int
    embedding_model: str
    scorer: str | None
    ppl_unscored_synthetic: int
    ppl_truncated: int
    seconds: Mapping[str, float]
    synthetic_perplexities: tuple[float, ...] = ()
    real_perplexities: tuple[float, ...] = ()
    num_empty_synthetic: int = 0
    #: the dtype the perplexity scorer ran in and why (:meth:`~invink_audit.models.DtypeChoice.to_json`;
    #: ``None`` without a scorer) and the dtype the embedder ran in (``"bfloat16"`` or ``"float32"``)
    scorer_dtype: Mapping | None = None
    embedding_dtype: str | None = None
    #: what this sample is too small for, one line per metric with the reason (:func:`small_sample_warnings`)
    warnings: tuple[str, ...] = ()
    #: the share of texts the off-genre rule flags (:func:`~invink_audit.evaluation.genre.off_genre_share`:
    #: a chatbot talking about the task, a refusal, a list, a url, an empty text), synthetic and real
    off_genre_synthetic: Interval | None = None
    off_genre_real: Interval | None = None

    def to_json(self) -> dict:
        """One JSON object, marked NOT PRIVATE (:func:`~invink_audit.not_private.mark_not_private`); each
        headline metric is ``{"estimate", "lower", "upper", ...}``."""
        out: dict = {
            "mauve": self.mauve.to_json(),
            "mauve_c5": self.mauve_c5.to_json(),
            "delta_ppl": None if self.delta_ppl is None else self.delta_ppl.to_json(),
        }
        if self.tstr is not None:
            gap = self.tstr.gap_closed
            out["tstr_gap_closed"] = None if gap is None else {**gap.to_json(), "note": self.tstr.gap_closed_note}
        out.update(
            {
                "perplexity_synthetic": None if self.perplexity_synthetic is None else self.perplexity_synthetic.to_json(),
                "perplexity_real": None if self.perplexity_real is None else self.perplexity_real.to_json(),
                "length_synthetic_tokens": self.length_synthetic.to_json(),
                "length_real_tokens": self.length_real.to_json(),
                "generated_tokens": None if self.generated_tokens is None else self.generated_tokens.to_json(),
                "eos_share": self.eos_share,
                "tstr": None if self.tstr is None else self.tstr.to_json(),
                "num_synthetic": self.num_synthetic,
                "num_real": self.num_real,
                "embedding_model": EMBEDDING_MODELS[self.embedding_model].hub_id,
                "scorer": self.scorer,
                "scorer_dtype": None if self.scorer_dtype is None else dict(self.scorer_dtype),
                "embedding_dtype": self.embedding_dtype,
                "ppl_unscored_synthetic": self.ppl_unscored_synthetic,
                "ppl_truncated": self.ppl_truncated,
                "num_empty_synthetic": self.num_empty_synthetic,
                "warnings": list(self.warnings),
                "off_genre_synthetic": None if self.off_genre_synthetic is None else self.off_genre_synthetic.to_json(),
                "off_genre_real": None if self.off_genre_real is None else self.off_genre_real.to_json(),
                "seconds": dict(self.seconds),
            }
        )
        return mark_not_private(out, EVALUATION_PRIVACY_NOTICE)


def _no_progress(stage: str, total: int) -> Callable[[int], None]:
    return lambda n: None


def _as_text_set(value, name: str) -> TextSet:
    if isinstance(value, TextSet):
        return value
    if isinstance(value, (str, Path)):
        raise ValueError(f"{name}: pass a TextSet (read_text_set(path)) or a list of strings, not a path string")
    if not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a TextSet or a sequence of strings; got {type(value).__name__}")
    return TextSet(texts=tuple(value))


def evaluate(
    synthetic: TextSet | Sequence[str],
    real: TextSet | Sequence[str],
    config: EvaluationConfig | None = None,
    *,
    scorer_model=None,
    embedder: Embedder | None = None,
    progress: ProgressFactory | None = None,
) -> EvaluationResult:
    """Evaluate ``synthetic`` against ``real`` (module docstring). ``scorer_model``: an already loaded
    :class:`~invink_audit.models.LoadedModel` to score perplexity with (else ``config.scorer`` is
    loaded); ``embedder``: an :class:`Embedder` to reuse (else one is made). TSTR runs when both sets
    carry labels. Randomness (samples, resamples, k-means) is seeded by ``config.seed``: an evaluation
    is reproducible."""
    config = config or EvaluationConfig()
    progress = progress or _no_progress
    synthetic = _as_text_set(synthetic, "synthetic")
    real = _as_text_set(real, "real")
    if len(synthetic.texts) < 2 or len(real.texts) < 2:
        raise ValueError(f"need at least 2 synthetic and 2 real texts; got {len(synthetic.texts)} and {len(real.texts)}")
    if (synthetic.labels is None) != (real.labels is None):
        raise ValueError("labels were given for only one of the synthetic and real sets; TSTR needs both")
    empty = _count_empty(synthetic)
    if empty:
        warnings.warn(
            f"{empty} of {len(synthetic.texts)} synthetic texts{_source(synthetic)} are empty; they are evaluated as "
            "empty texts (embedded for MAUVE, without a perplexity)",
            stacklevel=2,
        )
    rng = np.random.default_rng(config.seed)
    n_real = min(len(real.texts), config.max_real or len(synthetic.texts))
    real_sample = real.subset(sorted(rng.choice(len(real.texts), size=n_real, replace=False).tolist()))
    seconds: dict[str, float] = {}

    def timed(phase: str, run: Callable):
        start = time.perf_counter()
        out = run()
        seconds[phase] = seconds.get(phase, 0.0) + time.perf_counter() - start
        return out

    embedder = timed("embedding", lambda: embedder or config.make_embedder())  # building it counts as embedding
    p_features, q_features = timed("embedding", lambda: _embed(synthetic, real_sample, config, embedder, progress))
    mauve = timed("mauve", lambda: _mauve(p_features, q_features, config, progress))
    ppl = timed("perplexity", lambda: _perplexity(synthetic, real_sample, config, scorer_model, progress))
    tstr = None if synthetic.labels is None else timed("tstr", lambda: _tstr(synthetic, real, config))
    return _result(synthetic, real_sample, config, mauve, ppl, tstr, seconds, empty, embedder)


def _result(synthetic: TextSet, real: TextSet, config: EvaluationConfig, mauve, ppl, tstr, seconds, empty, embedder):
    """The :class:`EvaluationResult` of :func:`evaluate`'s phases (``real``: the real texts sampled for MAUVE and
    perplexity), with the off-genre shares and its small-sample warnings."""
    result = EvaluationResult(
        mauve=mauve["paper"],
        mauve_c5=mauve["library"],
        **ppl,
        generated_tokens=None if synthetic.num_tokens is None else wald_interval(synthetic.num_tokens, config.confidence),
        eos_share=_eos_share(synthetic),
        tstr=tstr,
        num_synthetic=len(synthetic.texts),
        num_real=len(real.texts),
        embedding_model=config.embedding_model,
        seconds=seconds,
        num_empty_synthetic=empty,
        embedding_dtype=getattr(embedder, "dtype", None),
        off_genre_synthetic=off_genre_share(synthetic.texts, config.confidence),
        off_genre_real=off_genre_share(real.texts, config.confidence),
    )
    return dataclasses.replace(result, warnings=small_sample_warnings(result))


#: The fewest texts each metric needs before its figure and interval mean what they say (the reasons are
#: in :func:`small_sample_warnings`); below them every report says so.
MIN_TEXTS = MappingProxyType({"MAUVE": 500, "perplexity": 30, "TSTR": 100})


def small_sample_warnings(result: EvaluationResult) -> tuple[str, ...]:
    """One line per metric whose sample is too small for it, with the reason (empty when none is)."""
    out = []
    n = min(result.num_synthetic, result.num_real)
    if n < MIN_TEXTS["MAUVE"]:
        out.append(
            f"MAUVE: {n} texts per side, below {MIN_TEXTS['MAUVE']} (the paper's; MAUVE's authors use 5,000): "
            "its k-means histogram has too few texts per bucket, so the score is biased and its interval understates "
            "the error; do not compare points by it at this n"
        )
    if result.perplexity_synthetic is not None and len(result.synthetic_perplexities) < MIN_TEXTS["perplexity"]:
        out.append(
            f"perplexity: {len(result.synthetic_perplexities)} scored texts, below {MIN_TEXTS['perplexity']}: "
            "per-text perplexities are heavy-tailed and a Wald interval assumes their mean is near normal"
        )
    if result.tstr is not None:
        if result.num_synthetic < MIN_TEXTS["TSTR"]:
            out.append(
                f"TSTR: {result.num_synthetic} synthetic training texts, below {MIN_TEXTS['TSTR']}: the classifiers "
                "are trained on too few texts for their accuracies to differ by more than noise"
            )
        if result.tstr.gap_closed_note.startswith(NOT_INTERPRETABLE):
            out.append(f"TSTR gap closed: {result.tstr.gap_closed_note.split(';')[0]}")
    return tuple(out)


def _source(texts: TextSet) -> str:
    return f" in {texts.source!r}" if texts.source else ""


def _count_empty(synthetic: TextSet) -> int:
    """The number of empty (or whitespace-only) synthetic texts; all of them is refused (MAUVE would
    score a set of empty strings: 0.55 against real texts, where it should be no score)."""
    empty = sum(1 for text in synthetic.texts if not text.strip())
    if empty == len(synthetic.texts):
        raise ValueError(
            f"every synthetic text{_source(synthetic)} is empty ({empty} of {empty}): there is nothing to evaluate"
        )
    return empty


def _embed(synthetic: TextSet, real_sample: TextSet, config: EvaluationConfig, embedder, progress):
    """Sentence embeddings of both sets (paper App. D.4), through the per-text cache."""
    if embedder.spec.name != config.embedding_model:
        raise ValueError(f"embedder is {embedder.spec.name!r} but config.embedding_model is {config.embedding_model!r}")
    update = progress("embedding", len(synthetic.texts) + len(real_sample.texts))
    return embedder.embed(synthetic.texts, progress=update), embedder.embed(real_sample.texts, progress=update)


def _mauve(p_features: np.ndarray, q_features: np.ndarray, config: EvaluationConfig, progress) -> dict[str, MauveResult]:
    """MAUVE in the paper's setting and the library's (paper App. D.4), each with its interval."""
    update = progress("MAUVE", 2 * (config.mauve_seeds + config.mauve_bootstrap))
    return {
        key: mauve_interval(
            p_features,
            q_features,
            setting,
            num_seeds=config.mauve_seeds,
            num_bootstrap=config.mauve_bootstrap,
            confidence=config.confidence,
            rng=np.random.default_rng([config.seed, 1 if key == "paper" else 2]),
            progress=update,
        )
        for key, setting in (("paper", PAPER_SETTING), ("library", LIBRARY_SETTING))
    }


def _perplexity(synthetic: TextSet, real_sample: TextSet, config: EvaluationConfig, scorer_model, progress) -> dict:
    """Perplexity, ΔPPL and lengths (paper App. D.4), as :class:`EvaluationResult`'s fields; without a scorer,
    lengths in words only."""
    if not (config.perplexity or scorer_model is not None):
        return dict(perplexity_synthetic=None, perplexity_real=None, delta_ppl=None, scorer=None,
                    length_synthetic=wald_interval([len(t.split()) for t in synthetic.texts], config.confidence),
                    length_real=wald_interval([len(t.split()) for t in real_sample.texts], config.confidence),
                    ppl_unscored_synthetic=0, ppl_truncated=0)  # fmt: skip
    from invink_audit.models import load_model

    loaded = scorer_model if scorer_model is not None else load_model(config.scorer)
    update = progress("perplexity", len(synthetic.texts) + len(real_sample.texts))
    cache = config.open_perplexity_cache()
    try:
        scored = [
            score_perplexity(texts, loaded, max_tokens=config.ppl_max_tokens, progress=update, cache=cache)
            for texts in (synthetic.texts, real_sample.texts)
        ]
    finally:
        if cache is not None:
            cache.close()
    syn, real = scored[0].defined, scored[1].defined
    ppl_syn = ppl_real = delta = None
    if syn.size and real.size:
        ppl_syn, ppl_real = (wald_interval(x, config.confidence, log_scale=True) for x in (syn, real))
        delta = delta_ppl_interval(syn, real, confidence=config.confidence, rng=np.random.default_rng([config.seed, 3]))
    return dict(
        perplexity_synthetic=ppl_syn, perplexity_real=ppl_real, delta_ppl=delta, scorer=str(loaded.name),
        length_synthetic=wald_interval(scored[0].num_tokens, config.confidence),
        length_real=wald_interval(scored[1].num_tokens, config.confidence),
        synthetic_perplexities=tuple(float(x) for x in syn), real_perplexities=tuple(float(x) for x in real),
        ppl_unscored_synthetic=len(synthetic.texts) - syn.size, ppl_truncated=scored[0].truncated + scored[1].truncated,
        scorer_dtype=None if getattr(loaded, "dtype_choice", None) is None else loaded.dtype_choice.to_json(),
    )  # fmt: skip


def _tstr(synthetic: TextSet, real: TextSet, config: EvaluationConfig) -> TstrResult:
    """Train on synthetic, test on real, against the real-data ceiling (a seeded split of ``real``)."""
    order = np.random.default_rng([config.seed, 4]).permutation(len(real.texts))
    n_test = max(1, int(round(len(order) * config.tstr_test_fraction)))
    if len(order) - n_test < 1:
        raise ValueError("TSTR needs at least 2 labelled real texts (one to train the ceiling, one to test)")
    test_idx, train_idx = sorted(order[:n_test].tolist()), sorted(order[n_test:].tolist())
    return train_on_synthetic_test_on_real(
        synthetic.texts,
        synthetic.labels,
        [real.texts[i] for i in train_idx],
        [real.labels[i] for i in train_idx],
        [real.texts[i] for i in test_idx],
        [real.labels[i] for i in test_idx],
        num_bootstrap=config.tstr_bootstrap,
        confidence=config.confidence,
        rng=np.random.default_rng([config.seed, 5]),
    )


def _eos_share(synthetic: TextSet) -> float | None:
    """Share of the synthetic texts that ended with an end-of-sequence token (``None``: unknown)."""
    if synthetic.finish_reasons is None:
        return None
    return sum(r == "eos" for r in synthetic.finish_reasons) / len(synthetic.finish_reasons)
