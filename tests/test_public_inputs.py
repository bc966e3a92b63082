"""Public inputs (examples, answer prefix, stop strings, field values) are published with every text: a
release refuses them when they come from the private input, before anything is charged (the same file, a
copy, a link, a subset of its records, a reference inside a public string)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from accounting import BudgetLedger
from invink_audit.cli import main
from invink_audit.generation import GenerationConfig, PromptSpec, generate
from invink_audit.prompts import MIN_QUOTED_PUBLIC_CHARS, get_preset, refuse_private_in_public

REVIEWS = [
    "The soup was cold and the waiter forgot our drinks twice.",
    "Great tacos, friendly staff, and the salsa bar is worth the trip.",
    "Slow service on a quiet night; the noodles were overcooked.",
    "Lovely staff who remembered our names after one visit.",
]
CONFIG = GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=5.0, top_k=8)
FIELDS = {"category": "Restaurants", "stars": "4.0"}


@pytest.fixture
def private_csv(tmp_path):
    path = tmp_path / "private.csv"
    path.write_text("text\n" + "".join(f'"{review}"\n' for review in REVIEWS), encoding="utf-8")
    return path


def _cli(tiny_dir, tmp_path, private_csv, examples, ledger):
    return main([
        "generate", "--input", str(private_csv), "--output", str(tmp_path / "out.jsonl"), "--model", str(tiny_dir),
        "--batch-size", "2", "--max-new-tokens", "4", "--epsilon", "5", "--delta", "1e-6", "--top-k", "8",
        "--prompt", "yelp", "--prompt-field", "category=Restaurants", "--prompt-field", "stars=4.0",
        "--public-examples", str(examples), "--ledger", str(ledger), "--no-progress",
    ])  # fmt: skip


def _subset(tmp_path, private_csv):
    subset = tmp_path / "subset.txt"
    subset.write_text(REVIEWS[2] + "\n", encoding="utf-8")
    return subset


def _symlink(tmp_path, private_csv):
    link = tmp_path / "examples.txt"
    link.symlink_to(private_csv)
    return link


def _hard_link(tmp_path, private_csv):
    link = tmp_path / "examples-hard.txt"
    os.link(private_csv, link)
    return link


def _copy(tmp_path, private_csv):
    copy = tmp_path / "copy.txt"
    copy.write_bytes(private_csv.read_bytes())
    return copy


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda tmp_path, private_csv: private_csv, "is the private --input file"),
        (_symlink, "is the private --input file"),
        (_hard_link, "is the private --input file"),
        (_copy, "is a copy of the private --input file"),
        (_subset, "public example 1 of prompt 'yelp' repeats private reference 3"),
    ],
    ids=["same-path", "symlink", "hard-link", "copy", "subset"],
)
def test_public_examples_from_the_private_file_are_refused_before_the_charge(
    make, why, tiny_dir, tmp_path, private_csv, capsys
):
    # probe: `generate --input private.csv --public-examples private.csv --ledger L` ran, was charged, and put
    # every reference verbatim into run.prompt.examples of every record of the published output
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    code = _cli(tiny_dir, tmp_path, private_csv, make(tmp_path, private_csv), ledger.path)
    err = capsys.readouterr().err
    assert code == 2, err
    assert why in err and "Nothing was charged" in err
    assert not any(review in err for review in REVIEWS)  # the message names positions, never the text
    assert ledger.status().releases == ()
    assert not (tmp_path / "out.jsonl").exists()


def test_examples_copied_from_records_left_out_by_where_are_refused(tiny_dir, tmp_path, capsys):
    """``--where`` reads only some records; the examples file is checked against the whole private file."""
    private = tmp_path / "labelled.csv"
    rows = [(review, "A" if i < 2 else "B") for i, review in enumerate(REVIEWS)]
    private.write_text("text,group\n" + "".join(f'"{text}",{group}\n' for text, group in rows), encoding="utf-8")
    examples = tmp_path / "examples.txt"
    examples.write_text(REVIEWS[3] + "\n", encoding="utf-8")  # a group-B review, not selected below
    code = main([
        "generate", "--input", str(private), "--where", "group=A", "--output", str(tmp_path / "out.jsonl"),
        "--model", str(tiny_dir), "--batch-size", "2", "--max-new-tokens", "4", "--epsilon", "5", "--delta", "1e-6",
        "--top-k", "8", "--public-examples", str(examples), "--no-progress",
    ])  # fmt: skip
    assert code == 2 and "public example 1 of prompt 'generic' repeats private reference 4" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change",
    [
        {"examples": ("A public review.", REVIEWS[1])},
        {"examples": (f"Like this: {REVIEWS[0]} and more.",)},
        {"answer_prefix": f"{REVIEWS[2]} "},
        {"stop": ("\n", REVIEWS[3])},
        {"system": f"You write reviews such as: {REVIEWS[0]}"},
    ],
    ids=["example-equal", "example-containing", "answer-prefix", "stop", "system"],
)
def test_a_reference_inside_any_public_string_is_refused_in_python(change, tiny, tmp_path):
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    template = dataclasses.replace(get_preset("yelp"), **change)
    with pytest.raises(ValueError, match="repeats private reference") as raised:
        generate(REVIEWS, CONFIG, model=tiny, prompt=PromptSpec(template, fields=FIELDS), ledger=ledger)
    assert "Nothing was charged" in str(raised.value)
    assert not any(review in str(raised.value) for review in REVIEWS)
    assert ledger.status().releases == ()


def test_a_field_value_from_the_private_data_is_refused(tiny):
    with pytest.raises(ValueError, match="prompt field 'category' of prompt 'yelp' repeats private reference 2"):
        generate(REVIEWS, CONFIG, model=tiny, prompt=PromptSpec("yelp", fields={**FIELDS, "category": REVIEWS[1]}))


def test_a_multi_line_reference_copied_line_by_line_is_refused():
    line = "We waited forty minutes for a table even though we had booked one a week ahead."
    assert len(line) >= MIN_QUOTED_PUBLIC_CHARS
    reference = f"First visit.\n{line}\nNever again."
    template = dataclasses.replace(get_preset("yelp"), examples=(line,))
    with pytest.raises(ValueError, match="public example 1 of prompt 'yelp' repeats private reference 2"):
        refuse_private_in_public(template, [None, reference])


def test_coincidences_are_not_refused():
    """A short reference inside a long public example, or a short example inside a reference, is kept;
    whitespace and case do not hide a copy."""
    template = dataclasses.replace(get_preset("yelp"), examples=("Great food and a view of the river.", "Cold soup."))
    refuse_private_in_public(template, ["Great food", "The cold soup. was awful", None, ""])
    with pytest.raises(ValueError, match="public example 2"):
        refuse_private_in_public(template, ["  COLD   soup. "])


QUOTED = [
    'The manager said "we are just here for the free breakfast" and walked off while we waited.',
    "Line one of a review about the noodles,\nand line two about the very slow service at lunch.",
    "Great tacos, friendly staff, and the salsa bar is worth the trip every single time.",
    "Lovely staff who remembered our names after one visit to the little bakery downtown.",
]


def _quoted_files(tmp_path):
    import csv
    import io
    import json

    rows = io.StringIO()
    csv.writer(rows).writerows([["text"], *[[t] for t in QUOTED]])
    private = tmp_path / "private.csv"
    private.write_text(rows.getvalue(), encoding="utf-8")
    lines = tmp_path / "csv-lines.txt"  # the CSV's own lines: quotes doubled, a field over two lines
    lines.write_text(rows.getvalue().split("\n", 1)[1], encoding="utf-8")
    jsonl = tmp_path / "copy.jsonl"  # the same rows as JSON lines: \" and \n escapes
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in QUOTED), encoding="utf-8")
    return private, lines, jsonl


@pytest.mark.parametrize("copy", ["csv-lines", "jsonl"])
def test_a_copy_of_the_private_rows_in_another_file_format_is_refused(copy, tiny_dir, tmp_path, capsys):
    # probe: the private rows written as CSV lines (quotes doubled) or as JSON lines (\" and \n escapes) were taken
    # as public examples, charged, and published in every record
    private, lines, jsonl = _quoted_files(tmp_path)
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    code = _cli(tiny_dir, tmp_path, private, lines if copy == "csv-lines" else jsonl, ledger.path)
    err = capsys.readouterr().err
    assert code == 2 and "repeats private reference" in err, err
    assert ledger.status().releases == ()


def test_a_prompt_field_from_a_record_left_out_by_where_is_refused(tiny_dir, tmp_path, capsys):
    # probe: --where plus a --prompt-field value copied from a record that is not selected was charged and published
    private = tmp_path / "labelled.csv"
    rows = [(review, "A" if i < 2 else "B") for i, review in enumerate(REVIEWS)]
    private.write_text("text,group\n" + "".join(f'"{text}",{group}\n' for text, group in rows), encoding="utf-8")
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    code = main([
        "generate", "--input", str(private), "--where", "group=A", "--output", str(tmp_path / "out.jsonl"),
        "--model", str(tiny_dir), "--batch-size", "2", "--max-new-tokens", "4", "--epsilon", "5", "--delta", "1e-6",
        "--top-k", "8", "--prompt-field", f"description={REVIEWS[3]}", "--ledger", str(ledger.path), "--no-progress",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--prompt-field description repeats private reference 4" in err, err
    assert ledger.status().releases == ()


def test_augpe_prompt_fields_from_the_private_data_are_refused_before_the_charge(tmp_path):
    # probe: AugPE took a --prompt-field category equal to a private review, was charged and published it
    from invink_audit.augpe import AugPEConfig, augpe_generate
    from invink_audit.augpe.prompts import get_augpe_prompts

    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    prompts = get_augpe_prompts("yelp", category=REVIEWS[1], stars="4.0")
    config = AugPEConfig(epsilon=4.0, delta=1e-6, num_texts=2, iterations=1, variations=2, max_new_tokens=8, prompts=prompts)
    with pytest.raises(ValueError, match="prompt field 'category' of AugPE prompts 'yelp' repeats private reference 2"):
        augpe_generate(REVIEWS, config, ledger=ledger)  # refused before any model or embedder loads
    assert ledger.status().releases == ()


LONG = ("I don't usually write reviews, but the ramen at this tiny counter was the best I've had outside Tokyo: "
        "rich pork broth, springy noodles, a perfectly jammy egg, and the chef remembered my order on the second "
        "visit even though the line was out the door.")


def _near_copies():
    import html
    import textwrap
    import urllib.parse

    return {
        "cut-mid-word": [LONG[3:150]],
        "last-two-characters-dropped": [LONG[:-2]],
        "wrapped-over-lines": textwrap.wrap(LONG, 60),
        "html-escaped": [html.escape(LONG)],
        "apostrophes-removed": [LONG.replace("'", "")],
        "zero-width-spaces": [LONG.replace("ve", "v\u200be").replace("no", "n\u00ado")],
        "percent-encoded": [urllib.parse.quote(LONG)],
        "python-escapes": [LONG.encode("unicode_escape").decode().replace(" ", "\\x20")],
    }


@pytest.mark.parametrize("kind", sorted(_near_copies()))
def test_near_copies_of_a_reference_are_refused(kind):
    # probe: a slice cut mid-word, a review wrapped at 60 columns, HTML-escaped, without apostrophes or with
    # zero-width spaces inside words got through, were charged and published
    template = dataclasses.replace(get_preset("yelp"), examples=tuple(_near_copies()[kind]))
    with pytest.raises(ValueError, match="repeats private reference 2"):
        refuse_private_in_public(template, [REVIEWS[0], LONG, None])


def test_common_phrases_shorter_than_a_copy_run_are_kept():
    """Phrases every review uses, shorter than COPY_RUN_WORDS words, are not a copy."""
    from invink_audit.prompts import COPY_RUN_WORDS

    phrase = "the food was great and the service was"
    assert len(phrase.split()) < COPY_RUN_WORDS
    template = dataclasses.replace(get_preset("yelp"), examples=(f"Honestly {phrase} quick, five stars from me.",))
    refuse_private_in_public(template, [f"We came on a Tuesday; {phrase} slow but friendly overall.", LONG])
