"""Boundary checks shared by the accounting package.

Every public function validates its arguments here, so a bad value is rejected with a message that
names the argument and its value, before any computation starts.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "check_positive",
    "check_nonnegative",
    "check_delta",
    "check_count",
    "check_order",
]


def _as_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number; got {value!r}")
    x = float(value)
    if math.isnan(x):
        raise ValueError(f"{name} must not be NaN; got {value!r}")
    return x


def check_positive(name: str, value, *, allow_inf: bool = False) -> float:
    """A finite (or, with ``allow_inf``, infinite) number > 0."""
    x = _as_float(name, value)
    if math.isinf(x) and not (allow_inf and x > 0):
        raise ValueError(f"{name} must be finite and > 0; got {value!r}")
    if x <= 0:
        raise ValueError(f"{name} must be > 0; got {value!r}")
    return x


def check_nonnegative(name: str, value, *, allow_inf: bool = False) -> float:
    """A finite (or, with ``allow_inf``, +inf) number >= 0."""
    x = _as_float(name, value)
    if math.isinf(x) and not (allow_inf and x > 0):
        raise ValueError(f"{name} must be finite and >= 0; got {value!r}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0; got {value!r}")
    return x


def check_delta(name: str, value) -> float:
    """A probability in the open interval (0, 1)."""
    x = _as_float(name, value)
    if not 0.0 < x < 1.0:
        raise ValueError(f"{name} must be in (0, 1); got {value!r}")
    return x


def check_count(name: str, value, *, minimum: int = 1, allow_none: bool = False) -> int | None:
    """An integer >= ``minimum`` (bool and floats such as 3.0 are rejected), or ``None`` with ``allow_none``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{' or None' if allow_none else ''}; got {value!r}")
    return int(value)


def check_order(name: str, value, *, allow_inf: bool = False) -> float:
    """A Rényi order α: a finite (or, with ``allow_inf``, +inf) number > 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (value > 1 and (allow_inf or math.isfinite(value))):
        raise ValueError(f"{name} must be a {'' if allow_inf else 'finite '}number > 1; got {value!r}")
    return float(value)
