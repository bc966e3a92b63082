"""MAUVE (Pillutla et al., NeurIPS 2021; JMLR 2023) of synthetic against real texts, with intervals.

:func:`mauve_score` calls ``mauve-text`` on sentence-embedding *features only* (it never loads a
featuriser); :data:`PAPER_SETTING` is the paper's (App. D.4 (sec:expt:eval-metrics), "MAUVE score":
n/20 buckets, c = 0.9), :data:`LIBRARY_SETTING` the library's defaults (n/10, c = 5).
:func:`mauve_interval`: the mean over k-means seeds, with a percentile bootstrap that resamples both sets
and reseeds k-means in every replicate.

Design: docs/guide/evaluating.md (§"invink-audit evaluate", rows ``mauve``, ``mauve_c5``, "interval of both").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile

import numpy as np

from accounting.limits import check_count
from invink_audit.evaluation.stats import DEFAULT_CONFIDENCE, Interval, percentile_interval

__all__ = ["LIBRARY_SETTING", "PAPER_SETTING", "MauveResult", "MauveSetting", "mauve_interval", "mauve_score"]

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MauveSetting:
    """``bucket_divisor``: ``num_buckets = max(2, round(n / bucket_divisor))``; ``scaling_factor``: MAUVE's c."""

    name: str
    bucket_divisor: int
    scaling_factor: float

    def __post_init__(self) -> None:
        check_count("bucket_divisor", self.bucket_divisor)
        if not isinstance(self.scaling_factor, (int, float)) or not self.scaling_factor > 0:
            raise ValueError(f"scaling_factor must be > 0; got {self.scaling_factor!r}")

    def num_buckets(self, n: int) -> int:
        # mauve-text's "auto" is max(2, int(round(n / 10))) (compute_mauve.py); the paper's n/20 the same way
        return max(2, int(round(n / self.bucket_divisor)))


PAPER_SETTING = MauveSetting("paper", bucket_divisor=20, scaling_factor=0.9)
LIBRARY_SETTING = MauveSetting("library default", bucket_divisor=10, scaling_factor=5.0)


@contextlib.contextmanager
def _captured_native_stderr():
    """faiss writes k-means warnings ("please provide at least ... training points") from C++ straight to
    file descriptor 2; they are collected and logged at debug level instead of interleaving with output."""
    try:
        fd = os.dup(2)
    except OSError:  # pragma: no cover - no stderr descriptor
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(fd, 2)
            os.close(fd)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                _LOG.debug("mauve/faiss: %s", text)


@contextlib.contextmanager
def _one_thread():
    """faiss k-means and the PCA's BLAS on one thread. On this project's shared 2-core machine one MAUVE
    of 500 + 500 texts took 0.65 s on one thread and 1.9-28 s on two (OpenMP threads spin-waiting for a
    busy core); the clustering of a few hundred points gains nothing from a second thread anyway."""
    import faiss
    from threadpoolctl import threadpool_limits

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        faiss.omp_set_num_threads(before)


def _check_features(name: str, features) -> np.ndarray:
    array = np.asarray(features, dtype=np.float32)
    if array.ndim != 2 or array.shape[0] < 2 or array.shape[1] < 1:
        raise ValueError(f"{name} must be a 2-d array with at least 2 rows; got shape {array.shape}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite")
    return array


def mauve_score(p_features, q_features, setting: MauveSetting = PAPER_SETTING, *, seed: int = 0) -> float:
    """MAUVE of P against Q by ``mauve.compute_mauve(p_features=..., q_features=...)`` with the
    setting's bucket count and scaling factor, k-means seed ``seed`` (other arguments: the library's
    defaults). ``n`` for the bucket count is the smaller set's size, as in the library's ``auto``."""
    import mauve

    p = _check_features("p_features", p_features)
    q = _check_features("q_features", q_features)
    if p.shape[1] != q.shape[1]:
        raise ValueError(f"p_features and q_features must have the same dimension; got {p.shape[1]} and {q.shape[1]}")
    buckets = setting.num_buckets(min(len(p), len(q)))
    with _captured_native_stderr(), _one_thread():
        out = mauve.compute_mauve(
            p_features=p,
            q_features=q,
            num_buckets=buckets,
            mauve_scaling_factor=float(setting.scaling_factor),
            seed=int(seed),
            verbose=False,
        )
    return float(out.mauve)


@dataclasses.dataclass(frozen=True)
class MauveResult:
    """MAUVE in one setting: the interval, the per-seed scores on the full sets, and the bucket count."""

    setting: MauveSetting
    interval: Interval
    seed_scores: tuple[float, ...]
    bootstrap_scores: tuple[float, ...]
    num_buckets: int
    num_synthetic: int
    num_real: int

    def to_json(self) -> dict:
        return {
            **self.interval.to_json(),
            "setting": self.setting.name,
            "scaling_factor": self.setting.scaling_factor,
            "num_buckets": self.num_buckets,
            "seed_scores": list(self.seed_scores),
            "seed_min": min(self.seed_scores),
            "seed_max": max(self.seed_scores),
            "num_synthetic": self.num_synthetic,
            "num_real": self.num_real,
        }


def mauve_interval(
    p_features,
    q_features,
    setting: MauveSetting = PAPER_SETTING,
    *,
    num_seeds: int = 5,
    num_bootstrap: int = 20,
    confidence: float = DEFAULT_CONFIDENCE,
    rng: np.random.Generator | None = None,
    progress=None,
) -> MauveResult:
    """MAUVE with an interval over k-means seeds and bootstrap resamples (docs/guide/evaluating.md,
    "interval of both").

    ``rng`` draws the resamples (default: a fixed seed, so an evaluation is reproducible: the
    evaluation is not a private release, nothing needs OS randomness). ``progress``: called with 1
    after each MAUVE computation (``num_seeds + num_bootstrap`` in all).
    """
    for name, value, least in (("num_seeds", num_seeds, 1), ("num_bootstrap", num_bootstrap, 0)):
        check_count(name, value, minimum=least)
    p = _check_features("p_features", p_features)
    q = _check_features("q_features", q_features)
    rng = rng if rng is not None else np.random.default_rng(20251)
    seed_scores = []
    for seed in range(num_seeds):
        seed_scores.append(mauve_score(p, q, setting, seed=seed))
        if progress is not None:
            progress(1)
    estimate = float(np.mean(seed_scores))
    replicates = []
    for r in range(num_bootstrap):
        p_star = p[rng.integers(0, len(p), size=len(p))]
        q_star = q[rng.integers(0, len(q), size=len(q))]
        replicates.append(mauve_score(p_star, q_star, setting, seed=num_seeds + r))
        if progress is not None:
            progress(1)
    if replicates:
        interval = percentile_interval(estimate, replicates, confidence, method="bootstrap over texts and k-means seeds")
    else:
        interval = Interval(estimate, min(seed_scores), max(seed_scores), confidence, "range over k-means seeds")
    return MauveResult(
        setting=setting,
        interval=interval,
        seed_scores=tuple(seed_scores),
        bootstrap_scores=tuple(replicates),
        num_buckets=setting.num_buckets(min(len(p), len(q))),
        num_synthetic=len(p),
        num_real=len(q),
    )
