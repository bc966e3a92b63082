"""The ``augpe-histogram`` audit spec (invink_audit.audit.spec): the committed specs load, run and reproduce their
committed reports; the claim is planned by the accounting layer; every bad key is refused at load time with the
file, the section and the key. Figures: docs/guide/auditing.md ("Auditing AugPE")."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from accounting import AugPEEvent, AugPESensitivity, plan_augpe_noise_std
from invink_audit.audit.records import BlackBoxReport, report_from_dict
from invink_audit.audit.spec import AugPEHistogramSpec, load_spec, parse_spec, run_spec
from invink_audit.audit.stats import Verdict
from invink_audit.audit.augpe import exact_histogram_check, true_epsilon, worst_case_canary
from invink_audit.audit.targets import HistogramTarget

AUDITS = Path(__file__).resolve().parents[1] / "audits"
CORRECT, PAPER = AUDITS / "blackbox_augpe_correct.toml", AUDITS / "blackbox_augpe_paper.toml"
#: a small audit for the tests that change a spec (the smallest num_batches the batched audit takes is 16)
SMALL_BATCHES = 2_000

MINIMAL = """
kind = "augpe-histogram"
[mechanism]
iterations = 3
epsilon = 2.0
"""


def _raw(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _exact_note(report: BlackBoxReport) -> str:
    (note,) = [n for n in report.notes if n.startswith("exact check")]
    return note


@pytest.mark.parametrize(("path", "sensitivity"), [(CORRECT, AugPESensitivity.REPLACE_BY_NULL),
                                                   (PAPER, AugPESensitivity.PAPER)], ids=["correct", "paper"])
def test_committed_specs_plan_their_claim_through_the_accountant(path, sensitivity):
    spec = load_spec(path)
    a = spec.augpe
    assert spec.kind == "augpe-histogram" and isinstance(a, AugPEHistogramSpec)
    assert spec.mechanism is None and spec.blackbox is None and spec.model is None
    raw = _raw(path)["mechanism"]
    # the oracle: the planner itself, on the exact μ-GDP curve the audit tests; its safe side never overspends
    sigma = plan_augpe_noise_std(raw["epsilon"], raw["delta"], raw["iterations"], sensitivity, exact_gaussian=True)
    assert a.event == AugPEEvent(sigma, raw["iterations"], sensitivity)
    assert a.event.gaussian_epsilon(a.delta) <= raw["epsilon"]
    assert (a.num_batches, a.significance, a.sequential, a.threshold) == (10_000, 0.05, True, 0.0)


def test_the_correct_spec_is_the_paper_specs_control():
    """The same audit but for the claimed sensitivity."""
    assert {k: v for k, v in _raw(CORRECT).items() if k not in ("name", "mechanism")} == {
        k: v for k, v in _raw(PAPER).items() if k not in ("name", "mechanism")}
    assert {k: v for k, v in _raw(CORRECT)["mechanism"].items() if k != "sensitivity"} == {
        k: v for k, v in _raw(PAPER)["mechanism"].items() if k != "sensitivity"}


@pytest.mark.parametrize("path", [CORRECT, PAPER], ids=["correct", "paper"])
def test_committed_specs_reproduce_their_committed_reports(path):
    """The spec's seed fixes noise and coins: rerun, the report equals the committed one but for its timings."""
    report = run_spec(load_spec(path))
    committed = json.loads((AUDITS / "reports" / path.stem / "report.json").read_text())
    fresh = report.to_dict()
    assert {k: v for k, v in fresh.items() if k != "timings"} == {k: v for k, v in committed.items() if k != "timings"}
    assert isinstance(report_from_dict(committed), BlackBoxReport)


