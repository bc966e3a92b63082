"""Bad input is refused at the boundary, in one line.

Each test reproduces a probe: an audit spec that skipped the command line's range checks (a traceback
after the model loaded, a silently truncated T, ``batch_size = true``, an unknown key, a missing
optional package leaving a temporary folder), a file that is not UTF-8 named without its file, a
symbolic link at a lock's path, an all-empty synthetic set scored, a world-writable Ray session
folder, a model whose parameters require gradients, seeded or data-dependent figures written as if
they were private, a stray CSV quote that swallowed the rest of the file into one reference, a 21.6 MB
field that took 50 s and 5.2 GB to refuse, and a lone surrogate that gave ``evaluate`` a traceback.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import re
import stat
import sys
import tempfile
import tracemalloc
import types
import warnings
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from accounting import BudgetLedger, LedgerError, Release
from invink_audit.audit import spec
from invink_audit.cli import EXIT_BAD_INPUT, main
from invink_audit.data import MAX_FIELD_CHARS, MAX_LINE_BYTES, read_labelled_references, read_references
from invink_audit.generation import SEEDED_VOID_REASON
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.models import build_tiny_model
from releases import call_flat

ROOT = Path(__file__).resolve().parents[1]

WHITE_BOX = """\
kind = "white-box"
[data]
inline = ["Great tacos.", "Cold soup.", "Slow wifi."]
[mechanism]
batch_size = 2
max_new_tokens = 3
clip_norm = 1.0
[audit]
num_samples = 8
"""

BLACK_BOX_INVINK = """\
kind = "black-box"
[target]
kind = "invink"
model_path = "tiny"
[data]
inline = ["Great tacos.", "Cold soup.", "Slow wifi."]
[mechanism]
batch_size = 2
epsilon = 1.0
[blackbox]
num_trials = 8
scores = ["length", "characters"]
"""


def _edit(text: str, section: str, key: str, value: str) -> str:
    """``text`` with ``key = value`` in ``[section]`` (``""``: the top level), replacing an existing line."""
    lines = text.splitlines()
    header = f"[{section}]" if section else None
    start = 0 if header is None else lines.index(header) + 1 if header in lines else None
    if start is None:
        return text + f"[{section}]\n{key} = {value}\n"
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("[")), len(lines))
    body = [line for line in lines[start:end] if not line.startswith(f"{key} =")]
    return "\n".join(lines[:start] + [f"{key} = {value}"] + body + lines[end:]) + "\n"


def _write(tmp_path: Path, text: str, name: str = "s.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: the checks must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the spec was checked")

    monkeypatch.setattr("invink_audit.models.load_model", refuse)
    monkeypatch.setattr("invink_audit.models.build_tiny_model", refuse)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# -- audit specs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "section", "key", "value", "message"),
    [
        # the probes
        ("white-box", "audit", "num_samples", "1_000_000_000_000_000", "an integer from 1 to 1000000000"),
        ("white-box", "mechanism", "max_new_tokens", "4.7", "an integer from 1 to 1000000000; got 4.7"),
        ("white-box", "mechanism", "batch_size", "true", "an integer from 1 to 1000000000; got True"),
        ("selftest", "selftest", "num_samples", "1_000_000_000_000_000", "an integer from 1 to 1000000000"),
        ("selftest", "selftest", "max_new_tokens", "4.7", "an integer from 1 to 1000000000; got 4.7"),
        ("selftest", "selftest", "batch_size", "true", "an integer from 1 to 1000000000; got True"),
        # the command line's other ranges (accounting.limits)
        ("white-box", "mechanism", "clip_norm", "0.0", "clip_norm must be in [1e-06, 1e+06]"),
        ("white-box", "mechanism", "delta", "1.0", "delta must be in [1e-300, 1)"),
        ("white-box", "mechanism", "temperature", "1e9", "temperature must be in [0.0001, 10000]"),
        ("white-box", "mechanism", "top_k", "0", "top_k must be an integer from 1 to 1000000000 or 'full'"),
        ("white-box", "mechanism", "accountant", '"magic"', "accountant must be one of"),
        ("selftest", "selftest", "clip_norm", "nan", "clip_norm must be in"),
        ("selftest", "selftest", "baselines", '"yes"', "baselines must be true or false"),
        ("selftest", "selftest", "alphas", "[0.5]", "alphas[0] must be a finite number > 1"),
        ("white-box", "audit", "num_is_samples", "-1", "num_is_samples must be an integer from 0"),
        ("white-box", "audit", "alphas", "2.0", "alphas must be a non-empty list"),
        ("white-box", "audit", "neighbours", "[0.5]", "neighbours must be 'all' or a non-empty list"),
        ("white-box", "audit", "significance", '"0.05"', "significance must be a finite number"),
        ("white-box", "model", "max_batch_rows", "0", "max_batch_rows must be an integer from 1"),
        ("white-box", "model", "dtype", '"float8"', "dtype must be 'auto' or one of"),
        ("white-box", "data", "offset", "-1", "offset must be an integer from 0"),
        ("white-box", "canaries", "secret", "1.5", "secret must be an integer from 0"),
        ("white-box", "prompt", "preset", '"nope"', "prompt must be one of"),
        ("white-box", "", "seed", "-1", "seed must be an integer from 0"),
    ],
)
def test_spec_values_are_range_checked_at_load(tmp_path, no_model_loads, kind, section, key, value, message):
    text = WHITE_BOX if kind == "white-box" else 'kind = "selftest"\n[selftest]\nnum_samples = 100\n'
    path = _write(tmp_path, _edit(text, section, key, value))
    with pytest.raises(ValueError) as info:
        spec.load_spec(path)
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith(f"audit spec {str(path)!r}: ")
    assert (f"[{section}] {key}" if section else key) in text and message in text


def test_a_huge_num_samples_is_refused_before_the_model_loads(tmp_path, no_model_loads, capsys):
    # probe: num_samples = 10^15 passed the spec and failed with a traceback after the model loaded
    path = _write(tmp_path, _edit(WHITE_BOX, "audit", "num_samples", "1_000_000_000_000_000"))
    assert main(["audit", str(path)]) == EXIT_BAD_INPUT
    line = _one_line_error(capsys)
    assert line.startswith("invink-audit audit: error: audit spec ") and str(path) in line
    assert "[audit] num_samples must be an integer from 1 to 1000000000; got 1000000000000000" in line


def test_unknown_keys_are_refused_with_the_allowed_names(tmp_path, capsys):
    # probe: an unknown [selftest] key ended in a TypeError traceback
    path = _write(tmp_path, 'kind = "selftest"\n[selftest]\nnum_sample = 100\n')
    assert main(["audit", str(path)]) == EXIT_BAD_INPUT
    line = _one_line_error(capsys)
    assert str(path) in line and "unknown keys in [selftest]: ['num_sample']; allowed: [" in line
    assert "'num_samples'" in line
    for section, key in (("mechanism", "clip_nrom"), ("model", "nmae"), ("data", "colum"), ("canaries", "secrets"),
                         ("prompt", "field"), ("audit", "alpha")):
        path = _write(tmp_path, _edit(WHITE_BOX, section, key, "1"))
        with pytest.raises(ValueError, match=rf"unknown keys in \[{section}\]: \['{key}'\]; allowed: \["):
            spec.load_spec(path)
    path = _write(tmp_path, WHITE_BOX + "[selftest]\nnum_samples = 100\n")  # a section of another kind
    with pytest.raises(ValueError, match=r"unknown keys in a white-box spec: \['selftest'\]; allowed: "):
        spec.load_spec(path)


def test_spec_mechanism_kinds_are_checked_at_load(tmp_path, no_model_loads):
    amin = WHITE_BOX.replace("clip_norm = 1.0", 'kind = "amin"\nepsilon = 10.0\nmax_private_tokens = 2.5')
    with pytest.raises(ValueError, match=r"\[mechanism\] max_private_tokens must be an integer from 1"):
        spec.load_spec(_write(tmp_path, amin))
    amin = WHITE_BOX.replace("clip_norm = 1.0", 'kind = "amin"\nepsilon = 10.0\ntop_k = 5')
    with pytest.raises(ValueError, match=r"unknown keys in \[mechanism\]: \['top_k'\]; allowed: \["):
        spec.load_spec(_write(tmp_path, amin))
    ada = WHITE_BOX.replace("clip_norm = 1.0", 'kind = "adapmixed"')
    with pytest.raises(ValueError, match=r"\[mechanism\] kind 'adapmixed' needs epsilon"):
        spec.load_spec(_write(tmp_path, ada))
    both = _edit(WHITE_BOX, "mechanism", "epsilon", "3.0")
    with pytest.raises(ValueError, match=r"\[mechanism\] give one of epsilon .* and clip_norm; got both"):
        spec.load_spec(_write(tmp_path, both))
    no_epsilon = BLACK_BOX_INVINK.replace("epsilon = 1.0\n", "")
    with pytest.raises(ValueError, match=r"\[mechanism\] epsilon is required for \[target\] kind = 'invink'"):
        spec.load_spec(_write(tmp_path, no_epsilon))
    amin_black_box = BLACK_BOX_INVINK.replace("[mechanism]\n", '[mechanism]\nkind = "amin"\n')
    with pytest.raises(ValueError, match=r"\[mechanism\] kind 'amin' is audited white-box only"):
        spec.load_spec(_write(tmp_path, amin_black_box))


def test_every_spec_key_has_a_check():
    """Each section is read into the library's record through its fields' types: every field of every record a spec
    fills has a TOML reading, and the records' defaults, written as TOML, read back to the defaults."""
    from dataclasses import fields

    from invink_audit.audit.selftest import SelfTestSettings
    from invink_audit.audit.whitebox import WhiteBoxConfig
    from invink_audit.generation import ModelSpec
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import AdaPMixEDConfig, AminConfig

    for record in (SelfTestSettings, WhiteBoxConfig, ModelSpec, MechanismConfig, AminConfig, AdaPMixEDConfig,
                   spec.TargetSpec, spec.BlackBoxSpec):
        assert spec.fields_of(record)  # each field's type is readable (a TypeError otherwise, at the first spec)
    defaults = SelfTestSettings()
    toml = {f.name: (list(v) if isinstance(v, tuple) else v) for f in fields(SelfTestSettings)
            for v in [getattr(defaults, f.name)]}
    assert spec.read_table(SelfTestSettings, toml, "[selftest]") == defaults


