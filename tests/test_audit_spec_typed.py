"""Audit specs are read into the library's own records when they are loaded (no shadow records)."""

from __future__ import annotations

from pathlib import Path

import pytest

from invink_audit.audit import spec
from invink_audit.audit.selftest import SelfTestSettings
from invink_audit.audit.whitebox import WhiteBoxConfig
from invink_audit.generation import ModelSpec, PromptSpec
from invink_audit.mechanisms import Mechanism

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
    assert isinstance(s.model, ModelSpec) and isinstance(s.prompt, PromptSpec)
    assert s.batch_size == int(s.section("mechanism")["batch_size"])
    assert s.model.model == s.section("model").get("name", "embedded")
    assert s.prompt.template == s.section("prompt").get("preset", "generic")
    if s.kind == "white-box":
        assert isinstance(s.mechanism, Mechanism) and s.mechanism.batch_size == s.batch_size
        assert isinstance(s.audit, WhiteBoxConfig) and s.blackbox is None
        assert s.audit == spec._whitebox_config(s.section("audit"), s.batch_size)
    else:
        assert isinstance(s.blackbox, spec.BlackBoxSpec) and isinstance(s.target, spec.TargetSpec) and s.audit is None
        assert s.mechanism is None and s.epsilon == s.section("mechanism")["epsilon"]  # the reference package's claim


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
    with pytest.raises(ValueError, match=r"\[mechanism\] max_new_tokens is required"):
        spec.load_spec(p)
    p.write_text('kind = "white-box"\n[mechanism]\nbatch_size = 2\nclip_norm = 1.0\nmax_new_tokens = 3\n')
    s = spec.load_spec(p)
    assert s.max_new_tokens == 3 and s.mechanism.config.clip_norm == 1.0 and s.epsilon is None
