"""ℓ∞ sensitivity of the aggregated next-token logits.

The one place where the factor between clip norm and sensitivity lives: the generator, the accountants
and the auditor all take it from here, never from a literal. :func:`linf_sensitivity` and
:func:`sensitivity_factor` for :class:`Clipping` (difference clipping, paper Eq. (4), eq:aggregated-logits;
naive, Amin et al. 2024) × :class:`Adjacency` (replace-by-null, paper §3; zero-out): paper Property 1 (§4),
Property 9 (App. B.3.1), Property 12 (App. C.1); numbering in docs/paper_map.md.

Design: docs/accounting_notes.md §1 (the table, and recentering under zero-out).
"""

from __future__ import annotations

import enum

from accounting._validation import check_count, check_positive

__all__ = [
    "Adjacency",
    "Clipping",
    "linf_sensitivity",
    "sensitivity_factor",
    "clip_norm_for_sensitivity",
    "coerce_enum",
]


class Adjacency(enum.StrEnum):
    """Neighbouring relation between reference datasets (a string enum: a member equals its name). ``add-remove``
    (one reference left out of the list) is a claim's relation (:class:`accounting.PrivacyClaim`); the aggregate's
    ℓ∞ sensitivity below is stated for replace-by-null and zero-out only (B changes under add-remove)."""

    REPLACE_BY_NULL = "replace-by-null"
    ZERO_OUT = "zero-out"
    ADD_REMOVE = "add-remove"


class Clipping(enum.Enum):
    """How the per-reference logits are clipped before averaging."""

    DIFFERENCE = "difference"
    NAIVE = "naive"


_FACTOR: dict[tuple[Clipping, Adjacency], int] = {
    # paper Property 1: DClip moves by at most C/B when a row becomes the public row.
    (Clipping.DIFFERENCE, Adjacency.REPLACE_BY_NULL): 1,
    # paper Property 12 (prop:our-sens-zeroout): a zero row is clipped to clip_C(-phi_pub), anywhere in [-C, C].
    (Clipping.DIFFERENCE, Adjacency.ZERO_OUT): 2,
    # paper Property 9 (prop:amin-sens): clip_C(phi_i) and clip_C(phi_pub) can be at opposite ends of [-C, C].
    (Clipping.NAIVE, Adjacency.REPLACE_BY_NULL): 2,
    # Amin et al. 2024: clip_C(0) = 0, so the row moves by at most C.
    (Clipping.NAIVE, Adjacency.ZERO_OUT): 1,
}


def coerce_enum(value, enum_type, name: str | None = None):
    """``value`` as a member of ``enum_type`` (a member or its value); ``ValueError`` naming the argument (``name``,
    default the type's name in lower case) and the choices."""
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except ValueError as err:
        choices = ", ".join(repr(m.value) for m in enum_type)
        raise ValueError(f"{name or enum_type.__name__.lower()} must be one of {choices}; got {value!r}") from err


def sensitivity_factor(
    clipping: Clipping | str = Clipping.DIFFERENCE,
    adjacency: Adjacency | str = Adjacency.REPLACE_BY_NULL,
) -> int:
    """The integer ``f`` with ℓ∞ sensitivity ``f * C / B`` (table in the module docstring)."""
    key = (coerce_enum(clipping, Clipping), coerce_enum(adjacency, Adjacency))
    if key not in _FACTOR:
        raise ValueError(f"the aggregate's sensitivity is stated under replace-by-null and zero-out; got {key[1].value!r}")
    return _FACTOR[key]


def linf_sensitivity(
    clip_norm: float,
    batch_size: int,
    clipping: Clipping | str = Clipping.DIFFERENCE,
    adjacency: Adjacency | str = Adjacency.REPLACE_BY_NULL,
) -> float:
    r"""ℓ∞ sensitivity :math:`\Delta` of the aggregated logits (paper Properties 1, 9, 12).

    ``batch_size`` is the number of private references ``B`` per generated text (not ``B + 1``).
    """
    return sensitivity_factor(clipping, adjacency) * check_positive("clip_norm", clip_norm) / check_count("batch_size", batch_size)


def clip_norm_for_sensitivity(
    sensitivity: float,
    batch_size: int,
    clipping: Clipping | str = Clipping.DIFFERENCE,
    adjacency: Adjacency | str = Adjacency.REPLACE_BY_NULL,
) -> float:
    """Inverse of :func:`linf_sensitivity`: the clip norm ``C`` whose sensitivity is ``sensitivity``."""
    return check_positive("sensitivity", sensitivity) * check_count("batch_size", batch_size) / sensitivity_factor(clipping, adjacency)
