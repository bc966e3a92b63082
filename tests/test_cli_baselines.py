"""``invink-audit generate --mechanism amin|adapmixed``: the paper's baselines from the command line.

Amin et al. is charged to the ledger as a zCDP release before it generates (and over budget, refused with
nothing generated); AdaPMixED's data-dependent spend is never charged nor written; InvisibleInk-only flags are
refused, not ignored.
"""

from __future__ import annotations

import json

import pytest

from accounting import BudgetLedger, zcdp_to_epsilon
from invink_audit.cli import main
from invink_audit.mechanisms import AminConfig

TEXTS = [f"Review {i}: the soup was {'great' if i % 2 else 'cold'} and the bread {'fresh' if i % 3 else 'stale'}."
         for i in range(12)]  # fmt: skip


@pytest.fixture
def reviews(reviews_csv):
    return reviews_csv([(t,) for t in TEXTS], columns=("text",))


def _generate(reviews, output, tiny_dir, *extra):
    return main(["generate", "--input", str(reviews), "--output", str(output), "--model", str(tiny_dir),
                 "--batch-size", "3", "--max-new-tokens", "6", "--delta", "1e-6", "--no-progress", *extra])  # fmt: skip


AMIN = ["--mechanism", "amin", "--epsilon", "8", "--max-private-tokens", "4", "--svt-noise", "2"]


def test_amin_is_charged_as_a_zcdp_release_before_it_generates(reviews, tiny_dir, tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=20.0, delta=1e-6)
    output = tmp_path / "amin.jsonl"
    code = _generate(reviews, output, tiny_dir, *AMIN, "--ledger", str(ledger), "--json")
    assert code == 0, capsys.readouterr().err
    summary = json.loads(capsys.readouterr().out)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert summary["num_texts"] == len(records) == 4 and summary["kind"] == "a-priori"
    assert {r["mechanism"] for r in records} == {"amin2024"} and all("spend" not in r for r in records)
    entry = BudgetLedger(ledger).status().releases[0]
    planned = AminConfig.planned(epsilon=8.0, delta=1e-6, batch_size=3, max_private_tokens=4, svt_noise=2.0)
    assert entry["release"]["kind"] == "zcdp" and entry["release"]["num_batches"] == 4
    assert entry["rho"] == pytest.approx(planned.accounting.rho_sequence, rel=1e-12)
    # one release alone: its rho at the ledger's delta (CKS for br-adaptive), which the plan targeted: epsilon 8
    assert entry["epsilon_spent_after"] == pytest.approx(zcdp_to_epsilon(entry["rho"], 1e-6, "cks"), rel=1e-9)
    assert entry["epsilon_spent_after"] == pytest.approx(8.0, rel=1e-9)
    assert summary["epsilon"] == pytest.approx(8.0, rel=1e-9)
    main(["ledger", "show", str(ledger)])
    assert "amin2024, rho=" in capsys.readouterr().out


def test_amin_over_budget_is_refused_and_generates_nothing(reviews, tiny_dir, tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=5.0, delta=1e-6)
    output = tmp_path / "amin.jsonl"
    assert _generate(reviews, output, tiny_dir, *AMIN, "--ledger", str(ledger)) == 2
    assert "over the budget" in capsys.readouterr().err and not output.exists()
    assert BudgetLedger(ledger).status().releases == ()


def test_adapmixed_runs_uncharged_and_is_refused_with_a_ledger(reviews, tiny_dir, tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=20.0, delta=1e-6)
    output = tmp_path / "adapmixed.jsonl"
    assert _generate(reviews, output, tiny_dir, "--mechanism", "adapmixed", "--epsilon", "8", "--ledger", str(ledger)) == 2
    assert "data-dependent" in capsys.readouterr().err and not output.exists()
    assert _generate(reviews, output, tiny_dir, "--mechanism", "adapmixed", "--epsilon", "8", "--num-texts", "2") == 0
    out = capsys.readouterr().out
    assert "data-dependent" in out and "not charged" in out
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 2 and all("spend" not in r for r in records)


@pytest.mark.parametrize("extra, message", [
    (["--top-k", "8"], "--top-k applies to --mechanism invisibleink only"),
    (["--label-columns", "label1"], "--label-columns applies to --mechanism invisibleink only"),
    (["--ray-actors", "2"], "--ray-actors applies"),
    (["--svt-noise", "0.01"], "infeasible"),
])  # fmt: skip
def test_flags_that_do_not_apply_or_cannot_work_are_refused_before_loading(reviews, tiny_dir, tmp_path, capsys, extra,
                                                                           message):
    base = [a for a in AMIN if a not in ("--svt-noise", "2")] if "--svt-noise" in extra else AMIN
    assert _generate(reviews, tmp_path / "x.jsonl", tiny_dir, *base, *extra) == 2
    assert message in capsys.readouterr().err


def test_a_baseline_never_overwrites_an_output(reviews, tiny_dir, tmp_path, capsys):
    output = tmp_path / "texts.jsonl"
    output.write_text('{"text": "earlier"}\n')
    assert _generate(reviews, output, tiny_dir, *AMIN) == 2
    assert "does not resume" in capsys.readouterr().err and output.read_text() == '{"text": "earlier"}\n'
