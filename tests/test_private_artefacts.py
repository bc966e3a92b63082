"""Non-private artefacts are marked and closed: each test reproduces a probe.

* R3: the sweep's reference points (the ceiling copies a private reference in the clear) are written
  owner-only, every record marked, in ``reference_points/``, never beside a release.
* R4: a stale ``<output>.pending.json`` never hands its release id (already charged) to a new release.
* R8: the journal, locks and shards next to an output are never opened through a planted symbolic link.
* R9: the evaluation cache refuses a link and tightens a loose file; every report is owner-only and marked.
* L: a local Ray's temporary folders are 0700 throughout and removed at exit; ``profile --json`` is marked;
  the sweep's timing and evaluation records are owner-only, marked, and not in a release's directory.

Files are checked under umask 022, where a plain ``open(..., "w")`` gives mode 0644.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import stat
import warnings
from pathlib import Path

import pytest

import invink_audit.outputs as outputs_module
from invink_audit.mechanism import SeededGeneratorWarning
from invink_audit.not_private import NOT_PRIVATE_BANNER
from releases import generate_flat

ROOT = Path(__file__).resolve().parents[1]
REFERENCES = [
    "Marguerite Lindqvist has a dry cough since the new tablets.",
    "Tomasz Wierzbicki has a rash after camping.",
    "Elliot Brandt-Moyo, age 7, has a fever.",
    "Priya Raghunathan is 31 weeks pregnant.",
    "Gerald Foxworth needs his metformin.",
    "Agnes Mulcahy is more confused lately.",
]
OWNER_ONLY = 0o600


@pytest.fixture(autouse=True)
def loose_umask():
    """umask 022: a file written without care is world-readable (0644)."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _generate(tiny, **kwargs):
    options = dict(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=5.0, model=tiny, top_k=8)
    options.update(kwargs)
    return generate_flat(REFERENCES, **options)


def _ledger(tmp_path):
    from accounting import BudgetLedger

    return BudgetLedger.create(tmp_path / "ledger.json", epsilon=50.0, delta=1e-6)


# the bookkeeping files next to an output, named by the module that owns them
_state, _pending, _journal = outputs_module.state_path, outputs_module.pending_path, outputs_module.journal_path


def _assert_marked_json(payload) -> None:
    for record in payload if isinstance(payload, list) else [payload]:
        assert record["not_private"] is True
        assert record["privacy_notice"].startswith("NOT PRIVATE")


def _assert_closed_and_marked(directory: Path) -> list[Path]:
    """Every file under ``directory`` is owner-only; JSON records are marked, Markdown opens with the banner."""
    files = sorted(p for p in directory.rglob("*") if p.is_file())
    assert files
    for path in files:
        assert _mode(path) == OWNER_ONLY, path
        if path.suffix == ".json":
            _assert_marked_json(json.loads(path.read_text()))
        elif path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                _assert_marked_json(json.loads(line))
        elif path.suffix == ".md":
            assert path.read_text().splitlines()[0] == NOT_PRIVATE_BANNER, path
    return files


# ---------------------------------------------------------------------------------------------
# R3: reference points (floor and ceiling) are owner-only, marked, and never beside a release


def _reference_texts(kind="ceiling"):
    from invink_audit.evaluation.reference_points import ReferenceTexts

    return ReferenceTexts(kind=kind, texts=(REFERENCES[0], "soup"), labels=(None, {"stars": "1"}), num_tokens=(9, 1),
                          finish_reasons=("length", "eos"))


def test_reference_point_texts_are_owner_only_and_every_record_is_marked(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text("old\n")  # an existing world-readable file is replaced by an owner-only one
    assert _mode(path) == 0o644
    _reference_texts().write_jsonl(path)
    assert _mode(path) == OWNER_ONLY
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["text"] for r in records] == [REFERENCES[0], "soup"] and records[1]["labels"] == {"stars": "1"}
    for record in records:
        assert record["not_private"] is True and record["reference_point"] == "ceiling"
        assert record["privacy_notice"].startswith("NOT PRIVATE")


def test_reference_point_texts_are_never_written_through_a_symbolic_link(tmp_path):
    shared = tmp_path / "public" / "texts.jsonl"  # where a planted link would send the ceiling's texts
    shared.parent.mkdir()
    link = tmp_path / "texts.jsonl"
    link.symlink_to(shared)
    with pytest.raises(OSError, match="symbolic link"):
        _reference_texts().write_jsonl(link)
    assert not shared.exists()


