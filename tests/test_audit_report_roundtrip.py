"""Typed audit reports keep their JSON schema: typed → JSON → typed → identical JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from invink_audit.audit import analysis, synthetic
from invink_audit.audit.records import AuditTimings, LossHistogram, ReportedClaim, WhiteBoxReport, WorstNeighbour, report_from_dict
from invink_audit.audit.whitebox import Claim, WhiteBoxConfig
from invink_audit.mechanisms import GuaranteeKind, MechanismGuarantee

REPORTS = Path(__file__).resolve().parents[1] / "audits" / "reports"


def _committed_reports():
    out = []
    for path in sorted(REPORTS.rglob("report.json")):
        data = json.loads(path.read_text())
        for item in data if isinstance(data, list) else [data]:
            # current schema only (older reports were written before ``privacy_notice``)
            if item.get("kind") in ("white-box", "black-box") and "privacy_notice" in item:
                out.append(pytest.param(item, id=str(path.relative_to(REPORTS))))
    return out


@pytest.mark.parametrize("data", _committed_reports())
def test_committed_report_round_trips_exactly(data):
    typed = report_from_dict(data)
    assert json.dumps(typed.to_dict()) == json.dumps(data)
    if isinstance(typed, WhiteBoxReport):
        assert isinstance(typed.claim, ReportedClaim) and isinstance(typed.worst_neighbour, WorstNeighbour)
        assert isinstance(typed.timings, AuditTimings) and isinstance(typed.loss_histogram, LossHistogram)


def _fresh_report(mech, source) -> WhiteBoxReport:
    config = WhiteBoxConfig(alphas=(2.0, 4.0), num_samples=30, num_is_samples=10)
    rec = synthetic.run_synthetic_audit(source, mech, config, generator=torch.Generator().manual_seed(7))
    return analysis.analyse(
        rec, mechanism=mech.name, source=source.name, canaries=source.canaries,
        timings={"decode_seconds": 0.5}, settings={"num_samples": 30}, claim_details={"claimed_by": "test"},
    )


def test_fresh_report_typed_json_typed_identical_json():
    source = synthetic.HardestCaseSource(vocab_size=6, batch_size=3, temperature=1.0)
    mech = synthetic.correct_mechanism(clip_norm=0.5, temperature=1.0, top_k=3, batch_size=3, max_new_tokens=5)
    report = _fresh_report(mech, source)
    first = json.dumps(report.to_dict())
    again = report_from_dict(json.loads(first))
    assert json.dumps(again.to_dict()) == first
    # the typed records themselves survive the trip
    assert again.claim == report.claim
    assert again.worst_neighbour == report.worst_neighbour
    assert again.loss_histogram == report.loss_histogram
    assert again.timings == report.timings
    assert again.sequence == report.sequence and again.accountants == report.accountants
    # the JSON schema: the keys of the untyped report, in their order
    data = json.loads(first)
    assert list(data["claim"])[:7] == [
        "epsilon0", "rho_token", "rho_sequence", "max_new_tokens", "batch_size", "delta", "epsilon[br-adaptive]"
    ]
    assert list(data["claim"])[-1] == "claimed_by"
    assert list(data["worst_neighbour"]) == ["index", "label", "ratio"]
    assert list(data["loss_histogram"]) == ["neighbour", "edges", "counts", "num_infinite", "mean"]
    assert list(data["timings"]) == ["decode_seconds", "analysis_seconds", "check_seconds"]
    # records still read as the mappings they replace; the claim reads as the claim it states
    assert report.claim["epsilon0"] == report.claim.epsilon0 and "guarantee" not in report.claim
    assert isinstance(again.claim.claim, Claim) and again.claim.claim.rho_sequence == report.claim.claim.rho_sequence
    assert report.timings.get("decode_seconds") == 0.5


def test_reported_claim_keeps_a_mechanism_detail_in_its_place():
    """A data-dependent claim whose mechanism details also carry renyi_order / renyi_budget (AdaPMixED)."""
    guarantee = MechanismGuarantee(GuaranteeKind.DATA_DEPENDENT, "adapmixed", 3.0, 1e-6, 8, "renyi-filter",
                                   renyi_order=15.0, renyi_budget=2.5)
    claim = Claim(guarantee, 4)
    details = {"mechanism": "adapmixed", "renyi_order": 15.0, "beta": 0.3, "renyi_budget": 2.5}
    reported = ReportedClaim(claim, {"rdp-filter": 3.0}, details)
    keys = list(reported.json_fields())
    assert keys[6:] == [
        "epsilon[rdp-filter]", "mechanism", "renyi_order", "beta", "renyi_budget", "guarantee", "composition",
        "epsilon_claimed",
    ]
    back = ReportedClaim.from_json(reported.json_fields())
    assert back == reported and list(back.json_fields()) == keys
    assert back["guarantee"] == back.kind == "data-dependent" and back.renyi_budget == 2.5
    # read back, it is the same claim: the guarantee's figures and B, its epsilon the one claimed
    assert back.claim.guarantee.epsilon == 3.0 and back.claim.batch_size == 4 and back.claim.renyi(15.0) == 2.5


def test_extra_timings_are_kept_after_the_known_ones():
    t = AuditTimings.from_json({"custom_seconds": 1.0, "generation_seconds": 2.0})
    assert t.generation_seconds == 2.0 and dict(t.extra) == {"custom_seconds": 1.0}
    assert list(t.json_fields()) == ["generation_seconds", "custom_seconds"]


def test_a_record_read_back_ignores_keys_it_does_not_have():
    from invink_audit.audit.records import WorstNeighbour

    record = WorstNeighbour(index=2, label="R'_2", ratio=0.5)
    assert WorstNeighbour.from_json({**record.json_fields(), "added_by_a_newer_version": 1}) == record
