r"""Intervals (:class:`Interval`, the one record of the evaluator and the auditor): an estimate with two ends.

* :func:`wald_interval`: the paper's intervals (App. D.6 (sec:expt:confidence-intervals)):
  :math:`\bar x \pm z_{\alpha/2}\, s/\sqrt m`, for means of per-text quantities (perplexity, length).
* :func:`bootstrap_interval`: the percentile bootstrap (Efron & Tibshirani 1993, §13.3): the :math:`\alpha/2`
  and :math:`1-\alpha/2` quantiles of a statistic over resamples, by :func:`scipy.stats.bootstrap`;
  :func:`percentile_interval`: the same ends of replicates a caller drew itself (MAUVE, TSTR, paired ratios).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy import stats

from accounting.limits import check_delta

__all__ = ["DEFAULT_CONFIDENCE", "Interval", "bootstrap_interval", "percentile_interval", "wald_interval"]

#: Confidence level of every interval unless told otherwise (the paper's main figures use 95%).
DEFAULT_CONFIDENCE = 0.95


@dataclasses.dataclass(frozen=True)
class Interval:
    """``estimate`` with ``[lower, upper]`` (infinite allowed, never NaN) at ``confidence`` in (0, 1] (an auditor's
    bound at significance β: 1 − β); ``method`` says how the ends were found."""

    estimate: float
    lower: float
    upper: float
    confidence: float = DEFAULT_CONFIDENCE
    method: str = ""

    def __post_init__(self) -> None:
        for name in ("estimate", "lower", "upper"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or math.isnan(value):
                raise ValueError(f"{name} must be a number; got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.lower > self.upper:
            raise ValueError(f"lower must be <= upper; got [{self.lower}, {self.upper}]")
        if self.confidence != 1.0:
            check_delta("confidence", self.confidence)

    def contains(self, value: float) -> bool:
        return self.lower <= value <= self.upper

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def format(self, digits: int = 3, scale: float = 1.0) -> str:
        """``0.812 [0.771, 0.845]``."""
        estimate, lower, upper = (f"{x * scale:.{digits}f}" for x in (self.estimate, self.lower, self.upper))
        return f"{estimate} [{lower}, {upper}]"


def wald_interval(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE, *, log_scale: bool = False) -> Interval:
    r"""Mean of ``values`` with the Wald interval :math:`\bar x \pm z\, s/\sqrt m` (paper App. D.6,
    "Confidence Intervals"; ``s`` the sample standard deviation). One value gives a zero-width interval.

    ``log_scale=True`` (positive quantities such as perplexity, whose means are heavy-tailed): the same
    standard error taken on the log scale by the delta method (Casella & Berger 2002, §5.5.4:
    :math:`\mathrm{se}(\log \bar x) \approx \mathrm{se}(\bar x)/\bar x`), back-transformed:
    :math:`\bar x \exp(\pm z\, s/(\bar x\sqrt m))`, never negative and wider above the mean than below it."""
    check_delta("confidence", confidence)
    data = np.asarray(values, dtype=np.float64)
    if data.ndim != 1 or data.size == 0:
        raise ValueError("values must be a non-empty 1-d sequence")
    if not np.all(np.isfinite(data)):
        raise ValueError("values must be finite")
    if log_scale and not np.all(data > 0):
        raise ValueError("log_scale needs positive values")
    mean = float(data.mean())
    if data.size == 1:
        return Interval(mean, mean, mean, confidence, "wald (one value)")
    half = float(stats.norm.ppf(0.5 + confidence / 2) * data.std(ddof=1) / math.sqrt(data.size))
    if log_scale:
        factor = math.exp(half / mean)
        return Interval(mean, mean / factor, mean * factor, confidence, "wald (log scale)")
    return Interval(mean, mean - half, mean + half, confidence, "wald")


def _around(estimate: float, lower: float, upper: float, confidence: float, method: str, replicates: int) -> Interval:
    if not lower <= estimate <= upper:
        method += " (widened to the estimate)"
        lower, upper = min(lower, estimate), max(upper, estimate)
    return Interval(float(estimate), float(lower), float(upper), confidence, f"{method}, {replicates} replicates")


def percentile_interval(
    estimate: float, replicates: Sequence[float], confidence: float = DEFAULT_CONFIDENCE, method: str = "bootstrap"
) -> Interval:
    """``estimate`` with the percentile-bootstrap ends of ``replicates`` (linear interpolation of the empirical
    quantiles, as scipy's), widened as :func:`bootstrap_interval`'s."""
    check_delta("confidence", confidence)
    data = np.asarray(replicates, dtype=np.float64)
    if data.ndim != 1 or data.size == 0 or not np.all(np.isfinite(data)):
        raise ValueError("replicates must be a non-empty 1-d sequence of finite numbers")
    alpha = 1.0 - confidence
    lower, upper = np.quantile(data, [alpha / 2, 1 - alpha / 2])
    return _around(estimate, lower, upper, confidence, method, data.size)


def bootstrap_interval(samples: Sequence[Sequence[float]], statistic: Callable[..., float],
                       confidence: float = DEFAULT_CONFIDENCE, *, num_resamples: int, rng: np.random.Generator,
                       method: str = "bootstrap", vectorized: bool = False) -> Interval:  # fmt: skip
    """``statistic(*samples)`` with its percentile-bootstrap interval from :func:`scipy.stats.bootstrap`
    (``method="percentile"``; each sample, of two or more values, resampled independently ``num_resamples`` times
    from ``rng``: seeded, reproducible; ``vectorized``: ``statistic`` takes ``axis=``). The ends are widened to
    contain the estimate if a biased statistic put every replicate on one side of it (said in the method)."""
    check_delta("confidence", confidence)
    data = tuple(np.asarray(x, dtype=np.float64) for x in samples)
    estimate = float(statistic(*data, axis=-1) if vectorized else statistic(*data))
    ci = stats.bootstrap(data, statistic, n_resamples=num_resamples, vectorized=vectorized, confidence_level=confidence,
                         method="percentile", rng=rng).confidence_interval  # fmt: skip
    return _around(estimate, ci.low, ci.high, confidence, method, num_resamples)
