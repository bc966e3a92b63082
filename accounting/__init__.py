r"""Privacy accounting for InvisibleInk decoding (torch-free: numpy, scipy, dp-accounting, numba).

Layers: :mod:`~accounting.sensitivity` (ℓ∞ sensitivity of the aggregated logits),
:mod:`~accounting.conversions` (ρ-zCDP, μ-GDP ↔ (ε, δ)), :mod:`~accounting.bounded_range` (optimal adaptive
composition of ε0-bounded-range mechanisms), :mod:`~accounting.accountants` (named accountants),
:mod:`~accounting.planner` (every inverse of C, T, B, τ ↔ ε, δ), :mod:`~accounting.ledger`
(a persisted privacy odometer) and :mod:`~accounting.limits` (the documented valid range of every
parameter, :func:`check_parameter_ranges`). :mod:`~accounting.augpe` accounts the AugPE baseline (T Gaussian
nearest-neighbour histograms). :mod:`~accounting.claims`: a generator's privacy claim in the form it was made
(:class:`PrivacyClaim`, :class:`StepClaim`) and every figure derived from it.
"""

from accounting.accountants import (
    ACCOUNTANTS,
    DEFAULT_ACCOUNTANT,
    Accountant,
    as_accountant,
    bounded_range_epsilon,
    composed_delta,
    composed_epsilon,
    max_epsilon0,
    pure_composed_delta,
    pure_composed_epsilon,
)
from accounting.augpe import (
    AugPEEvent,
    AugPESensitivity,
    augpe_l2_sensitivity,
    plan_augpe_noise_std,
)
from accounting.claims import PrivacyClaim, StepClaim
from accounting.bounded_range import DeltaBracket, br_adaptive_delta
from accounting.conversions import (
    ConversionMethod,
    br_to_zcdp,
    br_to_zcdp_total,
    epsilon_to_gdp,
    epsilon_to_zcdp,
    gdp_to_delta,
    gdp_to_epsilon,
    rdp_to_delta,
    rdp_to_epsilon,
    zcdp_to_delta,
    zcdp_to_epsilon,
)
from accounting.events import GenerationEvent, ZcdpEvent
from accounting.limits import RANGES, check_parameter_ranges
from accounting.ledger import BudgetExceededError, BudgetLedger, ChargeOutcome, LedgerError, LedgerStatus, Release
from accounting.planner import (
    Plan,
    PlanningRow,
    epsilon_for_clip_norm,
    plan_clip_norm,
    plan_max_new_tokens,
    plan_min_batch_size,
    planning_table,
)
from accounting.sensitivity import (
    Adjacency,
    Clipping,
    clip_norm_for_sensitivity,
    linf_sensitivity,
    sensitivity_factor,
)

__all__ = [
    "GenerationEvent",
    "ZcdpEvent",
    "br_to_zcdp",
    "br_to_zcdp_total",
    "ACCOUNTANTS",
    "DEFAULT_ACCOUNTANT",
    "Accountant",
    "as_accountant",
    "augpe_l2_sensitivity",
    "Adjacency",
    "AugPEEvent",
    "AugPESensitivity",
    "BudgetExceededError",
    "BudgetLedger",
    "ChargeOutcome",
    "Clipping",
    "ConversionMethod",
    "DeltaBracket",
    "LedgerError",
    "LedgerStatus",
    "Plan",
    "PlanningRow",
    "RANGES",
    "Release",
    "bounded_range_epsilon",
    "check_parameter_ranges",
    "br_adaptive_delta",
    "clip_norm_for_sensitivity",
    "composed_delta",
    "composed_epsilon",
    "epsilon_for_clip_norm",
    "epsilon_to_gdp",
    "epsilon_to_zcdp",
    "gdp_to_delta",
    "gdp_to_epsilon",
    "linf_sensitivity",
    "max_epsilon0",
    "plan_clip_norm",
    "plan_max_new_tokens",
    "plan_min_batch_size",
    "plan_augpe_noise_std",
    "planning_table",
    "PrivacyClaim",
    "StepClaim",
    "pure_composed_delta",
    "pure_composed_epsilon",
    "rdp_to_delta",
    "rdp_to_epsilon",
    "sensitivity_factor",
    "zcdp_to_delta",
    "zcdp_to_epsilon",
]
