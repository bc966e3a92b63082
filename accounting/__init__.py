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

import importlib

#: the public names, by the module that defines them (imported here, so ``from accounting import X`` works)
_EXPORTS = {
    "accountants": ("ACCOUNTANTS", "DEFAULT_ACCOUNTANT", "Accountant", "as_accountant", "bounded_range_epsilon",
                    "composed_delta", "composed_epsilon", "max_epsilon0", "pure_composed_delta",
                    "pure_composed_epsilon"),
    "augpe": ("AugPEEvent", "AugPESensitivity", "augpe_l2_sensitivity", "plan_augpe_noise_std"),
    "claims": ("PrivacyClaim", "StepClaim"),
    "bounded_range": ("DeltaBracket", "br_adaptive_delta"),
    "conversions": ("ConversionMethod", "br_to_zcdp", "br_to_zcdp_total", "epsilon_to_gdp", "epsilon_to_zcdp",
                    "gdp_to_delta", "gdp_to_epsilon", "rdp_to_delta", "rdp_to_epsilon", "zcdp_to_delta",
                    "zcdp_to_epsilon"),
    "events": ("GenerationEvent", "ZcdpEvent"),
    "limits": ("RANGES", "check_parameter_ranges"),
    "ledger": ("BudgetExceededError", "BudgetLedger", "ChargeOutcome", "LedgerError", "LedgerStatus", "Release"),
    "planner": ("Plan", "PlanningRow", "epsilon_for_clip_norm", "plan_clip_norm", "plan_max_new_tokens",
                "plan_min_batch_size", "planning_table"),
    "sensitivity": ("Adjacency", "Clipping", "clip_norm_for_sensitivity", "linf_sensitivity", "sensitivity_factor"),
}
for _module, _names in _EXPORTS.items():
    globals().update({name: getattr(importlib.import_module(f"accounting.{_module}"), name) for name in _names})

__all__ = [name for names in _EXPORTS.values() for name in names]
