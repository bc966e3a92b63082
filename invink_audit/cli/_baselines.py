"""``invink-audit generate --mechanism amin|adapmixed``: the paper's baselines through the one release pipeline.

The baseline is a :class:`~invink_audit.mechanisms.Mechanism` released by :func:`invink_audit.generation.generate`
as a :class:`~invink_audit.generation.MechanismRelease`: the same disjoint batches of B references (paper
Corollary 11, coro:parallel-batches), label conditioning, resume, lock and journal, torchrun and Ray as an
InvisibleInk release, and ``invink-audit audit --release`` reads its output back. Amin et al. 2024 is accounted in
zCDP before it runs (:func:`invink_audit.mechanisms.plan_amin`: r private tokens of ρ_em + ρ_svt each), so it is
charged to the ledger as a zCDP release (:class:`accounting.ZcdpEvent`) before anything is generated.
AdaPMixED's spend is data-dependent (a Rényi filter stopped at ε on the dataset it ran on): it is no a-priori
guarantee, so it is never charged to a ledger, and its per-text spend, computed from the references, is never
written.

AugPE (Xie et al. 2024, ``--mechanism augpe``) is no batched release: all references vote in each of its T
histograms, and its n texts exist only when its last iteration ends. :func:`run_augpe` checks every option (the
ones of ``generate`` that do not apply to it are refused, not ignored), charges the ledger once with the event's ρ
(:meth:`accounting.AugPEEvent.zcdp_event`) before anything is generated, runs
:func:`invink_audit.augpe.augpe_generate`, and writes the texts at once (atomically) to a new file: it cannot resume,
so an existing output is refused. Records carry the DP texts and public settings only; the noisy histograms (DP
outputs too) are not written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from accounting.augpe import AugPESensitivity
from invink_audit.cli import CliError, parse_float, parse_int, phase_progress, plural, shown

#: the sensitivities ``--augpe-sensitivity`` offers (add-or-remove does not compose with the ledger's releases)
_AUGPE_SENSITIVITIES = (AugPESensitivity.REPLACE_BY_NULL, AugPESensitivity.PAPER)

#: what ``--mechanism`` accepts; ``invisibleink`` is the project's own mechanism
MECHANISMS = ("invisibleink", "amin", "adapmixed", "augpe")

_DATA_DEPENDENT_LEDGER = (
    "--mechanism adapmixed cannot be charged to a ledger: its spend is data-dependent (a Renyi filter stopped at "
    "--epsilon on the dataset it ran on), not an a-priori guarantee a ledger can compose; run it without --ledger, "
    "on data whose budget is not tracked (a public proxy, a comparison)"
)


def add_baseline_arguments(p) -> None:
    """``--mechanism`` and the flags of Amin et al. (defaults: the paper's re-implementation)."""
    p.add_argument("--mechanism", default="invisibleink", choices=MECHANISMS, help="the mechanism (default invisibleink)")
    amin = p.add_argument_group("Amin et al. 2024 (--mechanism amin)")
    amin.add_argument("--max-private-tokens", default=None, help="r: private tokens per text at most (default: T)")
    amin.add_argument("--svt-threshold", default=None, help="sparse-vector threshold (default 0.7)")
    amin.add_argument("--svt-noise", default=None, help="sparse-vector noise scale sigma (default 0.3)")
    amin.add_argument("--public-temperature", default=None, help="temperature of public tokens (default 1.0)")
    augpe = p.add_argument_group(
        "AugPE, Xie et al. 2024 (--mechanism augpe; also --num-texts n (required), --epsilon or --noise-std, --delta, "
        "--max-new-tokens, --temperature, --max-batch-rows: sequences per generate call, default 16)"
    )
    augpe.add_argument("--iterations", default=None, help="T_AugPE: noisy histograms, an integer >= 1 (required; the paper: 1-10)")
    augpe.add_argument("--variations", default=None, help="L: candidates per kept text, an integer >= 2 (default 7, the paper's)")
    augpe.add_argument("--noise-std", default=None,
                       help="sigma: the Gaussian noise's standard deviation on each count, instead of --epsilon")
    augpe.add_argument(
        "--augpe-sensitivity", default=None, choices=[s.value for s in _AUGPE_SENSITIVITIES],
        help="the histogram's l2 sensitivity the accountant is told: replace-by-null (sqrt 2, correct; default) or "
        "paper (1, the paper's convention: NOT A VALID GUARANTEE, refused with --ledger)",
    )  # fmt: skip
    augpe.add_argument("--embedder", default=None, choices=("mpnet", "minilm"),
                       help="sentence embedder of the votes (default mpnet, the official all-mpnet-base-v2)")


def baseline_release(args, values: dict):
    """The :class:`~invink_audit.generation.MechanismRelease` of ``--mechanism amin|adapmixed`` from the release
    parameters the command line gave (``values``: parsed by ``_generation_config``, each checked once);
    ``--top-k`` is InvisibleInk's and refused, AdaPMixED with ``--ledger`` is refused."""
    from invink_audit.generation import MechanismRelease

    if args.top_k is not None:
        raise CliError(f"--top-k applies to --mechanism invisibleink only; remove it for --mechanism {args.mechanism}")
    if args.mechanism == "adapmixed" and args.ledger is not None:
        raise CliError(_DATA_DEPENDENT_LEDGER)
    return MechanismRelease(_mechanism(args, values), values["max_new_tokens"], values["delta"], num_texts=values["num_texts"],
                            num_texts_per_group=values["num_texts_per_group"], allow_all_null=values["allow_all_null"])


def _mechanism(args, values: dict):
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism

    batch_size, max_new_tokens, delta = values["batch_size"], values["max_new_tokens"], values["delta"]
    temperature, epsilon = values["temperature"], values["epsilon"]
    if args.mechanism == "adapmixed":
        if epsilon is None:
            raise CliError("--mechanism adapmixed needs --epsilon (its stop rule's budget); --clip-norm does not apply")
        return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size, epsilon, delta, temperature))
    r = max_new_tokens if args.max_private_tokens is None else parse_int("--max-private-tokens", args.max_private_tokens)
    options = {"temperature": temperature} | {
        name: parse_float(flag, default if getattr(args, name) is None else getattr(args, name))
        for name, flag, default in _AMIN_DEFAULTS
    }
    if epsilon is not None:
        config = AminConfig.planned(epsilon=epsilon, delta=delta, batch_size=batch_size, max_private_tokens=r, **options)
    else:
        config = AminConfig(values["clip_norm"], batch_size, max_private_tokens=r, **options)
    return AminMechanism(config)


