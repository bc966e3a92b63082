"""``audit --release`` audits what was published: every record's text, claim and settings against the state and
the journal, missing, duplicated and unpublished batches, the state's own settings, and the model by the fingerprint
of its weights and tokenizer. Each probe edits a copy of one small release the way the privacy-hygiene issue did;
each finding is named and the verdict is never a PASS; a record that is not a text record is one line, exit 2."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from invink_audit.audit.quick import audit_release_file
from invink_audit.audit.stats import Verdict
from invink_audit.cli import EXIT_BAD_INPUT, main
from invink_audit.models import build_tiny_model, load_model
from releases import generate_flat

REFERENCES = [f"Review {i}: the soup was {'great' if i % 2 else 'cold'}." for i in range(8)]
OPTIONS = dict(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=4.0, top_k=8)  # 4 batches
FILES = ("out.jsonl", "out.jsonl.state.json", "out.jsonl.sampled", "refs.jsonl")


@pytest.fixture(scope="module")
def release(tiny_dir, tmp_path_factory):
    """One unseeded release of 4 batches (its output, state, journal and input), shared by the module: each test
    edits a copy."""
    root = tmp_path_factory.mktemp("release")
    (root / "refs.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in REFERENCES), encoding="utf-8")
    generate_flat(root / "refs.jsonl", output=root / "out.jsonl", model=str(tiny_dir), **OPTIONS)
    return root


@pytest.fixture
def copy(release, tmp_path):
    for name in FILES:
        shutil.copy(release / name, tmp_path / name)
    return tmp_path


def _lines(path):
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(path, items):
    path.write_text("".join(json.dumps(item) + "\n" for item in items), encoding="utf-8")


def _edit_records(root, edit):
    records = _lines(root / "out.jsonl")
    _write(root / "out.jsonl", edit(records) or records)


def _edit_state(root, edit):
    state = json.loads((root / "out.jsonl.state.json").read_text())
    edit(state["run"])
    (root / "out.jsonl.state.json").write_text(json.dumps(state))


def _audit(root, tiny_dir, model=None):
    return audit_release_file(root / "out.jsonl", root / "refs.jsonl", model=model or str(tiny_dir), sampled_batch=None)


def _kinds(report) -> set:
    return {f.kind for f in report.findings}


def test_an_untouched_release_passes_with_no_finding(copy, tiny_dir):
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.PASS and report.findings == () and report.texts_audited == 4
    # the records claim what the accountant certifies for the planned C (the target 4, on the safe side)
    assert report.claimed_epsilon == report.accountant_epsilon == pytest.approx(4.0, rel=1e-6)
    assert "the release claims eps = 4 (its published records)" in report.summary()


def test_records_edited_to_claim_a_smaller_epsilon_are_a_violation(copy, tiny_dir):
    _edit_records(copy, lambda rs: [r["guarantee"].update(epsilon=0.5) for r in rs] and None)
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.VIOLATION and _kinds(report) == {"edited-claim"}
    # the claim printed is the release's (0.5), the accountant's figure beside it is recomputed from the settings
    assert report.claimed_epsilon == 0.5 and report.accountant_epsilon == pytest.approx(4.0, rel=1e-3)
    summary = report.summary()
    assert "the release claims eps = 0.5" in summary and "certify only ε = 4" in summary


def test_an_edited_clip_norm_in_the_records_is_a_violation(copy, tiny_dir):
    def edit(records):
        for r in records:
            r["guarantee"]["clip_norm"] = r["run"]["clip_norm"] = 0.01

    _edit_records(copy, edit)
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.VIOLATION and "edited-claim" in _kinds(report)
    assert any("clip_norm" in f.message or "epsilon0" in f.message for f in report.findings)


def test_a_text_that_was_never_drawn_is_a_violation(copy, tiny_dir):
    def edit(records):
        records[1].update(text="a text nobody drew", token_ids=records[1]["token_ids"][:1], num_tokens=1)

    _edit_records(copy, edit)
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.VIOLATION and _kinds(report) == {"text-not-drawn"}
    assert report.findings[0].batches == (1,) and report.texts_audited == 3  # the others are still audited


def test_tokens_the_mechanism_cannot_draw_are_a_finding_without_a_journal(copy, tiny_dir):
    (copy / "out.jsonl.sampled").unlink()
    eos = load_model(tiny_dir, dtype="float32").eos_token_ids[0]
    _edit_records(copy, lambda rs: rs[2].update(token_ids=[eos, 5, 6], num_tokens=3) and None)
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.VIOLATION and _kinds(report) == {"text-not-drawn", "unverified-text"}
    # named twice: its text is not its tokens' decoding, and its tokens are not what the mechanism could draw
    assert {f.batches for f in report.findings if f.kind == "text-not-drawn"} == {(2,)} and report.texts_audited == 3


def test_a_dropped_record_is_named(copy, tiny_dir):
    _edit_records(copy, lambda rs: rs[:1] + rs[2:])
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.INCONCLUSIVE and _kinds(report) == {"missing-record", "partial-release"}
    assert next(f for f in report.findings if f.kind == "missing-record").batches == (1,)


def test_a_duplicated_record_is_named(copy, tiny_dir):
    _edit_records(copy, lambda rs: rs + [rs[0]])
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.INCONCLUSIVE and _kinds(report) == {"duplicated-record"}
    assert "batch 0 on lines 1, 5" in report.findings[0].message


def test_a_partial_release_is_named(copy, tiny_dir):
    _edit_records(copy, lambda rs: rs[:2])  # batches 0 and 1; the run stopped before it drew the others
    journal = _lines(copy / "out.jsonl.sampled")  # in the order the texts finished
    _write(copy / "out.jsonl.sampled", [line for line in journal if line["batch_index"] < 2])
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.INCONCLUSIVE and _kinds(report) == {"partial-release"}
    assert "2 of the release's 4 batches are published" in report.findings[0].message


def test_a_state_edited_to_a_large_clip_norm_is_named_whatever_the_realised_loss(copy, tiny_dir):
    # the audit rebuilt the mechanism from the edited state (C = 50) and passed it, with a negative realised loss
    _edit_state(copy, lambda run: run.update(clip_norm=50.0))
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.INCONCLUSIVE and _kinds(report) == {"state-inconsistent"}
    assert report.accountant_epsilon > 100 and report.claimed_epsilon == pytest.approx(4.0, rel=1e-6)
    assert any("clip_norm" in f.message for f in report.findings)


def test_another_model_under_the_recorded_name_is_named(copy, tiny_dir):
    impostor = dataclasses.replace(build_tiny_model(seed=6), name=str(tiny_dir))  # the same path, other weights
    report = _audit(copy, tiny_dir, model=impostor)
    assert report.verdict is Verdict.INCONCLUSIVE and _kinds(report) == {"model-mismatch"} and report.texts_audited == 0
    with pytest.raises(ValueError, match="give --model"):  # another name and other weights: the wrong --model
        _audit(copy, tiny_dir, model=build_tiny_model(seed=6))


def test_an_empty_recorded_model_name_skips_no_check(copy, tiny_dir):
    _edit_state(copy, lambda run: run.update(model=""))
    assert _kinds(_audit(copy, tiny_dir)) == {"state-inconsistent"}
    impostor = dataclasses.replace(build_tiny_model(seed=6), name="anything")
    assert "model-mismatch" in _kinds(_audit(copy, tiny_dir, model=impostor))


def test_a_release_without_a_model_fingerprint_is_named_and_resumes(copy, tiny_dir):
    # as written before fingerprints were recorded: none in the state, the records or the journal
    _edit_state(copy, lambda run: run.pop("model_fingerprint"))
    _edit_records(copy, lambda rs: [r["run"].pop("model_fingerprint") for r in rs] and None)
    journal = _lines(copy / "out.jsonl.sampled")
    for line in journal:
        line["record"]["run"].pop("model_fingerprint")
    _write(copy / "out.jsonl.sampled", journal)
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.INCONCLUSIVE and _kinds(report) == {"model-unidentified"}
    resumed = generate_flat(copy / "refs.jsonl", output=copy / "out.jsonl", model=str(tiny_dir), **OPTIONS)
    assert resumed.num_resumed == 4


@pytest.mark.parametrize("index", ["one", -1, 4, 1.5, True, None])
def test_a_bad_batch_index_is_one_line_of_bad_input(copy, tiny_dir, capsys, index):
    _edit_records(copy, lambda rs: rs[1].update(batch_index=index) and None)
    code = main(["audit", "--release", str(copy / "out.jsonl"), "--input", str(copy / "refs.jsonl"),
                 "--model", str(tiny_dir), "--sampled-batch", "none"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT and err[-1].startswith("invink-audit audit: error: ")
    assert f"{copy / 'out.jsonl'}:2: batch_index must be an integer in 0 .. 3" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_other_malformed_lines_are_one_line_of_bad_input(copy, tiny_dir):
    out = copy / "out.jsonl"
    good = out.read_text()
    for bad, problem in [("not json\n", ":5: not a JSON line"), ("[1, 2]\n", ":5: not a text record"),
                         (json.dumps({**_lines(out)[0], "token_ids": "abc"}) + "\n", ":5: token_ids must be")]:
        out.write_text(good + bad)
        with pytest.raises(ValueError, match=problem):
            _audit(copy, tiny_dir)


def test_the_fingerprint_is_of_the_weights_and_the_tokenizer(tiny, tiny_dir):
    from invink_audit.models import model_fingerprint

    fingerprint = model_fingerprint(tiny)
    assert fingerprint.startswith("sha256:") and len(fingerprint) == 71
    # a float32 and a bfloat16 load of the same checkpoint agree (a release may resume in another dtype)
    assert model_fingerprint(load_model(tiny_dir, dtype="float32")) == fingerprint
    assert model_fingerprint(load_model(tiny_dir, dtype="bfloat16")) == fingerprint
    assert model_fingerprint(build_tiny_model(seed=6)) != fingerprint
    other_tokenizer = dataclasses.replace(tiny, tokenizer=build_tiny_model(seed=5, vocab_size=300).tokenizer)
    assert model_fingerprint(other_tokenizer) != fingerprint


def test_a_finding_is_one_named_line():
    from invink_audit.audit.release_checks import FINDING_KINDS, Finding

    assert all(verdict is not Verdict.PASS for verdict in FINDING_KINDS.values())
    with pytest.raises(ValueError, match="kind must be one of"):
        Finding("something-else", "message")
    with pytest.raises(ValueError, match="one non-empty line"):
        Finding("partial-release", "two\nlines")


def test_with_a_sampled_audit_the_claim_printed_is_the_records(copy, tiny_dir):
    import warnings

    from invink_audit.mechanism import SeededGeneratorWarning

    _edit_records(copy, lambda rs: [r["guarantee"].update(epsilon=0.5) for r in rs] and None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)  # a reproducible audit
        report = audit_release_file(copy / "out.jsonl", copy / "refs.jsonl", model=str(tiny_dir), sampled_batch=0,
                                    num_samples=16, seed=1)  # fmt: skip
    summary = report.summary()
    assert report.verdict is Verdict.VIOLATION and "the release claims eps = 0.5" in summary
    assert "the release claims 4" not in summary and "ε: its settings certify 4" in summary


# ---------------------------------------------------------------------------------------------
# labels and prompt fields: the state's input fingerprint fixes each batch's labels (adversarial probe F5)

LABELLED = [("Bars", "5.0"), ("Bars", "5.0"), ("Restaurants", "1.0"), ("Restaurants", "1.0")]


@pytest.fixture(scope="module")
def labelled_release(tiny_dir, tmp_path_factory):
    """A label-conditioned ``yelp`` release of 2 batches (batch 0: Bars, 5.0), as ``--label-columns label1,label2
    --prompt yelp`` writes it."""
    import warnings

    root = tmp_path_factory.mktemp("labelled")
    rows = [{"text": f"Review {i} of the {c.lower()}.", "label1": f"Business Category: {c}",
             "label2": f"Review Stars: {s}"} for i, (c, s) in enumerate(LABELLED)]  # fmt: skip
    _write(root / "refs.jsonl", rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the yelp preset on a tiny model
        generate_flat(root / "refs.jsonl", output=root / "out.jsonl", model=str(tiny_dir), prompt="yelp",
                      label_columns=["label1", "label2"], **dict(OPTIONS, batch_size=2))  # fmt: skip
    return root


def _edit_both(root, edit):
    """``edit(record)`` applied to every published record and to the journal's copy of each."""
    _edit_records(root, lambda rs: [edit(r) for r in rs] and None)
    journal = _lines(root / "out.jsonl.sampled")
    for line in journal:
        edit(line["record"])
    _write(root / "out.jsonl.sampled", journal)


