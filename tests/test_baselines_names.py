"""Public names of :mod:`invink_audit.mechanisms`: ``MechanismGuarantee`` (once ``Guarantee``), which is also every
release's guarantee (the run's ``invink_audit.Guarantee`` and ``MechanismReleaseGuarantee`` are gone)."""

from __future__ import annotations

import importlib

import pytest

import invink_audit
import invink_audit.mechanisms as mechanisms
from invink_audit.mechanisms.base import MechanismGuarantee


@pytest.mark.parametrize("module", ["invink_audit.mechanisms", "invink_audit.mechanisms.base"])
def test_the_old_guarantee_name_is_gone(module):
    # a 0.x package with no outside users keeps no compatibility aliases
    with pytest.raises(AttributeError):
        importlib.import_module(module).Guarantee  # noqa: B018


def test_mechanism_guarantee_is_the_run_guarantee():
    import invink_audit.generation as generation

    assert mechanisms.MechanismGuarantee is MechanismGuarantee
    for module, name in ((invink_audit, "Guarantee"), (generation, "Guarantee"), (generation, "MechanismReleaseGuarantee")):
        with pytest.raises(AttributeError):
            getattr(module, name)
    assert generation.GenerationResult.__annotations__["guarantee"] == "MechanismGuarantee"
    assert "Guarantee" not in mechanisms.__all__ and "MechanismGuarantee" in mechanisms.__all__


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        mechanisms.NoSuchName  # noqa: B018
