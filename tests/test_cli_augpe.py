"""``invink-audit generate --mechanism augpe`` on the tiny model and MiniLM: it writes one record per text with the
public settings and nothing else from the references, charges the ledger once with the event's rho (over budget:
exit 4, nothing written), never charges the paper's convention, marks a seeded release void, refuses an existing
output, and refuses the options that do not apply, in one line with exit status 2."""

from __future__ import annotations

import json

import pytest

from accounting import AugPEEvent, BudgetLedger, plan_augpe_noise_std
from invink_audit.cli import EXIT_BAD_INPUT, EXIT_OVER_BUDGET, main
from invink_audit.generation import SEEDED_VOID_REASON, read_generation_output
from invink_audit.mechanism import SeededGeneratorWarning

REFERENCES = ["Discharge Instructions: rest at home and drink fluids.", "Discharge Instructions: take one tablet a day.",
              "", "Mr Smith was admitted to the hospital on Monday.", "The patient was given a sling for the left arm."]  # fmt: skip
EPSILON, DELTA, ITERATIONS, NUM_TEXTS, VARIATIONS = 4.0, 1e-6, 2, 3, 3


@pytest.fixture
def notes(reviews_csv):
    return reviews_csv([(t, "er" if i % 2 else "ward") for i, t in enumerate(REFERENCES)], columns=("text", "unit"))