def test_a_spec_that_is_not_utf8_is_named_with_its_line(tmp_path, capsys):
    path = tmp_path / "latin1.toml"
    path.write_bytes('kind = "selftest"\n# caf\xe9\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{str(path)!r} is not valid UTF-8: line 2"):
        spec.load_spec(path)
    assert main(["audit", str(path)]) == EXIT_BAD_INPUT
    assert str(path) in _one_line_error(capsys)


def _no_temp_folders(folder: Path) -> list[str]:
    """The tiny-model folders left in ``folder`` (torch may keep its own caches there)."""
    return sorted(p.name for p in folder.glob("invink-audit-tiny-*"))


def test_a_missing_reference_package_is_one_line_and_leaves_no_temp_folder(tmp_path, monkeypatch, capsys):
    # probe: without `invink` importable, an ImportError traceback and a tiny-model folder left in /tmp
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setitem(sys.modules, "invink", None)  # `import invink` raises ImportError
    path = _write(tmp_path, BLACK_BOX_INVINK)
    assert main(["audit", str(path)]) == EXIT_BAD_INPUT
    line = _one_line_error(capsys)
    assert str(path) in line and "[target] kind = 'invink'" in line and "cannot be imported" in line
    assert _no_temp_folders(temp) == []


@pytest.mark.parametrize("fails", [True, False], ids=["error", "success"])
def test_the_tiny_model_folder_is_removed_on_every_path(tmp_path, monkeypatch, fails):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    seen = []

    def generate(**kwargs):  # the reference package, faked: records the model folder it was given
        seen.append(Path(kwargs["model_name_or_path"]))
        assert seen[-1].is_dir() and seen[-1].parent == temp
        if fails:
            raise RuntimeError("the package failed")
        return types.SimpleNamespace(texts=["a text " * (len(seen) % 3)])

    monkeypatch.setitem(sys.modules, "invink", types.SimpleNamespace(generate=generate))
    loaded = spec.load_spec(_write(tmp_path, BLACK_BOX_INVINK))
    if fails:
        with pytest.raises(RuntimeError, match="the package failed"):
            spec.run_spec(loaded)
    else:
        assert spec.run_spec(loaded).kind == "black-box"
    assert seen and _no_temp_folders(temp) == []


# -- evaluate: files that are not UTF-8 --------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_evaluate_names_the_file_and_line_of_bytes_that_are_not_utf8(tmp_path, suffix, capsys):
    # probe: a JSON Lines file in Latin-1 gave "'utf-8' codec can't decode byte 0xe9", no file, no line
    synthetic = tmp_path / f"synthetic{suffix}"
    if suffix == ".jsonl":
        synthetic.write_bytes(b'{"text": "fine"}\n{"text": "also fine"}\n{"text": "caf\xe9"}\n')
    else:
        synthetic.write_bytes(b"text\nfine\nalso fine\ncaf\xe9\n")
    real = tmp_path / "real.csv"
    real.write_text("text\na\nb\n", encoding="utf-8")
    from invink_audit.evaluation import read_text_set

    with pytest.raises(ValueError, match=rf"{str(synthetic)!r} is not valid UTF-8: line [34] "):
        read_text_set(synthetic)
    assert main(["evaluate", "--synthetic", str(synthetic), "--real", str(real), "--no-progress"]) == EXIT_BAD_INPUT
    line = _one_line_error(capsys)
    assert str(synthetic) in line and "line " in line


# -- evaluate: empty synthetic texts -----------------------------------------------------------------


class _FakeEmbedder:
    """Gaussian features for any text (the embedding model is not what is tested)."""

    def __init__(self, name: str) -> None:
        self.spec = types.SimpleNamespace(name=name)

    def embed(self, texts, progress=None):
        if progress is not None:
            progress(len(texts))
        return np.random.default_rng(len(texts)).normal(size=(len(texts), 8))


def _evaluate(synthetic, real, **kwargs):
    from invink_audit.evaluation import EvaluationConfig, evaluate

    config = EvaluationConfig(embedding_model="minilm", mauve_seeds=1, mauve_bootstrap=0, perplexity=False)
    return evaluate(synthetic, real, config, embedder=_FakeEmbedder("minilm"), **kwargs)


def test_an_all_empty_synthetic_set_is_refused():
    # probe: 40 empty texts were scored (MAUVE 0.552), without a word
    real = [f"review {i}: the soup was {'cold' if i % 2 else 'great'}" for i in range(40)]
    for empty in ([""] * 40, [" ", "\n"] * 20):
        with pytest.raises(ValueError, match=r"every synthetic text is empty \(40 of 40\)"):
            _evaluate(empty, real)


def test_some_empty_synthetic_texts_warn_with_their_count_and_are_reported():
    from invink_audit.evaluation.report import evaluation_markdown

    real = [f"review {i}: the soup was {'cold' if i % 2 else 'great'}" for i in range(40)]
    synthetic = [""] * 3 + real[3:]
    with pytest.warns(UserWarning, match=r"^3 of 40 synthetic texts are empty") as record:
        result = _evaluate(synthetic, real)
    assert record[0].filename == __file__  # stacklevel=2: the caller's line
    assert result.num_empty_synthetic == 3 and result.to_json()["num_empty_synthetic"] == 3
    assert "3 of 40 synthetic texts are empty" in evaluation_markdown(result)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none empty: no warning, nothing in the report
        clean = _evaluate(real, real)
    assert clean.num_empty_synthetic == 0 and "are empty" not in evaluation_markdown(clean)


# -- lock files ---------------------------------------------------------------------------------------


def _release() -> Release:
    return Release.of(clip_norm=1.0, batch_size=4, temperature=1.0, max_new_tokens=10)


@pytest.mark.parametrize("target_exists", [True, False], ids=["link-to-file", "dangling-link"])
def test_a_symlinked_ledger_lock_is_refused(tmp_path, target_exists):
    # probe: a symbolic link at <ledger>.lock gave "cannot lock ... (Too many levels of symbolic links):
    # writing needs a writable directory", a raw OSError's wording for a planted link
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    lock = tmp_path / "ledger.json.lock"
    lock.unlink()
    victim = tmp_path / "victim.txt"
    if target_exists:
        victim.write_text("keep me")
    lock.symlink_to(victim)
    with pytest.raises(LedgerError) as info:
        ledger.charge(_release())
    text = str(info.value)
    assert "\n" not in text and "is a symbolic link; refusing to follow it" in text and str(lock) in text
    assert ledger.status().releases == ()
    assert victim.read_text() == "keep me" if target_exists else not victim.exists()


def test_a_refused_hard_linked_ledger_leaves_no_lock_file_of_its_own(tmp_path):
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=10.0, delta=1e-6)
    lock = tmp_path / "ledger.json.lock"
    lock.unlink()
    os.link(tmp_path / "ledger.json", tmp_path / "other-name.json")
    with pytest.raises(LedgerError, match="2 hard links"):
        ledger.charge(_release())
    assert not lock.exists()  # probe: the refusal left the lock file it had created
    lock.write_text("")  # a lock file that was there before is kept (others may wait on it)
    with pytest.raises(LedgerError, match="2 hard links"):
        ledger.charge(_release())
    assert lock.exists()


