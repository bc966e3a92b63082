"""``invink-audit generate``: DP synthetic texts from a file of references, streamed to JSON Lines.

Every argument is checked (one line, exit status 2) before the model is loaded, and everything,
including that each prompt fits the model's context, before the ledger is charged.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from invink_audit.cli import CliError, parse_float, parse_int
from invink_audit.distributed import launch_rank

_B_HELP = (
    "B: private references per generated text. Each token costs B+1 forward rows (B private prompts + "
    "1 public prompt); the reference package's batch_size is B+1."
)


def parse_top_k(text: str) -> int | None:
    """``--top-k``: a positive integer, or ``full`` for the full vocabulary."""
    if text.strip().lower() in {"full", "none", "all"}:
        return None
    value = parse_int("--top-k", text)
    if value < 1:
        raise ValueError(f"--top-k must be an integer >= 1 or 'full'; got {text!r}")
    return value


def parse_fields(items: list[str] | None, flag: str = "--prompt-field") -> dict[str, str]:
    fields = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{flag} must look like NAME=VALUE; got {item!r}")
        fields[name.strip()] = value
    return fields


def add_model_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="HF model directory or hub id, or a .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside the --model directory")
    parser.add_argument("--device", default="auto", help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="model dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16",
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
    p.add_argument("--batch-size", required=True, help=_B_HELP + " An integer >= 1.")
    p.add_argument(
        "--max-new-tokens",
        required=True,
        help="token budget T per text, an integer >= 1 that leaves room for the prompt in the model's context; "
        "never derived from data",
    )
    p.add_argument(
        "--num-texts", default=None, help="texts to generate, 1 .. full batches (default: one per full batch)"
    )
    p.add_argument("--top-k", default="100", help="k of the Top-k+ set, an integer >= 1, or 'full' (default 100)")
    p.add_argument("--temperature", default="1.0", help="sampling temperature tau (finite, > 0; default 1.0)")


def _add_prompt_arguments(p) -> None:
    """The prompt preset and its public fields."""
    p.add_argument("--prompt", default="generic", help="prompt preset: generic, yelp, tab, mimic (default generic)")
    p.add_argument(
        "--prompt-field",
        action="append",
        metavar="NAME=VALUE",
        help="public prompt field, e.g. description=... (generic) or category=... stars=... (yelp); repeatable",
    )


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
    p.add_argument("--ray-gpus-per-actor", default="0", help="GPUs per Ray actor (default 0)")
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
        "release (one ledger charge, one output file). " + _B_HELP,
    )
    _add_input_arguments(p)
    _add_privacy_arguments(p)
    _add_prompt_arguments(p)
    _add_run_arguments(p)
    from accounting import ACCOUNTANTS, DEFAULT_ACCOUNTANT

    p.add_argument("--accountant", default=DEFAULT_ACCOUNTANT.value, choices=ACCOUNTANTS)
    add_model_arguments(p)
    p.set_defaults(handler=_generate)


def _generate(args) -> int:
    from invink_audit.generation import generate

    if args.epsilon is None and args.clip_norm is None:
        raise CliError("give --epsilon (plan the clip norm) or --clip-norm")
    if args.epsilon is not None and args.clip_norm is not None:
        raise CliError("give only one of --epsilon and --clip-norm")
    seed = None if args.seed is None else parse_int("--seed", args.seed)
    max_batch_rows = None if args.max_batch_rows is None else parse_int("--max-batch-rows", args.max_batch_rows)
    if not args.input.strip():
        raise CliError("--input must name a .csv or .jsonl file; got an empty path")
    if not args.output.strip():
        raise CliError("--output must name a .jsonl file; got an empty path")
    kwargs = dict(
        batch_size=parse_int("--batch-size", args.batch_size),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        delta=parse_float("--delta", args.delta),
        epsilon=None if args.epsilon is None else parse_float("--epsilon", args.epsilon),
        clip_norm=None if args.clip_norm is None else parse_float("--clip-norm", args.clip_norm),
        temperature=parse_float("--temperature", args.temperature),
        top_k=parse_top_k(args.top_k),
        num_texts=None if args.num_texts is None else parse_int("--num-texts", args.num_texts),
        accountant=args.accountant,
        prompt=args.prompt,
        prompt_fields=parse_fields(args.prompt_field),
        column=args.column,
        label_columns=None if args.label_columns is None else _label_columns(args.label_columns),
        label_fields=None if args.label_field is None else parse_fields(args.label_field, "--label-field"),
        num_texts_per_group=None
        if args.num_texts_per_group is None
        else parse_int("--num-texts-per-group", args.num_texts_per_group),
        output=args.output,
        ledger=args.ledger,
        seed=seed,
        max_batch_rows=max_batch_rows,
        allow_all_null=args.allow_all_null,
        # the model is loaded inside generate(), after every argument and the input file were checked
        model=args.model,
        gguf_file=args.gguf_file,
        device=args.device,
        dtype=args.dtype,
    )
    # under torchrun / accelerate launch, only rank 0 shows progress and prints the summary
    rank = launch_rank()
    progress = _Progress(enabled=not args.no_progress and rank == 0)
    try:
        # a Path, so that a missing input is named in the error (a str could be a reference and is not echoed)
        if args.ray_actors is not None:
            from invink_audit.ray_release import generate_on_ray

            ray = dict(
                concurrency=parse_int("--ray-actors", args.ray_actors),
                num_gpus=parse_float("--ray-gpus-per-actor", args.ray_gpus_per_actor),
            )
            result = generate_on_ray(Path(args.input), on_text=progress.text, **ray, **kwargs)
        else:
            result = generate(Path(args.input), on_tokens=progress.update, on_text=progress.text, **kwargs)
    finally:
        progress.close()
    if result.rank != 0:
        return 0
    summary = summarise(result)
    if args.json:
        print(json.dumps(summary))
    else:
        print(format_summary(result))
    return 0


def _label_columns(text: str) -> list[str]:
    columns = [c.strip() for c in text.split(",")]
    if not all(columns):
        raise CliError(f"--label-columns must be comma-separated column names; got {text!r}")
    return columns


class _Progress:
    """A tqdm bar created at the first generated token, so that no bar fragment precedes an input error."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None
        self.texts = 0

    def update(self, tokens: int) -> None:
        if not self.enabled:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(unit="tok", desc="generating", file=sys.stderr, dynamic_ncols=True)
        self.bar.update(tokens)

    def text(self, text) -> None:
        self.texts += 1
        if self.bar is not None:
            self.bar.set_postfix(texts=self.texts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def summarise(result) -> dict:
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
        "seeded": result.seeded,
        "processes": [dataclasses.asdict(p) | {"tokens_per_second": p.tokens_per_second} for p in result.processes],
        # a seeded run: "guarantee": null and "guarantee_void_reason" (no epsilon to take at face value)
        **result.guarantee.record_fields(),
    }