def _write_csv(path: Path, texts) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        writer.writerows([t] for t in texts)
    return path


def _evaluation_result():
    """A small, valid evaluation (the numbers do not matter here: only how the result is written)."""
    from invink_audit.evaluation.evaluator import EvaluationResult
    from invink_audit.evaluation.mauve_metric import LIBRARY_SETTING, PAPER_SETTING, MauveResult
    from invink_audit.evaluation.stats import Interval

    def mauve(setting):
        return MauveResult(setting, Interval(0.8, 0.7, 0.9), (0.8,), (0.75, 0.85), 2, 4, 4)

    return EvaluationResult(
        mauve=mauve(PAPER_SETTING), mauve_c5=mauve(LIBRARY_SETTING), perplexity_synthetic=Interval(20, 10, 30),
        perplexity_real=Interval(25, 15, 35), delta_ppl=Interval(5, 0, 10), length_synthetic=Interval(3, 2, 4),
        length_real=Interval(9, 8, 10), generated_tokens=Interval(3, 2, 4), eos_share=0.5, tstr=None,
        num_synthetic=4, num_real=4, embedding_model="minilm", scorer="tiny", ppl_unscored_synthetic=0,
        ppl_truncated=0, seconds={"mauve": 0.1}, synthetic_perplexities=(10.0, 30.0), real_perplexities=(15.0, 35.0),
    )  # fmt: skip