def test_a_symlinked_output_lock_is_refused(tmp_path):
    # probe: a symbolic link at <output>.lock gave a raw OSError
    from invink_audit.outputs import output_lock

    output = tmp_path / "texts.jsonl"
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "texts.jsonl.lock").symlink_to(victim)
    with pytest.raises(ValueError) as info:
        with output_lock(output):
            pass
    text = str(info.value)
    assert "\n" not in text and "is a symbolic link; refusing to follow it" in text
    assert victim.read_text() == "keep me"


# -- Ray's session folder -----------------------------------------------------------------------------


def test_a_local_ray_session_folder_is_owner_only_and_removed(tiny_dir, tmp_path, monkeypatch):
    # probe: a local Ray started by generate_on_ray kept its session in a 0777 folder (/tmp/ray), never removed
    from invink_audit.ray_release import generate_on_ray

    class Started(Exception):
        pass

    calls, modes = [], {}

    def init(**kwargs):  # Ray, faked: it makes its folders world-writable, as ray._common.utils does
        calls.append(kwargs)
        if "_temp_dir" in kwargs:
            for folder in (Path(kwargs["_temp_dir"]), Path(kwargs["_temp_dir"]) / "session_2025-01-01_00-00-00_0_1"):
                folder.mkdir()
                folder.chmod(0o777)

    def remote(*args, **kwargs):  # the pipeline starts: the folders' modes now, then stop
        if "_temp_dir" in calls[-1]:
            root = Path(calls[-1]["_temp_dir"])
            modes.update({folder: stat.S_IMODE(folder.stat().st_mode) for folder in (root.parent, root, *root.glob("session_*"))})
        raise Started

    fake = types.SimpleNamespace(is_initialized=lambda: False, init=init, remote=remote)
    monkeypatch.setitem(sys.modules, "ray", fake)
    temp = tmp_path / "tmp"
    temp.mkdir(mode=0o755)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    refs = tmp_path / "refs.csv"
    refs.write_text("text\n" + "".join(f"review {i}\n" for i in range(4)), encoding="utf-8")
    options = dict(model=str(tiny_dir), batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=8.0, device="cpu")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(Started):
        call_flat(generate_on_ray, refs, output=tmp_path / "a.jsonl", **options)
    root = Path(calls[-1]["_temp_dir"])
    assert root.parent.parent == temp and len(modes) == 3
    assert modes == dict.fromkeys(modes, 0o700)  # a private folder, and Ray's made private
    assert not root.parent.exists()  # removed when the call returned (here: on error)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")  # joining a cluster: its own folders
    with pytest.raises(Started):
        call_flat(generate_on_ray, refs, output=tmp_path / "b.jsonl", **options)
    assert "_temp_dir" not in calls[-1]


