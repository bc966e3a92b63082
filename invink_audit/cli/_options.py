"""The options several commands share, each defined once, and the readers of their values.

:data:`SHARED` holds every flag that two commands or more take, with its converter (argparse ``type=``), default
and help; a command registers them with :func:`add` (``add(p, "--delta", required=True)``: the entry with the
command's changes) and adds with ``add_argument`` only what is its own. A value its converter refuses is one line
naming the flag, exit status 2 (``--epsilon must be a number; got 'x'``); ranges are checked where the value is
used, by :mod:`accounting.limits` and the records' constructors, whose messages name the parameter and its range.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from accounting import ACCOUNTANTS, DEFAULT_ACCOUNTANT
from invink_audit.cli import CliError, comma_list, integer, number, top_k

B_HELP = (
    "B: private references per generated text (the paper's B). Each token costs B+1 forward rows "
    "(B private prompts + 1 public prompt); the reference package's batch_size is B+1."
)

#: What a run without ``--ledger`` says (on stderr, in the text summary and as ``ledger_notice`` in the JSON).
NOT_CHARGED = (
    "not charged to any ledger (no --ledger): the release's (epsilon, delta) is what it costs the references, and "
    "nothing records that it was spent; charge it to their ledger (`invink-audit ledger charge`) if they are private"
)


def pair(form: str):
    """A converter of ``NAME=VALUE`` into ``(name, value)``; ``form``: how its error says it."""

    def convert(text: str) -> tuple[str, str]:
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"must {form}; got {text!r}")
        return name, value

    return convert


def columns(text: str) -> list[str]:
    """``A,B``: comma-separated column names, none empty."""
    names = [c.strip() for c in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"must be comma-separated column names; got {text!r}")
    return names


SHARED: dict[str, dict] = {
    # privacy and the release's shape (the planners, the ledger, generate): ranges in docs/guide/planning.md
    "--epsilon": dict(type=number, help="target epsilon, in [1e-6, 1e4]"),
    "--delta": dict(type=number, help="delta, in [1e-300, 1)"),
    "--clip-norm": dict(type=number, help="clip norm C, in [1e-6, 1e6]"),
    "--temperature": dict(type=number, default="1.0", help="sampling temperature tau, in [1e-4, 1e4] (default 1.0)"),
    "--max-new-tokens": dict(type=integer, help="token budget T per text, 1 .. 1e9 (never derived from data)"),
    "--batch-size": dict(type=integer, help=B_HELP + " 1 .. 1e9."),
    "--texts-per-batch": dict(type=integer, default="1", help="texts generated from each batch, 1 .. 1e9 (default 1)"),
    "--num-batches": dict(type=integer, default="1", help="disjoint batches in the release (parallel composition: "
                          "they cost one batch's epsilon), 1 .. 1e9 (default 1)"),
    "--accountant": dict(default=DEFAULT_ACCOUNTANT.value, choices=ACCOUNTANTS,
                         help=f"privacy accountant (default: {DEFAULT_ACCOUNTANT.value})"),
    "--top-k": dict(help="k of the Top-k+ set, an integer >= 1, or 'full' (default 100)"),  # read by hand: 'full' is None
    "--num-texts": dict(type=integer, help="texts to generate (default: one per full batch)"),
    "--num-texts-per-group": dict(type=integer, help="with label columns: texts per label group"),
    "--seed": dict(type=integer, help="fixed seed, an integer >= 0: reproducible output, NOT private (tests/audits only)"),
    # a grid of releases (table, sweep, profile)
    "--epsilons": dict(type=comma_list(number), help="comma-separated epsilons, e.g. 1,3,10"),
    "--batch-sizes": dict(type=comma_list(integer), help="comma-separated B values, e.g. 4,8"),
    "--top-ks": dict(type=comma_list(top_k), default="100", help="comma-separated k values or 'full' (default 100)"),
    "--temperatures": dict(type=comma_list(number), default="1.0", help="comma-separated tau values (default 1.0)"),
    # the model
    "--model": dict(help="the generator's model: HF model directory or hub id, a .gguf file, gemma3-270m or "
                    "smollm2-135m-instruct (default: generate's, Gemma-3-270M)"),
    "--device": dict(default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N"),
    "--dtype": dict(default="auto", help="model dtype: auto (bfloat16 on CUDA; on a CPU with native bfloat16, "
                    "bfloat16 when a probe on public text finds it close to float32, else float32), float32, "
                    "bfloat16, float16"),
    "--max-batch-rows": dict(type=integer, help="rows per forward pass, an integer >= 1 (memory bound; default: by device)"),
    # the data
    "--input": dict(required=True, help="references: a UTF-8 .csv (see --column) or .jsonl file (a BOM is accepted)"),
    "--real": dict(required=True, help="held-out real texts (.csv or .jsonl)"),
    "--column": dict(default="text", help="text column of --input and --real (default: text)"),
    "--where": dict(action="append", type=pair("be COLUMN=VALUE"), metavar="COLUMN=VALUE",
                    help="use only the records whose COLUMN equals VALUE (repeatable: all must hold), e.g. "
                    "'label1=Business Category: Restaurants'; COLUMN is a public attribute like a label, never the "
                    "text column (sweep: selects from --input; --real is read as given)"),
    "--label-column": dict(action="append", default=[], metavar="NAME", help="label column (repeat for several)"),
    "--label-columns": dict(type=columns, metavar="A,B", help="the same, comma-separated (as generate takes them)"),
    # the unit of privacy (docs/guide/privacy-unit.md)
    "--privacy-unit": dict(metavar="COLUMN", help="the unit of privacy: references sharing this column's value (e.g. "
                           "a user id) are one unit, and the guarantee protects all of a unit's references together "
                           "(default: one reference). Unit values are never written"),
    "--unit-rule": dict(choices=("combine", "spread", "first"), help="with --privacy-unit, how a unit's references "
                        "are bounded (public rules: file order and the unit column only): combine (default: one slot "
                        "per unit, its references joined in file order, cut at --unit-max-chars), spread (at most "
                        "--unit-max-references per unit, each in a different batch, charged that many texts), first "
                        "(a unit's first reference only)"),
    "--unit-max-references": dict(type=integer, metavar="K", help="rule spread's bound k: a unit's first K references, "
                                  "in K different batches; the guarantee per unit composes K texts (default 1)"),
    "--unit-max-chars": dict(type=integer, metavar="N", help="rule combine's public length bound: a unit's joined "
                             "references cut to their first N characters (default: no cut)"),
    # the public prompt (generate, sweep, profile)
    "--prompt": dict(help="prompt preset: generic, yelp (answer started as a quoted review), yelp-paper (the paper's "
                     "Table 4), tab, mimic; base models (no chat template): yelp-completion, generic-completion "
                     "(default generic; --mechanism augpe: its own presets mimic (default) and yelp)"),
    "--prompt-field": dict(action="append", type=pair("look like NAME=VALUE"), metavar="NAME=VALUE",
                           help="public prompt field, e.g. description=... (generic) or category=... stars=... "
                           "(yelp); repeatable"),
    "--answer-prefix": dict(metavar="TEXT", help="public start of the model's answer in every row (replaces the "
                            "preset's; may use the public fields, e.g. 'Review ({stars} stars): \"'); '' for none"),
    "--stop": dict(action="append", metavar="TEXT", help="public stop string: a text ends at the first one it draws, "
                   "which is cut (replaces the preset's; repeatable; '' alone for none)"),
    "--public-examples": dict(metavar="FILE", help="UTF-8 text file of PUBLIC example texts (one per line, e.g. a "
                              "published proxy set; never the private input), shown in every row's prompt"),
    # what a run writes and says
    "--ledger": dict(help="budget ledger to charge before generating (see `ledger init`)"),
    "path": dict(help="the ledger file"),
    "--output": dict(metavar="DIR", help="directory for report.json, report.md and plots"),
    "--json": dict(action="store_true", help="print one JSON object instead of text"),
    "--no-progress": dict(action="store_true", help="no progress bars on stderr"),
}

#: the public prompt's flags (generate, sweep, profile)
PROMPT = ("--prompt", "--prompt-field", "--answer-prefix", "--stop", "--public-examples")


def add(parser, *flags: str, **changes) -> None:
    """Register shared ``flags`` (:data:`SHARED`) on ``parser`` (or an argument group), each with ``changes``."""
    for flag in flags:
        parser.add_argument(flag, **SHARED[flag] | changes)


def add_grid(parser) -> None:
    """The grid's axes and its δ, as ``sweep`` and ``profile`` take them (:func:`grid_options` reads them)."""
    add(parser, "--epsilons", "--batch-sizes", required=True)
    add(parser, "--top-ks", "--temperatures")
    add(parser, "--delta", default="1e-6", help="delta of every point (default 1e-6)")


