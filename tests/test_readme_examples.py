"""Every ```python block of README.md and of the guide runs as a reader would run it.

The blocks are read at run time (never copied here) from README.md and from every Markdown file under
docs/guide/ and docs/design/ (:data:`DOCUMENTS`), so an edit that breaks an example fails the suite.
Each file's blocks run in order, each in a fresh namespace, in a temporary working directory of its
own, with the Hugging Face hub offline (``HF_HUB_OFFLINE=1``); each block is one test, whose id names
its file and the line of its opening fence (``docs/guide/planning.md:73``).

* **Skipping.** A block is skipped only when its file says so on the line right before it, with an
  HTML comment ``<!-- not run: <reason> -->`` (invisible on GitHub); the test reports it as skipped
  with that reason, and asserts, file by file, that it found every ```python fence (no silent skips)
  and that every such marker sits right before a ```python fence.
* **What a reader would have.** Some blocks use files or names the reader brings (``my.csv`` and a
  ledger for the README's tour, ``texts.jsonl`` and ``heldout.csv`` for an evaluation,
  ``references``, ``my_generate``). A small setup per block, keyed by a distinctive substring of the
  block (:data:`SETUPS`), writes or defines them; every key must match exactly one block across all
  the files, so a setup cannot outlive its block unnoticed.
* **The tiny model.** Blocks keyed in :data:`TINY_DEFAULT_MODEL` load the default model (``model=None``, or
  the default generator Gemma-3-270M that ``generate`` names) for many texts: the model audit (``num_samples=32``) took 143 s
  with it on a 2-core CPU, and a quick audit generates and then samples 16 more texts at B = 7. For
  those blocks the test replaces ``invink_audit.models.load_model``'s default (``None``) by
  :func:`invink_audit.models.build_tiny_model` (every invink_audit module that imported
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
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the Markdown files whose ```python blocks run, in this order (each file's blocks in file order)
DOCUMENTS = (
    ROOT / "README.md",
    *sorted((ROOT / "docs" / "guide").glob("*.md")),
    *sorted((ROOT / "docs" / "design").glob("*.md")),
)

#: an HTML comment on the line right before a ```python fence that exempts the block, with its reason
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->$")
#: info strings that GitHub highlights as Python: a block under any of these but "python" would be missed
PYTHON_LIKE = {"py", "py3", "python3", "pycon", "ipython", "ipython3"}


@dataclasses.dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root, e.g. "docs/guide/planning.md"
    index: int  # 0-based, in file order
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None  # the reason of a `<!-- not run: ... -->` marker, else None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    def __str__(self) -> str:
        return f"{self.path} block {self.index} (line {self.line})"


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _fences(text: str, name: str = "README.md"):
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
    assert inside is None, f"{name}: the fence opened on line {inside[0]} is never closed"


def read_blocks(text: str, name: str = "README.md") -> list[Block]:
    lines = text.split("\n")
    blocks = []
    for number, info, body in _fences(text, name):
        if info != "python":
            continue
        previous = lines[number - 2].strip() if number >= 2 else ""
        marker = NOT_RUN.match(previous)
        blocks.append(Block(name, len(blocks), number, "\n".join(body) + "\n", marker["reason"] if marker else None))
    return blocks


#: relative path -> text, for every file of DOCUMENTS
TEXTS = {_relative(path): path.read_text(encoding="utf-8") for path in DOCUMENTS}
#: every ```python block of every file, file by file in DOCUMENTS order
BLOCKS = [block for name, text in TEXTS.items() for block in read_blocks(text, name)]


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


def _reviews_and_ledger(namespace: dict, workdir: Path) -> None:
    """``my.csv`` with Yelp-style labels (two star groups of seven reviews: one batch of B = 7 each) and
    the ledger ``invink-audit ledger init reviews.ledger.json --epsilon 10 --delta 1e-6`` creates."""
    from accounting import BudgetLedger

    with open(workdir / "my.csv", "w", encoding="utf-8", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["text", "label1", "label2"])
        for good in (True, False):
            for i in range(7):
                writer.writerow([f"{(_GOOD if good else _BAD)[i % 5]} Visit {i}.", _CATEGORY, _STARS[good]])
    BudgetLedger.create(workdir / "reviews.ledger.json", epsilon=10.0, delta=1e-6)


def _references(namespace: dict, workdir: Path) -> None:
    namespace["references"] = list(REFERENCES)


def _references_and_generator(namespace: dict, workdir: Path) -> None:
    """``references`` and a trivial black-box generator (the first word of every reference)."""
    namespace["references"] = list(REFERENCES)
    namespace["my_generate"] = lambda references: " ".join(r.split()[0] for r in references if r and r.strip())


#: distinctive substring of a block -> what the reader would have before running it
SETUPS: dict[str, Callable[[dict, Path], None]] = {
    'ReferencesFile(Path("my.csv")': _reviews_and_ledger,
    'read_text_set("texts.jsonl"': _evaluation_inputs,
    "audit = quick_audit(result)": _references,
    "blackbox_audit(my_generate, references": _references_and_generator,
}

#: blocks (by substring) run with the tiny model as the default model (module docstring)
TINY_DEFAULT_MODEL = ("audit_model(", "audit = quick_audit(result)", "report = quick_audit(result)")


# ---------------------------------------------------------------------------------------------
# what a block's comments say it prints or writes


def _check_plan(stdout: str, workdir: Path) -> None:
    # print(plan.clip_norm, plan.epsilon0, plan.rho_sequence, plan.accountant)    # 0.0887... br-adaptive
    assert re.fullmatch(r"0\.0887\d*( \S+){2} br-adaptive\n", stdout), stdout


def _check_tour_audit(stdout: str, workdir: Path) -> None:
    # print(report.summary())        # NOT PRIVATE: computed from the references; keep it with the data
    assert stdout.startswith("audit verdict: ") and "NOT PRIVATE" in stdout, stdout
    assert (workdir / "texts.jsonl").stat().st_size > 0  # the release, charged once to the ledger
    from accounting import BudgetLedger

    assert len(BudgetLedger(workdir / "reviews.ledger.json").status().releases) == 1


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
    "print(report.summary())": _check_tour_audit,
    'write_report(report, "out/")': _check_files("out", ("report.json", "report.md"), "*.png"),
    'write_evaluation_report(result, "report/")': _check_files(
        "report", ("report.md", "report.json", "mauve.png", "perplexity.png")
    ),
}


def _matching(table, block: Block) -> list:
    return [value for key, value in table.items() if key in block.code]


# ---------------------------------------------------------------------------------------------
# structure: every block found, every marker and key attached to one block


def test_the_documents_are_found():
    assert DOCUMENTS[0].name == "README.md" and all(path.is_file() for path in DOCUMENTS)
    names = set(TEXTS)
    for expected in ("docs/guide/planning.md", "docs/guide/generating.md", "docs/guide/auditing.md",
                     "docs/design/engine.md"):
        assert expected in names, f"{expected} is not among the documents whose blocks run: {sorted(names)}"
    assert len(BLOCKS) >= 10, "the documents lost most of their examples, or the parser broke"


@pytest.mark.parametrize("name", list(TEXTS))
def test_every_python_fence_is_found(name):
    opening = [n for n, line in enumerate(TEXTS[name].split("\n"), start=1) if line.strip() == "```python"]
    assert [b.line for b in BLOCKS if b.path == name] == opening


@pytest.mark.parametrize("name", list(TEXTS))
def test_no_python_block_under_another_name(name):
    fences = _fences(TEXTS[name], name)
    others = [(n, info) for n, info, _ in fences if info.split()[:1] and info.split()[0] in PYTHON_LIKE]
    assert not others, f"{name}: write ```python so that the block is run: {others}"


@pytest.mark.parametrize("name", list(TEXTS))
def test_every_not_run_marker_precedes_a_python_block(name):
    lines = TEXTS[name].split("\n")
    markers = {n for n, line in enumerate(lines, start=1) if "not run" in line and line.lstrip().startswith("<!--")}
    attached = {b.line - 1 for b in BLOCKS if b.path == name and b.not_run is not None}
    assert markers == attached, (
        f"{name}: a `<!-- not run: reason -->` marker must be the line right before a ```python fence"
    )


@pytest.mark.parametrize("table", ["SETUPS", "CHECKS", "TINY_DEFAULT_MODEL"])
def test_every_key_matches_exactly_one_block(table):
    keys = globals()[table]
    for key in keys:
        found = [str(b) for b in BLOCKS if key in b.code]
        assert len(found) == 1, f"{table} key {key!r} matches {found or 'no block'}: update it to the documents"
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
    from invink_audit.models import DEFAULT_GENERATOR

    original = invink_audit.models.load_model

    def load_model(model=None, **kwargs):
        # the default (None, or the default generator generate names) and the tiny model's own recorded name
        # (what quick_audit loads a result's model by)
        return loaded if model in (None, DEFAULT_GENERATOR, loaded.name) else original(model, **kwargs)

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
    namespace = {"__name__": "doc_block_" + re.sub(r"\W", "_", block.path) + f"_{block.index}"}
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
@pytest.mark.parametrize("block", BLOCKS, ids=[block.id for block in BLOCKS])
def test_python_block_runs(block, tmp_path, monkeypatch, tiny_model):
    if block.not_run is not None:
        pytest.skip(f"{block}: not run: {block.not_run}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    _run(block, tmp_path, tiny_model, monkeypatch)