# -- a model whose parameters require gradients -------------------------------------------------------


@pytest.mark.parametrize("top_k", [10, None], ids=["top-k", "full-vocabulary"])
def test_the_engine_runs_a_model_whose_parameters_require_grad(top_k):
    # probe: "add(): functions with out=... arguments don't support automatic differentiation"
    from invink_audit.engine import Engine
    from invink_audit.prompts import encode_request, get_preset

    model = build_tiny_model(seed=7)
    requests = [encode_request(model.tokenizer, get_preset("generic"), refs, key=f"t{i}")
                for i, refs in enumerate([["the soup was cold", "", "great"], ["slow", "wifi", "tacos"]])]
    mechanism = MechanismConfig(clip_norm=1.0, batch_size=3, temperature=1.0, top_k=top_k)

    def tokens():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SeededGeneratorWarning)
            generator = make_generator(3)
        finished = Engine(model, mechanism).generate(requests, max_new_tokens=6, generator=generator)
        return sorted((f.request_index, f.token_ids) for f in finished)

    frozen = tokens()
    model.model.requires_grad_(True)
    assert all(p.requires_grad for p in model.model.parameters())
    assert tokens() == frozen  # the same texts: only autograd is kept out


# -- seeded and data-dependent figures ----------------------------------------------------------------


