"""``invink-audit generate``: DP synthetic texts from a file of references, streamed to JSON Lines.

Every argument is checked (one line, exit status 2) before the model is loaded, and everything,
including that each prompt fits the model's context, before the ledger is charged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from invink_audit.cli import (
    CliError, add_accountant_argument, column_names, parse_float, parse_int, parse_top_k, plural, shown, tqdm_bar,
)
from invink_audit.distributed import launch_rank

#: What a run without ``--ledger`` says (on stderr, in the text summary and as ``ledger_notice`` in the JSON).
NOT_CHARGED = (
    "not charged to any ledger (no --ledger): the release's (epsilon, delta) is what it costs the references, and "
    "nothing records that it was spent; charge it to their ledger (`invink-audit ledger charge`) if they are private"
)

_B_HELP = (
    "B: private references per generated text. Each token costs B+1 forward rows (B private prompts + "
    "1 public prompt); the reference package's batch_size is B+1."
)


def _pairs(items, flag: str, form: str) -> list[tuple[str, str]]:
    """The ``NAME=VALUE`` items of a repeatable flag as ``(name, value)`` pairs; ``form``: how the error says it."""
    pairs = []
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise CliError(f"{flag} must {form}; got {item!r}")
        pairs.append((name, value))
    return pairs


def parse_fields(items: list[str] | None, flag: str = "--prompt-field") -> dict[str, str]:
    """``--prompt-field NAME=VALUE`` (repeated; or ``flag``) as ``{name: value}``, the last value of a name kept."""
    return {name.strip(): value for name, value in _pairs(items, flag, "look like NAME=VALUE")}


def add_model_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory or hub id, a .gguf file, gemma3-270m or smollm2-135m-instruct (default: the default "
        "generator, Gemma-3-270M, prompted with the completion twin of --prompt yelp or generic)",
    )
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside the --model directory")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="model dtype: auto (bfloat16 on CUDA; on a CPU with native bfloat16, bfloat16 when a probe on public "
        "text finds it close to float32, else float32), float32, bfloat16, float16",
    )
    parser.add_argument(
        "--max-batch-rows", default=None, help="rows per forward pass, an integer >= 1 (memory bound; default: by device)"
    )


def _add_input_arguments(p) -> None:
    """The references, their label groups and the output file."""
    p.add_argument(
        "--input", required=True, help="references: a UTF-8 .csv (see --column) or .jsonl file (a BOM is accepted)"
    )
    p.add_argument("--column", default=None, help="CSV column or JSONL field holding the text (default: text)")
    add_where_argument(p)
    p.add_argument(
        "--label-columns",
        default=None,
        help="label-conditioned generation: comma-separated label columns (e.g. label1,label2 for Yelp); each batch "
        "comes from one label group and its labels fill the prompt's public fields (labels are treated as public)",
    )
    p.add_argument(
        "--label-field",
        action="append",
        metavar="COLUMN=FIELD",
        help="map a label column to a prompt field (default: the preset's rule, or the field of the same name); repeatable",
    )
    p.add_argument(
        "--num-texts-per-group", default=None, help="with --label-columns: texts per label group (default: every full batch)"
    )
    p.add_argument(
        "--output",
        required=True,
        help="output .jsonl file: new or empty, or the output of an interrupted run with the same settings (resumed)",
    )


def _add_privacy_arguments(p) -> None:
    """The guarantee and the mechanism: (ε or C, δ), B, T, the number of texts, k and τ."""
    p.add_argument("--epsilon", default=None, help="target epsilon (finite, > 0); the clip norm is planned for it")
    p.add_argument(
        "--clip-norm", default=None, help="clip norm C (finite, > 0) instead of --epsilon (epsilon is reported)"
    )
    p.add_argument("--delta", required=True, help="target delta, in (0, 1)")
    p.add_argument("--batch-size", default=None, help=_B_HELP + " An integer >= 1 (required; not for --mechanism augpe).")
    p.add_argument(
        "--max-new-tokens",
        required=True,
        help="token budget T per text, an integer >= 1 that leaves room for the prompt in the model's context; "
        "never derived from data",
    )
    p.add_argument(
        "--num-texts", default=None, help="texts to generate, 1 .. full batches (default: one per full batch)"
    )
    p.add_argument("--top-k", default=None, help="k of the Top-k+ set, an integer >= 1, or 'full' (default 100)")
    p.add_argument("--temperature", default="1.0", help="sampling temperature tau (finite, > 0; default 1.0)")


def add_prompt_arguments(p) -> None:
    """The prompt preset, its public fields, and the public devices that keep a small model in the genre."""
    p.add_argument(
        "--prompt",
        default=None,
        help="prompt preset: generic, yelp (answer started as a quoted review), yelp-paper (the paper's Table 4), "
        "tab, mimic; base models (no chat template): yelp-completion, generic-completion (default generic; "
        "--mechanism augpe: its own presets mimic (default) and yelp)",
    )
    p.add_argument(
        "--prompt-field",
        action="append",
        metavar="NAME=VALUE",
        help="public prompt field, e.g. description=... (generic) or category=... stars=... (yelp); repeatable",
    )
    p.add_argument(
        "--answer-prefix",
        default=None,
        metavar="TEXT",
        help="public start of the model's answer in every row (replaces the preset's; may use the public fields, "
        "e.g. 'Review ({stars} stars): \"'); '' for none",
    )
    p.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="public stop string: a text ends at the first one it draws, which is cut (replaces the preset's; "
        "repeatable; '' alone for none)",
    )
    p.add_argument(
        "--public-examples",
        default=None,
        metavar="FILE",
        help="UTF-8 text file of PUBLIC example texts (one per line, e.g. a published proxy set; never the "
        "private input), shown in every row's prompt",
    )


def add_where_argument(p) -> None:
    p.add_argument(
        "--where",
        action="append",
        metavar="COLUMN=VALUE",
        help="use only the records whose COLUMN equals VALUE (repeatable: all must hold), e.g. "
        "'label1=Business Category: Restaurants'; COLUMN is a public attribute like a label, never the text column "
        "(sweep: selects from --input; --real is read as given)",
    )


def parse_where(items) -> dict[str, str] | None:
    """``--where COLUMN=VALUE`` (repeated) as ``{column: value}``; ``None`` when not given."""
    where: dict[str, str] = {}
    for column, value in _pairs(items, "--where", "be COLUMN=VALUE"):
        if where.setdefault(column, value) != value:
            raise CliError(f"--where gives two values for {column!r}: no record can have both")
    return where or None


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

    from invink_audit.prompts import get_preset

    name = "generic" if args.prompt is None else args.prompt
    changed = not (args.answer_prefix is None and args.stop is None and args.public_examples is None)
    if not changed and not (private_input and args.where):
        return name
    template = get_preset(name)
    changes = {}
    if args.answer_prefix is not None:
        changes["answer_prefix"] = args.answer_prefix
    if args.stop is not None:
        changes["stop"] = tuple(s for s in args.stop if s)
    if args.public_examples is not None:
        changes["examples"] = read_public_examples(args.public_examples, args.input if private_input else None)
    template = dataclasses.replace(template, **changes)
    if private_input and args.where:  # the release checks the records it reads; these come from the whole file
        _refuse_public_from_whole_input(template, parse_fields(getattr(args, "prompt_field", None)), args.input,
                                        args.column)
    return template if changed else name


def _refuse_public_from_whole_input(template, fields: dict[str, str], path: str, column: str | None) -> None:
    """Public inputs (the template's, and ``--prompt-field`` values) against every record of ``--input``, those
    ``--where`` leaves out included."""
    from invink_audit.data import read_references
    from invink_audit.prompts import public_inputs, refuse_private_strings

    named = [(f"{name} of prompt {template.name!r}", text) for name, text in public_inputs(template)]
    named += [(f"--prompt-field {name}", value) for name, value in fields.items()]
    try:
        refuse_private_strings(named, read_references(path, column=column))  # every reference read once
    except ValueError as err:
        raise CliError(f"--input {path!r}: {err}") from err


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


def _add_run_arguments(p) -> None:
    """How the release runs: ledger, seed, all-null batches, Ray, progress and the summary's form."""
    p.add_argument("--ledger", default=None, help="budget ledger to charge before generating (see `ledger init`)")
    p.add_argument(
        "--seed", default=None, help="fixed seed, an integer >= 0: reproducible output, NOT private (tests/audits only)"
    )
    p.add_argument(
        "--allow-all-null",
        action="store_true",
        help="generate even when every reference used is empty (public-only texts, still charged); refused otherwise",
    )
    p.add_argument(
        "--ray-actors",
        default=None,
        help="run the release as a Ray Data pipeline with this many actors (pip install 'invink-audit[ray]'; joins "
        "the cluster in RAY_ADDRESS, or starts a local one)",
    )
    p.add_argument("--ray-gpus-per-actor", default=None, help="GPUs per Ray actor (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON object")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate DP synthetic texts from references",
        description="Partition the references into disjoint batches of B (input order; empty references stay "
        "as nulls), generate one text per batch with InvisibleInk and stream them to a JSON Lines file. "
        "Re-running with the same --output resumes (batches already sampled are never drawn again; the output "
        "is locked while a run writes it). Under torchrun or accelerate launch, the processes share the batches of one "
        "release (one ledger charge, one output file). --mechanism amin|adapmixed|augpe runs the paper's baselines "
        "instead (docs/guide/baselines.md; AugPE writes its texts once, at its end, and does not resume). " + _B_HELP,
    )
    _add_input_arguments(p)
    _add_privacy_arguments(p)
    add_prompt_arguments(p)
    _add_run_arguments(p)
    add_accountant_argument(p)
    add_model_arguments(p)
    from invink_audit.cli._baselines import add_baseline_arguments

    add_baseline_arguments(p)
    p.set_defaults(handler=_generate)