def test_a_labelled_release_untouched_passes(labelled_release, tiny_dir):
    report = _audit(labelled_release, tiny_dir)
    assert report.verdict is Verdict.PASS and report.findings == ()


def test_labels_edited_in_the_output_and_the_journal_are_a_violation(labelled_release, tmp_path, tiny_dir):
    for name in FILES:
        shutil.copy(labelled_release / name, tmp_path / name)
    batch0 = next(r for r in _lines(tmp_path / "out.jsonl") if r["batch_index"] == 0)
    assert batch0["labels"]["label2"] == "Review Stars: 5.0" and batch0["prompt_fields"]["stars"] == "5.0"

    def edit(record):  # the probe: batch 0 said to be a 1-star review, the state untouched
        if record["batch_index"] == 0:
            record["labels"]["label2"] = "Review Stars: 1.0"
            record["prompt_fields"]["stars"] = "1.0"

    _edit_both(tmp_path, edit)
    report = _audit(tmp_path, tiny_dir)
    assert report.verdict is Verdict.VIOLATION and _kinds(report) == {"edited-labels"}
    assert report.findings[0].batches == (0,) and "labels and prompt_fields" in report.findings[0].message
    code = main(["audit", "--release", str(tmp_path / "out.jsonl"), "--input", str(tmp_path / "refs.jsonl"),
                 "--model", str(tiny_dir), "--sampled-batch", "none"])  # fmt: skip
    assert code == 1  # VIOLATION