# --------------------------------------------------------------------------------------------
# AugPE (--mechanism augpe)

#: ``generate``'s options that AugPE does not take, with their defaults: (attribute, flag, default, why)
_NOT_FOR_AUGPE = (
    ("batch_size", "--batch-size", None, "every reference votes in every histogram; there are no batches"),
    ("clip_norm", "--clip-norm", None, "give --epsilon or --noise-std"),
    ("top_k", "--top-k", None, "it is InvisibleInk's"),
    ("label_columns", "--label-columns", None, "AugPE generates from one public prompt (use --where to select)"),
    ("label_field", "--label-field", None, "AugPE generates from one public prompt"),
    ("num_texts_per_group", "--num-texts-per-group", None, "give --num-texts"),
    ("answer_prefix", "--answer-prefix", None, "AugPE's prompts are its presets (--prompt mimic|yelp)"),
    ("stop", "--stop", None, "AugPE's prompts are its presets (--prompt mimic|yelp)"),
    ("public_examples", "--public-examples", None, "AugPE's prompts are its presets (--prompt mimic|yelp)"),
    ("ray_actors", "--ray-actors", None, "AugPE runs in one process"),
    ("ray_gpus_per_actor", "--ray-gpus-per-actor", None, "AugPE runs in one process"),
)
#: each mechanism's own options (attribute, flag), refused for the others: given, never ignored
_AUGPE_ONLY = (("iterations", "--iterations"), ("variations", "--variations"), ("noise_std", "--noise-std"),
               ("augpe_sensitivity", "--augpe-sensitivity"), ("embedder", "--embedder"))  # fmt: skip
#: Amin et al.'s options with a default: (AminConfig field = attribute, flag, default), the paper's re-implementation
_AMIN_DEFAULTS = (("svt_threshold", "--svt-threshold", "0.7"), ("svt_noise", "--svt-noise", "0.3"),
                  ("public_temperature", "--public-temperature", "1.0"))  # fmt: skip
_AMIN_ONLY = (("max_private_tokens", "--max-private-tokens"), *((name, flag) for name, flag, _ in _AMIN_DEFAULTS))
_OWN_OPTIONS = {"augpe": _AUGPE_ONLY, "amin": _AMIN_ONLY}
_PAPER_LEDGER = (
    "--augpe-sensitivity paper cannot be charged to a ledger: the paper's convention (l2 sensitivity 1 under "
    "replace-by-null) is NOT A VALID GUARANTEE (it understates rho by 2); use --augpe-sensitivity replace-by-null"
)


def refuse_other_mechanisms_options(args) -> None:
    """AugPE's and Amin et al.'s own options, given with another ``--mechanism``, are refused, not ignored."""
    for mechanism, options in _OWN_OPTIONS.items():
        for attribute, flag in options:
            if mechanism != args.mechanism and getattr(args, attribute) is not None:
                raise CliError(f"{flag} applies to --mechanism {mechanism} only; remove it for --mechanism {args.mechanism}")


