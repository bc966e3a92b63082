"""Public names of :mod:`invink_audit.mechanisms`: ``MechanismGuarantee`` (formerly ``Guarantee``, which clashed
with the run's :class:`invink_audit.Guarantee`) and its deprecated alias."""

from __future__ import annotations

import importlib

import pytest

import invink_audit
import invink_audit.mechanisms as mechanisms
from invink_audit.mechanisms.base import MechanismGuarantee


@pytest.mark.parametrize("module", ["invink_audit.mechanisms", "invink_audit.mechanisms.base"])
def test_old_guarantee_name_is_a_deprecated_alias(module):
    mod = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.Guarantee is deprecated; use {module}\.MechanismGuarantee"):
        old = mod.Guarantee
    assert old is MechanismGuarantee
    with pytest.warns(DeprecationWarning):
        exec(f"from {module} import Guarantee as imported", namespace := {})  # noqa: S102
    assert namespace["imported"] is MechanismGuarantee


def test_mechanism_guarantee_is_not_the_run_guarantee():
    assert mechanisms.MechanismGuarantee is MechanismGuarantee
    assert invink_audit.Guarantee is not MechanismGuarantee
    assert "Guarantee" not in mechanisms.__all__ and "MechanismGuarantee" in mechanisms.__all__


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        mechanisms.NoSuchName  # noqa: B018