def grid_options(args, *, private_input: bool = True) -> dict:
    """What ``sweep`` and ``profile`` give their configs alike (``SweepConfig``, ``ProfileConfig``): the grid
    (:func:`add_grid`), the selection, the prompt (:func:`prompt_template`) and the label columns."""
    axes = {name: getattr(args, name) for name in ("epsilons", "batch_sizes", "top_ks", "temperatures", "delta")}
    return dict(axes, where=parse_where(args.where), prompt=prompt_template(args, private_input=private_input),
                prompt_fields=parse_fields(args.prompt_field) or None, column=args.column,
                label_columns=tuple(label_columns(args)))


#: the privacy unit's flags (generate, audit --release, profile; :func:`privacy_unit` reads them)
UNIT = ("--privacy-unit", "--unit-rule", "--unit-max-references", "--unit-max-chars")


def privacy_unit(args):
    """:data:`UNIT` as a :class:`~invink_audit.data.PrivacyUnit` (``None``: per reference); a rule's bound without
    ``--privacy-unit``, or a bound another rule does not take, is one line naming the flag."""
    from invink_audit.data import PrivacyUnit

    given = [f for f in UNIT[1:] if getattr(args, f[2:].replace("-", "_"), None) is not None]
    if args.privacy_unit is None:
        if given:
            raise CliError(f"{given[0]} is only used with --privacy-unit COLUMN")
        return None
    if getattr(args, "where", None):
        raise CliError("--where with --privacy-unit is not supported: select the records into a file first")
    try:
        return PrivacyUnit(args.privacy_unit, args.unit_rule or "combine",
                           1 if args.unit_max_references is None else args.unit_max_references, args.unit_max_chars)
    except ValueError as err:
        raise CliError(f"--privacy-unit: {err}") from err


