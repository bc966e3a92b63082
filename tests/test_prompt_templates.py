"""Templates that fit small models: a public answer start, public stop strings, public
few-shot examples and completion-style prompts for base models, none of which reads private data."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from invink_audit.engine import FINISH_STOP, Engine
from invink_audit.generation import GenerationConfig, PromptSpec, generate
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.models import build_tiny_model
from invink_audit.prompts import (
    PromptTemplate,
    encode_prompt,
    encode_request,
    get_preset,
    release_text,
    template_for_labels,
)


#: the Yelp presets' label fields, given explicitly (their example values alone are refused by generate)
FIELDS = {"category": "Restaurants", "stars": "4.0"}


def _generator(seed=0):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(seed)


def test_the_answer_prefix_starts_every_row_and_a_null_reference_is_the_public_row(tiny):
    template = get_preset("yelp", stars="1.0")
    answer = tiny.tokenizer('Review (1.0 stars): "', add_special_tokens=False)["input_ids"]
    request = encode_request(tiny.tokenizer, template, ["The soup was cold.", None, ""])
    for ids in (request.public_ids, request.private_ids[0]):
        assert list(ids[-len(answer):]) == answer
    assert request.private_ids[1] is None and request.private_ids[2] is None
    assert request.stop == ('"',)
    # labels fill the answer prefix too (a public field of the batch)
    labelled = template_for_labels(template, {"label2": "Review Stars: 5.0", "label1": "Business Category: Bars"})
    assert labelled.answer_start() == 'Review (5.0 stars): "'


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40).filter(str.strip)


@given(references=st.lists(_TEXT, min_size=1, max_size=3), examples=st.lists(_TEXT, max_size=2))
def test_no_private_byte_reaches_the_public_row_or_the_template(references, examples):
    """The public row, the answer start, the stop strings and the shared prefix are functions of the
    template alone; a private row is the public template's rendering with one reference inserted."""
    tokenizer = _TOKENIZER
    template = dataclasses.replace(get_preset("yelp"), examples=tuple(examples))
    request = encode_request(tokenizer, template, references)
    alone = encode_request(tokenizer, template, ["placeholder"])
    assert request.public_ids == alone.public_ids == encode_prompt(tokenizer, template, None)
    assert request.private_prefix == alone.private_prefix
    assert request.stop == alone.stop == template.stop
    for reference, ids in zip(references, request.private_ids):
        message = template.messages(reference)[-1]["content"]
        assert reference in message and message.endswith(template.private.format(**template.fields, reference=reference))
        assert ids == encode_prompt(tokenizer, template, reference)


_TOKENIZER = build_tiny_model(seed=5).tokenizer


def test_release_text_cuts_at_the_first_stop_string(tiny):
    ids = tiny.tokenizer('Great tacos." Then more', add_special_tokens=False)["input_ids"]
    assert release_text(tiny.tokenizer, ids, ('"',)) == "Great tacos."
    assert release_text(tiny.tokenizer, ids, ()) == 'Great tacos." Then more'
    assert release_text(tiny.tokenizer, ids, ("Then", '"')) == "Great tacos."


def test_the_engine_ends_a_text_at_its_public_stop_string(tiny):
    """Teacher-forced tokens that spell a closing quote: the text ends with reason 'stop' right after
    the token that completes it, and the released text is cut before it."""
    template = get_preset("yelp")
    forced = tiny.tokenizer('Nice place." and then it goes on and on', add_special_tokens=False)["input_ids"]
    quote_at = next(i for i in range(len(forced)) if '"' in tiny.tokenizer.decode(forced[: i + 1]))

    def rule(step):
        weights = torch.full_like(step.log_probs, -math.inf)
        for g, t in enumerate(step.positions.tolist()):
            weights[g, forced[t]] = 0.0
        return weights

    engine = Engine(tiny, MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=2))
    request = encode_request(tiny.tokenizer, template, ["Good food.", "Bad service."])
    (text,) = engine.generate([request], max_new_tokens=len(forced), generator=_generator(), sampling_rule=rule)
    assert text.finish_reason == FINISH_STOP
    assert list(text.token_ids) == forced[: quote_at + 1]
    assert release_text(tiny.tokenizer, text.token_ids, template.stop) == "Nice place."


