"""Property-based test kit for private-decoding mechanisms (hypothesis strategies + checkers).

Reusable from another project's test suite::

    from invink_audit.testing import check_linf_sensitivity, logit_batches

Importing this package imports torch and hypothesis (it is a test-time dependency, never imported
by the library itself).
"""

from invink_audit.testing.checkers import (
    ATTAINMENT_TOLERANCE,
    DEFAULT_ALPHAS,
    DEFAULT_SIGNIFICANCE,
    MIN_EXPECTED_COUNT,
    PRIVACY_ATOL,
    SENSITIVITY_ATOL,
    SENSITIVITY_RTOL,
    GoodnessOfFit,
    SensitivityWitness,
    TokenPrivacyReport,
    assert_linf_sensitivity,
    assert_linf_sensitivity_attained,
    assert_sampler_matches,
    assert_token_privacy,
    assert_topk_superset,
    check_linf_sensitivity,
    check_token_privacy,
    check_topk_superset,
    goodness_of_fit,
    log_ratio_span,
    max_linf_change,
    renyi_divergence,
)
from invink_audit.testing.contract import MechanismContract
from invink_audit.testing.reference import (
    reference_aggregate,
    reference_private_topk_sets,
    reference_token_log_probs,
    reference_topk_plus_set,
)
from invink_audit.testing.strategies import (
    DEFAULT_LOGIT_BOUND,
    LogitBatch,
    NeighbourPair,
    PrivacyBudget,
    clip_norms,
    logit_batches,
    logits,
    mechanism_configs,
    neighbour_pairs,
    neighbour_private_logits,
    privacy_budgets,
    temperatures,
    top_ks,
    topk_cases,
)

__all__ = [
    # the contract every mechanism passes by subclassing
    "MechanismContract",
    # strategies
    "DEFAULT_LOGIT_BOUND",
    "LogitBatch",
    "NeighbourPair",
    "PrivacyBudget",
    "clip_norms",
    "logit_batches",
    "logits",
    "mechanism_configs",
    "neighbour_pairs",
    "neighbour_private_logits",
    "privacy_budgets",
    "temperatures",
    "top_ks",
    "topk_cases",
    # checkers
    "ATTAINMENT_TOLERANCE",
    "DEFAULT_ALPHAS",
    "DEFAULT_SIGNIFICANCE",
    "MIN_EXPECTED_COUNT",
    "PRIVACY_ATOL",
    "SENSITIVITY_ATOL",
    "SENSITIVITY_RTOL",
    "GoodnessOfFit",
    "SensitivityWitness",
    "TokenPrivacyReport",
    "assert_linf_sensitivity",
    "assert_linf_sensitivity_attained",
    "assert_sampler_matches",
    "assert_token_privacy",
    "assert_topk_superset",
    "check_linf_sensitivity",
    "check_token_privacy",
    "check_topk_superset",
    "goodness_of_fit",
    "log_ratio_span",
    "max_linf_change",
    "renyi_divergence",
    # exact oracle
    "reference_aggregate",
    "reference_private_topk_sets",
    "reference_token_log_probs",
    "reference_topk_plus_set",
]