def parse_fields(items) -> dict[str, str]:
    """``--prompt-field`` (or ``--label-field``) pairs as ``{name: value}``, the last value of a name kept."""
    return {name.strip(): value for name, value in items or ()}


def parse_where(items) -> dict[str, str] | None:
    """``--where COLUMN=VALUE`` (repeated) as ``{column: value}``; ``None`` when not given."""
    where: dict[str, str] = {}
    for column, value in items or ():
        if where.setdefault(column, value) != value:
            raise CliError(f"--where gives two values for {column!r}: no record can have both")
    return where or None


def label_columns(args) -> list[str]:
    """``--label-column`` (repeated) and ``--label-columns A,B`` together, in order, without repeats."""
    return list(dict.fromkeys(args.label_column + (args.label_columns or [])))


def selected_references(args, label_columns):
    """``--input`` as ``generate`` takes it: its path, or with ``--where`` the selected records (their texts,
    or :class:`~invink_audit.data.LabelledReferences` with ``label_columns``)."""
    from invink_audit.data import select_references

    where = parse_where(args.where)
    if where is None:
        return Path(args.input), args.column
    try:
        selected = select_references(Path(args.input), where, column=args.column, label_columns=label_columns or ())
    except ValueError as err:
        raise CliError(f"--where: {err}") from err
    return selected, None