def _generate(args) -> int:
    from invink_audit.cli._baselines import refuse_other_mechanisms_options, run_augpe
    from invink_audit.generation import GenerationHooks, generate

    refuse_other_mechanisms_options(args)
    if args.mechanism == "augpe":  # not a batched release: its own run (docs/guide/baselines.md, "AugPE")
        return run_augpe(args)
    if args.batch_size is None:
        raise CliError("the following arguments are required: --batch-size")
    if args.epsilon is None and args.clip_norm is None:
        if args.mechanism == "adapmixed":
            raise CliError("--mechanism adapmixed needs --epsilon (its stop rule's budget)")
        raise CliError("give --epsilon (plan the clip norm) or --clip-norm")
    if args.epsilon is not None and args.clip_norm is not None:
        raise CliError("give only one of --epsilon and --clip-norm")
    seed = None if args.seed is None else parse_int("--seed", args.seed)
    max_batch_rows = None if args.max_batch_rows is None else parse_int("--max-batch-rows", args.max_batch_rows)
    if not args.input.strip():
        raise CliError("--input must name a .csv or .jsonl file; got an empty path")
    if not args.output.strip():
        raise CliError("--output must name a .jsonl file; got an empty path")
    config, label_columns = _generation_config(args)
    references = _references(args, label_columns)
    options = _release_options(args, seed, max_batch_rows)
    # under torchrun / accelerate launch, only rank 0 shows progress and prints the summary
    rank = launch_rank()
    progress = _Progress(enabled=not args.no_progress and rank == 0, max_new_tokens=config.max_new_tokens)
    try:
        if args.ray_actors is not None:
            from invink_audit.ray_release import generate_on_ray

            gpus = "0" if args.ray_gpus_per_actor is None else args.ray_gpus_per_actor  # None: not given (AugPE refuses it)
            ray = dict(concurrency=parse_int("--ray-actors", args.ray_actors), num_gpus=parse_float("--ray-gpus-per-actor", gpus))
            result = generate_on_ray(references, config, hooks=GenerationHooks(on_text=progress.text), **ray, **options)
        else:
            hooks = GenerationHooks(on_tokens=progress.update, on_text=progress.text, on_start=progress.start)
            result = generate(references, config, hooks=hooks, **options)
    finally:
        progress.close()
    if result.rank != 0:
        return 0
    if args.ledger is None:
        print(f"invink-audit generate: {_not_charged(result)}", file=sys.stderr)
    print(json.dumps(summarise(result, ledger=args.ledger)) if args.json else format_summary(result, ledger=args.ledger))
    return 0