@pytest.fixture(scope="module")
def compare_baselines():
    path = ROOT / "examples" / "compare_baselines.py"
    module_spec = importlib.util.spec_from_file_location("compare_baselines", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_the_comparison_writes_no_spend_and_marks_its_seeded_cells(compare_baselines, tiny, tmp_path, monkeypatch):
    # probe: cells.jsonl held AdaPMixED's data-dependent per-text spend, and "(3, 1e-06)-DP" on seeded cells
    monkeypatch.setattr("invink_audit.models.load_model", lambda model=None, **kwargs: tiny)
    references = [f"review {i}: the soup was cold" for i in range(8)]
    monkeypatch.setattr(compare_baselines, "yelp_references", lambda limit: references[:limit])
    args = Namespace(output=str(tmp_path), threads=torch.get_num_threads(), rows="4", epsilons="10",
                     methods="adapmixed,invisibleink-top100", seeds=1, max_new_tokens=4)
    with warnings.catch_warnings():
        compare_baselines.run(args)
    cells = [json.loads(line) for line in (tmp_path / "cells.jsonl").read_text().splitlines()]
    assert [c["method"] for c in cells] == ["adapmixed", "invisibleink-top100"]
    for cell in cells:
        assert cell["guarantee"] is None and cell["guarantee_void_reason"] == SEEDED_VOID_REASON
        assert all(set(t) == {"text", "num_tokens", "finish_reason", "modes"} for t in cell["texts"])


def test_the_committed_cells_hold_no_spend_and_no_seeded_guarantee():
    cells = [json.loads(line) for line in (ROOT / "audits" / "reports" / "baselines_comparison" / "cells.jsonl")
             .read_text().splitlines()]
    assert any(c["method"] == "adapmixed" and c["feasible"] for c in cells)
    for cell in cells:
        assert all("spend" not in t for t in cell["texts"])
        if cell["feasible"]:  # every generated cell is seeded (make_generator(1000 + seed))
            assert cell["guarantee"] is None and cell["guarantee_void_reason"] == SEEDED_VOID_REASON


# -- references files: stray quotes, oversized fields, lone surrogates -------------------------------


def _reviews(count: int) -> list[str]:
    return [f"review {i} was fine,Business Category: Bars,Review Stars: 3.0\n" for i in range(count)]


_QUOTED = '"a quoted review, with a comma",Business Category: Bars,Review Stars: 3.0\n'


@pytest.mark.parametrize(
    ("stray", "later", "message"),
    [
        # a field opens a quote that is never closed: every later line read as one field (40 records became 6)
        ('"the stray quote is never closed,Business Category: Bars,Review Stars: 3.0\n', False, "is never closed"),
        ('review six,"Business Category: Bars,Review Stars: 3.0\n', False, "is never closed"),
        # the stray quote closes at the next quoted field, with text after it: a shifted, garbled read
        ('"stray,Business Category: Bars,Review Stars: 3.0\n', True, "closes on line 22 but text follows"),
    ],
)
def test_a_stray_quote_is_refused_naming_the_line_where_it_opened(tmp_path, capsys, stray, later, message):
    # probe: a stray CSV quote silently swallowed the rest of the file into one reference
    rows = _reviews(40)
    rows[2] = _QUOTED  # a quoted field before it is read as usual
    rows[5] = stray
    if later:
        rows[20] = _QUOTED
    path = tmp_path / "stray.csv"
    path.write_text("text,label1,label2\n" + "".join(rows), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(path)))} line 7: .*{message}"):
        read_references(path)
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(path), "--batch-size", "2", "--epsilon", "1", "--delta", "1e-6",
            "--max-new-tokens", "4", "--output", str(out), "--no-progress"]
    assert main(argv) == EXIT_BAD_INPUT
    line = _one_line_error(capsys)
    assert str(path) in line and "line 7" in line and not out.exists()


