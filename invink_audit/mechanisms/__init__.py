"""Private decoding mechanisms behind one interface (:class:`Mechanism`): InvisibleInk and the paper's baselines.

* :class:`Mechanism`, :class:`MechanismStep`, :class:`MechanismGuarantee` — the interface the engine and the auditor use (:mod:`invink_audit.mechanisms.base`);
  ``examples/custom_mechanism.py`` plugs in one's own;
* :class:`InvisibleInk` — paper Algorithm 1 (the engine runs its own fast path for it);
* :class:`AminMechanism` / :class:`AminConfig` — Amin et al. 2024 (recentred naive clipping,
  sparse-vector public tokens, accounting by private tokens; both sensitivities selectable);
* :class:`AdaPMixEDMechanism` / :class:`AdaPMixEDConfig` — AdaPMixED (Flemings et al. 2024) adapted
  to generation, with its **data-dependent** guarantee.
"""

from invink_audit.mechanisms.adapmixed import AdaPMixEDConfig, AdaPMixEDMechanism
from invink_audit.mechanisms.amin import (
    AminAccounting,
    AminConfig,
    AminInfeasibleError,
    AminMechanism,
    AminSensitivity,
    plan_amin,
)
from invink_audit.mechanisms.base import GuaranteeKind, Mechanism, MechanismGuarantee, MechanismStep
from invink_audit.mechanisms.invisibleink import InvisibleInk, as_mechanism

__all__ = [
    "AdaPMixEDConfig",
    "AdaPMixEDMechanism",
    "AminAccounting",
    "AminConfig",
    "AminInfeasibleError",
    "AminMechanism",
    "AminSensitivity",
    "GuaranteeKind",
    "InvisibleInk",
    "Mechanism",
    "MechanismGuarantee",
    "MechanismStep",
    "as_mechanism",
    "plan_amin",
]