@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: the refusals come first."""
    import invink_audit.models

    def never(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(invink_audit.models, "load_model", never)


def _augpe(notes, output, tiny_dir, *extra, progress=False):
    return main(["generate", "--mechanism", "augpe", "--input", str(notes), "--output", str(output), "--model",
                 str(tiny_dir), "--embedder", "minilm", "--num-texts", str(NUM_TEXTS), "--iterations", str(ITERATIONS),
                 "--variations", str(VARIATIONS), "--delta", str(DELTA), "--max-new-tokens", "6",
                 *([] if progress else ["--no-progress"]), *extra])  # fmt: skip


def _records(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_release_is_written_with_its_public_settings_and_charged_once(notes, tiny_dir, tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=10.0, delta=DELTA)
    output = tmp_path / "augpe.jsonl"
    assert _augpe(notes, output, tiny_dir, "--epsilon", str(EPSILON), "--ledger", str(ledger), "--json") == 0
    summary = json.loads(capsys.readouterr().out)
    records = _records(output)
    sigma = plan_augpe_noise_std(EPSILON, DELTA, ITERATIONS)
    event = AugPEEvent(sigma, ITERATIONS)
    assert summary["texts"] == len(records) == NUM_TEXTS and summary["charged"] and summary["mechanism"] == "augpe"
    assert summary["generations"] == NUM_TEXTS + ITERATIONS * (VARIATIONS - 1) * NUM_TEXTS
    assert [r["batch_index"] for r in records] == list(range(NUM_TEXTS)) and all(isinstance(r["text"], str) for r in records)
    assert read_generation_output(output) == records  # the reader of every release
    run = records[0]["run"]
    assert all(r["run"] == run and r["release_id"] == summary["release_id"] for r in records)
    assert run["mechanism"] == "augpe" and run["noise_std"] == sigma and run["sensitivity"] == "replace-by-null"
    assert (run["num_texts"], run["iterations"], run["variations"], run["delta"]) == (NUM_TEXTS, ITERATIONS, VARIATIONS, DELTA)
    assert (run["embedder"], run["prompts"]["name"], run["max_new_tokens"], run["model"]) == ("minilm", "mimic", 6, str(tiny_dir))
    guarantee = records[0]["guarantee"]
    assert guarantee["rho_sequence"] == pytest.approx(event.rho, rel=1e-12) and guarantee["composition"] == "zcdp"
    assert guarantee["epsilon"] <= EPSILON and event.gaussian_epsilon(DELTA) <= guarantee["epsilon"]
    assert (guarantee["mechanism"], guarantee["kind"]) == ("augpe", "a-priori") and summary["guarantee"] == guarantee
    # what a privacy reviewer reads beside ε: the exact Gaussian ε, the accountant, the event
    assert guarantee["gaussian_epsilon"] == pytest.approx(event.gaussian_epsilon(DELTA), rel=1e-12)
    assert guarantee["event"] == event.to_json() and isinstance(guarantee["accountant"], str)
    # the ledger: one zcdp release of the event's rho, under the id the records carry
    (entry,) = BudgetLedger(ledger).status().releases
    assert entry["release"]["kind"] == "zcdp" and entry["release"]["release_id"] == summary["release_id"]
    assert entry["rho"] == pytest.approx(event.rho, rel=1e-12)
    # nothing derived from the references but the DP texts: no reference, no count, no histogram
    written = output.read_text(encoding="utf-8")
    assert not any(reference in written for reference in REFERENCES if reference)
    assert not {"histogram", "noisy_counts", "num_references"} & {key for r in records for key in (*r, *r["run"])}


def test_over_budget_exits_4_and_writes_nothing(notes, tiny_dir, tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=2.0, delta=DELTA)
    output = tmp_path / "augpe.jsonl"
    assert _augpe(notes, output, tiny_dir, "--epsilon", str(EPSILON), "--ledger", str(ledger)) == EXIT_OVER_BUDGET
    assert "over budget" in capsys.readouterr().err and not output.exists()
    assert BudgetLedger(ledger).status().releases == ()


def test_the_papers_convention_is_never_charged_and_never_a_guarantee(notes, tiny_dir, tmp_path, capsys):
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=10.0, delta=DELTA)
    output = tmp_path / "augpe.jsonl"
    paper = ["--noise-std", "3", "--augpe-sensitivity", "paper"]
    assert _augpe(notes, output, tiny_dir, *paper, "--ledger", str(ledger)) == EXIT_BAD_INPUT  # before loading
    assert "NOT A VALID GUARANTEE" in capsys.readouterr().err and not output.exists()
    assert BudgetLedger(ledger).status().releases == ()
    assert _augpe(notes, output, tiny_dir, *paper, progress=True) == 0
    captured = capsys.readouterr()
    assert "guarantee        NONE (" in captured.out and "NOT A VALID GUARANTEE" in captured.out
    assert "none can be" in captured.err and "AugPE: generations: 100%|" in captured.err  # the progress bar
    for record in _records(output):
        assert record["guarantee"] is None and "NOT A VALID GUARANTEE" in record["guarantee_void_reason"]
        assert record["run"]["sensitivity"] == "paper" and record["run"]["noise_std"] == 3.0


def test_a_seeded_release_repeats_and_is_marked_void(notes, tiny_dir, tmp_path, capsys):
    outputs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for output in outputs:
        with pytest.warns(SeededGeneratorWarning):
            assert _augpe(notes, output, tiny_dir, "--epsilon", str(EPSILON), "--seed", "7", "--prompt", "yelp",
                          "--prompt-field", "category=Bars", "--prompt-field", "stars=4.0") == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "WARNING          fixed seed" in out and "NOT CHARGED" in out
    first, second = (_records(output) for output in outputs)
    assert [r["text"] for r in first] == [r["text"] for r in second]
    for record in first:
        assert record["guarantee"] is None and record["guarantee_void_reason"] == SEEDED_VOID_REASON
        assert record["run"]["prompts"]["fields"] == {"category": "Bars", "stars": "4.0"}
    # the command line is the Python entrance: the same settings and seed give the same texts
    # (examples/compare_augpe.py measures AugPE through augpe_generate)
    from invink_audit.augpe import AugPEConfig, augpe_generate, get_augpe_prompts
    from invink_audit.evaluation import Embedder

    config = AugPEConfig(num_texts=NUM_TEXTS, iterations=ITERATIONS, delta=DELTA, epsilon=EPSILON, variations=VARIATIONS,
                         max_new_tokens=6, prompts=get_augpe_prompts("yelp", category="Bars", stars="4.0"))  # fmt: skip
    assert config.to_json() == {k: first[0]["run"][k] for k in config.to_json()}
    with pytest.warns(SeededGeneratorWarning):
        python = augpe_generate(REFERENCES, config, model=str(tiny_dir), embedder=Embedder("minilm", cache=False), seed=7)
    assert list(python.texts) == [r["text"] for r in first]


@pytest.mark.parametrize("fields", [[], ["--prompt-field", "category=Bars"], ["--prompt-field", "stars=2.0"]])
def test_the_yelp_preset_s_example_label_values_are_refused_as_generate_refuses_them(notes, tiny_dir, tmp_path, capsys,
                                                                                    no_model_load, fields):
    # probe: --prompt yelp silently prompted every text as a 4.0-star restaurant review (the preset's example values),
    # which generate refuses for InvisibleInk; refused here too, before anything is loaded or charged
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=10.0, delta=DELTA)
    before = ledger.read_bytes()
    output = tmp_path / "augpe.jsonl"
    code = _augpe(notes, output, tiny_dir, "--epsilon", str(EPSILON), "--prompt", "yelp", "--ledger", str(ledger), *fields)
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and err.count("\n") == 1 and "would prompt every text with the example value" in err
    defaulted = {"category", "stars"} - {f.split("=")[0] for f in fields[1::2]}
    assert all(f"--prompt-field {name}=" in err for name in defaulted) and "Nothing was charged" in err
    assert ledger.read_bytes() == before and not output.exists()


@pytest.mark.parametrize("where", [[], ["--where", "unit=ward"]], ids=["all", "where"])
def test_a_prompt_field_from_the_private_input_is_refused_before_the_model_loads(notes, tiny_dir, tmp_path, capsys,
                                                                                  no_model_load, where):
    # probe: AugPE took --prompt-field category=<a private review>, was charged and published it in every record;
    # with --where, a review the selection leaves out (REFERENCES[1] is unit "er") is refused too
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=10.0, delta=DELTA)
    before = ledger.read_bytes()
    output = tmp_path / "augpe.jsonl"
    code = _augpe(notes, output, tiny_dir, "--epsilon", str(EPSILON), "--prompt", "yelp", "--ledger", str(ledger),
                  "--prompt-field", f"category={REFERENCES[1]}", "--prompt-field", "stars=4.0", *where)
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and "prompt field 'category' of AugPE prompts 'yelp' repeats private reference" in err
    assert REFERENCES[1] not in err and ledger.read_bytes() == before and not output.exists()


def test_an_existing_output_is_refused_and_kept(notes, tiny_dir, tmp_path, capsys, no_model_load):
    output = tmp_path / "augpe.jsonl"
    output.write_text("keep me\n")
    assert _augpe(notes, output, tiny_dir, "--epsilon", str(EPSILON)) == EXIT_BAD_INPUT
    assert "exists; AugPE writes its texts once" in capsys.readouterr().err and output.read_text() == "keep me\n"
    assert _augpe(notes, tmp_path, tiny_dir, "--epsilon", str(EPSILON)) == EXIT_BAD_INPUT
    assert "is a directory" in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--batch-size", "3"], "--batch-size does not apply to --mechanism augpe"),
    (["--top-k", "8"], "--top-k does not apply to --mechanism augpe"),
    (["--clip-norm", "1"], "--clip-norm does not apply to --mechanism augpe"),
    (["--label-columns", "unit"], "--label-columns does not apply to --mechanism augpe"),
    (["--stop", "."], "--stop does not apply to --mechanism augpe"),
    (["--svt-noise", "2"], "--svt-noise applies to --mechanism amin only; remove it for --mechanism augpe"),
    (["--top-k", "100"], "--top-k does not apply"),  # given, even at its default: refused, not ignored
    (["--ray-gpus-per-actor", "0"], "--ray-gpus-per-actor does not apply"),
    (["--ray-actors", "2"], "--ray-actors does not apply to --mechanism augpe"),
    (["--noise-std", "3"], "exactly one of --epsilon"),
    (["--prompt", "generic"], "prompts must be one of ['mimic', 'yelp']"),
    (["--prompt-field", "stars=5"], "have no field(s) ['stars']"),
    (["--variations", "1"], "variations must be an integer >= 2"),
    (["--column", "missing"], "column"),
    (["--where", "unit=icu"], "no record has unit=icu"),
    (["--model", "./no/such/model-dir"], "model directory './no/such/model-dir' does not exist"),
    (["--embedder", "bert"], "invalid choice: 'bert'"),
    (["--ledger", "absent-ledger.json"], "no ledger at 'absent-ledger.json'"),
])  # fmt: skip
def test_options_that_do_not_apply_and_bad_input_are_refused_in_one_line_before_loading(notes, tiny_dir, tmp_path, capsys,
                                                                                        no_model_load, extra, message):
    output = tmp_path / "augpe.jsonl"
    try:
        code = _augpe(notes, output, tiny_dir, "--epsilon", str(EPSILON), *extra)
    except SystemExit as stop:  # argparse's own choices: one line and exit 2 too
        code = stop.code
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT and message in err and err.count("\n") == 1 and not output.exists()


def test_a_missing_input_or_empty_references_are_refused(reviews_csv, tiny_dir, tmp_path, capsys, no_model_load):
    output = tmp_path / "augpe.jsonl"
    assert _augpe(tmp_path / "absent.csv", output, tiny_dir, "--epsilon", "4") == EXIT_BAD_INPUT
    assert "not found" in capsys.readouterr().err
    nulls = reviews_csv([("",), ("",)], columns=("text",), name="nulls.csv")
    assert _augpe(nulls, output, tiny_dir, "--epsilon", "4") == EXIT_BAD_INPUT
    assert "are empty (nulls)" in capsys.readouterr().err and not output.exists()


@pytest.mark.parametrize("argv, message", [
    (["--mechanism", "amin", "--batch-size", "2", "--epsilon", "8", "--iterations", "2"],
     "--iterations applies to --mechanism augpe only"),
    (["--epsilon", "8", "--embedder", "minilm", "--batch-size", "2"], "--embedder applies to --mechanism augpe only"),
    (["--epsilon", "8"], "required: --batch-size"),
    (["--epsilon", "8", "--batch-size", "2", "--svt-threshold", "0.7"], "--svt-threshold applies to --mechanism amin only"),
    (["--mechanism", "adapmixed", "--epsilon", "8", "--batch-size", "2", "--max-private-tokens", "2"],
     "--max-private-tokens applies to --mechanism amin only"),
])  # fmt: skip
def test_augpe_options_are_refused_for_the_other_mechanisms(notes, tiny_dir, tmp_path, capsys, no_model_load, argv,
                                                           message):
    code = main(["generate", "--input", str(notes), "--output", str(tmp_path / "x.jsonl"), "--model", str(tiny_dir),
                 "--delta", "1e-6", "--max-new-tokens", "4", *argv])  # fmt: skip
    assert code == EXIT_BAD_INPUT and message in capsys.readouterr().err
