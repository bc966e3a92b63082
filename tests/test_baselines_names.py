"""Public names of :mod:`invink_audit.mechanisms`: ``MechanismGuarantee`` (once ``Guarantee``, which clashed with
the run's :class:`invink_audit.Guarantee`)."""

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


def test_mechanism_guarantee_is_not_the_run_guarantee():
    assert mechanisms.MechanismGuarantee is MechanismGuarantee
    assert invink_audit.Guarantee is not MechanismGuarantee
    assert "Guarantee" not in mechanisms.__all__ and "MechanismGuarantee" in mechanisms.__all__


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        mechanisms.NoSuchName  # noqa: B018