def test_the_paper_convention_is_refuted_and_the_correct_claim_is_not():
    correct, paper = run_spec(load_spec(CORRECT)), run_spec(load_spec(PAPER))
    assert correct.verdict is Verdict.INCONCLUSIVE  # a black box never confirms a claim
    assert paper.verdict is Verdict.VIOLATION
    assert correct.claimed_epsilon == pytest.approx(2.0) and paper.claimed_epsilon == pytest.approx(2.0)
    # the exact check of the same embeddings, reported beside the verdict (not in it)
    assert _exact_note(correct).startswith("exact check") and ": PASS, realised/claimed ρ = 1:" in _exact_note(correct)
    assert ": VIOLATION, realised/claimed ρ = 2:" in _exact_note(paper)
    # the exact figures against an independent computation on the worst-case canary
    data = worst_case_canary()
    for report, spec in ((correct, load_spec(CORRECT)), (paper, load_spec(PAPER))):
        event = spec.augpe.event
        check = exact_histogram_check([data.canary, *data.others], data.candidates, data.null, event)
        target = HistogramTarget(data, noise_std=event.noise_std, iterations=event.iterations)
        assert f"realised/claimed ρ = {check.ratio:.4g}" in _exact_note(report)
        assert f"true ε of this canary at δ = 1e-06: {true_epsilon(target, 1e-6):.4g}" in " ".join(report.notes)
        assert "exact_check_seconds" in report.timings and report.mechanism.startswith("augpe histogram")


def test_a_spec_can_be_run_smaller_and_reseeded():
    raw = _raw(PAPER)
    raw["blackbox"]["num_batches"], raw["blackbox"]["sequential"] = SMALL_BATCHES, False
    spec = parse_spec(raw)
    report = run_spec(spec, seed=7)  # --seed overrides the spec's seed
    assert len(report.coins) == SMALL_BATCHES and report.num_trials["batches_planned"] == SMALL_BATCHES
    assert len(report.sequential["looks"]) == 1
    assert any(n.startswith("seed 7 (noise) and 8 (coins)") for n in report.notes)
    assert report.to_dict() == {**run_spec(spec, seed=7).to_dict(), "timings": report.to_dict()["timings"]}


def test_noise_given_instead_of_planned(tmp_path):
    path = tmp_path / "sigma.toml"
    path.write_text(MINIMAL.replace("epsilon = 2.0", "noise_std = 8.0\nthreshold = 1.5\ndelta = 1e-5") +
                    f"[canary]\nothers_per_candidate = 5\nnum_candidates = 3\n[blackbox]\nnum_batches = {SMALL_BATCHES}\n")
    spec = load_spec(path)
    a = spec.augpe
    assert a.event == AugPEEvent(8.0, 3) and a.epsilon is None and a.threshold == 1.5 and a.delta == 1e-5
    assert spec.name == "sigma"  # no name: the file's stem
    report = run_spec(spec, seed=1)
    assert report.claimed_epsilon == pytest.approx(a.event.gaussian_epsilon(1e-5)) and report.claimed_delta == 1e-5
    assert report.verdict is not Verdict.VIOLATION  # a correct claim
    assert "all 16 replace-by-null neighbours" in _exact_note(report)  # 1 + 3·5 references
    assert any("σ given" in n and "threshold H = 1.5" in n for n in report.notes)


def test_cli_runs_the_specs_and_exits_by_verdict(tmp_path, capsys):
    from invink_audit.cli import main

    assert main(["audit", str(CORRECT), "--output", str(tmp_path / "correct")]) == 3  # INCONCLUSIVE
    assert main(["audit", str(PAPER), "--output", str(tmp_path / "paper"), "--no-plots"]) == 1  # VIOLATION
    assert "blackbox-augpe-paper: VIOLATION" in capsys.readouterr().out
    assert {p.name for p in (tmp_path / "correct").iterdir()} == {"report.json", "report.md", "scores.png"}
    assert {p.name for p in (tmp_path / "paper").iterdir()} == {"report.json", "report.md"}
    assert "## Notes" in (tmp_path / "paper" / "report.md").read_text()


