"""Reading references, the data-independent partition, and prompts (null reference ≡ public prompt)."""

from __future__ import annotations

import csv
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from invink_audit.data import partition_references, read_references
from invink_audit.models import build_tiny_model
from invink_audit.prompts import PRESETS, PromptTemplate, encode_messages, encode_prompt, encode_request, get_preset

# ---------------------------------------------------------------------------------------- partition


@given(
    references=st.lists(st.one_of(st.just(""), st.text(max_size=5)), max_size=40),
    batch_size=st.integers(1, 7),
    data=st.data(),
)
def test_partition_is_consecutive_disjoint_and_content_blind(references, batch_size, data):
    available = len(references) // batch_size
    if available == 0:
        with pytest.raises(ValueError, match="needs at least"):
            partition_references(references, batch_size)
        return
    num_texts = data.draw(st.one_of(st.none(), st.integers(1, available)))
    partition = partition_references(references, batch_size, num_texts=num_texts)
    count = available if num_texts is None else num_texts
    # batch i is exactly references[i*B:(i+1)*B]: order kept, nulls kept, nothing filtered
    assert partition.batches == tuple(tuple(references[i * batch_size : (i + 1) * batch_size]) for i in range(count))
    assert partition.num_leftover == len(references) % batch_size
    assert partition.num_skipped == available - count
    assert partition.num_unused == len(references) - count * batch_size
    # changing one reference's content changes at most the batch that holds it
    if references:
        index = data.draw(st.integers(0, len(references) - 1))
        changed = list(references)
        changed[index] = "" if references[index] else "replaced"
        other = partition_references(changed, batch_size, num_texts=num_texts)
        differing = [i for i, (a, b) in enumerate(zip(partition.batches, other.batches)) if a != b]
        assert differing in ([], [index // batch_size])


def test_partition_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        partition_references(["a"], 0)
    with pytest.raises(ValueError, match="num_texts=3 needs 6 references"):
        partition_references(["a"] * 5, 2, num_texts=3)
    with pytest.raises(ValueError, match="references must be a sequence"):
        partition_references("abc", 1)
    with pytest.raises(ValueError, match=r"references\[1\]"):
        partition_references(["a", 3], 1)
    assert partition_references(["a", None], 2).batches == (("a", ""),)


def test_csv_and_jsonl_readers_keep_order_and_nulls(tmp_path):
    rows = ["first, with comma", "", 'quote " inside\nand a newline', "last"]
    path = tmp_path / "refs.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "body"])
        for i, row in enumerate(rows):
            writer.writerow([i, row])
    assert read_references(path, column="body") == rows
    with pytest.raises(ValueError, match="column 'text' not found"):
        read_references(path)

    jsonl = tmp_path / "refs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": r if r else None}) for r in rows) + "\n\n")
    assert read_references(jsonl) == rows
    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="must be a string or null"):
        read_references(tmp_path / "bad.jsonl")
    (tmp_path / "missing.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match="field 'text' missing"):
        read_references(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=".csv or .jsonl"):
        (tmp_path / "refs.txt").write_text("x")
        read_references(tmp_path / "refs.txt")
    with pytest.raises(ValueError, match="not found"):
        read_references(tmp_path / "absent.csv")


# ---------------------------------------------------------------------------------------- prompts


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_model().tokenizer


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_null_reference_gives_exactly_the_public_prompt(tokenizer, name):
    template = get_preset(name)
    public = template.messages(None)
    assert template.messages("") == public
    assert template.user_message("") == template.public.format(**template.fields)
    private = template.messages("Mr Smith was admitted on Monday.")
    assert private != public and "Mr Smith was admitted on Monday." in private[-1]["content"]
    if template.system is not None:
        assert private[0] == public[0] == {"role": "system", "content": template.system}
    request = encode_request(tokenizer, template, ["", "Mr Smith", ""])
    assert request.private_ids[0] is None and request.private_ids[2] is None
    assert request.public_ids == encode_prompt(tokenizer, template, None)
    assert request.private_ids[1] == encode_prompt(tokenizer, template, "Mr Smith")
    if not template.answer_prefix and not template.completion:  # the paper's chat prompts, as they were
        assert request.public_ids == encode_messages(tokenizer, public)


def test_presets_follow_the_paper_table():
    yelp = get_preset("yelp", category="Hotels", stars="2.0")
    assert yelp.user_message(None) == (
        'Please give me a fake Yelp customer review of a fictional business with Business Category : "Hotels" '
        'and Review Stars : "2.0" out of 5.0. Poor reviews have lower scores and good reviews have higher scores.'
    )
    assert yelp.user_message("Great stay").startswith(
        'Here is a text with Business Category : "Hotels" and Review Stars : "2.0" out of 5.0.\nText: "Great stay"'
    )
    tab = get_preset("tab").user_message(None)
    assert tab.endswith("Begin with the phrase: 'PROCEDURE: The case originated in an application'.")
    assert get_preset("mimic").user_message(None).endswith('must begin with the exact words "Discharge Instructions:".')
    # braces inside a reference are text, not format fields
    assert "{description}" in get_preset("generic").user_message("literal {description} braces")


def test_prompt_templates_are_validated():
    with pytest.raises(ValueError, match=r"must contain \{reference\}"):
        PromptTemplate(name="x", private="no field", public="public")
    with pytest.raises(ValueError, match=r"must not contain \{reference\}"):
        PromptTemplate(name="x", private="{reference}", public="{reference}")
    with pytest.raises(ValueError, match="named fields"):
        PromptTemplate(name="x", private="{0} {reference}", public="p")
    template = PromptTemplate(name="x", private="{topic}: {reference}", public="{topic}")
    with pytest.raises(ValueError, match=r"needs values for field\(s\) \['topic'\]"):
        template.messages("a")
    assert template.with_fields(topic="cats").messages(None)[-1]["content"] == "cats"
    with pytest.raises(ValueError, match="has no field"):
        template.with_fields(colour="red")
    with pytest.raises(ValueError, match="prompt must be one of"):
        get_preset("nope")
    no_system = PromptTemplate(name="x", private="{reference}", public="p", system=None)
    assert no_system.messages(None) == [{"role": "user", "content": "p"}]


def test_tokenizer_without_chat_template_is_rejected(tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        encode_messages(plain, [{"role": "user", "content": "hi"}])
