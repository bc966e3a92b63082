"""The white-box auditor and quick_audit on any mechanism of the interface.

Oracles: exact enumeration of a small mechanism's whole output distribution (the Monte Carlo
intervals must cover the exact Rényi divergences; the exact divergences respect a correct claim);
exact per-step checks find the planted factor 2 of the paper's Amin et al. accounting; a
data-dependent guarantee is never a PASS and says so in every report.
"""

from __future__ import annotations

import json
import math
import runpy
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from invink_audit.audit import ModelAuditSettings, WhiteBoxConfig, audit_model, quick_audit, synthetic, write_report
from invink_audit.audit.analysis import analyse
from invink_audit.audit.whitebox import Claim
from invink_audit.generation import ReleaseConfig, generate
from invink_audit.mechanism import SeededGeneratorWarning, make_generator
from invink_audit.mechanisms import (
    AdaPMixEDConfig,
    AdaPMixEDMechanism,
    AminConfig,
    AminMechanism,
    GuaranteeKind,
    MechanismGuarantee,
)
from invink_audit.models import build_tiny_model

REFS = ["Great tacos and friendly staff.", None, "The soup was cold."]


def _gen(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(seed)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=1)


def _amin(sensitivity="replace-by-null", b=3, grid=256, **kw):
    return AminMechanism(AminConfig(clip_norm=kw.pop("clip_norm", 1.0), batch_size=b, svt_threshold=kw.pop("svt_threshold", 0.5),
                                    svt_noise=kw.pop("svt_noise", 1.0), max_private_tokens=kw.pop("r", 3),
                                    sensitivity=sensitivity, posterior_grid=grid, **kw))


def test_claims_from_guarantees():
    amin = Claim.from_mechanism(_amin(), 6, 1e-6)
    assert amin.composition == "zcdp" and amin.a_priori and amin.step_checks and amin.batch_size == 3
    assert amin.rho_sequence == pytest.approx(_amin().accounting.rho_sequence)
    assert amin.renyi(2.0) == pytest.approx(2.0 * amin.rho_sequence) and math.isinf(amin.loss_upper())
    assert amin.epsilon_claimed == amin.guarantee.epsilon  # stated by a report: not an a-priori bounded-range claim
    ada = Claim.from_mechanism(AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=3, epsilon=4.0)), 6, 1e-6)
    assert not ada.a_priori and not ada.step_checks and ada.rho_sequence is None and ada.kind == "data-dependent"
    assert ada.renyi(15.0) == pytest.approx(ada.renyi_budget) and math.isinf(ada.renyi(2.0))

    def guarantee(**kw):
        fields = dict(kind=GuaranteeKind.DATA_DEPENDENT, mechanism="m", epsilon=1.0, delta=1e-6, max_new_tokens=5,
                      composition="zcdp", rho_sequence=None)
        return MechanismGuarantee(**{**fields, **kw})

    with pytest.raises(ValueError, match="renyi_order"):  # the guarantee's own check
        guarantee(composition="renyi-filter")
    with pytest.raises(ValueError, match="renyi_order"):
        Claim(guarantee(composition="renyi-filter", renyi_order=1.0, renyi_budget=2.0), 3)
    with pytest.raises(ValueError, match="rho_sequence"):
        Claim(guarantee(), 3)
    with pytest.raises(ValueError, match="both"):
        guarantee(step_epsilon0=0.1)
    with pytest.raises(ValueError, match="bounded-range claim needs epsilon0"):
        Claim(guarantee(kind=GuaranteeKind.A_PRIORI, composition="bounded-range", rho_sequence=0.1), 3)