def _generation_config(args):
    """The release's :class:`~invink_audit.generation.GenerationConfig` from the command line (each value
    checked, in this order), and the label columns."""
    from invink_audit.generation import GenerationConfig

    label_columns = None if args.label_columns is None else column_names("--label-columns", args.label_columns)
    per_group = None if args.num_texts_per_group is None else parse_int("--num-texts-per-group", args.num_texts_per_group)
    values = dict(
        batch_size=parse_int("--batch-size", args.batch_size),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        delta=parse_float("--delta", args.delta),
        epsilon=None if args.epsilon is None else parse_float("--epsilon", args.epsilon),
        clip_norm=None if args.clip_norm is None else parse_float("--clip-norm", args.clip_norm),
        temperature=parse_float("--temperature", args.temperature),
        top_k=parse_top_k("--top-k", "100" if args.top_k is None else args.top_k),
        num_texts=None if args.num_texts is None else parse_int("--num-texts", args.num_texts),
        accountant=args.accountant,
        num_texts_per_group=per_group,
        allow_all_null=args.allow_all_null,
    )
    if per_group is not None and label_columns is None:
        raise CliError("--num-texts-per-group is only used with --label-columns")
    if label_columns is not None and values["num_texts"] is not None:
        raise CliError("with --label-columns, give --num-texts-per-group (texts per label group), not --num-texts")
    if args.mechanism != "invisibleink":  # the paper's baselines: the same release, another mechanism
        from invink_audit.cli._baselines import baseline_release

        return baseline_release(args, values), label_columns
    return GenerationConfig(**values), label_columns