def _refuse_not_for_augpe(args) -> None:
    for attribute, flag, default, why in _NOT_FOR_AUGPE:
        if getattr(args, attribute) != default:
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
    from invink_audit.cli._generate import parse_fields

    try:
        prompts = get_augpe_prompts("mimic" if args.prompt is None else args.prompt, **parse_fields(args.prompt_field))
    except ValueError as err:
        raise CliError(f"--mechanism augpe: --prompt/--prompt-field: {err}") from err
    optional = dict(
        variations=None if args.variations is None else parse_int("--variations", args.variations),
        batch_size=None if args.max_batch_rows is None else parse_int("--max-batch-rows", args.max_batch_rows),
        sensitivity=args.augpe_sensitivity,
    )
    return AugPEConfig(
        num_texts=parse_int("--num-texts", args.num_texts),
        iterations=parse_int("--iterations", args.iterations),
        delta=parse_float("--delta", args.delta),
        noise_std=None if args.noise_std is None else parse_float("--noise-std", args.noise_std),
        epsilon=None if args.epsilon is None else parse_float("--epsilon", args.epsilon),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        prompts=prompts,
        sampling=SamplingSettings(temperature=parse_float("--temperature", args.temperature)),
        accountant=args.accountant,
        allow_all_null=args.allow_all_null,
        **{name: value for name, value in optional.items() if value is not None},
    )


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
    from invink_audit.cli._generate import selected_references
    from invink_audit.data import read_references

    if not args.input.strip():
        raise CliError("--input must name a .csv or .jsonl file; got an empty path")
    source, column = selected_references(args, None)
    references = read_references(source, column=column) if isinstance(source, Path) else list(source)
    if not references:
        raise CliError(f"--input {args.input!r} holds no reference")
    check_not_all_null(references, args.allow_all_null)  # before the model loads; augpe_generate checks it again
    return references


def _refuse_private_prompts(prompts, args, references: list[str]) -> None:
    """AugPE's public prompts (field values included) against every record of ``--input``: ``references`` as read,
    or with ``--where`` the whole file again (the records it leaves out included). From the private data, they
    would be published with every text."""
    from invink_audit.data import read_references
    from invink_audit.prompts import refuse_private_strings

    every = read_references(Path(args.input), column=args.column) if args.where else references
    try:
        refuse_private_strings(prompts.public_inputs(), every, f"of AugPE prompts {prompts.name!r}")
    except ValueError as err:
        raise CliError(f"--input {args.input!r}: {err}") from err


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
    seed = None if args.seed is None else parse_int("--seed", args.seed)
    spec = ModelSpec(args.model, gguf_file=args.gguf_file, device=args.device, dtype=args.dtype)  # checked, not loaded
    references = _augpe_references(args)
    _refuse_private_prompts(config.prompts, args, references)  # before the model loads
    ledger = None if args.ledger is None else BudgetLedger(args.ledger)  # read and verified now; charged in augpe_generate
    embedder_name = args.embedder or "mpnet"
    embedding_model_dir(embedder_name)  # a missing embedder fails here, before the ledger is charged
    loaded = load_model(spec.model, gguf_file=spec.gguf_file, device=spec.device, dtype=spec.dtype)
    embedder = Embedder(embedder_name, device=str(loaded.device), cache=False)  # the references' vectors stay in memory
    progress, close = phase_progress(not args.no_progress, unit="it")
    try:
        result = augpe_generate(references, config, model=loaded, embedder=embedder, seed=seed, ledger=ledger,
                                progress=progress)  # fmt: skip
    finally:
        close()
    run = {**config.to_json(), "embedder": embedder.spec.name, "model": loaded.name}
    dtype = None if loaded.dtype_choice is None else loaded.dtype_choice.to_json()
    written = _write_augpe_release(output, result, run, dtype)
    summary = _augpe_summary(result, written, len(references), run, args.ledger, model_dtype=dtype)
    if args.ledger is None:
        print(f"invink-audit generate: {summary['ledger_notice']}", file=sys.stderr)
    print(json.dumps(summary) if args.json else _format_augpe(summary, result))
    return 0


def _write_augpe_release(output: Path, result, run: dict, model_dtype) -> Path:
    """One JSON record per text, written at once and atomically (the usual mode of a release file). Should the
    output have appeared while AugPE ran, the texts go beside it (``<output>.<release_id>.jsonl``), never over it."""
    from invink_audit.outputs import write_records

    records = [
        {"index": i, "text": text, **result.guarantee.record_fields(), "release_id": result.release_id, "run": run,
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


def _augpe_summary(result, output: Path, num_references: int, run: dict, ledger: str | None, *, model_dtype) -> dict:
    """The run summary as a JSON object (``guarantee``: null with ``guarantee_void_reason`` when it does not hold)."""
    from invink_audit.cli._generate import NOT_CHARGED

    g = result.guarantee
    notice = NOT_CHARGED
    if not g.event.valid:
        notice = "no ledger was charged, and none can be: the paper's convention is not a valid guarantee"
    return {
        "output": str(output), "texts": len(result.texts), "seconds": result.stats.seconds,
        "generations": result.stats.generations, "num_references": num_references, "release_id": result.release_id,
        "model": result.stats.model, "model_dtype": model_dtype, "seeded": g.void_reason is not None,
        "ledger": ledger, "charged": ledger is not None, "mechanism": "augpe", "run": run,
        **({} if ledger is not None else {"ledger_notice": notice}),
        **g.record_fields(),
    }  # fmt: skip


def _format_augpe(summary: dict, result) -> str:
    """The run summary as text, in the form of the other mechanisms'."""
    g, run = result.guarantee, summary["run"]
    guarantee = g.describe() if g.holds else f"NONE ({g.why_not})"
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