def test_sweep_keeps_reference_points_and_records_out_of_the_releases_owner_only_and_marked(tiny, tmp_path, monkeypatch):
    import invink_audit.evaluation.sweep as sweep_module
    import invink_audit.generation as generation_module
    from invink_audit.evaluation import EvaluationConfig
    from invink_audit.evaluation.sweep import EVALUATIONS_DIR, REFERENCE_POINTS_DIR, SweepConfig, run_sweep

    # the generation (tiny model) is real; the evaluation's models are not needed to see where files go
    monkeypatch.setattr(EvaluationConfig, "make_embedder", lambda self: type("E", (), {"close": lambda s: None})())
    monkeypatch.setattr(sweep_module, "evaluate", lambda *a, **k: _evaluation_result())
    refs = _write_csv(tmp_path / "refs.csv", REFERENCES)
    real = _write_csv(tmp_path / "real.csv", ["real one", "real two", "real three"])
    out = tmp_path / "sweep"
    config = SweepConfig(epsilons=(5.0,), batch_sizes=(2,), max_new_tokens=(3,), top_ks=(8,), num_texts=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        rows = run_sweep(refs, real, out, config, EvaluationConfig(), public_proxy=True, model=tiny)
    assert [r.kind for r in rows] == ["floor", "ceiling", "invisibleink"]

    # the probe: ceiling/texts.jsonl beside the releases, 0644, marked only "reference_point"
    assert not (out / "ceiling").exists() and not (out / "floor").exists()
    release = out / rows[2].name
    assert not any("reference_point" in p.read_text() for p in release.glob("*.jsonl"))
    reference_points = out / REFERENCE_POINTS_DIR
    assert _mode(reference_points) == 0o700
    files = _assert_closed_and_marked(reference_points)
    assert {p.relative_to(reference_points).as_posix() for p in files} >= {"ceiling/texts.jsonl", "floor/texts.jsonl"}
    ceiling = [json.loads(line) for line in (reference_points / "ceiling" / "texts.jsonl").read_text().splitlines()]
    assert len(ceiling) == 2 and all(r["reference_point"] == "ceiling" for r in ceiling)

    # the sweep's own reports are owner-only and marked too
    for name in ("sweep.md", "sweep.jsonl", "sweep_utility.png", "sweep_cost.png"):
        assert _mode(out / name) == OWNER_ONLY, name
    assert (out / "sweep.md").read_text().splitlines()[0] == NOT_PRIVATE_BANNER
    for line in (out / "sweep.jsonl").read_text().splitlines():
        _assert_marked_json(json.loads(line))

    # the probe: generation.json beside the release, 0644 and unmarked (and point.json beside it too)
    records = out / EVALUATIONS_DIR / rows[2].name
    assert not {p.name for p in release.iterdir()} & {"point.json", "generation.json"}
    assert _mode(out / EVALUATIONS_DIR) == 0o700 and _mode(records) == 0o700
    assert {p.name for p in _assert_closed_and_marked(records)} == {"point.json", "generation.json"}

    # a rerun resumes every point from its marked record: nothing is generated again
    monkeypatch.setattr(generation_module, "generate", lambda *a, **k: pytest.fail("a finished point was generated again"))
    again = run_sweep(refs, real, out, config, EvaluationConfig(), public_proxy=True, model=tiny)
    assert [r.to_json() for r in again] == [r.to_json() for r in rows]

    # an earlier version's records beside the release (0644, generation.json unmarked) are moved out, closed
    point, seconds = (records / "point.json").read_text(), json.loads((records / "generation.json").read_text())["seconds"]
    shutil.rmtree(records)
    (release / "point.json").write_text(point)
    (release / "generation.json").write_text(json.dumps({"seconds": seconds}) + "\n")
    (release / "point.json").chmod(0o644)
    moved = run_sweep(refs, real, out, config, EvaluationConfig(), public_proxy=True, model=tiny)
    assert [r.to_json() for r in moved] == [r.to_json() for r in rows]
    assert not {p.name for p in release.iterdir()} & {"point.json", "generation.json"}
    assert {p.name for p in _assert_closed_and_marked(records)} == {"point.json", "generation.json"}


# ---------------------------------------------------------------------------------------------
# R4: a pending charge is never reused by a new release


@pytest.mark.parametrize("stale_format", ["earlier-version", "state-copy"])
def test_a_stale_pending_file_never_gives_a_new_release_the_charged_id(tiny, tmp_path, stale_format):
    output = tmp_path / "out.jsonl"
    ledger = _ledger(tmp_path)
    first = _generate(tiny, output=output, ledger=ledger)
    # the probe: a stop between writing the state and removing the pending file left both
    state = json.loads(_state(output).read_text())
    if stale_format == "earlier-version":
        stale = {"release_id": state["release_id"], "run": state["run"]}
    else:
        stale = dict(state)
    _pending(output).write_text(json.dumps(stale))
    resumed = _generate(tiny, output=output, ledger=ledger)  # a resume: its id is the state's
    assert resumed.num_resumed == len(first.texts) and len(ledger.status().releases) == 1
    assert not _pending(output).exists()
    # as the guide says (docs/guide/generating.md), a new release on the same path: delete output, state and journal
    for path in (output, _state(output), _journal(output)):
        path.unlink()
    _generate(tiny, output=output, ledger=ledger)
    releases = ledger.status().releases
    assert len(releases) == 2  # charged: a new release id, not the first release's
    assert json.loads(_state(output).read_text())["release_id"] != state["release_id"]


def test_a_pending_file_beside_a_state_file_is_removed_even_when_the_resume_is_refused(tiny, tmp_path):
    output = tmp_path / "out.jsonl"
    ledger = _ledger(tmp_path)
    _generate(tiny, output=output, ledger=ledger)
    state = json.loads(_state(output).read_text())
    _pending(output).write_text(json.dumps(state))
    with pytest.raises(ValueError, match="different settings"):
        _generate(tiny, output=output, ledger=ledger, max_new_tokens=4)
    assert not _pending(output).exists()
    for path in (output, _state(output), _journal(output)):
        path.unlink()
    _generate(tiny, output=output, ledger=ledger)
    assert len(ledger.status().releases) == 2


def test_a_stop_after_the_charge_and_before_the_state_file_still_charges_once(tiny, tmp_path, monkeypatch):
    output = tmp_path / "out.jsonl"
    ledger = _ledger(tmp_path)
    real_write = outputs_module.atomic_write_json
    calls = []

    def write_then_stop(path, data, **kwargs):
        real_write(path, data, **kwargs)
        calls.append(Path(path).name)
        if len(calls) == 2:  # start_output rewrote the pending file; stop before it becomes the state
            raise KeyboardInterrupt

    monkeypatch.setattr(outputs_module, "atomic_write_json", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        _generate(tiny, output=output, ledger=ledger)
    monkeypatch.setattr(outputs_module, "atomic_write_json", real_write)
    assert calls == [_pending(output).name] * 2 and not _state(output).exists()
    charged = ledger.status().releases[0]["release"]["release_id"]
    _generate(tiny, output=output, ledger=ledger)
    assert [r["release"]["release_id"] for r in ledger.status().releases] == [charged]  # the same id, once
    assert json.loads(_state(output).read_text())["release_id"] == charged and not _pending(output).exists()


def test_a_pending_file_is_honoured_only_for_the_same_input_and_settings(tmp_path):
    from invink_audit.outputs import inspect_output, pending_release_id, start_output

    output = tmp_path / "out.jsonl"
    state = inspect_output(output, "fp", 3)
    release_id = pending_release_id(output, state, {"x": 1}, "fp")
    assert inspect_output(output, "fp", 3).release_id == release_id  # a rerun of this input: the same id
    assert inspect_output(output, "another input", 3).release_id != release_id
    again = inspect_output(output, "fp", 3)
    assert pending_release_id(output, again, {"x": 2}, "fp") != release_id  # other settings: a new id
    again = inspect_output(output, "fp", 3)
    release_id = pending_release_id(output, again, {"x": 2}, "fp")
    start_output(output, again, "fp", {"x": 2}, release_id)
    assert not _pending(output).exists()  # it became the state file
    assert json.loads(_state(output).read_text())["release_id"] == release_id
    assert _mode(_state(output)) == OWNER_ONLY and _mode(_journal(output)) == OWNER_ONLY


# ---------------------------------------------------------------------------------------------
# R8: bookkeeping files next to an output are never opened through a symbolic link


@pytest.mark.parametrize("target_exists", [False, True])
def test_a_symlink_planted_at_the_journal_is_refused_and_nothing_is_written_through_it(tiny, tmp_path, target_exists):
    output = tmp_path / "out.jsonl"
    leak = tmp_path / "elsewhere" / "leak.txt"  # e.g. a world-readable place
    leak.parent.mkdir()
    if target_exists:
        leak.write_bytes(b"")
    _journal(output).symlink_to(leak)
    ledger = _ledger(tmp_path)
    with pytest.raises(OSError, match="symbolic link"):
        _generate(tiny, output=output, ledger=ledger)
    assert leak.exists() == target_exists and (not target_exists or leak.read_bytes() == b"")
    assert not output.exists() or output.read_bytes() == b""
    assert ledger.status().releases == ()  # refused before the charge


def test_the_journal_refuses_a_link_put_in_its_place_mid_release(tmp_path):
    from invink_audit.outputs import Journal, inspect_output, start_output

    output = tmp_path / "out.jsonl"
    state = inspect_output(output, "fp", 3)
    start_output(output, state, "fp", {"x": 1})
    leak = tmp_path / "leak.txt"
    leak.write_bytes(b"")
    _journal(output).unlink()
    _journal(output).symlink_to(leak)
    with pytest.raises(OSError, match="symbolic link"):
        Journal(output, state.release_id, 3).claim(0, {"batch_index": 0, "text": REFERENCES[0]})
    assert leak.read_bytes() == b""


@pytest.mark.parametrize("suffix", [".lock", ".sampled.lock"])
def test_a_symlink_planted_at_a_lock_file_is_refused_and_its_target_kept(tiny, tmp_path, suffix):
    output = tmp_path / "out.jsonl"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    output.with_name(output.name + suffix).symlink_to(victim)
    with pytest.raises((OSError, ValueError), match="refusing to follow"):
        _generate(tiny, output=output)
    assert victim.read_text() == "keep me"


def test_a_shard_sink_refuses_a_symbolic_link(tmp_path):
    from invink_audit.outputs import RecordSink, shard_path

    shard = shard_path(tmp_path / "out.jsonl", "run1", 0)
    leak = tmp_path / "leak.txt"
    shard.symlink_to(leak)
    with pytest.raises(OSError, match="symbolic link"):
        RecordSink(shard, lock=True)
    assert not leak.exists()


# ---------------------------------------------------------------------------------------------
# R9: the evaluation cache, and every report, are closed and marked


def test_the_evaluation_cache_is_created_owner_only(tmp_path):
    from invink_audit.evaluation.cache import TextCache

    cache = TextCache(tmp_path / "new.sqlite", "t")
    cache.close()
    assert _mode(tmp_path / "new.sqlite") == OWNER_ONLY


def test_an_existing_loose_evaluation_cache_is_tightened_with_a_warning(tmp_path):
    import numpy as np

    from invink_audit.evaluation.cache import TextCache

    path = tmp_path / "embeddings.sqlite"
    TextCache(path, "t").close()
    path.chmod(0o644)  # e.g. copied in, or written by an earlier version under another umask
    with pytest.warns(UserWarning, match="readable by others"):
        cache = TextCache(path, "t")
    assert _mode(path) == OWNER_ONLY
    cache.put_many({"k": np.ones(2, dtype=np.float32)})
    cache.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the file is owner-only now
        TextCache(path, "t").close()


@pytest.mark.parametrize("target_exists", [False, True])
def test_a_symlink_at_the_evaluation_cache_path_is_refused(tmp_path, target_exists):
    from invink_audit.evaluation.cache import TextCache

    target = tmp_path / "elsewhere.sqlite"
    if target_exists:
        target.write_bytes(b"")
    link = tmp_path / "embeddings.sqlite"
    link.symlink_to(target)
    with pytest.raises(OSError, match="symbolic link"):
        TextCache(link, "t")
    assert target.exists() == target_exists and (not target_exists or target.read_bytes() == b"")


def test_evaluation_reports_are_owner_only_and_marked(tmp_path):
    from invink_audit.evaluation import write_evaluation_report

    result = _evaluation_result()
    _assert_marked_json(result.to_json())  # what --json prints, too
    write_evaluation_report(result, tmp_path / "report")
    files = _assert_closed_and_marked(tmp_path / "report")
    assert {p.name for p in files} == {"report.json", "report.md", "mauve.png", "perplexity.png"}
    assert _mode(tmp_path / "report") == 0o700  # a new report directory is owner-only too


def test_profile_json_is_marked_and_its_files_are_owner_only_and_marked(tiny_dir, tmp_path, capsys):
    from invink_audit.cli import main

    proxy = _write_csv(tmp_path / "proxy.csv", REFERENCES)
    real = _write_csv(tmp_path / "real.csv", ["Ines Okafor has a sore throat.", "Bruno Salgado twisted an ankle."])
    out = tmp_path / "profile"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a sample this small is warned about
        status = main(["profile", "--input", str(proxy), "--real", str(real), "--epsilons", "5", "--batch-sizes", "2",
                       "--top-ks", "8", "--max-new-tokens", "4", "--num-texts", "2", "--model", str(tiny_dir),
                       "--json", "--output", str(out), "--no-progress"])  # fmt: skip
    captured = capsys.readouterr()
    assert status == 0, captured.err
    # the probe: profile --json printed {"points": ...} with no NOT PRIVATE marker
    payload = json.loads(captured.out)
    assert list(payload)[:2] == ["not_private", "privacy_notice"]
    _assert_marked_json(payload)
    assert payload["points"] and "NOT differentially private" in payload["notice"]
    files = _assert_closed_and_marked(out)
    assert {p.name for p in files} >= {"profile.json", "profile.md"}


def test_selftest_json_is_marked_like_its_report():
    from invink_audit.audit.selftest import SelfTestEntry, SelfTestResult

    entry = SelfTestEntry(mechanism="correct", description="d", expected="PASS", verdict="PASS", passed=True,
                          sources=({"source": "demo"},), seconds=0.1)  # fmt: skip
    result = SelfTestResult(entries=(entry,), coverage={"passed": True}, reports=(), seconds=0.1)
    # the probe: audit --selftest --json printed [{"mechanism": ...}] with no NOT PRIVATE marker
    payload = result.to_json()
    _assert_marked_json(payload)
    assert payload[0]["mechanism"] == "correct" and payload[0]["coverage"] == {"passed": True}


@pytest.mark.parametrize("as_json", [True, False])
def test_bench_on_given_references_is_marked(tiny_dir, tmp_path, capsys, as_json):
    from invink_audit.cli import main

    refs = _write_csv(tmp_path / "refs.csv", REFERENCES)
    args = ["bench", "--model", str(tiny_dir), "--references", str(refs), "--batch-size", "2", "--max-new-tokens", "3",
            "--repeats", "0", "--no-one-at-a-time", "--no-floor", "--dtype", "float32"]  # fmt: skip
    assert main(args + (["--json"] if as_json else [])) == 0
    out = capsys.readouterr().out
    # the probe: bench --references private.csv printed the prompts' token counts with no NOT PRIVATE marker
    if as_json:
        payload = json.loads(out)
        _assert_marked_json(payload)
        assert payload["prompt_tokens"] > 0
    else:
        assert out.splitlines()[0] == NOT_PRIVATE_BANNER


def _committed_whitebox_report():
    from invink_audit.audit.records import report_from_dict

    return report_from_dict(json.loads((ROOT / "audits" / "reports" / "yelp_smollm2_adapmixed" / "report.json").read_text()))


def test_audit_reports_are_owner_only_and_marked(tmp_path):
    from invink_audit.audit.records import REPORT_PRIVACY_NOTICE, report_from_dict
    from invink_audit.audit.report import write_report

    report = _committed_whitebox_report()
    data = report.to_dict()
    assert list(data)[:2] == ["not_private", "privacy_notice"] and data["not_private"] is True
    assert data["privacy_notice"] == REPORT_PRIVACY_NOTICE and report_from_dict(data).to_dict() == data
    written = write_report(report, tmp_path / "audit")
    files = _assert_closed_and_marked(tmp_path / "audit")
    assert _mode(tmp_path / "audit") == 0o700  # a new report directory is owner-only too
    assert {p.name for p in files} == {p.name for p in written} >= {"report.json", "report.md", "renyi.png"}


def test_quick_audit_reports_are_marked():
    from invink_audit.audit.quick import QuickAuditReport
    from invink_audit.audit.stats import Verdict

    report = QuickAuditReport(
        verdict=Verdict.PASS, reason="test", texts_audited=1, step_checks=1, step_failures={},
        max_loss_range_over_epsilon0=0.5, realised_loss_max=0.1, realised_loss_mean=0.1, a_priori_loss_bound=1.0,
        accountant_epsilon=1.0, sampled=None, seconds=0.1,
    )  # fmt: skip
    _assert_marked_json(report.to_dict())


def test_reports_are_never_written_through_a_symbolic_link(tmp_path):
    from invink_audit.audit.report import write_report

    out = tmp_path / "audit"
    out.mkdir()
    published = tmp_path / "public" / "report.md"  # where a planted link would send the report
    published.parent.mkdir()
    published.write_text("public page")
    (out / "report.md").symlink_to(published)
    with pytest.raises(OSError, match="symbolic link"):
        write_report(_committed_whitebox_report(), out, plots=False)
    assert published.read_text() == "public page"


# ---------------------------------------------------------------------------------------------
# L: a local Ray's temporary folders are owner-only throughout and removed at exit, also on error


@pytest.mark.slow
@pytest.mark.parametrize("outcome", ["finishes", "fails"])
def test_a_local_ray_keeps_its_folders_owner_only_and_removes_them_at_exit(tiny_dir, tmp_path, monkeypatch, outcome):
    import tempfile

    from invink_audit.ray_release import generate_on_ray
    from releases import call_flat

    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("Ray is already initialised in this process: generate_on_ray would use it")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    scratch = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    from_items, seen = ray.data.from_items, {}

    def probe(rows):  # the pipeline's first step, while Ray runs: every folder it has made so far
        seen.update({folder: _mode(Path(folder)) for folder, _, _ in os.walk(scratch)})
        if outcome == "fails":
            raise RuntimeError("the pipeline failed")
        return from_items(rows)

    monkeypatch.setattr(ray.data, "from_items", probe)
    options = dict(batch_size=2, max_new_tokens=3, delta=1e-6, epsilon=5.0, top_k=8, seed=1, device="cpu")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Ray's own deprecation notices; the seeded-generator warning
            if outcome == "fails":
                with pytest.raises(RuntimeError, match="the pipeline failed"):
                    call_flat(generate_on_ray, REFERENCES, model=str(tiny_dir), output=tmp_path / "out.jsonl", **options)
            else:
                result = call_flat(generate_on_ray, REFERENCES, model=str(tiny_dir), output=tmp_path / "out.jsonl", **options)
                assert len(result.texts) == len(REFERENCES) // 2
        # the probe: session folders 0777 (sockets/, logs/, runtime_resources/), left behind after the run
        assert any("session_" in folder for folder in seen), seen
        assert {folder: mode for folder, mode in seen.items() if mode != 0o700} == {}
        assert not ray.is_initialized() and list(scratch.iterdir()) == []
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)
