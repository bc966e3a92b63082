"""Every ```python block of README.md runs as a reader would run it.

The blocks are read from README.md at run time (never copied here), so a README edit that breaks an
example fails the suite. Each block runs in order, in a fresh namespace, in a temporary working
directory of its own, with the Hugging Face hub offline (``HF_HUB_OFFLINE=1``).

* **Skipping.** A block is skipped only when the README says so on the line right before it, with an
  HTML comment ``<!-- not run: <reason> -->`` (invisible on GitHub); the test asserts that every other
  block ran, and that it found every ```python fence of the file (no silent skips).
* **What a reader would have.** Some blocks use files or names the reader brings (``texts.jsonl`` and
  ``heldout.csv`` for an evaluation, ``references``, ``my_generate``). A small setup per block, keyed
  by a distinctive substring of the block (:data:`SETUPS`), writes or defines them; every key must
  match exactly one block, so a setup cannot outlive its block unnoticed.
* **The tiny model.** Blocks keyed in :data:`TINY_DEFAULT_MODEL` load the default model (``model=None``,
  the embedded SmolLM2-135M-Instruct) for many texts: the model audit (``num_samples=32``) took 143 s
  with it on a 2-core CPU, and the quick audit generates and then samples 16 more texts of 32 tokens
  at B = 7. For those blocks the test replaces ``invink_audit.models.load_model``'s default (``None``)
  by :func:`invink_audit.models.build_tiny_model` (every invink_audit module that imported
  ``load_model`` sees the replacement; a named model or a path still loads as written). The blocks are
  otherwise run unchanged, and the others (generation, the evaluation's perplexity scorer) use the
  real model.
* **Printed values.** Where a block's comment states what it prints or writes (``# 0.0887...
  br-adaptive``, ``# report.json, report.md, PNG plots``), :data:`CHECKS` asserts it on the captured
  stdout or the working directory.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"

#: an HTML comment on the line right before a ```python fence that exempts the block, with its reason
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->$")
#: info strings that GitHub highlights as Python: a block under any of these but "python" would be missed
PYTHON_LIKE = {"py", "py3", "python3", "pycon", "ipython", "ipython3"}


@dataclasses.dataclass(frozen=True)
class Block:
    index: int  # 0-based, in README order
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason of a `<!-- not run: ... -->` marker, else None

    def __str__(self) -> str:
        return f"README.md block {self.index} (line {self.line})"


def _fences(text: str):
    """(line number, info string) of every opening fence, with the lines of its block."""
    lines = text.split("\n")
    inside = None
    for number, line in enumerate(lines, start=1):
        if not line.startswith("```"):
            if inside is not None:
                inside[2].append(line)
            continue
        if inside is None:
            inside = (number, line[3:].strip(), [])
        else:
            yield inside
            inside = None
    assert inside is None, f"README.md: the fence opened on line {inside[0]} is never closed"


def read_blocks(text: str) -> list[Block]:
    lines = text.split("\n")
    blocks = []
    for number, info, body in _fences(text):
        if info != "python":
            continue
        previous = lines[number - 2].strip() if number >= 2 else ""
        marker = NOT_RUN.match(previous)
        blocks.append(Block(len(blocks), number, "\n".join(body) + "\n", marker["reason"] if marker else None))
    return blocks


README_TEXT = README.read_text(encoding="utf-8")
BLOCKS = read_blocks(README_TEXT)


# ---------------------------------------------------------------------------------------------
# what a reader would have: files and names a block uses without defining them

# A few reviews with two star labels whose words tell them apart, so that the TSTR ceiling beats chance
_GOOD = ["Great food and great staff.", "Loved the pasta, great wine.", "Great desserts, lovely service.",
         "Wonderful brunch, great coffee.", "Excellent tacos, lovely patio."]
_BAD = ["Terrible service and cold food.", "Bland soup, terrible value.", "Rude waiter, terrible wait.",
        "Burnt pizza and dirty tables.", "Terrible fish, never again."]
_STARS = {True: "Review Stars: 5.0", False: "Review Stars: 1.0"}
_CATEGORY = "Business Category: Restaurants"

REFERENCES = [
    "The tacos were great and the staff friendly.",
    "Cold soup, slow service.",
    "",
    "Best brunch in town, but a long queue.",
    "Overpriced wine list, lovely terrace.",
    "The pizza crust was burnt.",
    "Friendly owner, tiny portions.",
]


def _evaluation_inputs(namespace: dict, workdir: Path) -> None:
    """``texts.jsonl`` as ``invink-audit generate`` writes it (labelled) and a labelled ``heldout.csv``."""
    with open(workdir / "texts.jsonl", "w", encoding="utf-8") as out:
        for i in range(8):
            good = i % 2 == 1
            text = (_GOOD if good else _BAD)[i % 5]
            record = {
                "batch_index": i, "text": text, "num_tokens": len(text.split()), "finish_reason": "eos",
                "labels": {"label1": _CATEGORY, "label2": _STARS[good]}, "release_id": "readme-example",
            }
            out.write(json.dumps(record) + "\n")
    with open(workdir / "heldout.csv", "w", encoding="utf-8", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["text", "label1", "label2"])
        for i in range(16):
            good = i % 2 == 1
            writer.writerow([f"{(_GOOD if good else _BAD)[(i // 2) % 5]} Visit {i}.", _CATEGORY, _STARS[good]])


def _references(namespace: dict, workdir: Path) -> None:
    namespace["references"] = list(REFERENCES)


def _references_and_generator(namespace: dict, workdir: Path) -> None:
    """``references`` and a trivial black-box generator (the first word of every reference)."""
    namespace["references"] = list(REFERENCES)
    namespace["my_generate"] = lambda references: " ".join(r.split()[0] for r in references if r.strip())


#: distinctive substring of a block -> what the reader would have before running it
SETUPS: dict[str, Callable[[dict, Path], None]] = {
    'read_text_set("texts.jsonl"': _evaluation_inputs,
    "audit = quick_audit(result)": _references,
    "blackbox_audit(my_generate, references": _references_and_generator,
}

#: blocks (by substring) run with the tiny model as the default model (module docstring)
TINY_DEFAULT_MODEL = ("audit_model(", "quick_audit(")


# ---------------------------------------------------------------------------------------------
# what a block's comments say it prints or writes


def _check_plan(stdout: str, workdir: Path) -> None:
    # print(plan.clip_norm, plan.epsilon0, plan.rho_sequence, plan.accountant)    # 0.0887... br-adaptive
    assert re.fullmatch(r"0\.0887\d*( \S+){2} br-adaptive\n", stdout), stdout


def _check_files(folder: str, names: tuple[str, ...], pattern: str | None = None):
    def check(stdout: str, workdir: Path) -> None:
        written = sorted(p.name for p in (workdir / folder).iterdir())
        assert set(names) <= set(written), written
        if pattern is not None:
            assert any(Path(name).match(pattern) for name in written), written

    return check


#: distinctive substring of a block -> a check of its stdout and working directory
CHECKS: dict[str, Callable[[str, Path], None]] = {
    "print(plan.clip_norm, plan.epsilon0": _check_plan,
    'write_report(report, "out/")': _check_files("out", ("report.json", "report.md"), "*.png"),
    'write_evaluation_report(result, "report/")': _check_files(
        "report", ("report.md", "report.json", "mauve.png", "perplexity.png")
    ),
}


def _matching(table, block: Block) -> list:
    return [value for key, value in table.items() if key in block.code]


# ---------------------------------------------------------------------------------------------
# structure: every block found, every marker and key attached to one block


def test_every_python_fence_is_found():
    opening = [n for n, line in enumerate(README_TEXT.split("\n"), start=1) if line.strip() == "```python"]
    assert [b.line for b in BLOCKS] == opening
    assert len(BLOCKS) >= 10, "README.md lost most of its examples, or the parser broke"


def test_no_python_block_under_another_name():
    others = [(n, info) for n, info, _ in _fences(README_TEXT) if info.split()[:1] and info.split()[0] in PYTHON_LIKE]
    assert not others, f"write ```python so that the block is run: {others}"


def test_every_not_run_marker_precedes_a_python_block():
    lines = README_TEXT.split("\n")
    markers = {n for n, line in enumerate(lines, start=1) if "not run" in line and line.lstrip().startswith("<!--")}
    attached = {b.line - 1 for b in BLOCKS if b.not_run is not None}
    assert markers == attached, "a `<!-- not run: reason -->` marker must be the line right before a ```python fence"


@pytest.mark.parametrize("table", ["SETUPS", "CHECKS", "TINY_DEFAULT_MODEL"])
def test_every_key_matches_exactly_one_block(table):
    keys = globals()[table]
    for key in keys:
        found = [str(b) for b in BLOCKS if key in b.code]
        assert len(found) == 1, f"{table} key {key!r} matches {found or 'no block'}: update it to the README"
        assert not [b for b in BLOCKS if key in b.code and b.not_run], f"{table} key {key!r}: that block is not run"


# ---------------------------------------------------------------------------------------------
# running them


@pytest.fixture(scope="module")
def tiny_model():
    from invink_audit.models import build_tiny_model

    return build_tiny_model()


@contextlib.contextmanager
def _default_model(loaded, monkeypatch):
    """``load_model(None)`` returns ``loaded`` in every invink_audit module that holds ``load_model``;
    a module first imported meanwhile (and so holding the replacement) gets the original back after."""
    import invink_audit.models

    original = invink_audit.models.load_model

    def load_model(model=None, **kwargs):
        return loaded if model is None else original(model, **kwargs)

    def holding(function):
        return [
            module for name, module in list(sys.modules.items())
            if name.partition(".")[0] == "invink_audit" and getattr(module, "load_model", None) is function
        ]

    with monkeypatch.context() as patch:
        for module in holding(original):
            patch.setattr(module, "load_model", load_model)
        try:
            yield
        finally:
            for module in holding(load_model):
                module.load_model = original


def _run(block: Block, workdir: Path, tiny, monkeypatch) -> str:
    """Run one block; return its stdout."""
    namespace = {"__name__": f"readme_block_{block.index}"}
    for setup in _matching(SETUPS, block):
        setup(namespace, workdir)
    stdout = io.StringIO()
    code = compile(block.code, f"<{block}>", "exec")
    tiny_default = any(key in block.code for key in TINY_DEFAULT_MODEL)
    model = _default_model(tiny, monkeypatch) if tiny_default else contextlib.nullcontext()
    with model, contextlib.redirect_stdout(stdout):
        exec(code, namespace)
    for check in _matching(CHECKS, block):
        check(stdout.getvalue(), workdir)
    return stdout.getvalue()


@pytest.mark.slow
def test_readme_python_blocks_run(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    ran, skipped, failures = [], [], []
    for block in BLOCKS:
        if block.not_run is not None:
            skipped.append(block.index)
            continue
        workdir = tmp_path / f"block{block.index}"
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        try:
            _run(block, workdir, tiny_model, monkeypatch)
        except Exception:  # report every failing block, not just the first
            failures.append(f"{block}:\n{traceback.format_exc()}")
        ran.append(block.index)
    assert not failures, "\n\n".join(failures)
    unmarked = [b.index for b in BLOCKS if b.not_run is None]
    assert ran == unmarked, f"blocks that ran {ran}, blocks without a not-run marker {unmarked}"
    assert len(ran) + len(skipped) == len(BLOCKS)