def test_prompt_fields_edited_in_the_output_and_the_journal_are_a_violation(copy, tiny_dir):
    # an unlabelled release: its records' prompt_fields are the template's; a record stating labels is edited too
    _edit_both(copy, lambda r: r["batch_index"] == 2 and r["prompt_fields"].update(topic="a private topic"))
    _edit_both(copy, lambda r: r["batch_index"] == 3 and r.update(labels={"label1": "Business Category: Bars"}))
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.VIOLATION and _kinds(report) == {"edited-labels"}
    assert report.findings[0].batches == (2, 3)


def test_a_record_without_prompt_fields_is_compared_by_its_labels(copy, tiny_dir):
    # records written before they carried prompt_fields still audit (and still pass)
    _edit_both(copy, lambda r: r.pop("prompt_fields") and None)
    assert _audit(copy, tiny_dir).verdict is Verdict.PASS


# ---------------------------------------------------------------------------------------------
# a repeated JSON key (adversarial probe F6): json.loads keeps the last value, another reader the first


def _repeat_text_key(line: str, first: str) -> str:
    """``line`` (one record) with ``"text": first`` inserted before its own ``"text"``."""
    return line.replace('"text": ', f'"text": {json.dumps(first)}, "text": ', 1)


@pytest.mark.parametrize(("name", "where"), [("out.jsonl", "out.jsonl:2: "), ("out.jsonl.sampled", "corrupt at line 2"),
                                           ("out.jsonl.state.json", "out.jsonl.state.json' is corrupt")])
