"""Audit specs are parsed into typed sections when they are loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from invink_audit.audit import spec
from invink_audit.audit.selftest import SelfTestSettings
from invink_audit.audit.whitebox import WhiteBoxConfig

AUDITS = Path(__file__).resolve().parents[1] / "audits"


@pytest.mark.parametrize("path", sorted(AUDITS.glob("*.toml")), ids=lambda p: p.name)
def test_committed_specs_load_into_typed_sections(path):
    s = spec.load_spec(path)
    if s.kind == "selftest":
        assert isinstance(s.selftest, SelfTestSettings) and s.mechanism is None
        return
    if s.kind == "augpe-histogram":  # the AugPE histogram audit reads no model, prompt or data
        assert isinstance(s.augpe, spec.AugPEHistogramSpec) and s.mechanism is None and s.model is None
        return
    assert isinstance(s.model, spec.ModelSpec) and isinstance(s.prompt, spec.PromptSpec)
    assert isinstance(s.mechanism, spec.MechanismSpec)
    assert s.mechanism.batch_size == int(s.section("mechanism")["batch_size"])
    assert s.model.name == s.section("model").get("name", "embedded")
    if s.kind == "white-box":
        assert isinstance(s.audit, WhiteBoxConfig) and s.blackbox is None
        assert s.audit == spec._whitebox_config(s.section("audit"), s.mechanism.batch_size)
    else:
        assert isinstance(s.blackbox, spec.BlackBoxSpec) and s.audit is None


def test_spec_errors_are_found_at_load_time(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('kind = "white-box"\n[mechanism]\nbatch_size = 2\n[audit]\nfoo = 1\n')
    with pytest.raises(ValueError, match=r"unknown keys in \[audit\]"):
        spec.load_spec(p)
    p.write_text('kind = "black-box"\n[mechanism]\nmax_new_tokens = 3\n')
    with pytest.raises(ValueError, match="batch_size"):
        spec.load_spec(p)
    p.write_text('kind = "selftest"\n[selftest]\nbogus = 1\n')
    with pytest.raises(ValueError, match=r"unknown keys in \[selftest\]: \['bogus'\]; allowed: "):
        spec.load_spec(p)


def test_a_model_audit_needs_max_new_tokens(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('kind = "white-box"\n[mechanism]\nbatch_size = 2\nclip_norm = 1.0\n')
    s = spec.load_spec(p)
    assert s.mechanism.max_new_tokens is None and s.mechanism.clip_norm == 1.0
    with pytest.raises(ValueError, match="max_new_tokens is required"):
        spec._model_audit_settings(s)
