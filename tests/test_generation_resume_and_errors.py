"""Generation's resume, errors and refusals: each test reproduces one probe that once failed.

Resume never re-draws a released batch (item 1), one run per output (2), no private data in error
messages (5), seeded runs and audit reports do not overstate privacy (6), no silent overwrite (7),
everything checked before the charge and the state written after it (8), over-long references refused
up front (12), input encodings and all-null inputs (13), and the CLI's one-line errors (15).
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import invink_audit.generation as generation_module
import invink_audit.outputs as outputs_module
from invink_audit.cli import main
from invink_audit.data import partition_references, read_references
from invink_audit.generation import (
    SEEDED_VOID_REASON,
    OutputInUseError,
    read_generation_output,
)
from invink_audit.mechanism import SeededGeneratorWarning
from releases import generate_flat

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
B, T, NUM_BATCHES = 2, 5, 4
ROOT = Path(__file__).resolve().parents[1]
SECRET = "Marguerite Lindqvist (DOB 1961-03-04) tested HIV positive"


class Crash(Exception):
    """Stands in for a kill: raised from inside a run."""



@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if any text is decoded."""

    def never(*args, **kwargs):
        raise AssertionError("the engine must not run")

    monkeypatch.setattr(generation_module.Engine, "generate", never)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a model is loaded."""

    def never(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(generation_module, "load_model", never)


def _generate(tiny, references=REFERENCES, **kwargs):
    # one text at a time (B + 1 rows): each decoding step finishes at most one text, so each text is
    # released alone and a crash after the n-th text leaves exactly n records (the texts one step
    # finishes are released together, test_texts_of_one_step_are_released_together)
    options = dict(batch_size=B, max_new_tokens=T, delta=1e-6, epsilon=5.0, model=tiny, top_k=8, max_batch_rows=B + 1)
    options.update(kwargs)
    return generate_flat(references, **options)


def _ledger(tmp_path, epsilon=20.0):
    from accounting import BudgetLedger

    return BudgetLedger.create(tmp_path / "ledger.json", epsilon=epsilon, delta=1e-6)


def _stop_after(count):
    seen = []

    def on_text(text):
        seen.append(text)
        if len(seen) >= count:
            raise Crash

    return on_text


def _state(output):
    return output.with_name(output.name + ".state.json")


def _journal(output):
    return output.with_name(output.name + ".sampled")


# ---------------------------------------------------------------------------------------------
# item 1: a batch, once sampled, is never sampled again without being charged


def test_deleted_records_of_sampled_batches_are_restored_from_the_journal_not_redrawn(tiny, tmp_path, monkeypatch):
    # the probe: delete the last line (or the whole output), keep the state file, rerun
    output = tmp_path / "out.jsonl"
    ledger = _ledger(tmp_path)
    _generate(tiny, output=output, ledger=ledger)
    complete = read_generation_output(output)
    lines = output.read_text().splitlines(keepends=True)
    assert len(lines) == NUM_BATCHES
    output.write_text("".join(lines[:-1]))

    def never(*args, **kwargs):
        raise AssertionError("a released batch must not be drawn again")

    monkeypatch.setattr(generation_module.Engine, "generate", never)
    again = _generate(tiny, output=output, ledger=ledger)
    assert again.num_resumed == NUM_BATCHES and again.tokens_generated == 0
    assert sorted(read_generation_output(output), key=lambda r: r["batch_index"]) == sorted(
        complete, key=lambda r: r["batch_index"]
    )  # the very same texts, from the journal

    output.unlink()
    _generate(tiny, output=output, ledger=ledger)
    assert len(read_generation_output(output)) == NUM_BATCHES
    assert len(ledger.status().releases) == 1


def test_a_bare_claim_of_an_older_journal_whose_record_is_gone_is_refused(tiny, tmp_path, monkeypatch):
    output = tmp_path / "out.jsonl"
    _generate(tiny, output=output)
    lines = output.read_text().splitlines(keepends=True)
    deleted = json.loads(lines[-1])["batch_index"]
    output.write_text("".join(lines[:-1]))
    journal = [json.loads(line) for line in _journal(output).read_text().splitlines()]
    for entry in journal:
        entry.pop("record")  # a journal written before records were journaled: bare claims
    _journal(output).write_text("".join(json.dumps(e) + "\n" for e in journal))

    def never(*args, **kwargs):
        raise AssertionError("a released batch must not be drawn again")

    monkeypatch.setattr(generation_module.Engine, "generate", never)
    with pytest.raises(ValueError, match=rf"batch\(es\) {deleted} of .* were already sampled"):
        _generate(tiny, output=output)
    assert len(output.read_text().splitlines()) == NUM_BATCHES - 1  # untouched


def test_a_complete_last_record_without_its_newline_is_kept(tiny, tmp_path):
    output = tmp_path / "out.jsonl"
    with pytest.raises(Crash):
        _generate(tiny, output=output, on_text=_stop_after(2))
    first = read_generation_output(output)
    output.write_bytes(output.read_bytes().rstrip(b"\n"))  # the last record lost only its newline
    assert read_generation_output(output) == first

    # the texts of one decoding step are written together: at least the two handed out are kept
    assert len(first) >= 2
    generated = []
    result = _generate(tiny, output=output, on_text=generated.append)
    assert result.num_resumed == len(first) and len(generated) == NUM_BATCHES - len(first)
    records = read_generation_output(output)
    assert records[: len(first)] == first and sorted(r["batch_index"] for r in records) == list(range(NUM_BATCHES))
    assert output.read_bytes().count(b"\n") == NUM_BATCHES and output.read_bytes().endswith(b"\n")

    # a finished output whose last newline is gone: nothing to draw, nothing lost
    output.write_bytes(output.read_bytes().rstrip(b"\n"))
    again = _generate(tiny, output=output)
    assert again.num_resumed == NUM_BATCHES and again.tokens_generated == 0


def test_a_record_torn_by_a_crash_mid_write_is_restored_from_the_journal(tiny, tmp_path, monkeypatch):
    output = tmp_path / "out.jsonl"
    real_append = outputs_module._append_line
    torn = {}

    def crash_in_third_write(handle, data):
        if handle.name.endswith(".jsonl") and len(torn) == 0:
            count = output.read_bytes().count(b"\n") if output.exists() else 0
            if count == 2:  # third record: half of it reaches the disk, then the process dies
                line = json.dumps(data).encode()
                handle.write(line[: len(line) // 2])
                handle.flush()
                torn["record"] = data
                raise Crash
        real_append(handle, data)

    monkeypatch.setattr(outputs_module, "_append_line", crash_in_third_write)
    with pytest.raises(Crash):
        _generate(tiny, output=output)
    monkeypatch.setattr(outputs_module, "_append_line", real_append)
    assert len(read_generation_output(output)) == 2  # the torn line is not a record
    result = _generate(tiny, output=output)
    assert result.num_resumed == 3  # the torn batch's text comes back from the journal, not redrawn
    records = {r["batch_index"]: r for r in read_generation_output(output)}
    assert records[torn["record"]["batch_index"]] == torn["record"] and len(records) == NUM_BATCHES
    assert [r["batch_index"] for r in read_generation_output(output)] == sorted(records)  # merged in order


def test_each_batch_is_journaled_before_its_text_leaves_the_process(tiny, tmp_path):
    output = tmp_path / "out.jsonl"

    def on_text(text):
        journal = [json.loads(line)["batch_index"] for line in _journal(output).read_text().splitlines()]
        assert text.batch_index in journal  # recorded before on_text (and before the output line)

    result = _generate(tiny, output=output, on_text=on_text)
    journal = [json.loads(line) for line in _journal(output).read_text().splitlines()]
    assert sorted(e["batch_index"] for e in journal) == list(range(NUM_BATCHES))
    assert {e["release_id"] for e in journal} == {result.release_id}


def test_a_torn_journal_line_is_dropped_and_a_batch_never_written_is_drawn_on_resume(tiny, tmp_path):
    output = tmp_path / "out.jsonl"
    with pytest.raises(Crash):
        _generate(tiny, output=output, on_text=_stop_after(2))
    with _journal(output).open("ab") as handle:  # killed while journaling a third batch
        handle.write(b'{"batch_index": 3, "rel')
    result = _generate(tiny, output=output)
    assert result.num_resumed == 2 and len(result.texts) == NUM_BATCHES
    lines = _journal(output).read_text().splitlines()
    assert len(lines) == NUM_BATCHES and all(json.loads(line) for line in lines)


def test_resume_without_the_journal_or_from_a_pre_journal_state_is_refused(tiny, tmp_path):
    output = tmp_path / "out.jsonl"
    with pytest.raises(Crash):
        _generate(tiny, output=output, on_text=_stop_after(2))
    _journal(output).rename(tmp_path / "aside")
    with pytest.raises(ValueError, match="journal .* is missing"):
        _generate(tiny, output=output)
    (tmp_path / "aside").rename(_journal(output))

    # a state file written before the journal existed: any missing batch may have been released
    state = json.loads(_state(output).read_text())
    del state["version"]
    _state(output).write_text(json.dumps(state))
    with pytest.raises(ValueError, match="predates the sampled-batch journal"):
        _generate(tiny, output=output)


# ---------------------------------------------------------------------------------------------
# item 2: one run per output


def test_a_second_run_on_the_same_output_is_refused_while_the_first_runs(tiny, tmp_path):
    output = tmp_path / "out.jsonl"
    ledger = _ledger(tmp_path)
    refusals = []

    def start_a_second_run(text):
        if not refusals:
            with pytest.raises(OutputInUseError, match="another run is writing") as info:
                _generate(tiny, output=output, ledger=ledger)
            refusals.append(info.value)

    result = _generate(tiny, output=output, ledger=ledger, on_text=start_a_second_run)
    assert refusals
    records = read_generation_output(output)
    assert sorted(r["batch_index"] for r in records) == list(range(NUM_BATCHES))
    assert [r["release_id"] for r in records] == [result.release_id] * NUM_BATCHES
    assert len(ledger.status().releases) == 1
    # released when the run ends
    assert _generate(tiny, output=output).num_resumed == NUM_BATCHES


def test_cli_generate_on_an_output_locked_by_another_process_exits_2(tiny_dir, tmp_path, capsys):
    output = tmp_path / "out.jsonl"
    lock = output.with_name(output.name + ".lock")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys; from filelock import FileLock; held = FileLock({str(lock)!r}); held.acquire(); "
         "print('locked', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        csv_path = tmp_path / "refs.csv"
        csv_path.write_text("text\n" + "\n".join(f'"{r}"' for r in REFERENCES) + "\n")
        args = ["generate", "--input", str(csv_path), "--output", str(output), "--delta", "1e-6", "--epsilon", "5"]
        args += ["--batch-size", "2", "--max-new-tokens", "3", "--model", str(tiny_dir), "--no-progress"]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "another run is writing" in err and len(err.strip().splitlines()) == 1
        assert not output.exists() and not _state(output).exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
        holder.stdout.close()


# ---------------------------------------------------------------------------------------------
# item 5: error messages never echo private data


def test_errors_never_echo_cells_keys_or_references(tiny, tmp_path):
    headerless = tmp_path / "headerless.csv"
    headerless.write_text(f"{SECRET},other cell\nsecond,row\n")
    with pytest.raises(ValueError, match=r"column 'text' not found .* 2 column") as info:
        read_references(headerless)
    assert "Marguerite" not in str(info.value) and "other cell" not in str(info.value)

    keyed = tmp_path / "keyed.jsonl"
    keyed.write_text(json.dumps({SECRET: "x", "body": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1: field 'text' missing .* 2 other field") as info:
        read_references(keyed)
    assert "Marguerite" not in str(info.value) and "body" not in str(info.value)

    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "' + SECRET + '" oops}\n')
    with pytest.raises(ValueError, match="line 1 is not valid JSON") as info:
        read_references(bad_json)
    assert "Marguerite" not in str(info.value)

    # a reference passed where a path is expected
    with pytest.raises(ValueError, match="input file not found") as info:
        _generate(tiny, references=SECRET)
    assert "Marguerite" not in str(info.value)


def test_cli_errors_never_echo_cells(tiny_dir, tmp_path, capsys, no_model_load):
    headerless = tmp_path / "headerless.csv"
    headerless.write_text(f"{SECRET}\nsecond\n")
    args = ["generate", "--input", str(headerless), "--output", str(tmp_path / "o.jsonl"), "--delta", "1e-6"]
    args += ["--epsilon", "1", "--batch-size", "1", "--max-new-tokens", "3", "--model", str(tiny_dir)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "column 'text' not found" in err and "Marguerite" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------
# item 6: seeded runs and audit reports do not overstate privacy


def test_seeded_records_and_summaries_carry_no_guarantee(tiny, tiny_dir, tmp_path, capsys):
    output = tmp_path / "seeded.jsonl"
    with pytest.warns(SeededGeneratorWarning):
        result = _generate(tiny, output=output, seed=3)
    assert not result.guarantee.holds and result.guarantee.void_reason == SEEDED_VOID_REASON
    for record in read_generation_output(output):
        assert record["guarantee"] is None and record["guarantee_void_reason"].startswith("seeded")
    unseeded = _generate(tiny, output=tmp_path / "private.jsonl")
    assert unseeded.guarantee.holds
    for record in read_generation_output(tmp_path / "private.jsonl"):
        assert record["guarantee"]["epsilon"] == unseeded.guarantee.epsilon and "guarantee_void_reason" not in record

    csv_path = tmp_path / "refs.csv"
    csv_path.write_text("text\n" + "\n".join(f'"{r}"' for r in REFERENCES) + "\n")
    args = ["generate", "--input", str(csv_path), "--delta", "1e-6", "--epsilon", "5", "--batch-size", "2"]
    args += ["--max-new-tokens", "3", "--model", str(tiny_dir), "--no-progress", "--seed", "4", "--num-texts", "1"]
    with pytest.warns(SeededGeneratorWarning):
        assert main(args + ["--output", str(tmp_path / "a.jsonl"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["guarantee"] is None and summary["guarantee_void_reason"] == SEEDED_VOID_REASON
    with pytest.warns(SeededGeneratorWarning):
        assert main(args + ["--output", str(tmp_path / "b.jsonl")]) == 0
    text = capsys.readouterr().out
    assert "guarantee        NONE (seeded" in text and "-DP" not in text


def test_audit_reports_say_they_are_not_private_and_label_uncharged_samples(tiny, tmp_path):
    from types import SimpleNamespace

    from invink_audit.audit.quick import QuickAuditReport, quick_audit
    from invink_audit.audit.records import REPORT_PRIVACY_NOTICE, report_from_dict
    from invink_audit.audit.report import write_report
    from invink_audit.audit.stats import Verdict

    refs = ["The food was great.", "Mr Smith was admitted.", "", "Slow service."]
    result = _generate(tiny, references=refs, max_new_tokens=3)
    report = quick_audit(result, refs, model=tiny, sampled_batch=None)
    assert report.summary().splitlines()[1].strip().startswith("NOT PRIVATE")
    assert report.to_dict()["privacy_notice"] == REPORT_PRIVACY_NOTICE and report.uncharged_samples == 0

    sampled = SimpleNamespace(
        verdict=Verdict.PASS, num_texts=16, headroom_summary=lambda: {"sequence_renyi_min": 2.0, "epsilon": 1.5}
    )
    labelled = QuickAuditReport(**{**report.__dict__, "sampled": sampled, "uncharged_samples": 16})
    assert "16 extra texts drawn outside the ledger: UNCHARGED" in labelled.summary()

    committed = json.loads((ROOT / "audits" / "reports" / "yelp_smollm2" / "report.json").read_text())
    written = write_report(report_from_dict(committed), tmp_path / "rep", plots=False)
    markdown = (tmp_path / "rep" / "report.md").read_text()
    assert markdown.splitlines()[0].startswith("NOT PRIVATE")  # the banner every NOT PRIVATE Markdown file opens with
    assert markdown.splitlines()[4] == f"> **{REPORT_PRIVACY_NOTICE}**"
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["privacy_notice"] == REPORT_PRIVACY_NOTICE
    assert len(written) == 2


# ---------------------------------------------------------------------------------------------
# item 7: a non-empty output without its state file is never overwritten


@pytest.mark.parametrize("content", [b'{"minified":true}', b"[1, 2]\n", b"\n", b"not json at all"])
def test_a_non_empty_output_without_state_is_refused_and_kept(tiny, tmp_path, no_model_load, content):
    output = tmp_path / "config.json"
    output.write_bytes(content)
    with pytest.raises(ValueError, match="exists and is not empty, but its resume state"):
        _generate(tiny, output=output)
    assert output.read_bytes() == content and not _state(output).exists()


def test_an_empty_existing_output_is_used(tiny, tmp_path):
    output = tmp_path / "out.jsonl"
    output.touch()
    assert len(_generate(tiny, output=output).texts) == NUM_BATCHES


# ---------------------------------------------------------------------------------------------
# item 8: everything is checked before the charge; the state file is written after it


def test_bad_max_batch_rows_is_refused_before_the_charge_and_the_model_load(tiny_dir, tmp_path, no_model_load):
    from accounting import BudgetLedger

    ledger = _ledger(tmp_path)
    output = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="max_batch_rows must be"):
        _generate(str(tiny_dir), output=output, ledger=ledger, max_batch_rows=0)
    assert BudgetLedger(ledger.path).status().releases == ()
    assert not output.exists() and not _state(output).exists()


def test_over_budget_or_missing_ledger_leaves_no_state_and_a_smaller_retry_runs(tiny, tmp_path):
    from accounting import BudgetExceededError, BudgetLedger, LedgerError

    output = tmp_path / "out.jsonl"
    with pytest.raises(LedgerError):
        _generate(tiny, output=output, ledger=tmp_path / "absent.json")
    assert not _state(output).exists()

    ledger = _ledger(tmp_path, epsilon=4.0)
    with pytest.raises(BudgetExceededError):
        _generate(tiny, output=output, ledger=ledger, epsilon=5.0)
    assert not _state(output).exists() and not output.exists()
    result = _generate(tiny, output=output, ledger=ledger, epsilon=3.0)  # the smaller retry
    assert len(result.texts) == NUM_BATCHES and result.num_resumed == 0
    assert len(BudgetLedger(ledger.path).status().releases) == 1


# ---------------------------------------------------------------------------------------------
# item 12: a reference longer than the model's context is refused up front


def test_a_reference_longer_than_the_context_is_refused_before_decoding(tiny, tmp_path, no_engine):
    from accounting import BudgetLedger

    long_reference = f"{SECRET} " + "0123456789 {}[]()<>!?" * 600
    positions = tiny.model.config.max_position_embeddings
    assert len(tiny.tokenizer(long_reference)["input_ids"]) > positions
    references = list(REFERENCES)
    references[5] = long_reference
    ledger = _ledger(tmp_path)
    output = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match=rf"reference 5 .*batch 2.* {positions} positions.* at most {positions - T}") as info:
        _generate(tiny, references=references, output=output, ledger=ledger)
    assert "Marguerite" not in str(info.value) and "0123" not in str(info.value)
    assert BudgetLedger(ledger.path).status().releases == () and not _state(output).exists()
    with pytest.raises(ValueError, match="does not fit the model"):
        _generate(tiny, max_new_tokens=positions)


# ---------------------------------------------------------------------------------------------
# item 13: encodings, duplicate headers, all-null inputs


def test_utf8_bom_files_are_read(tmp_path):
    csv_path = tmp_path / "excel.csv"
    csv_path.write_bytes(b"\xef\xbb\xbftext,stars\r\ncaf\xc3\xa9,5\r\n,4\r\n")
    assert read_references(csv_path) == ["café", ""]
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "caf\u00e9"}).encode() + b"\n")
    assert read_references(jsonl) == ["café"]


def test_non_utf8_and_lone_surrogates_name_the_file_and_line(tmp_path):
    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes(b"text\nfine\ncaf\xe9 " + SECRET.encode() + b"\n")
    with pytest.raises(ValueError, match=r"latin1\.csv' is not valid UTF-8: line 3 \(byte offset 13\)") as info:
        read_references(latin1)
    assert "Marguerite" not in str(info.value)
    encoded_surrogate = tmp_path / "surrogate.csv"
    encoded_surrogate.write_bytes(b"text\nok\nbad \xed\xa0\x80\n")
    with pytest.raises(ValueError, match="surrogate.csv' is not valid UTF-8: line 3"):
        read_references(encoded_surrogate)
    escaped = tmp_path / "escaped.jsonl"
    escaped.write_text('{"text": "ok"}\n{"text": "bad \\ud800 here"}\n')
    with pytest.raises(ValueError, match=r"escaped\.jsonl' line 2 holds a lone surrogate at character position 4"):
        read_references(escaped)
    with pytest.raises(ValueError, match=r"references\[1\] holds a lone surrogate"):
        partition_references(["ok", "bad \ud800"], 1)


def test_a_duplicate_csv_header_is_refused(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("text,id,text\nfirst,1,second\n")
    with pytest.raises(ValueError, match=r"column 'text' appears 2 times .* \(columns 1, 3\)"):
        read_references(path)
    assert read_references(path, column="id") == ["1"]  # another column is unambiguous


def test_an_all_null_input_is_refused_before_charging_unless_allowed(tiny, tiny_dir, tmp_path, capsys, monkeypatch):
    from accounting import BudgetLedger

    ledger = _ledger(tmp_path)
    nulls = ["", None, "", ""]
    with monkeypatch.context() as patch:
        patch.setattr(generation_module, "load_model", lambda *a, **k: pytest.fail("the model must not be loaded"))
        with pytest.raises(ValueError, match=r"all 4 references in the 2 batch\(es\) to generate are empty"):
            _generate(tiny, references=nulls, ledger=ledger, model=str(tiny_dir))
    assert BudgetLedger(ledger.path).status().releases == ()
    result = _generate(tiny, references=nulls, ledger=ledger, allow_all_null=True)
    assert len(result.texts) == 2 and len(BudgetLedger(ledger.path).status().releases) == 1

    csv_path = tmp_path / "empty.csv"
    csv_path.write_text("text\n\n\"\"\n\"\"\n")
    args = ["generate", "--input", str(csv_path), "--output", str(tmp_path / "o.jsonl"), "--delta", "1e-6"]
    args += ["--epsilon", "5", "--batch-size", "1", "--max-new-tokens", "2", "--model", str(tiny_dir), "--no-progress"]
    assert main(args) == 2
    assert "are empty" in capsys.readouterr().err
    assert main(args + ["--allow-all-null", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["texts"] == 2


# ---------------------------------------------------------------------------------------------
# item 15 and the valid ranges: one line, exit 2, before any model loads


def _cli_args(tmp_path, tiny_dir, **overrides):
    csv_path = tmp_path / "refs.csv"
    if not csv_path.exists():
        csv_path.write_text("text\n" + "\n".join(f'"{r}"' for r in REFERENCES) + "\n")
    options = {
        "--input": str(csv_path),
        "--output": str(tmp_path / "out.jsonl"),
        "--delta": "1e-6",
        "--epsilon": "5",
        "--batch-size": "2",
        "--max-new-tokens": "3",
        "--model": str(tiny_dir),
    }
    options.update(overrides)
    args = ["generate"]
    for flag, value in options.items():
        if value is not None:
            args += [flag, value]
    return args


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"--batch-size": "0"}, "batch_size must be an integer >= 1"),
        ({"--max-new-tokens": "0"}, "max_new_tokens must be an integer >= 1"),
        ({"--delta": "1"}, "delta"),
        ({"--delta": "0"}, "delta"),
        ({"--epsilon": "-1"}, "epsilon"),
        ({"--epsilon": "nan"}, "epsilon"),
        ({"--epsilon": None, "--clip-norm": "0"}, "clip_norm"),
        ({"--temperature": "0"}, "temperature"),
        ({"--top-k": "0"}, "--top-k must be"),
        ({"--num-texts": "0"}, "num_texts must be"),
        ({"--num-texts": "9"}, "num_texts=9 needs 18 references"),
        ({"--seed": "-1"}, "seed must be an integer in"),
        ({"--max-batch-rows": "0"}, "max_batch_rows must be an integer >= 1"),
        ({"--device": "tpu9"}, "device must be"),
        ({"--dtype": "int8"}, "dtype must be"),
        ({"--prompt": "nope"}, "prompt must be one of"),
        ({"--prompt-field": "colour=red"}, "has no field"),
        ({"--column": "note"}, "column 'note' not found"),
        ({"--ledger": "absent-ledger.json"}, "no ledger"),
        ({"--output": ""}, "--output must name a .jsonl file; got an empty path"),
        ({"--output": "."}, "must name a file, not a directory"),
        ({"--input": "."}, "is a directory, not a .csv or .jsonl file"),
        ({"--model": "./no/such/model-dir"}, "model directory './no/such/model-dir' does not exist"),
        ({"--model": "/no/such/model.gguf"}, "GGUF file '/no/such/model.gguf' does not exist"),
        ({"--accountant": "magic"}, "invalid choice"),
    ],
)
def test_cli_out_of_range_arguments_are_one_line_exit_2_before_the_model_loads(
    tiny_dir, tmp_path, capsys, no_model_load, overrides, message
):
    args = _cli_args(tmp_path, tiny_dir, **overrides)
    if "--accountant" in overrides:  # argparse's own choices: also one line and exit 2
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2
    else:
        assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out.jsonl").exists()


def test_cli_input_errors_print_no_progress_bar_fragment(tiny_dir, tmp_path, capsys):
    # progress bars on (no --no-progress): an input error must still be the only line on stderr
    args = _cli_args(tmp_path, tiny_dir, **{"--input": str(tmp_path / "absent.csv")})
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"invink-audit generate: error: input file not found: {str(tmp_path / 'absent.csv')!r}"]
    assert main(_cli_args(tmp_path, tiny_dir)) == 0  # and a bar once tokens are drawn
    assert "generating" in capsys.readouterr().err


def test_a_missing_hub_style_model_names_the_missing_directory(tmp_path, monkeypatch):
    def offline_hub(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files ...")

    monkeypatch.setattr(generation_module, "load_model", offline_hub)
    with pytest.raises(ValueError, match="no local directory or file of that name exists"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _generate("models/absent", output=tmp_path / "o.jsonl")
    assert not _state(tmp_path / "o.jsonl").exists()


def test_cli_generate_over_budget_exits_with_the_over_budget_code_and_leaves_no_state(tiny_dir, tmp_path, capsys):
    from invink_audit.cli import EXIT_OVER_BUDGET

    ledger = _ledger(tmp_path, epsilon=1.0)
    args = _cli_args(tmp_path, tiny_dir, **{"--ledger": str(ledger.path), "--epsilon": "5"}) + ["--no-progress"]
    assert main(args) == EXIT_OVER_BUDGET
    err = capsys.readouterr().err
    assert "over budget" in err and len(err.strip().splitlines()) == 1
    assert not _state(tmp_path / "out.jsonl").exists()
    # the smaller retry on the same output runs
    assert main(_cli_args(tmp_path, tiny_dir, **{"--ledger": str(ledger.path), "--epsilon": "0.5"}) + ["--no-progress"]) == 0


def test_texts_of_one_step_are_released_together_and_handed_out_after(tiny, tmp_path, monkeypatch):
    output = tmp_path / "out.jsonl"
    writes = []
    real = outputs_module._append_lines

    def spy(handle, items):
        writes.append((Path(handle.name).name, [d["batch_index"] for d in items]))
        real(handle, items)

    monkeypatch.setattr(outputs_module, "_append_lines", spy)
    seen = []

    def on_text(text):  # by the time a text is handed out, its step's records are all durable
        on_disk = {r["batch_index"] for r in read_generation_output(output)}
        seen.append(text.batch_index in on_disk)

    result = _generate(tiny, output=output, max_batch_rows=None, on_text=on_text)
    assert all(seen) and len(seen) == NUM_BATCHES
    grouped = [indices for name, indices in writes if name == "out.jsonl" and len(indices) > 1]
    assert grouped  # equal-length texts of one step: one write, one fsync
    journal = [indices for name, indices in writes if name == "out.jsonl.sampled"]
    assert sorted(i for group in journal for i in group) == [t.batch_index for t in result.texts]
