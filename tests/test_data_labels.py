"""Label-conditioned partition (:func:`invink_audit.data.partition_by_labels`) and labels filling prompt fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from invink_audit.data import (
    partition_by_labels,
    partition_references,
    read_labelled_references,
    read_references,
)
from invink_audit.prompts import LabelField, get_preset, label_fields_for, template_for_labels

YELP = Path(__file__).resolve().parents[2] / "shared" / "data" / "yelp" / "dev.csv"


def _labels(*pairs):
    return [{"cat": c, "stars": s} for c, s in pairs]


def test_batches_within_groups_in_input_order():
    refs = ["a0", "b0", "a1", "a2", "b1", "a3", "b2", "a4"]
    labels = _labels(*[("A", "1") if r[0] == "a" else ("B", "2") for r in refs])
    part = partition_by_labels(refs, labels, 2)
    assert [b.references for b in part.batches] == [("a0", "a1"), ("a2", "a3"), ("b0", "b1")]
    assert [dict(b.labels) for b in part.batches] == [{"cat": "A", "stars": "1"}] * 2 + [{"cat": "B", "stars": "2"}]
    assert [b.positions for b in part.batches] == [(0, 2), (3, 5), (1, 4)]
    assert [(g.num_references, g.num_batches, g.num_leftover) for g in part.groups] == [(5, 2, 1), (3, 1, 1)]
    assert part.num_unused == 2 and part.label_columns == ("cat", "stars")
    # every reference in at most one batch
    used = [p for b in part.batches for p in b.positions]
    assert len(used) == len(set(used))


def test_texts_never_move_batches():
    """Which batch a record lands in depends on positions and labels only: changing any text (to null
    or to anything else) leaves every batch's positions unchanged and changes exactly one batch."""
    refs = [f"text {i}" for i in range(20)]
    labels = _labels(*[(("A", "B", "C")[i % 3], str(i % 2)) for i in range(20)])
    base = partition_by_labels(refs, labels, 2)
    for i in range(20):
        for replacement in ("", None, "something else entirely " * 50):
            changed = list(refs)
            changed[i] = replacement
            other = partition_by_labels(changed, labels, 2)
            assert [b.positions for b in other.batches] == [b.positions for b in base.batches]
            differing = [j for j, (x, y) in enumerate(zip(base.batches, other.batches)) if x.references != y.references]
            assert len(differing) <= 1


def test_empty_reference_is_a_null_in_its_slot_and_per_group_cap():
    refs = ["x", "", None, "y", "z", "w"]
    labels = _labels(*[("A", "1")] * 6)
    part = partition_by_labels(refs, labels, 2, num_texts_per_group=2)
    assert [b.references for b in part.batches] == [("x", ""), ("", "y")]
    assert part.groups[0].num_skipped == 1 and part.groups[0].num_leftover == 0


def test_same_as_plain_partition_for_one_group():
    refs = [f"r{i}" for i in range(11)]
    plain = partition_references(refs, 3)
    part = partition_by_labels(refs, _labels(*[("A", "1")] * 11), 3)
    assert [b.references for b in part.batches] == list(plain.batches)


@pytest.mark.parametrize(
    "refs, labels, match",
    [
        (["a"], [{"c": "x"}, {"c": "y"}], "label mappings"),
        (["a", "b"], [{"c": "x"}, {"d": "x"}], "other label columns"),
        (["a"], [{"c": 3}], "must be a string"),
        (["a"], [{}], "non-empty mapping"),
        ([], [], "must not be empty"),
        (["a", "b"], [{"c": "x"}, {"c": "y"}], "no label group"),
        ("ab", [{"c": "x"}], "sequence of strings"),
        (["a"], {"c": "x"}, "sequence of mappings"),
    ],
)
def test_bad_input(refs, labels, match):
    with pytest.raises(ValueError, match=match):
        partition_by_labels(refs, labels, 2 if match == "no label group" else 1)


