"""Private decoding mechanisms behind one interface (:class:`Mechanism`): InvisibleInk and the paper's baselines.

* :class:`Mechanism`, :class:`MechanismStep`, :class:`MechanismGuarantee` — the interface the engine and the auditor use (:mod:`invink_audit.mechanisms.base`);
  ``examples/custom_mechanism.py`` plugs in one's own;
* :class:`InvisibleInk` — paper Algorithm 1 (the engine runs its own fast path for it);
* :class:`AminMechanism` / :class:`AminConfig` — Amin et al. 2024 (recentred naive clipping,
  sparse-vector public tokens, accounting by private tokens; both sensitivities selectable);
* :class:`AdaPMixEDMechanism` / :class:`AdaPMixEDConfig` — AdaPMixED (Flemings et al. 2024) adapted
  to generation, with its **data-dependent** guarantee.
"""

import dataclasses
import enum
import typing

from invink_audit.mechanism import MechanismConfig
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
    "mechanism_from_json",
    "mechanism_to_json",
    "plan_amin",
]

#: the mechanisms a release file can name and be audited from: name -> (mechanism class, its config class)
_RECORDED = {
    AminMechanism.name: (AminMechanism, AminConfig),
    AdaPMixEDMechanism.name: (AdaPMixEDMechanism, AdaPMixEDConfig),
    InvisibleInk.name: (InvisibleInk, MechanismConfig),
}


def mechanism_to_json(mechanism: Mechanism) -> dict:
    """``{"name", "config"}``: what a release's records say of its mechanism (``config``: the mechanism's
    config dataclass as JSON, ``None`` for a mechanism without one; InvisibleInk adds its ``accountant``).
    Public parameters only."""
    config = getattr(mechanism, "config", None)
    data = None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        values = {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}
        data = {name: value.value if isinstance(value, enum.Enum) else value for name, value in values.items()}
    out = {"name": mechanism.name, "config": data}
    if isinstance(mechanism, InvisibleInk):
        out["accountant"] = mechanism.accountant.value
    return out


def mechanism_from_json(data: dict) -> Mechanism:
    """The mechanism :func:`mechanism_to_json` described (InvisibleInk, Amin et al., AdaPMixED); any other is
    refused: its release can be audited from the result ``generate`` returned, not from its file."""
    name = data.get("name") if isinstance(data, dict) else None
    if name not in _RECORDED or not isinstance(data.get("config"), dict):
        raise ValueError(f"mechanism {name!r} cannot be rebuilt from its record (only {sorted(_RECORDED)}): audit the "
                         "result generate returned")
    mechanism, config = _RECORDED[name]
    hints = typing.get_type_hints(config)
    fields = {}
    for key, value in data["config"].items():  # enum fields (clipping, sensitivity) from their values
        kind = hints.get(key)
        fields[key] = kind(value) if isinstance(kind, type) and issubclass(kind, enum.Enum) else value
    if mechanism is InvisibleInk:
        return InvisibleInk(config(**fields), accountant=data.get("accountant", "br-adaptive"))
    return mechanism(config(**fields))