def _references(args, label_columns):
    """``--input`` as ``generate`` takes it: a :class:`~invink_audit.data.ReferencesFile` (a Path, so that a
    missing input is named in the error), or with ``--where`` the selected records."""
    from invink_audit.data import ReferencesFile

    references, column = selected_references(args, label_columns)
    if column is None and not isinstance(references, Path):
        return references
    return ReferencesFile(references, column=column, label_columns=label_columns)


def _release_options(args, seed: int | None, max_batch_rows: int | None) -> dict:
    """``generate``'s other keyword arguments: the model (loaded inside generate(), after every argument
    and the input file were checked), the prompt, the output, the ledger and the seed."""
    from invink_audit.generation import ModelSpec, PromptSpec

    label_fields = None if args.label_field is None else parse_fields(args.label_field, "--label-field")
    if label_fields is not None and args.label_columns is None:
        raise CliError("--label-field is only used with --label-columns")
    return dict(
        model=ModelSpec(args.model, gguf_file=args.gguf_file, device=args.device, dtype=args.dtype,
                        max_batch_rows=max_batch_rows),
        prompt=PromptSpec(prompt_template(args), fields=parse_fields(args.prompt_field), label_fields=label_fields),
        output=args.output,
        ledger=args.ledger,
        seed=seed,
    )


