"""The documented valid range of every public parameter of a plan, a release and a ledger (one
:class:`ParameterRange` each), and the shared argument checks: a value outside is refused with one ``ValueError``
naming the argument, its value and the range. Each range and why it ends there: docs/guide/planning.md (§"Valid
ranges and exit codes").
"""

from __future__ import annotations

import dataclasses
import numbers

from accounting._validation import check_count, check_delta, check_nonnegative, check_order, check_positive

__all__ = [
    # the checks every record's constructor and every boundary uses (one line naming the argument and its value)
    "check_count",
    "check_delta",
    "check_nonnegative",
    "check_order",
    "check_positive",
    "ParameterRange",
    "EPSILON_RANGE",
    "DELTA_RANGE",
    "CLIP_NORM_RANGE",
    "TEMPERATURE_RANGE",
    "COUNT_RANGE",
    "RHO_RANGE",
    "MAX_COUNT",
    "MAX_TABLE_VALUES",
    "RANGES",
    "check_parameter_ranges",
]

#: The largest T, B, texts per batch and number of batches accepted anywhere.
MAX_COUNT = 10**9

#: The most values in each list of a planning table (ε's and B's): one accountant run per ε.
MAX_TABLE_VALUES = 100


@dataclasses.dataclass(frozen=True)
class ParameterRange:
    """The interval ``[low, high]`` (``[low, high)`` with ``high_open``), integers only when ``integer``."""

    low: float
    high: float
    integer: bool = False
    high_open: bool = False

    def __post_init__(self) -> None:
        if not self.low < self.high:
            raise ValueError(f"invalid range [{self.low!r}, {self.high!r}]")

    def describe(self) -> str:
        """The range as the error messages and docs/guide/planning.md write it."""
        if self.integer:
            return f"an integer from {int(self.low)} to {int(self.high)}"
        return f"in [{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def check(self, name: str, value):
        """``value`` as a float (an int for integer ranges); ``ValueError`` naming ``name`` otherwise."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if self.integer else numbers.Real):
            raise ValueError(f"{name} must be {self.describe()}; got {value!r}")
        x = int(value) if self.integer else float(value)
        inside = self.low <= x < self.high if self.high_open else self.low <= x <= self.high
        if not inside:  # NaN fails every comparison and lands here too
            raise ValueError(f"{name} must be {self.describe()}; got {value!r}")
        return x


EPSILON_RANGE = ParameterRange(1e-6, 1e4)
DELTA_RANGE = ParameterRange(1e-300, 1.0, high_open=True)
CLIP_NORM_RANGE = ParameterRange(1e-6, 1e6)
TEMPERATURE_RANGE = ParameterRange(1e-4, 1e4)
COUNT_RANGE = ParameterRange(1, MAX_COUNT, integer=True)
#: ρ of a release accounted in zCDP directly (:class:`accounting.ZcdpEvent`): up to the largest ρ the ranges
#: above can produce (about 2e38), and no smaller than a double's underflow keeps meaningful.
RHO_RANGE = ParameterRange(1e-300, 1e40)

#: Every named parameter and its range (docs/guide/planning.md's table is checked against the same values).
RANGES: dict[str, ParameterRange] = {
    "epsilon": EPSILON_RANGE,
    "delta": DELTA_RANGE,
    "clip_norm": CLIP_NORM_RANGE,
    "temperature": TEMPERATURE_RANGE,
    "max_new_tokens": COUNT_RANGE,
    "batch_size": COUNT_RANGE,
    "texts_per_batch": COUNT_RANGE,
    "unit_contributions": COUNT_RANGE,
    "num_batches": COUNT_RANGE,
    "rho": RHO_RANGE,
}


def check_parameter_ranges(**values) -> dict:
    """Check any of ``epsilon, delta, clip_norm, temperature, max_new_tokens, batch_size,
    texts_per_batch, num_batches`` against its documented range (``None`` values are skipped).

    Returns the validated values (floats, or ints for the counts); raises ``ValueError`` with one line
    naming the first bad argument, its value and its range. It does no accounting, so callers (the
    ``generate`` command, before loading a model) can run it first and cheaply.
    """
    out = {}
    for name, value in values.items():
        if name not in RANGES:
            raise TypeError(f"check_parameter_ranges() got an unexpected parameter {name!r}")
        if value is not None:
            out[name] = RANGES[name].check(name, value)
    return out