def format_summary(result) -> str:
    g = result.guarantee
    top_k = "full vocabulary" if g.top_k is None else f"k = {g.top_k}"
    if g.holds:
        guarantee = (
            f"  guarantee        ({g.epsilon:.6g}, {g.delta:g})-DP for texts of at most T = {g.max_new_tokens} tokens "
            f"({g.accountant}); rho_sequence = {g.rho_sequence:.6g}"
        )
    else:
        guarantee = f"  guarantee        NONE ({g.void_reason})"
    lines = [
        f"wrote {len(result.texts)} texts to {result.output} "
        f"({result.num_resumed} kept from an earlier run, {result.tokens_generated} tokens generated in "
        f"{result.seconds:.1f} s)",
        f"  references       {result.num_references} read, {result.num_batches} batches of B = {g.batch_size}, "
        f"{result.num_unused_references} unused",
        guarantee,
        f"  mechanism        C = {g.clip_norm:.6g}, tau = {g.temperature:g}, Top-k+ with {top_k}, "
        f"epsilon0 = {g.epsilon0:.6g} per token",
        f"  model            {result.model}",
    ]
    if len(result.processes) > 1:
        for p in result.processes:
            lines.append(
                f"  process {p.rank:<8} {p.texts} texts, {p.tokens} tokens in {p.seconds:.1f} s "
                f"({p.tokens_per_second:.1f} tokens/s) on {p.device}"
            )
    if result.seeded:
        lines.append("  WARNING          fixed seed: these texts are reproducible and carry NO privacy guarantee")
    return "\n".join(lines)
