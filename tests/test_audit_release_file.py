"""A release audited from its output file (``invink-audit audit --release``): the partition is rebuilt
from the input and accepted only with the recorded fingerprint, and the audit's figures equal those of
:func:`quick_audit` on the result ``generate`` returned."""

from __future__ import annotations

import json
import warnings

import pytest

from invink_audit.audit.quick import ReleaseFile, audit_release_file, quick_audit, write_quick_report
from invink_audit.audit.stats import Verdict
from invink_audit.cli import main
from invink_audit.mechanism import SeededGeneratorWarning
from invink_audit.models import build_tiny_model
from releases import generate_flat

ROWS = [(f"Review {i}: the soup was {'great' if i % 2 else 'cold'}.", "Restaurants" if i % 5 else "Bars", f"{1 + i % 2}.0")
        for i in range(17)]  # fmt: skip


@pytest.fixture
def reviews(reviews_csv):
    return reviews_csv(ROWS)


def _release(path, output, tiny_dir, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return generate_flat(path, output=output, batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=6.0, top_k=8,
                        model=str(tiny_dir), prompt="yelp", label_columns=["label2"],
                        prompt_fields={"category": "Restaurants"}, seed=3, **kwargs)


def test_the_file_audit_equals_the_audit_of_the_returned_result(reviews, tiny_dir, tmp_path):
    output = tmp_path / "texts.jsonl"
    result = _release(reviews, output, tiny_dir, num_texts_per_group=2)
    direct = quick_audit(result, model=str(tiny_dir), sampled_batch=None)
    from_file = audit_release_file(output, reviews, model=str(tiny_dir), sampled_batch=None)
    assert from_file.step_checks == direct.step_checks > 0 and direct.verdict is Verdict.PASS
    # the release was drawn with a fixed seed: its file's audit names it and is never a PASS (probe F8)
    assert from_file.verdict is Verdict.INCONCLUSIVE and [f.kind for f in from_file.findings] == ["seeded-release"]
    assert from_file.realised_loss_max == pytest.approx(direct.realised_loss_max, rel=1e-12)
    assert from_file.realised_loss_mean == pytest.approx(direct.realised_loss_mean, rel=1e-12)
    # a seeded release records no guarantee: its ε is the one its clip norm certifies, at most the planned one
    assert from_file.accountant_epsilon == pytest.approx(direct.accountant_epsilon, rel=1e-3)
    assert from_file.accountant_epsilon <= direct.accountant_epsilon
    found = ReleaseFile.read(output, reviews)
    assert found.release.partition.batches == result.partition.batches and found.release.labels == result.labels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)  # a reproducible audit
        sampled = audit_release_file(output, reviews, model=str(tiny_dir), sampled_batch=1, num_samples=16, seed=1)
    assert sampled.sampled is not None and sampled.uncharged_samples == 16 and sampled.verdict.value != "VIOLATION"
    written = write_quick_report(sampled, tmp_path / "report")
    assert {p.name for p in written} >= {"report.json", "report.md"} and (tmp_path / "report" / "sampled").is_dir()


def test_other_references_are_refused_by_the_fingerprint(reviews, tiny_dir, tmp_path):
    output = tmp_path / "texts.jsonl"
    _release(reviews, output, tiny_dir)
    other = tmp_path / "other.csv"
    other.write_text(reviews.read_text().replace("soup", "stew"), encoding="utf-8")
    with pytest.raises(ValueError, match="recorded fingerprint"):
        ReleaseFile.read(output, other)
    with pytest.raises(ValueError, match="state file"):
        ReleaseFile.read(tmp_path / "missing.jsonl", reviews)
    with pytest.raises(ValueError, match="give --model"):
        audit_release_file(output, reviews, model=build_tiny_model(seed=6), sampled_batch=None)


def test_the_command_line_audits_a_label_conditioned_selected_release(reviews, tiny_dir, tmp_path, capsys):
    output = tmp_path / "texts.jsonl"
    common = ["--input", str(reviews), "--where", "label1=Restaurants"]
    code = main(["generate", *common, "--output", str(output), "--model", str(tiny_dir), "--batch-size", "2",
                 "--max-new-tokens", "4", "--epsilon", "6", "--delta", "1e-6", "--top-k", "8", "--prompt", "yelp",
                 "--label-columns", "label2", "--prompt-field", "category=Restaurants", "--no-progress"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    report_dir = tmp_path / "report"
    code = main(["audit", "--release", str(output), *common, "--model", str(tiny_dir), "--sampled-batch", "none",
                 "--output", str(report_dir), "--no-plots"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and "audit verdict: PASS" in out, out
    report = json.loads((report_dir / "report.json").read_text())
    assert report["not_private"] is True and report["step_failures"] == {} or sum(report["step_failures"].values()) == 0
    assert "NOT PRIVATE" in (report_dir / "report.md").read_text()
    # without the selection generate was given, the input is not the release's
    code = main(["audit", "--release", str(output), "--input", str(reviews), "--model", str(tiny_dir)])
    assert code == 2 and "recorded fingerprint" in capsys.readouterr().err
    code = main(["audit", "--release", str(output), "--model", str(tiny_dir)])
    assert code == 2 and "--input" in capsys.readouterr().err
