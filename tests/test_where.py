"""``--where COLUMN=VALUE`` on generate and sweep (:func:`invink_audit.data.select_references`): records
selected by public attributes, in file order, never by the text column; a bad selection is one clear
error and nothing is generated or charged."""

from __future__ import annotations

import json

import pytest

from invink_audit.cli import main
from invink_audit.data import LabelledReferences, select_references
from invink_audit.evaluation.sweep import SweepConfig

ROWS = [
    ("Soup was cold.", "Restaurants", "1.0"),
    ("Nice rooms.", "Hotels", "5.0"),
    ("Great tacos!", "Restaurants", "5.0"),
    ("", "Restaurants", "1.0"),
    ("Slow check-in.", "Hotels", "2.0"),
    ("Lovely staff.", "Restaurants", "5.0"),
    ("Loud music.", "Restaurants", "1.0"),
]


@pytest.fixture
def reviews(reviews_csv):
    return reviews_csv(ROWS)


def test_selection_keeps_file_order_and_the_label_columns_asked_for(reviews):
    texts = select_references(reviews, {"label1": "Restaurants"})
    assert texts == [t for t, c, _ in ROWS if c == "Restaurants"]  # the null kept: its slot is selected by attribute
    both = select_references(reviews, {"label1": "Restaurants", "label2": "1.0"})
    assert both == ["Soup was cold.", "", "Loud music."]
    labelled = select_references(reviews, {"label1": "Restaurants"}, label_columns=("label2",))
    assert isinstance(labelled, LabelledReferences) and labelled.label_columns == ("label2",)
    assert [dict(x) for x in labelled.labels] == [{"label2": s} for _, c, s in ROWS if c == "Restaurants"]


def test_a_neighbour_that_nulls_a_text_selects_the_same_slots(reviews, tmp_path):
    neighbour = tmp_path / "neighbour.csv"
    rows = [("", c, s) if i == 2 else (t, c, s) for i, (t, c, s) in enumerate(ROWS)]
    neighbour.write_text("text,label1,label2\n" + "".join(f'"{t}",{c},{s}\n' for t, c, s in rows), encoding="utf-8")
    a, b = select_references(reviews, {"label1": "Restaurants"}), select_references(neighbour, {"label1": "Restaurants"})
    assert len(a) == len(b) and [x for x, y in zip(a, b) if x != y] == ["Great tacos!"]


@pytest.mark.parametrize(
    ("where", "message"),
    [({"text": "Great tacos!"}, "text column"), ({"label1": "Bars"}, "no record has label1=Bars"), ({}, "at least one"),
     ({"label1": 5}, "string values")],
)
def test_bad_selections_are_refused(reviews, where, message):
    with pytest.raises(ValueError, match=message):
        select_references(reviews, where)
    assert "Great tacos" not in message or where == {"text": "Great tacos!"}


def test_generate_where_from_the_command_line(reviews, tiny_dir, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    common = ["generate", "--input", str(reviews), "--model", str(tiny_dir), "--batch-size", "1", "--max-new-tokens",
              "2", "--epsilon", "5", "--delta", "1e-6", "--top-k", "8", "--no-progress"]
    code = main([*common, "--output", str(output), "--where", "label1=Restaurants", "--where", "label2=5.0",
                 "--label-columns", "label2", "--prompt", "yelp", "--prompt-field", "category=Restaurants"])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 2 and {r["labels"]["label2"] for r in records} == {"5.0"}  # the two 5-star restaurants
    assert all(r["prompt_fields"] == {"category": "Restaurants", "stars": "5.0"} for r in records)
    for bad, message in ((["--where", "label1"], "COLUMN=VALUE"), (["--where", "label1=Bars"], "no record has"),
                         (["--where", "text=Great tacos!"], "text column"),
                         (["--where", "label1=Hotels", "--where", "label1=Bars"], "two values")):
        code = main([*common, "--output", str(tmp_path / "bad.jsonl"), *bad])
        assert code == 2 and message in capsys.readouterr().err
        assert not (tmp_path / "bad.jsonl").exists()


def test_sweep_config_checks_its_selection():
    assert SweepConfig(epsilons=(1.0,), batch_sizes=(2,), where={"label1": "Restaurants"}).where == {"label1": "Restaurants"}
    for bad in ({}, {"label1": 3}, {"text": "x"}):
        with pytest.raises(ValueError, match="where"):
            SweepConfig(epsilons=(1.0,), batch_sizes=(2,), where=bad)
