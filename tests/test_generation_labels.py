"""Label-conditioned generation: batches within one label group, prompted with it.

References are grouped by their label columns (the paper's Yelp setup: business category and stars);
each batch holds references of one group only (input order within the group), its labels fill the
prompt's public fields, and every record carries its batch's labels. Labels are part of the input:
a changed label is a different input, never silently resumed.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import warnings

import pytest

import invink_audit.generation as generation_module
from invink_audit.cli import main
from invink_audit.generation import GenerationConfig, PromptSpec, generate, read_generation_output
from releases import generate_flat

CATEGORIES = ["Business Category: Restaurants", "Business Category: Shopping"]
STARS = ["Review Stars: 5.0", "Review Stars: 1.0"]


def _write(path, rows):
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label1", "label2"])
        writer.writerows(rows)
    return path


@pytest.fixture()
def reviews(tmp_path):
    rows = []
    for i in range(22):  # interleaved groups, so input-order batching would mix them
        category, stars = CATEGORIES[i % 2], STARS[(i // 2) % 2]
        rows.append([f"review {i} of {category[19:]} with {stars[14:]} stars", category, stars])
    return _write(tmp_path / "reviews.csv", rows), rows


def _generate(tiny, path, **kwargs):
    options = dict(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=8.0, model=tiny, prompt="yelp", seed=3)
    options.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return generate_flat(path, label_columns=["label1", "label2"], **options)


def test_each_batch_is_one_label_group_prompted_with_its_labels(tiny, reviews, tmp_path, monkeypatch):
    path, rows = reviews
    seen = []
    real = generation_module.encode_request

    def spy(tokenizer, template, references, **kwargs):
        seen.append((dict(template.fields), tuple(references)))
        return real(tokenizer, template, references, **kwargs)

    monkeypatch.setattr(generation_module, "encode_request", spy)
    output = tmp_path / "out.jsonl"
    result = _generate(tiny, path, output=output)
    label_of = {row[0]: (row[1], row[2]) for row in rows}
    # 4 groups of 5 or 6 references: 2 + 3 + 2 + 3 ... full batches of 2, leftovers unused
    assert len(result.texts) == sum(len([r for r in rows if (r[1], r[2]) == g]) // 2 for g in set(label_of.values()))
    assert result.num_unused_references == 22 - 2 * len(result.texts)
    for fields, references in seen:
        groups = {label_of[r] for r in references}
        assert len(groups) == 1  # one group per batch
        (category, stars), = groups
        assert fields["category"] == category.removeprefix("Business Category: ")  # the labels reach the prompt
        assert fields["stars"] == stars.removeprefix("Review Stars: ")
    records = read_generation_output(output)
    for record in records:
        assert set(record["labels"]) == {"label1", "label2"}
        assert record["run"]["label_columns"] == ["label1", "label2"]
    assert [t.labels for t in result.texts] == [r["labels"] for r in records]


def test_within_a_group_batches_follow_input_order(tiny, reviews, monkeypatch):
    path, rows = reviews
    seen = []
    real = generation_module.encode_request
    monkeypatch.setattr(
        generation_module, "encode_request", lambda t, tpl, refs, **k: seen.append(tuple(refs)) or real(t, tpl, refs, **k)
    )
    _generate(tiny, path)
    group = [r[0] for r in rows if (r[1], r[2]) == (CATEGORIES[0], STARS[0])]
    assert (group[0], group[1]) in seen and (group[2], group[3]) in seen


def test_a_resumed_labelled_release_keeps_its_texts_and_a_changed_label_is_refused(tiny, reviews, tmp_path):
    path, rows = reviews
    output = tmp_path / "out.jsonl"
    first = _generate(tiny, path, output=output)
    again = _generate(tiny, path, output=output)
    assert again.num_resumed == len(first.texts) and again.tokens_generated == 0
    changed = [list(r) for r in rows]
    changed[0][2] = STARS[1]  # one label differs: another input
    _write(path, changed)
    with pytest.raises(ValueError, match="different input"):
        _generate(tiny, path, output=output)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_texts": 1}, "num_texts_per_group"),
        ({"label_fields": {"label1": "no_such_field"}}, "has no field 'no_such_field'"),
        ({"label_columns": ["label1", "missing"]}, "missing"),
        ({"label_columns": "label1"}, "sequence of column names"),
    ],
)
def test_bad_label_options_are_refused_before_the_model_loads(tiny, reviews, monkeypatch, kwargs, message):
    path, _ = reviews

    def never(*args, **kw):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(generation_module, "load_model", never)
    options = dict(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=8.0, model="smollm2", prompt="yelp", seed=3)
    options.update({"label_columns": ["label1", "label2"], **kwargs})
    with warnings.catch_warnings(), pytest.raises(ValueError, match=message):
        warnings.simplefilter("ignore")
        generate_flat(path, **options)


def test_label_options_without_label_columns_are_refused(tiny, reviews):
    path, _ = reviews
    config = GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=8.0)
    with pytest.raises(ValueError, match="only used with labelled references"):
        generate(path, dataclasses.replace(config, num_texts_per_group=1), model=tiny)
    with pytest.raises(ValueError, match="only used with labelled references"):
        generate(path, config, model=tiny, prompt=PromptSpec("generic", label_fields={"label1": "category"}))


def test_the_cli_generates_label_conditioned_texts(tiny_dir, reviews, tmp_path, capsys):
    path, _ = reviews
    output = tmp_path / "cli.jsonl"
    args = ["generate", "--input", str(path), "--output", str(output), "--batch-size", "2", "--max-new-tokens", "4",
            "--delta", "1e-6", "--epsilon", "8", "--model", str(tiny_dir), "--prompt", "yelp", "--no-progress",
            "--label-columns", "label1,label2", "--num-texts-per-group", "1", "--json"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["texts"] == 4  # one per label group
    labels = {tuple(sorted(r["labels"].items())) for r in read_generation_output(output)}
    assert len(labels) == 4
    assert main([*args[:-5], "--label-columns", "label1,", "--json"]) == 2
