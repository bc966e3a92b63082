"""``invink-audit generate --mechanism amin|adapmixed``: the paper's baselines through the one release pipeline.

Amin et al. is charged to the ledger as a zCDP release before it generates (and over budget, refused with
nothing generated); AdaPMixED's data-dependent spend is never charged nor written; a baseline release is
label-conditioned, resumed and audited from its file like an InvisibleInk release (``audit --release``);
``--top-k`` (InvisibleInk's) is refused, not ignored.
"""

from __future__ import annotations

import json

import pytest

from accounting import BudgetLedger, zcdp_to_epsilon
from invink_audit.cli import main
from invink_audit.mechanisms import AminConfig

TEXTS = [f"Review {i}: the soup was {'great' if i % 2 else 'cold'} and the bread {'fresh' if i % 3 else 'stale'}."
         for i in range(12)]  # fmt: skip
STARS = ["1.0", "5.0"]


@pytest.fixture
def reviews(reviews_csv):
    return reviews_csv([(t,) for t in TEXTS], columns=("text",))


@pytest.fixture
def labelled(reviews_csv):
    return reviews_csv([(t, STARS[i % 2]) for i, t in enumerate(TEXTS)], columns=("text", "stars"))


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
    assert summary["texts"] == len(records) == 4 and summary["guarantee"]["kind"] == "a-priori"
    assert {r["run"]["mechanism"]["name"] for r in records} == {"amin2024"} and all("spend" not in r for r in records)
    assert all(len(r["modes"]) == r["num_tokens"] for r in records)  # each token's mode: public or private
    entry = BudgetLedger(ledger).status().releases[0]
    planned = AminConfig.planned(epsilon=8.0, delta=1e-6, batch_size=3, max_private_tokens=4, svt_noise=2.0)
    assert entry["release"]["kind"] == "zcdp" and entry["release"]["num_batches"] == 4
    assert entry["rho"] == pytest.approx(planned.accounting.rho_sequence, rel=1e-12)
    # one release alone: its rho at the ledger's delta (CKS for br-adaptive), which the plan targeted: epsilon 8
    assert entry["epsilon_spent_after"] == pytest.approx(zcdp_to_epsilon(entry["rho"], 1e-6, "cks"), rel=1e-9)
    assert entry["epsilon_spent_after"] == pytest.approx(8.0, rel=1e-9)
    assert summary["guarantee"]["epsilon"] == pytest.approx(8.0, rel=1e-9)
    main(["ledger", "show", str(ledger)])
    assert "amin2024, rho=" in capsys.readouterr().out
    # a rerun resumes the release (nothing drawn, nothing charged again)
    assert _generate(reviews, output, tiny_dir, *AMIN, "--ledger", str(ledger), "--json") == 0
    assert json.loads(capsys.readouterr().out)["resumed"] == 4 and len(BudgetLedger(ledger).status().releases) == 1


def test_a_label_conditioned_amin_release_is_audited_from_its_file(labelled, tiny_dir, tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=20.0, delta=1e-6)
    output = tmp_path / "amin.jsonl"
    code = _generate(labelled, output, tiny_dir, *AMIN, "--ledger", str(ledger), "--label-columns", "stars",
                     "--prompt", "yelp", "--prompt-field", "category=Restaurants", "--num-texts-per-group", "1")
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(r["labels"]["stars"] for r in records) == STARS
    assert {r["prompt_fields"]["stars"] for r in records} == set(STARS)
    capsys.readouterr()
    code = main(["audit", "--release", str(output), "--input", str(labelled), "--model", str(tiny_dir),
                 "--sampled-batch", "none", "--output", str(tmp_path / "audit"), "--json"])
    assert code == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "audit" / "report.json").read_text())
    assert report["verdict"] == "PASS" and report["mechanism"] == "amin2024"


def test_amin_over_budget_is_refused_and_generates_nothing(reviews, tiny_dir, tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=5.0, delta=1e-6)
    output = tmp_path / "amin.jsonl"
    assert _generate(reviews, output, tiny_dir, *AMIN, "--ledger", str(ledger)) == 4
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
    assert "DATA-DEPENDENT" in out and "NOT CHARGED" in out
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 2 and all("spend" not in r for r in records)
    assert {r["guarantee"]["kind"] for r in records} == {"data-dependent"}


@pytest.mark.parametrize("extra, message", [
    (["--top-k", "8"], "--top-k applies to --mechanism invisibleink only"),
    (["--top-k", "100"], "--top-k applies to --mechanism invisibleink only"),  # its default, given: still refused
    (["--svt-noise", "0.01"], "infeasible"),
])  # fmt: skip
def test_flags_that_do_not_apply_or_cannot_work_are_refused_before_loading(reviews, tiny_dir, tmp_path, capsys, extra,
                                                                           message):
    base = [a for a in AMIN if a not in ("--svt-noise", "2")] if "--svt-noise" in extra else AMIN
    assert _generate(reviews, tmp_path / "x.jsonl", tiny_dir, *base, *extra) == 2
    assert message in capsys.readouterr().err