def test_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        partition_by_labels(["a"], [{"c": "x"}], 0)
    with pytest.raises(ValueError, match="num_texts_per_group"):
        partition_by_labels(["a"], [{"c": "x"}], 1, num_texts_per_group=0)


def test_read_labelled_references_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "refs.csv"
    csv_path.write_text('text,label1,label2\n"hello, world",Business Category: Bars,Review Stars: 4.0\n,X,\n', encoding="utf-8")
    refs = read_labelled_references(csv_path, label_columns=["label1", "label2"])
    assert refs.texts == ("hello, world", "")
    assert [dict(m) for m in refs.labels] == [
        {"label1": "Business Category: Bars", "label2": "Review Stars: 4.0"},
        {"label1": "X", "label2": ""},
    ]
    assert list(refs.texts) == read_references(csv_path)  # the text column reads as before
    jsonl = tmp_path / "refs.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in [{"text": "a", "y": "1"}, {"text": None, "y": None}]) + "\n")
    refs = read_labelled_references(jsonl, label_columns=["y"])
    assert refs.texts == ("a", "") and [dict(m) for m in refs.labels] == [{"y": "1"}, {"y": ""}]
    with pytest.raises(ValueError, match="not found in the header"):
        read_labelled_references(csv_path, label_columns=["nope"])
    with pytest.raises(ValueError, match="cannot also be a label column"):
        read_labelled_references(csv_path, label_columns=["text"])
    with pytest.raises(ValueError, match="repeat"):
        read_labelled_references(csv_path, label_columns=["label1", "label1"])
    with pytest.raises(ValueError, match="non-empty sequence"):
        read_labelled_references(csv_path, label_columns="label1")


def test_yelp_labels_fill_the_yelp_prompt():
    template = get_preset("yelp")
    filled = template_for_labels(template, {"label1": "Business Category: Bars", "label2": "Review Stars: 2.0"})
    message = filled.user_message(None)
    assert 'Business Category : "Bars"' in message and 'Review Stars : "2.0"' in message
    assert 'Business Category : "Bars"' in filled.user_message("some review")
    # the null reference is still exactly the public prompt
    assert filled.messages("") == filled.messages(None)
    assert template_for_labels(template, {"label1": "Bars", "label2": "5.0"}).fields["category"] == "Bars"


def test_label_field_rules():
    generic = get_preset("generic")
    assert label_fields_for(generic, ["description"]) == (LabelField("description", "description"),)
    assert label_fields_for(generic, ["topic"], {"topic": "description"})[0].field == "description"
    with pytest.raises(ValueError, match="fills no field"):
        label_fields_for(generic, ["topic"])
    with pytest.raises(ValueError, match="has no field"):
        label_fields_for(generic, ["topic"], {"topic": "nope"})
    with pytest.raises(ValueError, match="not label columns"):
        label_fields_for(generic, ["topic"], {"other": "description"})
    with pytest.raises(ValueError, match="same prompt field"):
        label_fields_for(get_preset("yelp"), ["label1", "category"])
    with pytest.raises(ValueError, match="empty for this group"):
        template_for_labels(get_preset("yelp"), {"label1": "Business Category: ", "label2": "4.0"})
    with pytest.raises(ValueError, match="reference"):
        LabelField("x", "reference")


@pytest.mark.skipif(not YELP.is_file(), reason="Yelp data not present (../shared/data/yelp)")
def test_yelp_file_partition():
    refs = read_labelled_references(YELP, label_columns=["label1", "label2"])
    part = partition_by_labels(refs.texts, refs.labels, 7, num_texts_per_group=2)
    assert len(part.groups) == 50  # 10 categories x 5 star ratings (paper App. D.2, "Yelp Reviews")
    for batch in part.batches:
        assert all(dict(refs.labels[p]) == dict(batch.labels) for p in batch.positions)
        template_for_labels(get_preset("yelp"), batch.labels).user_message(batch.references[0])