def test_amin_exact_enumeration_sums_to_one_respects_the_claim_and_covers_the_intervals():
    source = synthetic.RandomSource(vocab_size=3, batch_size=2, period=2, scale=1.5, private_scale=2.0, eos_shift=1.0, seed=3)
    mech = _amin(b=2, r=2, clip_norm=1.5, svt_threshold=0.4, svt_noise=0.5)
    audited = synthetic.AuditedMechanism("amin", "", mech, 3, "PASS")
    exact = synthetic.enumerate_outputs(source, audited)
    assert np.exp(exact.log_prob_actual).sum() == pytest.approx(1.0, abs=1e-9)
    claim = audited.claim()
    for j in range(2):
        assert np.exp(exact.log_prob_neighbours[:, j]).sum() == pytest.approx(1.0, abs=1e-9)
        for a in (2.0, 8.0):
            for reverse in (False, True):
                assert exact.renyi(a, j, reverse) <= claim.renyi(a)  # the correct accounting holds exactly
    config = WhiteBoxConfig(alphas=(1.5, 2.0, 4.0), num_samples=400, num_is_samples=0, significance=0.05)
    rec = synthetic.run_synthetic_audit(source, audited, config, generator=torch.Generator().manual_seed(8))
    report = analyse(rec, mechanism="amin", source="random", exact=exact)
    assert report.verdict.value == "PASS"
    rows = [s for s in report.sequence if s.exact is not None]
    covered = [s.lower - 1e-9 <= s.exact <= s.upper + 1e-9 for s in rows]
    assert rows and np.mean(covered) >= 0.9


def test_amin_paper_accounting_is_caught_exactly_by_the_per_step_checks():
    source = synthetic.HardestCaseSource(vocab_size=6, batch_size=3)
    config = WhiteBoxConfig(alphas=(2.0,), num_samples=40, num_is_samples=0, min_samples=10)
    found = {}
    for mode in ("paper", "replace-by-null"):
        audited = synthetic.AuditedMechanism(mode, "", _amin(mode, clip_norm=0.5), 5, "?")
        rec = synthetic.run_synthetic_audit(source, audited, config, generator=torch.Generator().manual_seed(1))
        found[mode] = (rec.failures, float(rec.max_loss_range_per_step.max()) / audited.claim().epsilon0)
    assert found["paper"][0]["range"] > 0 and found["paper"][1] == pytest.approx(2.0, abs=1e-9)
    assert sum(found["replace-by-null"][0].values()) == 0 and found["replace-by-null"][1] == pytest.approx(1.0, abs=1e-9)


def test_model_audit_of_amin_passes_and_of_adapmixed_is_labelled_data_dependent(tiny, tmp_path):
    config = WhiteBoxConfig(alphas=(2.0, 8.0), num_samples=24, num_is_samples=4, min_samples=16)
    rep = audit_model(REFS, ModelAuditSettings(max_new_tokens=5, mechanism=_amin()), config, model=tiny,
                      canaries={0: "c"}, generator=_gen(3))
    assert rep.verdict.value == "PASS" and rep.claim["composition"] == "zcdp"
    assert any("importance sampling disabled" in n for n in rep.notes)
    assert set(rep.settings["released_modes"]) <= {"public", "private"}
    ada = AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=3, epsilon=4.0, screen_samples=32))
    rep = audit_model(REFS, ModelAuditSettings(max_new_tokens=5, mechanism=ada), config, model=tiny, generator=_gen(3))
    assert rep.verdict.value != "PASS" and "DATA-DEPENDENT" in rep.reason
    assert rep.claim["guarantee"] == "data-dependent" and [s.alpha for s in rep.sequence] == [15.0] * len(rep.sequence)
    write_report(rep, tmp_path / "ada", plots=True)
    md = (tmp_path / "ada" / "report.md").read_text()
    assert "data-dependent: holds only for the audited references, never a PASS" in md
    assert json.loads((tmp_path / "ada" / "report.json").read_text())["claim"]["guarantee"] == "data-dependent"
    with pytest.raises(ValueError, match="hardest-case"):
        audit_model([None, "a", "b"], ModelAuditSettings(max_new_tokens=3, mechanism=_amin()), config, model=tiny,
                    hardest_case_slot=0)
    with pytest.raises(ValueError, match="not both"):
        ModelAuditSettings(max_new_tokens=3, mechanism=_amin(), clip_norm=1.0)


def test_quick_audit_of_texts_generated_with_any_mechanism(tiny):
    refs = REFS + ["Nice.", "", "Bad food."]
    run = generate(refs, ReleaseConfig(_amin(), max_new_tokens=6, delta=1e-6), model=tiny)
    assert len(run.texts) == 2 and all(len(t.modes) == t.num_tokens for t in run.texts)
    report = quick_audit(run, refs, model=tiny, generator=_gen(2))
    assert report.verdict.value == "PASS" and report.mechanism == "amin2024" and report.step_failures == {
        "support": 0, "range": 0, "renyi": 0, "delta": 0, "nonfinite": 0}
    ada = AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=3, epsilon=6.0, screen_samples=32))
    run = generate(refs, ReleaseConfig(ada, max_new_tokens=6, delta=1e-6), model=tiny)
    report = quick_audit(run, refs, model=tiny, sampled_batch=None)
    assert report.verdict.value != "PASS" and report.guarantee == "data-dependent"
    assert "DATA-DEPENDENT" in report.summary()