def prompt_template(args, *, private_input: bool = True):
    """The preset of ``--prompt`` with ``--answer-prefix``, ``--stop`` and ``--public-examples`` applied
    (all public); a preset name when none is given. ``private_input``: ``--input`` is private (``generate``,
    ``sweep``), so public inputs from it are refused (:func:`refuse_private_file`); ``profile`` reads proxy data."""
    import dataclasses

    from invink_audit.prompts import get_preset, public_inputs

    name = "generic" if args.prompt is None else args.prompt
    changed = not (args.answer_prefix is None and args.stop is None and args.public_examples is None)
    if not changed and not (private_input and args.where):
        return name
    changes = {}
    if args.answer_prefix is not None:
        changes["answer_prefix"] = args.answer_prefix
    if args.stop is not None:
        changes["stop"] = tuple(s for s in args.stop if s)
    if args.public_examples is not None:
        changes["examples"] = read_public_examples(args.public_examples, args.input if private_input else None)
    template = dataclasses.replace(get_preset(name), **changes)
    if private_input and args.where:  # the release checks the records it reads; these come from the whole file
        named = [(f"{name} of prompt {template.name!r}", text) for name, text in public_inputs(template)]
        named += [(f"--prompt-field {name}", value) for name, value in parse_fields(args.prompt_field).items()]
        refuse_public_from_input(named, args)
    return template if changed else name


def refuse_public_from_input(named, args, references=None, owner: str = "") -> None:
    """Public inputs (``(name, text)`` pairs) against every record of ``--input``: ``references`` as read, or (``None``)
    the whole file read once, the records ``--where`` leaves out included
    (:func:`~invink_audit.prompts.refuse_private_strings`; its error names ``--input``)."""
    from invink_audit.data import read_references
    from invink_audit.prompts import refuse_private_strings

    every = read_references(Path(args.input), column=args.column) if references is None else references
    try:
        refuse_private_strings(named, every, owner)
    except ValueError as err:
        raise CliError(f"--input {args.input!r}: {err}") from err


def read_public_examples(path: str, private_input: str | None = None) -> tuple[str, ...]:
    """The non-blank lines of a UTF-8 text file of public examples (a clear error names the file), refused when
    they come from ``private_input`` (:func:`refuse_private_file`)."""
    if private_input is not None:
        refuse_private_file("--public-examples", path, private_input)
    try:
        with open(path, encoding="utf-8-sig") as handle:
            lines = [line.strip() for line in handle]
    except FileNotFoundError as err:
        raise CliError(f"--public-examples: no such file {path!r}") from err
    except UnicodeDecodeError as err:
        raise CliError(f"--public-examples: {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from err
    examples = tuple(line for line in lines if line)
    if not examples:
        raise CliError(f"--public-examples: {path!r} holds no example (one per non-blank line)")
    return examples


def refuse_private_file(flag: str, path: str, private_input: str) -> None:
    """Refuse a public input file that is the private ``--input``: the same file (by path, a symbolic or hard
    link) or a byte-for-byte copy. Examples that repeat some of its records (a subset) are refused by the
    release, which checks every public input against the references it reads
    (:func:`~invink_audit.prompts.refuse_private_in_public`), and with ``--where`` against the whole file."""
    import filecmp

    public, private = Path(path), Path(private_input)
    if not public.is_file() or not private.is_file():
        return  # a missing file is named by the reader that opens it
    why = None
    if public.resolve() == private.resolve() or os.path.samefile(public, private):
        why = "is the private --input file"
    elif filecmp.cmp(public, private, shallow=False):
        why = "is a copy of the private --input file"
    if why is not None:
        raise CliError(f"{flag}: {path!r} {why}; public inputs are published with every text and must not come "
                       "from the private data. Nothing was charged.")