def test_quoted_fields_over_several_lines_and_quotes_inside_fields_are_still_read(tmp_path):
    # the strict reading of quotes refuses stray quotes only: what the csv module reads correctly is read as before
    text = ('text,label\r\n"first line\r\nsecond line, with a comma\r\n\r\nand ""quoted"" words",a\r\n'
            'a 5" screen and he said "hi",b\r\n\r\nplain,c\r\nold mac\rline,d\r')
    path = tmp_path / "multi.csv"
    path.write_bytes(text.encode("utf-8"))
    expected = list(csv.DictReader(io.StringIO(text, newline="")))
    labelled = read_labelled_references(path, label_columns=["label"])
    assert list(labelled.texts) == [row["text"] for row in expected] and len(expected) == 5
    assert [m["label"] for m in labelled.labels] == [row["label"] or "" for row in expected]
    assert labelled.texts[0] == 'first line\r\nsecond line, with a comma\r\n\r\nand "quoted" words'


@pytest.mark.parametrize("layout", ["one line", "many lines", "jsonl line", "jsonl escaped"])
def test_an_oversized_field_is_refused_while_reading_in_bounded_memory(tmp_path, layout):
    # probe: a 21.6 MB field took 50 s and 5.2 GB to refuse (read whole, then tokenized, then "too long for the model")
    size = 21_600_000
    if layout == "one line":
        path, body = tmp_path / "big.csv", "text\nshort\n" + "x" * size + "\nshort\n"
    elif layout == "many lines":  # one quoted field of 21,600 lines: each short, the field not
        path, body = tmp_path / "big.csv", "text\nshort\n\"" + ("y" * 999 + "\n") * (size // 1000) + "\"\n"
    elif layout == "jsonl line":
        path, body = tmp_path / "big.jsonl", '{"text": "short"}\n' + json.dumps({"text": "z" * size}) + "\n"
    else:  # under the line bound, over the field bound
        path, body = tmp_path / "big.jsonl", '{"text": "short"}\n' + json.dumps({"text": "é" * 1_200_000}) + "\n"
    path.write_text(body, encoding="utf-8")
    del body
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(path)))} line \d+.*(1,000,000 characters|bytes)"):
            read_references(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MAX_LINE_BYTES  # bounded by one line, not by the file or the field (21.6 MB here)
    assert MAX_FIELD_CHARS == 1_000_000


def test_a_field_of_the_bound_is_read(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "a" * MAX_FIELD_CHARS}) + "\n", encoding="utf-8")
    assert len(read_references(path)[0]) == MAX_FIELD_CHARS
    path = tmp_path / "long.csv"
    path.write_text("text\n" + "b" * MAX_FIELD_CHARS + "\n", encoding="utf-8")
    limit = csv.field_size_limit()
    assert len(read_references(path)[0]) == MAX_FIELD_CHARS
    assert csv.field_size_limit() == limit  # the csv module's limit is the caller's again after reading


