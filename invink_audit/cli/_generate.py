"""``invink-audit generate``: DP synthetic texts from a file of references, streamed to JSON Lines.

Every argument is checked (one line, exit status 2) before the model is loaded, and everything,
including that each prompt fits the model's context, before the ledger is charged.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from invink_audit.cli import CliError, integer, number, parse_top_k, plural, shown, tqdm_bar
from invink_audit.cli._augpe import AUGPE_OPTIONS, add_augpe_arguments, run_augpe
from invink_audit.cli._baselines import AMIN_OPTIONS, add_baseline_arguments, baseline_release
from invink_audit.cli._options import (
    B_HELP, NOT_CHARGED, PROMPT, UNIT, add, pair, parse_fields, privacy_unit, prompt_template, selected_references,
)
from invink_audit.distributed import launch_rank


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate", handler=_generate,
        help="generate DP synthetic texts from references",
        description="Partition the references into disjoint batches of B (input order; empty references stay "
        "as nulls), generate one text per batch with InvisibleInk and stream them to a JSON Lines file. "
        "Re-running with the same --output resumes (batches already sampled are never drawn again; the output "
        "is locked while a run writes it). Under torchrun or accelerate launch, the processes share the batches of one "
        "release (one ledger charge, one output file). --mechanism amin|adapmixed|augpe runs the paper's baselines "
        "instead (docs/guide/baselines.md; AugPE writes its texts once, at its end, and does not resume). " + B_HELP,
    )
    # the references, their label groups and the output file
    add(p, "--input")
    add(p, "--column", default=None, help="CSV column or JSONL field holding the text (default: text)")
    add(p, "--where")
    add(p, "--label-columns", metavar=None,
        help="label-conditioned generation: comma-separated label columns (e.g. label1,label2 for Yelp); each batch "
        "comes from one label group and its labels fill the prompt's public fields (labels are treated as public)")
    p.add_argument("--label-field", action="append", type=pair("look like NAME=VALUE"), metavar="COLUMN=FIELD",
                   help="map a label column to a prompt field (default: the preset's rule, or the field of the same "
                   "name); repeatable")
    add(p, "--num-texts-per-group", help="with --label-columns: texts per label group (default: every full batch)")
    add(p, *UNIT)
    add(p, "--output", required=True, metavar=None,
        help="output .jsonl file: new or empty, or the output of an interrupted run with the same settings (resumed)")
    # the guarantee and the mechanism: (epsilon or C, delta), B, T, the number of texts, k and tau
    add(p, "--epsilon", help="target epsilon (finite, > 0); the clip norm is planned for it")
    add(p, "--clip-norm", help="clip norm C (finite, > 0) instead of --epsilon (epsilon is reported)")
    add(p, "--delta", required=True, help="target delta, in (0, 1)")
    add(p, "--batch-size", help=B_HELP + " An integer >= 1 (required; not for --mechanism augpe).")
    add(p, "--max-new-tokens", required=True, help="token budget T per text, an integer >= 1 that leaves room for "
        "the prompt in the model's context; never derived from data")
    add(p, "--num-texts", help="texts to generate, 1 .. full batches (default: one per full batch)")
    add(p, "--top-k")
    add(p, "--temperature", help="sampling temperature tau (finite, > 0; default 1.0)")
    add(p, *PROMPT)
    # how the release runs: ledger, seed, all-null batches, Ray, progress and the summary's form
    add(p, "--ledger", "--seed")
    p.add_argument("--allow-all-null", action="store_true", help="generate even when every reference used is empty "
                   "(public-only texts, still charged); refused otherwise")
    p.add_argument("--ray-actors", type=integer, help="run the release as a Ray Data pipeline with this many actors "
                   "(pip install 'invink-audit[ray]'; joins the cluster in RAY_ADDRESS, or starts a local one)")
    p.add_argument("--ray-gpus-per-actor", type=number, help="GPUs per Ray actor (default 0)")
    add(p, "--no-progress", "--json", "--accountant")
    add(p, "--model", help="HF model directory or hub id, a .gguf file, gemma3-270m or smollm2-135m-instruct (default: "
        "the default generator, Gemma-3-270M, prompted with the completion twin of --prompt yelp or generic)")
    p.add_argument("--gguf-file", help="GGUF file name inside the --model directory")
    add(p, "--device", "--dtype", "--max-batch-rows")
    add_baseline_arguments(p)
    add_augpe_arguments(p)


def _refuse_other_mechanisms_options(args) -> None:
    """AugPE's and Amin et al.'s own options, given with another ``--mechanism``, are refused, not ignored."""
    for mechanism, options in (("augpe", AUGPE_OPTIONS), ("amin", AMIN_OPTIONS)):
        for attribute, flag in options:
            if mechanism != args.mechanism and getattr(args, attribute) is not None:
                raise CliError(f"{flag} applies to --mechanism {mechanism} only; remove it for --mechanism {args.mechanism}")


def _generate(args) -> int:
    from invink_audit.generation import GenerationHooks, generate

    _refuse_other_mechanisms_options(args)
    if args.mechanism == "augpe" and args.privacy_unit is not None:  # its histogram votes once per reference
        raise CliError("--privacy-unit is not supported by --mechanism augpe (each reference votes in its histogram)")
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
    if not args.input.strip():
        raise CliError("--input must name a .csv or .jsonl file; got an empty path")
    if not args.output.strip():
        raise CliError("--output must name a .jsonl file; got an empty path")
    config = _generation_config(args)
    references = _references(args)
    options = _release_options(args)
    # under torchrun / accelerate launch, only rank 0 shows progress and prints the summary
    rank = launch_rank()
    progress = _Progress(enabled=not args.no_progress and rank == 0, max_new_tokens=config.max_new_tokens)
    try:
        if args.ray_actors is not None:
            from invink_audit.ray_release import generate_on_ray

            gpus = 0.0 if args.ray_gpus_per_actor is None else args.ray_gpus_per_actor  # None: not given (AugPE refuses it)
            result = generate_on_ray(references, config, hooks=GenerationHooks(on_text=progress.text),
                                     concurrency=args.ray_actors, num_gpus=gpus, **options)  # fmt: skip
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
    """The release's :class:`~invink_audit.generation.ReleaseConfig` (InvisibleInk's: ``GenerationConfig``) from the command line (each value
    checked, in this order)."""
    from invink_audit.generation import GenerationConfig

    values = dict(
        batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, delta=args.delta, epsilon=args.epsilon,
        clip_norm=args.clip_norm, temperature=args.temperature,
        top_k=parse_top_k("--top-k", "100" if args.top_k is None else args.top_k),  # None: the full vocabulary
        num_texts=args.num_texts, accountant=args.accountant, num_texts_per_group=args.num_texts_per_group,
        allow_all_null=args.allow_all_null,
    )  # fmt: skip
    if args.num_texts_per_group is not None and args.label_columns is None:
        raise CliError("--num-texts-per-group is only used with --label-columns")
    if args.label_columns is not None and args.num_texts is not None:
        raise CliError("with --label-columns, give --num-texts-per-group (texts per label group), not --num-texts")
    unit = privacy_unit(args)
    spread = 1 if unit is None else unit.unit_contributions
    if args.mechanism != "invisibleink":  # the paper's baselines: the same release, another mechanism
        if spread > 1 and args.epsilon is not None:
            raise CliError(f"--epsilon with --unit-rule spread is planned per unit for InvisibleInk only; for "
                           f"--mechanism {args.mechanism} use --unit-rule combine or first")
        return baseline_release(args, values)
    return GenerationConfig(**values, unit_contributions=spread if args.epsilon is not None else 1)


def _references(args):
    """``--input`` as ``generate`` takes it: a :class:`~invink_audit.data.ReferencesFile` (a Path, so that a
    missing input is named in the error), or with ``--where`` the selected records."""
    from invink_audit.data import ReferencesFile

    unit = privacy_unit(args)
    references, column = selected_references(args, args.label_columns)
    if column is None and not isinstance(references, Path):
        return references
    return ReferencesFile(references, column=column, label_columns=args.label_columns, privacy_unit=unit)


def _release_options(args) -> dict:
    """``generate``'s other keyword arguments: the model (loaded inside generate(), after every argument
    and the input file were checked), the prompt, the output, the ledger and the seed."""
    from invink_audit.generation import ModelSpec, PromptSpec

    if args.label_field is not None and args.label_columns is None:
        raise CliError("--label-field is only used with --label-columns")
    return dict(
        model=ModelSpec(args.model, gguf_file=args.gguf_file, device=args.device, dtype=args.dtype,
                        max_batch_rows=args.max_batch_rows),
        prompt=PromptSpec(prompt_template(args), fields=parse_fields(args.prompt_field),
                          label_fields=None if args.label_field is None else parse_fields(args.label_field)),
        output=args.output,
        ledger=args.ledger,
        seed=args.seed,
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
    if not result.guarantee.a_priori:
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
        "privacy_unit": None if result.privacy_unit is None else result.privacy_unit.to_json(),
        **({} if ledger is not None else {"ledger_notice": _not_charged(result)}),
        # a seeded run: "guarantee": null and "guarantee_void_reason" (no epsilon to take at face value)
        **result.guarantee.record_fields(),
    }


def _mechanism_lines(result) -> tuple[str, str]:
    """The guarantee and mechanism lines of a summary: InvisibleInk's figures (its records' form), or another
    mechanism's guarantee."""
    g = result.guarantee
    figures = g.to_json()  # InvisibleInk's name C, tau, top-k and epsilon0
    if not g.holds:
        guarantee = f"  guarantee        NONE ({g.void_reason})"
    elif "clip_norm" not in figures:
        guarantee = f"  guarantee        {g.label()} for texts of at most T = {g.max_new_tokens} tokens"
    else:
        guarantee = (
            f"  guarantee        ({g.epsilon:.6g}, {g.delta:g})-DP for texts of at most T = {g.max_new_tokens} tokens "
            f"({figures['accountant']}); rho_sequence = {g.rho_sequence:.6g}"
        )
    if "clip_norm" not in figures:
        return guarantee, f"  mechanism        {g.description}"
    top_k = "full vocabulary" if figures["top_k"] is None else f"k = {figures['top_k']}"
    return guarantee, (f"  mechanism        C = {figures['clip_norm']:.6g}, tau = {figures['temperature']:g}, Top-k+ with "
                       f"{top_k}, epsilon0 = {figures['epsilon0']:.6g} per token")


def _protects(result) -> str:
    """What the guarantee protects: one reference, or one privacy unit under its rule."""
    unit = result.privacy_unit
    if unit is None:
        return "one reference (replace-by-null of one reference)"
    bound = {"spread": f", at most {unit.unit_contributions} per unit in different batches",
             "combine": "" if unit.max_chars is None else f", joined and cut at {unit.max_chars} characters"}
    return (f"one privacy unit: all references sharing a {unit.column!r} value (rule {unit.rule.value}"
            f"{bound.get(unit.rule.value, '')})")


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
        f"  protects         {_protects(result)}",
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