def test_a_repeated_key_in_any_release_file_is_one_line_of_bad_input(copy, tiny_dir, capsys, name, where):
    path = copy / name
    if name.endswith(".json"):
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace('"release_id": ', '"release_id": "another", "release_id": ', 1), encoding="utf-8")
    else:  # the probe: line 2 gets a first "text", a private review; json.loads read the last one and passed
        lines = path.read_text(encoding="utf-8").split("\n")
        lines[1] = _repeat_text_key(lines[1], "<a private review>")
        path.write_text("\n".join(lines), encoding="utf-8")
    code = main(["audit", "--release", str(copy / "out.jsonl"), "--input", str(copy / "refs.jsonl"),
                 "--model", str(tiny_dir), "--sampled-batch", "none"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT and err[-1].startswith("invink-audit audit: error: ") and where in err[-1]
    key = "'release_id'" if name.endswith(".json") else "'text'"
    assert f"repeats the key {key}" in err[-1] and "private review" not in err[-1]
    assert not any("Traceback" in line for line in err)


def test_a_text_edited_in_the_output_and_the_journal_with_its_tokens_kept_is_a_violation(copy, tiny_dir):
    """The published text must be the decoding of its own token ids: edited in both copies (tokens kept, so the
    journal agrees and teacher forcing accepts them), it would publish words nobody drew, e.g. a private review."""
    def edit(record):
        if record["batch_index"] == 2:
            record["text"] = "A private review the mechanism never drew."

    _edit_both(copy, edit)
    report = _audit(copy, tiny_dir)
    assert report.verdict is Verdict.VIOLATION and _kinds(report) == {"text-not-drawn"}
    assert report.findings[0].batches == (2,) and "decoding of its own token ids" in report.findings[0].message


def test_a_seeded_release_is_named_and_never_a_pass(tiny_dir, tmp_path, capsys):
    # probe F8: a release drawn with --seed (records `guarantee: null`, state `run.seeded: true`) audited PASS
    import warnings

    from invink_audit.mechanism import SeededGeneratorWarning

    (tmp_path / "refs.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in REFERENCES[:4]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        generate_flat(tmp_path / "refs.jsonl", output=tmp_path / "out.jsonl", model=str(tiny_dir), seed=3,
                      **OPTIONS)  # fmt: skip
    state = json.loads((tmp_path / "out.jsonl.state.json").read_text())
    assert state["run"]["seeded"] is True and all(r["guarantee"] is None for r in _lines(tmp_path / "out.jsonl"))
    report = _audit(tmp_path, tiny_dir)
    assert report.verdict is Verdict.INCONCLUSIVE and _kinds(report) == {"seeded-release"}, report.findings
    assert report.texts_audited == 2 and "fixed seed" in report.findings[0].message
    code = main(["audit", "--release", str(tmp_path / "out.jsonl"), "--input", str(tmp_path / "refs.jsonl"),
                 "--model", str(tiny_dir), "--sampled-batch", "none", "--output", str(tmp_path / "report"),
                 "--no-plots"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 3 and "audit verdict: INCONCLUSIVE (the release was drawn with a fixed seed" in out, out
    assert "finding seeded-release (INCONCLUSIVE)" in out and "is not the release it records" not in out