def test_public_examples_are_in_every_rows_prompt(tiny):
    template = dataclasses.replace(get_preset("yelp"), examples=("Loved the pho.", "Too loud."))
    for reference in (None, "The soup was cold."):
        message = template.messages(reference)[-1]["content"]
        assert '"Loved the pho."' in message and '"Too loud."' in message
    with pytest.raises(ValueError, match="examples"):
        dataclasses.replace(template, examples="one string")
    with pytest.raises(ValueError, match="answer_prefix must not contain"):
        dataclasses.replace(template, answer_prefix="{reference}")


def test_a_base_model_gets_the_completion_twin_of_a_chat_preset_and_refuses_another_chat_template(tmp_path):
    base = build_tiny_model(seed=5)
    base.tokenizer.chat_template = None
    references = ["The soup was cold.", "Great tacos!", "Slow service.", "Lovely staff."]
    config = GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=5.0, top_k=8)
    changed = dataclasses.replace(get_preset("yelp"), stop=("!",))  # not the preset: no twin to stand for it
    with pytest.raises(ValueError, match="no chat template"):
        generate(references, config, model=base, prompt=PromptSpec(changed, fields=FIELDS))
    twin = tmp_path / "twin.jsonl"
    generate(references, config, model=base, prompt=PromptSpec("yelp", fields=FIELDS), output=twin)
    prompt = json.loads(twin.read_text().splitlines()[0])["run"]["prompt"]
    assert prompt["name"] == "yelp-completion" and prompt["completion"] is True  # the record says what ran
    assert prompt["fields"] == FIELDS
    output = tmp_path / "out.jsonl"
    result = generate(references, GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=5.0, top_k=8),
                      model=base, prompt=PromptSpec("yelp-completion", fields=FIELDS), output=output)
    assert len(result.texts) == 2
    record = json.loads(output.read_text().splitlines()[0])
    assert record["run"]["prompt"]["completion"] is True and record["run"]["prompt"]["stop"] == ['"']
    request = encode_request(base.tokenizer, get_preset("yelp-completion"), ["x"])
    assert base.tokenizer.decode(request.public_ids).endswith('5 stars:\n\n"')


def test_generate_cli_takes_answer_prefix_stop_and_public_examples(tiny_dir, tmp_path, capsys):
    from invink_audit.cli import main

    references = tmp_path / "refs.csv"
    references.write_text("text\nThe soup was cold.\nGreat tacos!\nSlow service.\nLovely staff.\n")
    examples = tmp_path / "public.txt"
    examples.write_text("A public review.\n\nAnother one.\n")
    output = tmp_path / "out.jsonl"
    code = main([
        "generate", "--input", str(references), "--output", str(output), "--model", str(tiny_dir),
        "--batch-size", "2", "--max-new-tokens", "4", "--epsilon", "5", "--delta", "1e-6", "--top-k", "8",
        "--prompt", "yelp", "--prompt-field", "category=Restaurants", "--prompt-field", "stars=4.0",
        "--answer-prefix", "Review: '", "--stop", "'", "--stop", "\n",
        "--public-examples", str(examples),
    ])
    assert code == 0, capsys.readouterr().err
    prompt = json.loads(output.read_text().splitlines()[0])["run"]["prompt"]
    assert prompt["answer_prefix"] == "Review: '" and prompt["stop"] == ["'", "\n"]
    assert prompt["examples"] == ["A public review.", "Another one."]
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    code = main([
        "generate", "--input", str(references), "--output", str(tmp_path / "o2.jsonl"), "--model", str(tiny_dir),
        "--batch-size", "2", "--max-new-tokens", "4", "--epsilon", "5", "--delta", "1e-6",
        "--public-examples", str(bad),
    ])
    assert code == 2 and "latin1.txt" in capsys.readouterr().err


