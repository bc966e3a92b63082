"""Hyperparameter planning for InvisibleInk: every inverse of (C, T, B, τ) ↔ (ε, δ).

The paper's recipe (§4, the paragraph after Theorem 2; also §5.3 "Practical Recommendations"),
C = Bτ√(2ρ_seq/T), generalised to every accountant of :mod:`accounting.accountants`. ``B`` is the number of private
references (``B + 1`` forward rows per token). Every function returns the conservative side: never more than the
budget. ``unit_contributions`` = k (docs/guide/privacy-unit.md) makes every inverse answer for k·T composed steps;
``T`` stays the token budget of one text. Design: docs/accounting_notes.md §5; usage: docs/guide/planning.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from accounting._validation import check_nonnegative
from accounting.limits import (
    RANGES,
    CLIP_NORM_RANGE,
    COUNT_RANGE,
    EPSILON_RANGE,
    MAX_COUNT,
    MAX_TABLE_VALUES,
    check_parameter_ranges,
)
from accounting.accountants import (
    DEFAULT_ACCOUNTANT,
    Accountant,
    as_accountant,
    bounded_range_epsilon,
    fits_budget,
    max_epsilon0,
)
from accounting.conversions import br_to_zcdp, epsilon_to_zcdp
from accounting.events import GenerationEvent, forwarded_property
from accounting.sensitivity import (
    Adjacency,
    Clipping,
    coerce_enum,
    clip_norm_for_sensitivity,
    linf_sensitivity,
)

__all__ = [
    "Plan",
    "PlanningRow",
    "plan_clip_norm",
    "epsilon_for_clip_norm",
    "plan_max_new_tokens",
    "plan_min_batch_size",
    "planning_table",
]


@dataclasses.dataclass(frozen=True)
class Plan:
    r"""An a-priori privacy guarantee for one release: ``event`` (C, B, τ, T, the clipping and adjacency) is
    (``epsilon``, ``delta``)-DP as ``accountant`` certifies.

    The event is the record; every other quantity is derived from it: ``rho_token`` = ε0²/8 and
    ``rho_sequence`` = T·ρ_tok are the zCDP guarantees (paper Theorem 2, thm:accounting). A plan whose fields
    disagree cannot be built: there is one copy of C, B, τ and T, and the constructor checks ε and δ.
    """

    event: GenerationEvent
    epsilon: float
    delta: float
    accountant: Accountant

    def __post_init__(self) -> None:
        if not isinstance(self.event, GenerationEvent):
            raise ValueError(f"event must be an accounting.GenerationEvent; got {type(self.event).__name__}")
        object.__setattr__(self, "epsilon", check_nonnegative("epsilon", self.epsilon, allow_inf=True))
        object.__setattr__(self, "delta", RANGES["delta"].check("delta", self.delta))
        object.__setattr__(self, "accountant", as_accountant(self.accountant))

    clip_norm = forwarded_property("event", "clip_norm", "Clip norm C.")
    batch_size = forwarded_property("event", "batch_size", "B private references per text.")
    temperature = forwarded_property("event", "temperature", "Temperature τ.")
    max_new_tokens = forwarded_property("event", "max_new_tokens", "Token budget T per text.")
    clipping = forwarded_property("event", "clipping", "The clipping rule (difference clipping by default).")
    adjacency = forwarded_property("event", "adjacency", "The neighbouring relation (replace-by-null by default).")
    sensitivity = forwarded_property("event", "sensitivity", "ℓ∞ sensitivity Δ of the aggregated logits.")
    epsilon0 = forwarded_property("event", "epsilon0", "Per-token bounded range ε0 = 2Δ/τ.")
    rho_token = forwarded_property("event", "rho_token", "Per-token zCDP ρ_tok = ε0²/8.")
    rho_sequence = forwarded_property("event", "rho_sequence", "zCDP of a text (per privacy unit: k texts): T·k·ρ_tok.")
    unit_contributions = forwarded_property("event", "unit_contributions", "Batches one privacy unit may touch, k.")

    @property
    def forward_rows_per_token(self) -> int:
        """Each token costs B + 1 forward rows (B private prompts, one public prompt)."""
        return self.batch_size + 1

    def summary(self) -> dict:
        """The six headline quantities (the CLI's JSON keys)."""
        return {
            "clip_norm": self.clip_norm,
            "rho_token": self.rho_token,
            "rho_sequence": self.rho_sequence,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
        }


def _make_plan(clip_norm, epsilon, delta, acc, T, B, tau, clipping, adjacency, k: int = 1) -> Plan:
    return Plan(GenerationEvent(clip_norm, B, tau, T, 1, clipping, adjacency, k), epsilon, delta, acc)


#: Relative safety margin on planned clip norms: any recomputation of the spend from (C, B, τ, T), in
#: whatever order of floating-point operations, stays within the budget.
_CLIP_NORM_MARGIN = 1e-10


def _clip_norm_from_epsilon0(e0: float, B: int, tau: float, clipping, adjacency) -> float:
    return clip_norm_for_sensitivity(e0 * tau / 2.0, B, clipping, adjacency) * (1.0 - _CLIP_NORM_MARGIN)


def _validate(epsilon=None, delta=None, T=None, B=None, tau=None, C=None, k=1):
    """Range checks of :mod:`accounting.limits` (one line naming the argument, its value and range); ``steps``:
    the token steps charged, T·k (``k``: the batches one privacy unit may touch)."""
    v = check_parameter_ranges(
        epsilon=epsilon, delta=delta, max_new_tokens=T, batch_size=B, temperature=tau, clip_norm=C
    )
    v["k"] = RANGES["unit_contributions"].check("unit_contributions", k)
    names = {"max_new_tokens": "T", "batch_size": "B", "temperature": "tau", "clip_norm": "C"}
    out = {names.get(key, key): x for key, x in v.items()}
    if T is not None:
        out["steps"] = out["T"] * out["k"]
    return out


def _check_planned_clip_norm(C: float, what: str) -> float:
    """A planned clip norm must itself be a valid input (so the plan can be generated and charged)."""
    low, high = CLIP_NORM_RANGE.low, CLIP_NORM_RANGE.high
    if not low <= C <= high:
        raise ValueError(
            f"the planned clip norm C = {C:.6g} for {what} is outside the supported range "
            f"[{low:g}, {high:g}]; change epsilon, max_new_tokens, batch_size or temperature"
        )
    return C


def _largest_clip_norm(e0: float, B: int, tau: float, clipping, adjacency) -> float:
    """The clip norm for per-token range ``e0``, stepped down until its recomputed ε0 is <= ``e0``."""
    C = _clip_norm_from_epsilon0(e0, B, tau, clipping, adjacency)
    # the round trip e0 -> C -> e0 may gain an ulp or two; a handful of steps always suffices
    for _ in range(64):
        if bounded_range_epsilon(linf_sensitivity(C, B, clipping, adjacency), tau) <= e0:
            return C
        C = math.nextafter(C, 0.0)
    raise RuntimeError(f"internal error: no clip norm reproduces epsilon0={e0!r}")  # pragma: no cover


def plan_clip_norm(
    *,
    epsilon: float,
    delta: float,
    max_new_tokens: int,
    batch_size: int,
    temperature: float,
    accountant: Accountant | str = DEFAULT_ACCOUNTANT,
    clipping: Clipping | str = Clipping.DIFFERENCE,
    adjacency: Adjacency | str = Adjacency.REPLACE_BY_NULL,
    unit_contributions: int = 1,
) -> Plan:
    """The largest clip norm C for which T tokens with B references at temperature τ are (ε, δ)-DP (per privacy
    unit touching ``unit_contributions`` batches: k·T steps, module docstring).

    Errs low: the returned C is verified against the accountant before it is returned.
    """
    v = _validate(epsilon, delta, max_new_tokens, batch_size, temperature, k=unit_contributions)
    acc = as_accountant(accountant)
    clipping, adjacency = coerce_enum(clipping, Clipping), coerce_enum(adjacency, Adjacency)
    e0 = max_epsilon0(v["epsilon"], v["delta"], v["steps"], acc)
    C = _largest_clip_norm(e0, v["B"], v["tau"], clipping, adjacency)
    _check_planned_clip_norm(C, f"epsilon={v['epsilon']:g}")
    return _make_plan(C, v["epsilon"], v["delta"], acc, v["T"], v["B"], v["tau"], clipping, adjacency, v["k"])


def epsilon_for_clip_norm(
    *,
    clip_norm: float,
    max_new_tokens: int,
    batch_size: int,
    temperature: float,
    delta: float,
    accountant: Accountant | str = DEFAULT_ACCOUNTANT,
    clipping: Clipping | str = Clipping.DIFFERENCE,
    adjacency: Adjacency | str = Adjacency.REPLACE_BY_NULL,
    unit_contributions: int = 1,
) -> Plan:
    """The certified ε at ``delta`` of a release with clip norm C (errs upwards), per privacy unit touching
    ``unit_contributions`` batches."""
    v = _validate(None, delta, max_new_tokens, batch_size, temperature, clip_norm, k=unit_contributions)
    acc = as_accountant(accountant)
    clipping, adjacency = coerce_enum(clipping, Clipping), coerce_enum(adjacency, Adjacency)
    event = GenerationEvent(v["C"], v["B"], v["tau"], v["T"], 1, clipping, adjacency, v["k"])
    return Plan(event, event.epsilon(v["delta"], acc), v["delta"], acc)


def plan_max_new_tokens(
    *,
    epsilon: float,
    delta: float,
    clip_norm: float,
    batch_size: int,
    temperature: float,
    accountant: Accountant | str = DEFAULT_ACCOUNTANT,
    clipping: Clipping | str = Clipping.DIFFERENCE,
    adjacency: Adjacency | str = Adjacency.REPLACE_BY_NULL,
    unit_contributions: int = 1,
) -> Plan:
    """The largest token budget T for which the release is (ε, δ)-DP (per privacy unit touching
    ``unit_contributions`` = k batches: k·T steps fit; the cap is ⌊10^9 / k⌋).

    Raises ``ValueError`` when not even one token fits the budget. The answer is capped at
    :data:`accounting.limits.MAX_COUNT` (10^9 tokens, the largest valid T). For the zCDP accountants
    T = ⌊ρ_seq/ρ_tok⌋; for ``br-adaptive`` an exponential then binary search on T, starting from the
    CKS answer (always feasible), every candidate verified on the certified upper δ. Errs low: the
    returned T is one that was evaluated feasible.
    """
    v = _validate(epsilon, delta, None, batch_size, temperature, clip_norm, k=unit_contributions)
    acc = as_accountant(accountant)
    clipping, adjacency = coerce_enum(clipping, Clipping), coerce_enum(adjacency, Adjacency)
    e0 = bounded_range_epsilon(linf_sensitivity(v["C"], v["B"], clipping, adjacency), v["tau"])
    k, cap = v["k"], MAX_COUNT // v["k"]

    def fits(T: int) -> bool:
        return fits_budget(v["epsilon"], v["delta"], e0, T * k, acc)

    if not fits(1):
        raise ValueError(
            f"not even one token fits: a single token at clip_norm={clip_norm!r}, batch_size={batch_size!r}, "
            f"temperature={temperature!r} already exceeds (epsilon={epsilon!r}, delta={delta!r})"
        )
    rho_seq = epsilon_to_zcdp(v["epsilon"], v["delta"], acc.zcdp_conversion)
    # the zCDP answer as a first guess, clamped to [1, MAX_COUNT] (it can exceed 1e40 for tiny e0)
    guess = rho_seq / br_to_zcdp(e0) / k
    guess = cap if not guess < cap else max(1, int(math.floor(guess)))
    if fits(guess):
        lo = guess  # feasible; search upwards for the first infeasible T (or the cap)
        if lo == cap or fits(cap):
            lo, hi = cap, None
        else:
            hi = min(lo + 1, cap)
            while fits(hi):
                lo, hi = hi, min(max(hi + 1, int(hi * 1.2)), cap)
    else:
        lo, hi = 1, guess  # fits(1) holds, fits(guess) does not
    if hi is not None:
        while hi - lo > 1:  # bisection on the monotone predicate; lo stays feasible, hi infeasible
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return _make_plan(v["C"], v["epsilon"], v["delta"], acc, lo, v["B"], v["tau"], clipping, adjacency, k)


def plan_min_batch_size(
    *,
    epsilon: float,
    delta: float,
    max_new_tokens: int,
    temperature: float,
    clip_norm: float,
    accountant: Accountant | str = DEFAULT_ACCOUNTANT,
    clipping: Clipping | str = Clipping.DIFFERENCE,
    adjacency: Adjacency | str = Adjacency.REPLACE_BY_NULL,
    unit_contributions: int = 1,
) -> Plan:
    """The smallest B whose planned clip norm reaches ``clip_norm`` at (ε, δ, T, τ) (per privacy unit touching
    ``unit_contributions`` batches: k·T steps).

    The feasible ε0* does not depend on B, and C grows linearly in B (C = ε0* τ B / (2f)), so
    B = ⌈2 f C / (τ ε0*)⌉. The returned plan uses exactly the requested ``clip_norm`` (≤ the largest
    feasible one at that B), so it never overspends.
    """
    v = _validate(epsilon, delta, max_new_tokens, None, temperature, clip_norm, k=unit_contributions)
    acc = as_accountant(accountant)
    clipping, adjacency = coerce_enum(clipping, Clipping), coerce_enum(adjacency, Adjacency)
    e0 = max_epsilon0(v["epsilon"], v["delta"], v["steps"], acc)
    per_reference = _clip_norm_from_epsilon0(e0, 1, v["tau"], clipping, adjacency)
    estimate = v["C"] / per_reference
    if not estimate <= MAX_COUNT:
        raise ValueError(
            f"clip_norm={clip_norm!r} needs about {estimate:.3g} references per text at (epsilon={epsilon!r}, "
            f"delta={delta!r}, max_new_tokens={max_new_tokens!r}, temperature={temperature!r}), more than the "
            f"largest batch_size {MAX_COUNT}"
        )

    def reaches(B: int) -> bool:
        return _clip_norm_from_epsilon0(e0, B, v["tau"], clipping, adjacency) >= v["C"]

    B = max(1, math.ceil(estimate))
    # the estimate is within an ulp-sized error of the answer: a few steps either way settle it
    for _ in range(64):
        if B > 1 and reaches(B - 1):
            B -= 1
        elif not reaches(B):
            B += 1
        else:
            break
    # the requested clip norm at this B spends at most e0 per token; verify against the accountant
    for _ in range(64):
        if bounded_range_epsilon(linf_sensitivity(v["C"], B, clipping, adjacency), v["tau"]) <= e0:
            break
        B += 1
    else:  # pragma: no cover - the ratio is exact to a few ulps
        raise RuntimeError(f"internal error: no batch size found for clip_norm={clip_norm!r}")
    if B > MAX_COUNT:
        raise ValueError(f"clip_norm={clip_norm!r} needs batch_size={B}, more than the largest {MAX_COUNT}")
    return _make_plan(v["C"], v["epsilon"], v["delta"], acc, v["T"], B, v["tau"], clipping, adjacency, v["k"])


@dataclasses.dataclass(frozen=True)
class PlanningRow:
    """One row of :func:`planning_table`: the plan and its compute cost."""

    plan: Plan

    @property
    def forward_rows_per_token(self) -> int:
        return self.plan.forward_rows_per_token

    @property
    def forward_rows_per_text(self) -> int:
        """Worst case (all T tokens): T·(B + 1) forward rows."""
        return self.plan.max_new_tokens * self.forward_rows_per_token

    def as_dict(self) -> dict:
        return {
            "epsilon": self.plan.epsilon,
            "batch_size": self.plan.batch_size,
            "clip_norm": self.plan.clip_norm,
            "rho_sequence": self.plan.rho_sequence,
            "forward_rows_per_token": self.forward_rows_per_token,
            "forward_rows_per_text": self.forward_rows_per_text,
        }


def planning_table(
    *,
    epsilons: Iterable[float],
    batch_sizes: Iterable[int],
    delta: float,
    max_new_tokens: int,
    temperature: float,
    accountant: Accountant | str = DEFAULT_ACCOUNTANT,
    clipping: Clipping | str = Clipping.DIFFERENCE,
    adjacency: Adjacency | str = Adjacency.REPLACE_BY_NULL,
) -> list[PlanningRow]:
    """Clip norms over a grid of ε × B, with the compute each B costs (B + 1 rows per token).

    ε0* depends only on (ε, δ, T), so the accountant runs once per ε.
    """
    epsilons = [EPSILON_RANGE.check("epsilon", e) for e in epsilons]
    batch_sizes = [COUNT_RANGE.check("batch_size", b) for b in batch_sizes]
    if not epsilons or not batch_sizes:
        raise ValueError("epsilons and batch_sizes must be non-empty")
    for name, values in (("epsilons", epsilons), ("batch_sizes", batch_sizes)):
        if len(values) > MAX_TABLE_VALUES:
            raise ValueError(f"{name} must hold at most {MAX_TABLE_VALUES} values; got {len(values)}")
    v = _validate(None, delta, max_new_tokens, None, temperature)
    acc = as_accountant(accountant)
    clipping, adjacency = coerce_enum(clipping, Clipping), coerce_enum(adjacency, Adjacency)
    rows = []
    for eps in epsilons:
        e0 = max_epsilon0(eps, v["delta"], v["T"], acc)
        for B in batch_sizes:
            C = _largest_clip_norm(e0, B, v["tau"], clipping, adjacency)
            _check_planned_clip_norm(C, f"epsilon={eps:g}, B={B}")
            rows.append(PlanningRow(_make_plan(C, eps, v["delta"], acc, v["T"], B, v["tau"], clipping, adjacency)))
    return rows