def test_custom_mechanism_example_runs(monkeypatch):
    path = Path(__file__).resolve().parents[1] / "examples" / "custom_mechanism.py"
    monkeypatch.setattr(sys, "argv", [str(path)])
    module = runpy.run_path(str(path), run_name="example")
    assert module["main"](tiny=True) == {"correct": "PASS", "sampled colder than accounted": "VIOLATION"}


def test_spec_mechanism_sections():
    from invink_audit.audit.spec import load_spec, mechanism_from_section
    from invink_audit.mechanisms import InvisibleInk

    invink = mechanism_from_section({"clip_norm": 1.0}, 7)  # InvisibleInk, a Mechanism like every other
    assert isinstance(invink, InvisibleInk) and invink.config.clip_norm == 1.0 and invink.batch_size == 7
    amin = mechanism_from_section({"kind": "amin", "epsilon": 10.0, "max_private_tokens": 4, "svt_noise": 1.0}, 7)
    assert isinstance(amin, AminMechanism) and amin.guarantee(12, 1e-6).epsilon <= 10.0 * (1 + 1e-9)
    paper = mechanism_from_section({"kind": "amin", "epsilon": 10.0, "max_private_tokens": 4, "svt_noise": 1.0,
                                    "sensitivity": "paper"}, 7)
    assert paper.config.clip_norm > amin.config.clip_norm  # the understated sensitivity buys a larger C
    ada = mechanism_from_section({"kind": "adapmixed", "epsilon": 5.0, "screen_samples": 64}, 7)
    assert isinstance(ada, AdaPMixEDMechanism) and ada.config.epsilon == 5.0
    for bad, match in (({"kind": "magic"}, "kind"), ({"kind": "amin", "clip_norm": 1.0, "oops": 1}, "unknown"),
                       ({"kind": "amin"}, "exactly one"), ({"kind": "adapmixed", "epsilon": 1.0, "clip_norm": 1.0}, "unknown")):
        with pytest.raises(ValueError, match=match):
            mechanism_from_section(bad, 7)
    root = Path(__file__).resolve().parents[1] / "audits"
    for name in ("yelp_smollm2_amin", "yelp_smollm2_amin_paper", "yelp_smollm2_adapmixed"):
        spec = load_spec(root / f"{name}.toml")
        assert mechanism_from_section(spec.section("mechanism"), 7) is not None


@pytest.mark.parametrize(
    ("epsilon0", "max_new_tokens", "delta", "message"),
    [(0.1, 20.5, 1e-6, "num_steps must be an integer"), (0.1, 20.0, 1e-6, "num_steps must be an integer"),
     (True, 20, 1e-6, "epsilon0 must be a real number"), ("0.1", 20, 1e-6, "epsilon0 must be a real number"),
     (0.1, 20, "1e-6", "delta must be a real number")],
)
def test_the_accountants_epsilons_refuse_what_the_accountant_refuses_even_after_a_cached_call(
    epsilon0, max_new_tokens, delta, message
):
    """The report's per-accountant ε are cached by value: a value equal to a cached one (20.0 for 20, True for 1)
    is still refused as :func:`accounting.composed_epsilon` refuses it, never answered from the cache."""
    from accounting import composed_epsilon
    from invink_audit.audit.analysis import accountant_epsilons

    assert accountant_epsilons(0.1, 20, 1e-6, ["cks"]) == {"cks": composed_epsilon(1e-6, 0.1, 20, "cks")}
    assert accountant_epsilons(1.0, 20, 1e-6, ["cks"]) == {"cks": composed_epsilon(1e-6, 1.0, 20, "cks")}
    with pytest.raises(ValueError, match=message):
        composed_epsilon(delta, epsilon0, max_new_tokens, "cks")
    with pytest.raises(ValueError, match=message):
        accountant_epsilons(epsilon0, max_new_tokens, delta, ["cks"])