@pytest.mark.parametrize("where", ["text", "label"])
def test_evaluate_refuses_a_lone_surrogate_naming_the_file_and_line(tmp_path, capsys, where):
    # probe: a JSON "\ud800" escape in a synthetic JSON Lines file gave a tokenizer TypeError traceback in evaluate
    synthetic = tmp_path / "synthetic.jsonl"
    lines = [json.dumps({"text": f"fine text {i}", "stars": "4"}) for i in range(6)]
    lines[3] = '{"text": "bad \\udc80 text", "stars": "4"}' if where == "text" else '{"text": "ok", "stars": "4 \\ud800"}'
    synthetic.write_text("\n".join(lines) + "\n", encoding="utf-8")
    real = tmp_path / "real.csv"
    real.write_text("text,stars\n" + "".join(f"real {i},4\n" for i in range(6)), encoding="utf-8")
    from invink_audit.evaluation import read_text_set

    labels = ["--label-column", "stars"] if where == "label" else []
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(synthetic)))} line 4.* lone surrogate"):
        read_text_set(synthetic, label_columns=["stars"] if labels else ())
    argv = ["evaluate", "--synthetic", str(synthetic), "--real", str(real), "--no-progress", "--no-perplexity", *labels]
    assert main(argv) == EXIT_BAD_INPUT
    line = _one_line_error(capsys)
    assert str(synthetic) in line and "line 4" in line and "lone surrogate" in line


