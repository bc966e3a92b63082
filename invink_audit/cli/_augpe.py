"""``invink-audit generate --mechanism augpe``: AugPE (Xie et al. 2024) from the command line (docs/guide/baselines.md,
§"From the command line"): every option checked (those of ``generate`` that do not apply are refused, not ignored),
the ledger charged once before anything is generated, the texts written at once to a new file (no resume). Records
carry the DP texts and public settings only; the noisy histograms (DP outputs too) are not written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accounting.augpe import AugPESensitivity
from invink_audit.cli import CliError, integer, number, phase_progress, plural, shown
from invink_audit.cli._options import NOT_CHARGED, parse_fields, refuse_public_from_input, selected_references

#: AugPE's own options (attribute, flag), refused for the other mechanisms: given, never ignored
AUGPE_OPTIONS = (("iterations", "--iterations"), ("variations", "--variations"), ("noise_std", "--noise-std"),
                 ("augpe_sensitivity", "--augpe-sensitivity"), ("embedder", "--embedder"))  # fmt: skip

#: ``generate``'s options that AugPE does not take (all default to ``None``): (attribute, flag, why)
_NOT_FOR_AUGPE = (
    ("batch_size", "--batch-size", "every reference votes in every histogram; there are no batches"),
    ("clip_norm", "--clip-norm", "give --epsilon or --noise-std"),
    ("top_k", "--top-k", "it is InvisibleInk's"),
    ("label_columns", "--label-columns", "AugPE generates from one public prompt (use --where to select)"),
    ("label_field", "--label-field", "AugPE generates from one public prompt"),
    ("num_texts_per_group", "--num-texts-per-group", "give --num-texts"),
    ("answer_prefix", "--answer-prefix", "AugPE's prompts are its presets (--prompt mimic|yelp)"),
    ("stop", "--stop", "AugPE's prompts are its presets (--prompt mimic|yelp)"),
    ("public_examples", "--public-examples", "AugPE's prompts are its presets (--prompt mimic|yelp)"),
    ("ray_actors", "--ray-actors", "AugPE runs in one process"),
    ("ray_gpus_per_actor", "--ray-gpus-per-actor", "AugPE runs in one process"),
)
_PAPER_LEDGER = (
    "--augpe-sensitivity paper cannot be charged to a ledger: the paper's convention (l2 sensitivity 1 under "
    "replace-by-null) is NOT A VALID GUARANTEE (it understates rho by 2); use --augpe-sensitivity replace-by-null"
)


def add_augpe_arguments(p) -> None:
    """AugPE's own flags, a group of ``generate``'s."""
    augpe = p.add_argument_group(
        "AugPE, Xie et al. 2024 (--mechanism augpe; also --num-texts n (required), --epsilon or --noise-std, --delta, "
        "--max-new-tokens, --temperature, --max-batch-rows: sequences per generate call, default 16)"
    )
    augpe.add_argument("--iterations", type=integer,
                       help="T_AugPE: noisy histograms, an integer >= 1 (required; the paper: 1-10)")
    augpe.add_argument("--variations", type=integer,
                       help="L: candidates per kept text, an integer >= 2 (default 7, the paper's)")
    augpe.add_argument("--noise-std", type=number,
                       help="sigma: the Gaussian noise's standard deviation on each count, instead of --epsilon")
    augpe.add_argument(
        "--augpe-sensitivity", choices=[s.value for s in (AugPESensitivity.REPLACE_BY_NULL, AugPESensitivity.PAPER)],
        help="the histogram's l2 sensitivity the accountant is told: replace-by-null (sqrt 2, correct; default) or "
        "paper (1, the paper's convention: NOT A VALID GUARANTEE, refused with --ledger)",
    )  # add-or-remove is not offered: it does not compose with the ledger's releases
    augpe.add_argument("--embedder", choices=("mpnet", "minilm"),
                       help="sentence embedder of the votes (default mpnet, the official all-mpnet-base-v2)")


def _refuse_not_for_augpe(args) -> None:
    for attribute, flag, why in _NOT_FOR_AUGPE:
        if getattr(args, attribute) is not None:
            raise CliError(f"{flag} does not apply to --mechanism augpe ({why}); remove it")
    if args.num_texts is None:
        raise CliError("--mechanism augpe needs --num-texts (n, the texts it releases)")
    if args.iterations is None:
        raise CliError("--mechanism augpe needs --iterations (T_AugPE, its noisy histograms; the paper: 1-10)")
    if (args.epsilon is None) == (args.noise_std is None):
        raise CliError("--mechanism augpe needs exactly one of --epsilon (sigma planned for it) and --noise-std")
    if args.ledger is not None and args.augpe_sensitivity == AugPESensitivity.PAPER.value:
        raise CliError(_PAPER_LEDGER)


def _augpe_config(args):
    """The :class:`~invink_audit.augpe.AugPEConfig` of the command line, each value checked (σ planned, safe side)."""
    from invink_audit.augpe import AugPEConfig, SamplingSettings, get_augpe_prompts

    try:
        prompts = get_augpe_prompts("mimic" if args.prompt is None else args.prompt, **parse_fields(args.prompt_field))
    except ValueError as err:
        raise CliError(f"--mechanism augpe: --prompt/--prompt-field: {err}") from err
    optional = dict(variations=args.variations, batch_size=args.max_batch_rows, sensitivity=args.augpe_sensitivity)
    return AugPEConfig(
        num_texts=args.num_texts, iterations=args.iterations, delta=args.delta, noise_std=args.noise_std,
        epsilon=args.epsilon, max_new_tokens=args.max_new_tokens, prompts=prompts,
        sampling=SamplingSettings(temperature=args.temperature), accountant=args.accountant,
        allow_all_null=args.allow_all_null, **{name: value for name, value in optional.items() if value is not None},
    )  # fmt: skip


def _new_output(text: str) -> Path:
    """``--output``: a new file in an existing directory (AugPE writes once, at its end, and cannot resume)."""
    if not text.strip():
        raise CliError("--output must name a .jsonl file; got an empty path")
    path = Path(text)
    if path.is_dir():
        raise CliError(f"--output {text!r} is a directory; give a new file inside it, e.g. {str(path / 'augpe.jsonl')!r}")
    if path.exists() or path.is_symlink():
        raise CliError(
            f"--output {text!r} exists; AugPE writes its texts once, when its last iteration ends, and cannot resume "
            "a run: give a new file (or move this one away)"
        )
    if not path.resolve().parent.is_dir():
        raise CliError(f"--output {text!r}: directory {str(path.parent)!r} does not exist")
    return path


def _augpe_references(args) -> list[str]:
    """``--input`` (with ``--column`` and ``--where``) as a list of texts; empty input, or only nulls without
    ``--allow-all-null``, is refused."""
    from invink_audit.augpe.generator import check_not_all_null
    from invink_audit.data import read_references

    if not args.input.strip():
        raise CliError("--input must name a .csv or .jsonl file; got an empty path")
    source, column = selected_references(args, None)
    references = read_references(source, column=column) if isinstance(source, Path) else list(source)
    if not references:
        raise CliError(f"--input {args.input!r} holds no reference")
    check_not_all_null(references, args.allow_all_null)  # before the model loads; augpe_generate checks it again
    return references


def run_augpe(args) -> int:
    """``generate --mechanism augpe``: every option and the input checked, the model and embedder loaded, AugPE run
    (the ledger charged once, before anything is generated), its texts written to a new file, the summary printed."""
    from accounting import BudgetLedger
    from invink_audit.augpe import augpe_generate
    from invink_audit.evaluation.embeddings import Embedder, embedding_model_dir
    from invink_audit.generation import ModelSpec
    from invink_audit.models import load_model

    _refuse_not_for_augpe(args)
    config = _augpe_config(args)
    output = _new_output(args.output)
    spec = ModelSpec(args.model, gguf_file=args.gguf_file, device=args.device, dtype=args.dtype)  # checked, not loaded
    references = _augpe_references(args)
    # AugPE's public prompts against every record of --input (with --where, the whole file again), before the model
    refuse_public_from_input(config.prompts.public_inputs(), args, None if args.where else references,
                             f"of AugPE prompts {config.prompts.name!r}")
    ledger = None if args.ledger is None else BudgetLedger(args.ledger)  # read and verified now; charged in augpe_generate
    embedder_name = args.embedder or "mpnet"
    embedding_model_dir(embedder_name)  # a missing embedder fails here, before the ledger is charged
    loaded = load_model(spec.model, gguf_file=spec.gguf_file, device=spec.device, dtype=spec.dtype)
    embedder = Embedder(embedder_name, device=str(loaded.device), cache=False)  # the references' vectors stay in memory
    progress, close = phase_progress(not args.no_progress, unit="it")
    try:
        result = augpe_generate(references, config, model=loaded, embedder=embedder, seed=args.seed, ledger=ledger,
                                progress=progress)  # fmt: skip
    finally:
        close()
    run = {**config.to_json(), "embedder": embedder.spec.name, "model": loaded.name}
    dtype = None if loaded.dtype_choice is None else loaded.dtype_choice.to_json()
    written = _write_augpe_release(output, result, run, dtype)
    summary = _augpe_summary(result, written, len(references), run, args.ledger, model_dtype=dtype,
                             seeded=args.seed is not None)
    if args.ledger is None:
        print(f"invink-audit generate: {summary['ledger_notice']}", file=sys.stderr)
    print(json.dumps(summary) if args.json else _format_augpe(summary, result))
    return 0


def _guarantee_fields(g) -> dict:
    """The guarantee as AugPE's records and summary write it: the common form and its details (the exact Gaussian
    ε of the T composed Gaussians, the accountant, the event), which a privacy reviewer reads beside ε."""
    fields = g.record_fields()
    if fields["guarantee"] is not None:
        fields["guarantee"] = {**fields["guarantee"], **{k: str(v) if k == "accountant" else v for k, v in g.details.items()}}
    return fields


def _write_augpe_release(output: Path, result, run: dict, model_dtype) -> Path:
    """One JSON record per text, written at once and atomically (the usual mode of a release file). Should the
    output have appeared while AugPE ran, the texts go beside it (``<output>.<release_id>.jsonl``), never over it."""
    from invink_audit.outputs import write_records

    records = [
        {"batch_index": i, "text": text, **_guarantee_fields(result.guarantee), "release_id": result.release_id, "run": run,
         "model_dtype": model_dtype, "version": 1}
        for i, text in enumerate(result.texts)
    ]  # fmt: skip
    if output.exists() or output.is_symlink():
        beside = output.with_name(f"{output.name}.{result.release_id}.jsonl")
        print(f"invink-audit generate: {str(output)!r} appeared while AugPE ran; writing to {str(beside)!r}",
              file=sys.stderr)  # fmt: skip
        output = beside
    write_records(output, records, keep_mode=False, allow_nan=False)
    return output


def _augpe_summary(result, output: Path, num_references: int, run: dict, ledger: str | None, *, model_dtype,
                   seeded: bool) -> dict:
    """The run summary as a JSON object (``guarantee``: null with ``guarantee_void_reason`` when it does not hold)."""
    g = result.guarantee
    notice = NOT_CHARGED
    if run["sensitivity"] == "paper":
        notice = "no ledger was charged, and none can be: the paper's convention is not a valid guarantee"
    return {
        "output": str(output), "texts": len(result.texts), "seconds": result.stats.seconds,
        "generations": result.stats.generations, "num_references": num_references, "release_id": result.release_id,
        "model": result.stats.model, "model_dtype": model_dtype, "seeded": seeded,
        "ledger": ledger, "charged": ledger is not None, "mechanism": "augpe", "run": run,
        **({} if ledger is not None else {"ledger_notice": notice}),
        **_guarantee_fields(g),
    }  # fmt: skip


def _format_augpe(summary: dict, result) -> str:
    """The run summary as text, in the form of the other mechanisms'."""
    g, run = result.guarantee, summary["run"]
    guarantee = f"({g.epsilon:.6g}, {g.delta:g})-DP, {g.description}" if g.holds else f"NONE ({g.void_reason})"
    if summary["charged"]:
        charged = f"charged to {shown(summary['ledger'])} (once, before anything was generated)"
    else:
        charged = f"NOT CHARGED: {summary['ledger_notice']}"
    lines = [
        f"wrote {plural(summary['texts'], 'text')} to {shown(summary['output'])} ({plural(summary['generations'], 'generation')} "
        f"in {summary['seconds']:.1f} s)",
        f"  references       {summary['num_references']} read, all voting in each of the T histograms",
        f"  guarantee        {guarantee}",
        f"  ledger           {charged}",
        f"  mechanism        AugPE: n = {run['num_texts']}, T = {run['iterations']}, L = {run['variations']}, noise std "
        f"{run['noise_std']:.6g} ({run['sensitivity']}), prompts {run['prompts']['name']}, embedder {run['embedder']}",
        f"  model            {shown(summary['model'])}",
    ]
    if summary["seeded"]:
        lines.append("  WARNING          fixed seed: these texts are reproducible and carry NO privacy guarantee")
    return "\n".join(lines)