class _Progress:
    """A tqdm bar over this process's token budget, created when decoding starts (``on_start``: no bar
    fragment precedes an input error). Its total is texts × T token slots, so it shows an ETA; a text
    that stops before T tokens counts its unused slots as done, so the bar ends full and its ETA is an
    upper bound."""

    def __init__(self, enabled: bool, max_new_tokens: int):
        self.enabled = enabled
        self.max_new_tokens = max_new_tokens
        self.bar = None
        self.texts = 0
        self.num_texts = 0

    def start(self, num_texts: int) -> None:
        if not self.enabled or num_texts < 1 or self.bar is not None:
            return
        self.num_texts = num_texts
        desc = f"generating (T = {self.max_new_tokens} per text)"
        self.bar = tqdm_bar(total=num_texts * self.max_new_tokens, unit="tok", desc=desc)
        self.bar.set_postfix_str(f"texts 0/{num_texts}")

    def update(self, tokens: int) -> None:
        if self.bar is not None:
            self.bar.update(tokens)

    def text(self, text) -> None:
        self.texts += 1
        if self.bar is not None:
            self.bar.update(max(self.max_new_tokens - text.num_tokens, 0))  # the slots it did not use
            self.bar.set_postfix_str(f"texts {self.texts}/{self.num_texts}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _not_charged(result) -> str:
    """Why no ledger was charged, and what to do: record the release, unless its guarantee is data-dependent."""
    if result.plan is None and not result.guarantee.a_priori:
        return ("no ledger was charged, and none can be: this guarantee is data-dependent (computed from the "
                "references), not an a-priori spend a ledger composes")
    return NOT_CHARGED


def summarise(result, ledger: str | None = None) -> dict:
    """The run summary as a JSON object; ``ledger``: the ledger file charged (``None``: none was, which
    the summary says, ``ledger_notice``)."""
    return {
        "output": result.output,
        "texts": len(result.texts),
        "resumed": result.num_resumed,
        "tokens_generated": result.tokens_generated,
        "seconds": result.seconds,
        "tokens_per_second": result.tokens_per_second,
        "num_references": result.num_references,
        "num_batches": result.num_batches,
        "unused_references": result.num_unused_references,
        "release_id": result.release_id,
        "model": result.model,
        "model_dtype": None if result.dtype_choice is None else result.dtype_choice.to_json(),
        "seeded": result.seeded,
        "processes": [dataclasses.asdict(p) | {"tokens_per_second": p.tokens_per_second} for p in result.processes],
        "ledger": ledger,
        "charged": ledger is not None,
        "mechanism": getattr(result.mechanism, "name", "invisibleink"),
        **({} if ledger is not None else {"ledger_notice": _not_charged(result)}),
        # a seeded run: "guarantee": null and "guarantee_void_reason" (no epsilon to take at face value)
        **result.guarantee.record_fields(),
    }


def _mechanism_lines(result) -> tuple[str, str]:
    """The guarantee and mechanism lines of a summary: InvisibleInk's figures, or a baseline's guarantee."""
    g = result.guarantee
    if not g.holds:
        guarantee = f"  guarantee        NONE ({g.void_reason})"
    elif result.plan is None:  # a MechanismRelease
        guarantee = f"  guarantee        {g.guarantee.label()} for texts of at most T = {g.max_new_tokens} tokens"
    else:
        guarantee = (
            f"  guarantee        ({g.epsilon:.6g}, {g.delta:g})-DP for texts of at most T = {g.max_new_tokens} tokens "
            f"({g.accountant}); rho_sequence = {g.rho_sequence:.6g}"
        )
    if result.plan is None:
        return guarantee, f"  mechanism        {g.guarantee.description}"
    top_k = "full vocabulary" if g.top_k is None else f"k = {g.top_k}"
    return guarantee, (f"  mechanism        C = {g.clip_norm:.6g}, tau = {g.temperature:g}, Top-k+ with {top_k}, "
                       f"epsilon0 = {g.epsilon0:.6g} per token")


def format_summary(result, ledger: str | None = None) -> str:
    """The run summary as text; ``ledger``: the ledger file charged (``None``: none was, and it says so)."""
    guarantee, mechanism = _mechanism_lines(result)
    if ledger is None:
        charged = f"  ledger           NOT CHARGED: {_not_charged(result)}"
    else:
        charged = f"  ledger           charged to {shown(ledger)} (once per release: a resumed run is not charged again)"
    lines = [
        f"wrote {plural(len(result.texts), 'text')} to {shown(result.output)} "
        f"({result.num_resumed} kept from an earlier run, {plural(result.tokens_generated, 'token')} generated in "
        f"{result.seconds:.1f} s)",
        f"  references       {result.num_references} read, {plural(result.num_batches, 'batch', 'batches')} of "
        f"B = {result.partition.batch_size}, {result.num_unused_references} unused",
        guarantee,
        charged,
        mechanism,
        f"  model            {shown(result.model)}",
    ]
    if result.dtype_choice is not None:
        lines.append(f"  dtype            {result.dtype_choice.dtype} ({result.dtype_choice.reason})")
    if len(result.processes) > 1:
        for p in result.processes:
            lines.append(
                f"  process {p.rank:<8} {plural(p.texts, 'text')}, {plural(p.tokens, 'token')} in {p.seconds:.1f} s "
                f"({p.tokens_per_second:.1f} tokens/s) on {p.device}"
            )
    if result.seeded:
        lines.append("  WARNING          fixed seed: these texts are reproducible and carry NO privacy guarantee")
    return "\n".join(lines)