# -- a repeated JSON key (adversarial probe F7): json.loads keeps the last value, another reader the first ----------


def test_a_label_column_given_twice_in_a_record_is_refused_naming_the_line(tmp_path, capsys):
    # probe: {"label1": "A", "label1": "B"} was read as B, so --where label1=B selected a record a reader keeping the
    # first value says is A
    path = tmp_path / "refs.jsonl"
    path.write_text('{"text": "one", "label1": "A"}\n{"text": "two", "label1": "A", "label1": "B"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(path)))} line 2: a JSON object repeats a key"):
        read_labelled_references(path, label_columns=["label1"])
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(path), "--where", "label1=B", "--batch-size", "1", "--epsilon", "1",
            "--delta", "1e-6", "--max-new-tokens", "4", "--output", str(out), "--no-progress"]
    assert main(argv) == EXIT_BAD_INPUT
    line = _one_line_error(capsys)
    assert str(path) in line and "line 2" in line and "label1" not in line and not out.exists()


def test_a_text_given_twice_is_refused_before_anything_is_charged(tmp_path, capsys):
    # probe: {"text": "first secret", "text": "second secret"} as --input, then "first secret" as a public example:
    # the run was charged and published a string of the private file as public
    path, examples = tmp_path / "refs.jsonl", tmp_path / "examples.txt"
    path.write_text('{"text": "first secret", "text": "second secret"}\n', encoding="utf-8")
    examples.write_text("first secret\n", encoding="utf-8")
    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=10.0, delta=1e-5)
    argv = ["generate", "--input", str(path), "--public-examples", str(examples), "--ledger", str(ledger),
            "--batch-size", "1", "--epsilon", "1", "--delta", "1e-6", "--max-new-tokens", "4",
            "--output", str(tmp_path / "out.jsonl"), "--no-progress"]  # fmt: skip
    assert main(argv) == EXIT_BAD_INPUT
    line = _one_line_error(capsys)
    assert "line 1: a JSON object repeats a key" in line and "secret" not in line
    assert BudgetLedger(ledger).status().releases == ()
    for nested in ('{"text": "t", "meta": {"k": 1, "k": 2}}\n', '{"text": "t", "text": "t"}\n'):  # at any depth
        path.write_text(nested, encoding="utf-8")
        with pytest.raises(ValueError, match="line 1: a JSON object repeats a key"):
            read_references(path)


def test_a_ledger_repeating_a_key_is_refused(tmp_path):
    path = tmp_path / "ledger.json"
    BudgetLedger.create(path, epsilon=10.0, delta=1e-5)
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace('"budget": {', '"budget": {"epsilon": 0.1, ', 1), encoding="utf-8")
    with pytest.raises(LedgerError, match=r"corrupt: an object repeats the key 'epsilon'"):
        BudgetLedger(path).status()


def test_a_repeated_key_is_named_escaped():
    from accounting.strict_json import DuplicateKeyError, loads_strict

    with pytest.raises(DuplicateKeyError) as info:
        loads_strict('{"a\\nb\\u001b": 1, "a\\nb\\u001b": 2}')
    assert info.value.key == "a\nb\x1b" and info.value.key_shown() == "'a\\nb\\x1b'"
    assert "a\nb" not in str(info.value)
    assert loads_strict('{"a": {"a": 1}, "b": [{"a": 2}]}') == {"a": {"a": 1}, "b": [{"a": 2}]}  # per object