def test_sweep_takes_the_same_public_template_flags_as_generate(tmp_path, monkeypatch):
    """``invink-audit sweep`` builds its points' template from --answer-prefix, --stop and
    --public-examples as generate does (nothing is generated: run_sweep is replaced by a recorder)."""
    import invink_audit.evaluation.sweep as sweep
    from invink_audit.cli import main

    seen = {}

    def record(references, real, output, config, *args, **kwargs):
        seen["config"] = config
        (Path(output)).mkdir(parents=True, exist_ok=True)
        (Path(output) / "sweep.md").write_text("table\n")
        return []

    monkeypatch.setattr(sweep, "run_sweep", record)
    examples = tmp_path / "public.txt"
    examples.write_text("A public review.\nAnother one.\n")
    refs = tmp_path / "refs.csv"
    refs.write_text("text\nThe soup was cold.\nGreat tacos!\n")
    code = main([
        "sweep", "--input", str(refs), "--real", str(refs), "--output", str(tmp_path / "sweep"), "--epsilons", "3",
        "--batch-sizes", "2", "--public-proxy", "--prompt", "generic", "--prompt-field", "description=notes",
        "--answer-prefix", "Note: '", "--stop", "'", "--public-examples", str(examples), "--no-progress",
    ])  # fmt: skip
    assert code == 0
    template = seen["config"].prompt
    assert isinstance(template, PromptTemplate) and template.name == "generic"
    assert (template.answer_prefix, template.stop, template.examples) == ("Note: '", ("'",), ("A public review.", "Another one."))
    assert seen["config"].prompt_fields == {"description": "notes"}


def test_the_paper_prompt_stays_available_and_unchanged():
    paper = get_preset("yelp-paper")
    assert paper.answer_prefix == "" and paper.stop == () and not paper.completion
    assert get_preset("yelp").private == paper.private and get_preset("yelp").public == paper.public
    assert PromptTemplate.from_json(get_preset("yelp").as_json()) == get_preset("yelp")
    # a recorded list that is not one is a TypeError, which a release's state reader reports as unreadable
    with pytest.raises(TypeError):
        PromptTemplate.from_json({**get_preset("yelp").as_json(), "stop": 5})


def test_a_base_model_release_is_audited_with_its_completion_prompt(tmp_path):
    """A model without a chat template generates with a completion preset and the quick audit (exact
    checks and a sampled batch) replays it with the same plain-text prompt (base models are accepted by
    generate, sweep and audit)."""
    from invink_audit.audit.quick import quick_audit

    base = build_tiny_model(seed=5)
    base.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="chat template"):  # a chat preset without a completion twin
        generate(["a b", "c d"], GenerationConfig(batch_size=2, max_new_tokens=2, delta=1e-6, epsilon=5.0), model=base,
                 prompt="mimic")
    for prompt in ("generic-completion", "generic"):  # generic runs as its twin, and is audited as it ran
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SeededGeneratorWarning)
            result = generate(["Anna liked the soup.", "", "Bo found the waiter rude.", "Cy came back twice."],
                              GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=5.0, top_k=8),
                              model=base, prompt=PromptSpec(prompt, fields={"description": "reviews"}), seed=1)
        report = quick_audit(result, model=base, sampled_batch=0, num_samples=16, generator=_generator(2))
        assert report.step_checks > 0 and sum(report.step_failures.values()) == 0
        assert report.verdict.value != "VIOLATION"


def test_template_for_model_picks_the_twin_only_for_a_base_model_and_an_unchanged_preset():
    from invink_audit.prompts import COMPLETION_PRESETS, template_for_model

    base, chat = build_tiny_model(seed=5).tokenizer, build_tiny_model(seed=5).tokenizer
    base.chat_template = None
    for name, twin in COMPLETION_PRESETS.items():
        template = dataclasses.replace(get_preset(name, **({"stars": "2.0"} if name == "yelp" else {})),
                                       examples=("A public example.",))
        fitted = template_for_model(template, base)
        assert fitted.name == twin and fitted.completion and fitted.examples == ("A public example.",)
        assert dict(fitted.fields) == {**get_preset(twin).fields, **template.fields}
        assert template_for_model(template, chat) is template  # a chat model keeps its chat template
    for kept in (get_preset("yelp-completion"), get_preset("mimic"), dataclasses.replace(get_preset("yelp"), answer_prefix="")):
        assert template_for_model(kept, base) is kept