BAD = [
    ("iterations = 3\n", "iterations = 2.5\n", r"\[mechanism\] iterations must be an integer from 1 to 100; got 2.5"),
    ("iterations = 3\n", "iterations = true\n", r"\[mechanism\] iterations must be"),
    ("iterations = 3\n", "iterations = 101\n", r"\[mechanism\] iterations must be an integer from 1 to 100"),
    ("iterations = 3\n", "", r"\[mechanism\] iterations is required"),
    ("epsilon = 2.0\n", "", r"\[mechanism\] give one of noise_std \(σ\) and epsilon"),
    ("epsilon = 2.0\n", "epsilon = 2.0\nnoise_std = 3.0\n", r"\[mechanism\] give one of noise_std"),
    ("epsilon = 2.0\n", "epsilon = 0.0\n", r"\[mechanism\] epsilon must be in \[1e-06, 10000\]; got 0.0"),
    ("epsilon = 2.0\n", 'epsilon = "2"\n', r"\[mechanism\] epsilon must be"),
    ("epsilon = 2.0\n", "noise_std = -1.0\n", r"\[mechanism\] noise_std must be"),
    ("epsilon = 2.0\n", "epsilon = 2.0\ndelta = 1.0\n", r"\[mechanism\] delta must be"),
    ("epsilon = 2.0\n", 'epsilon = 2.0\nsensitivity = "add-or-remove"\n',
     r"\[mechanism\] sensitivity must be one of \['replace-by-null', 'paper'\]; got 'add-or-remove'"),
    ("epsilon = 2.0\n", "epsilon = 2.0\nthreshold = -1.0\n", r"\[mechanism\] threshold must be >= 0"),
    ("epsilon = 2.0\n", 'epsilon = 2.0\nkind = "amin"\n', r"\[mechanism\] kind must be one of \['augpe'\]"),
    ("epsilon = 2.0\n", "epsilon = 2.0\nbatch_size = 4\n", r"unknown keys in \[mechanism\]: \['batch_size'\]; allowed: "),
    ("", '[canary]\nkind = "random"\n', r"\[canary\] kind must be one of \['worst-case'\]; got 'random'"),
    ("", "[canary]\nnum_candidates = 1\n", r"\[canary\] num_candidates must be an integer from 2 to 16; got 1"),
    ("", "[canary]\nothers_per_candidate = 0\n", r"\[canary\] others_per_candidate must be an integer from 1 to 500"),
    ("", "[canary]\nslot = 0\n", r"unknown keys in \[canary\]: \['slot'\]"),
    ("", "[blackbox]\nnum_batches = 8\n", r"\[blackbox\] num_batches must be an integer from 16"),
    ("", "[blackbox]\nnum_trials = 200\n", r"unknown keys in \[blackbox\]: \['num_trials'\]"),
    ("", "[blackbox]\nsignificance = 2.0\n", r"\[blackbox\] .*significance"),
    ("", '[blackbox]\nsequential = "yes"\n', r"\[blackbox\] sequential must be true or false; got 'yes'"),
    ("", '[model]\nname = "embedded"\n', r"unknown keys in a augpe-histogram spec: \['model'\]"),
]


@pytest.mark.parametrize(("old", "new", "match"), BAD, ids=[f"{i}" for i in range(len(BAD))])
def test_bad_sections_are_refused_at_load_time_naming_file_section_and_key(tmp_path, old, new, match):
    path = tmp_path / "bad.toml"
    body = MINIMAL.replace(old, new) if old else MINIMAL + new
    path.write_text(body)
    with pytest.raises(ValueError) as err:
        load_spec(path)
    message = str(err.value)
    assert message.startswith(f"audit spec {str(path)!r}: ") and "\n" not in message
    assert re.search(match, message), message


def test_a_bad_top_level_seed_is_refused(tmp_path):
    path = tmp_path / "seed.toml"
    path.write_text("seed = -1\n" + MINIMAL)
    with pytest.raises(ValueError, match=r"seed must be an integer from 0"):
        load_spec(path)
