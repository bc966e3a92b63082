"""``invink-audit generate --mechanism amin|adapmixed``: the paper's baselines from the command line.

Amin et al. 2024 is accounted in zCDP before it runs (:func:`invink_audit.mechanisms.plan_amin`: r private tokens
of ρ_em + ρ_svt each), so a release is charged to the ledger as a zCDP release (:class:`accounting.ZcdpEvent`)
before anything is generated, like an InvisibleInk release. AdaPMixED's spend is data-dependent (a Rényi filter
stopped at ε on the dataset it ran on): it is no a-priori guarantee, so it is never charged to a ledger, and its
per-text spend, computed from the references, is never written. Each text comes from its own disjoint batch of B
references in input order (paper Corollary 11, coro:parallel-batches), as for InvisibleInk.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from invink_audit.cli import CliError, parse_float, parse_int

#: what ``--mechanism`` accepts; ``invisibleink`` is the project's own pipeline (:mod:`invink_audit.cli._generate`)
MECHANISMS = ("invisibleink", "amin", "adapmixed")

#: InvisibleInk-only flags: refused with a baseline rather than silently ignored (flag, attribute, its default)
_INVISIBLEINK_ONLY = (
    ("--top-k", "top_k", "100"),
    ("--label-columns", "label_columns", None),
    ("--label-field", "label_field", None),
    ("--num-texts-per-group", "num_texts_per_group", None),
    ("--ray-actors", "ray_actors", None),
    ("--allow-all-null", "allow_all_null", False),
)

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
    amin.add_argument("--svt-threshold", default="0.7", help="sparse-vector threshold (default 0.7)")
    amin.add_argument("--svt-noise", default="0.3", help="sparse-vector noise scale sigma (default 0.3)")
    amin.add_argument("--public-temperature", default="1.0", help="temperature of public tokens (default 1.0)")


def generate_with_baseline(args, references, column: str | None) -> int:
    """Check, charge (Amin et al.), generate and write one baseline release; exit status. ``references``: the
    input file's path (its ``column``) or the texts ``--where`` selected."""
    from invink_audit.data import partition_references, read_references
    from invink_audit.mechanisms.run import generate_with_mechanism

    _refuse_invisibleink_flags(args)
    if isinstance(references, Path):
        try:
            references = read_references(references, column=column)
        except (OSError, ValueError) as err:
            raise CliError(f"--input: {err}") from err
    output = Path(args.output)
    if output.exists() and output.stat().st_size > 0:
        raise CliError(f"--output {args.output!r} exists: a baseline release does not resume; choose a new file")
    batch_size = parse_int("--batch-size", args.batch_size)
    max_new_tokens = parse_int("--max-new-tokens", args.max_new_tokens)
    delta = parse_float("--delta", args.delta)
    num_texts = None if args.num_texts is None else parse_int("--num-texts", args.num_texts)
    max_rows = None if args.max_batch_rows is None else parse_int("--max-batch-rows", args.max_batch_rows)
    mechanism = _mechanism(args, batch_size, max_new_tokens, delta)
    try:
        partition = partition_references(references, batch_size, num_texts=num_texts)
        guarantee = mechanism.guarantee(max_new_tokens, delta)
    except ValueError as err:
        raise CliError(str(err)) from err
    prompt, fields = _template(args)
    charged = _charge(args, mechanism, len(partition.batches), output)
    loaded = _load(args)
    run = generate_with_mechanism(
        references, mechanism, max_new_tokens=max_new_tokens, delta=delta, model=loaded, prompt=prompt,
        prompt_fields=fields, num_texts=num_texts, generator=_generator(args, loaded.device), max_batch_rows=max_rows,
    )  # fmt: skip
    _write(output, run)
    summary = {
        "mechanism": args.mechanism, "guarantee": guarantee.description, "epsilon": guarantee.epsilon,
        "delta": guarantee.delta, "kind": guarantee.kind.value, "num_texts": len(run.texts), "output": str(output),
        "seconds": run.seconds, "ledger": charged, "seeded": run.seeded,
    }  # fmt: skip
    print(json.dumps(summary) if args.json else _format(summary))
    return 0


def _refuse_invisibleink_flags(args) -> None:
    for flag, name, default in _INVISIBLEINK_ONLY:
        if getattr(args, name, default) != default:
            raise CliError(f"{flag} applies to --mechanism invisibleink only; remove it for --mechanism {args.mechanism}")
    if args.mechanism == "adapmixed" and args.ledger is not None:
        raise CliError(_DATA_DEPENDENT_LEDGER)


def _mechanism(args, batch_size: int, max_new_tokens: int, delta: float):
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminInfeasibleError, AminMechanism

    temperature = parse_float("--temperature", args.temperature)
    epsilon = None if args.epsilon is None else parse_float("--epsilon", args.epsilon)
    try:
        if args.mechanism == "adapmixed":
            if epsilon is None:
                raise CliError("--mechanism adapmixed needs --epsilon (its stop rule's budget); --clip-norm does not apply")
            return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size, epsilon, delta, temperature))
        r = max_new_tokens if args.max_private_tokens is None else parse_int("--max-private-tokens", args.max_private_tokens)
        options = dict(
            temperature=temperature, public_temperature=parse_float("--public-temperature", args.public_temperature),
            svt_threshold=parse_float("--svt-threshold", args.svt_threshold),
            svt_noise=parse_float("--svt-noise", args.svt_noise),
        )  # fmt: skip
        if epsilon is not None:
            config = AminConfig.planned(epsilon=epsilon, delta=delta, batch_size=batch_size, max_private_tokens=r, **options)
        else:
            config = AminConfig(parse_float("--clip-norm", args.clip_norm), batch_size, max_private_tokens=r, **options)
        return AminMechanism(config)
    except (ValueError, AminInfeasibleError) as err:
        raise CliError(str(err)) from err


def _charge(args, mechanism, num_batches: int, output: Path) -> str | None:
    """Amin et al.: charge its zCDP before generating (refused over budget: nothing generated)."""
    if args.ledger is None:
        return None
    from accounting import BudgetExceededError, BudgetLedger, LedgerError, Release, ZcdpEvent

    event = ZcdpEvent(mechanism.accounting.rho_sequence, mechanism.name)
    release = Release(event, num_batches, uuid.uuid4().hex, f"generate --mechanism {args.mechanism} -> {output.name}")
    try:
        entry = BudgetLedger(args.ledger).charge(release)
    except (BudgetExceededError, LedgerError) as err:
        raise CliError(str(err)) from err
    return f"{args.ledger}: rho={event.rho:.6g} charged, total epsilon {entry['epsilon_spent_after']:.6g}"


def _template(args) -> tuple:
    """The prompt (a preset name, or a preset with --answer-prefix/--stop/--public-examples) and its fields."""
    from invink_audit.cli._generate import parse_fields, prompt_template

    template, fields = prompt_template(args), parse_fields(args.prompt_field)
    if fields and not isinstance(template, str):
        raise CliError("--prompt-field with --answer-prefix, --stop or --public-examples applies to --mechanism "
                       "invisibleink only")
    return template, fields


def _load(args):
    from invink_audit.models import load_model

    try:
        return load_model(args.model, gguf_file=args.gguf_file, device=_auto(args.device), dtype=_auto(args.dtype))
    except (ValueError, FileNotFoundError) as err:
        raise CliError(str(err)) from err


def _auto(value: str):
    return None if value == "auto" else value


def _generator(args, device):
    from invink_audit.mechanism import make_generator

    return None if args.seed is None else make_generator(parse_int("--seed", args.seed), device=device)


def _write(output: Path, run) -> None:
    """One JSON line per text: batch, text, tokens, finish reason, each token's mode (an outcome the mechanism
    releases and accounts for: Amin et al.'s sparse-vector answers), the run's guarantee label; never a spend."""
    from accounting.atomic import atomic_write_bytes

    lines = [
        json.dumps({
            "batch_index": t.batch_index, "text": t.text, "num_tokens": t.num_tokens,
            "finish_reason": t.finish_reason, "mechanism": run.mechanism.name,
            "modes": [run.mechanism.mode_names[m] for m in t.modes], **run.record_fields(),
        }, ensure_ascii=False)
        for t in run.texts
    ]  # fmt: skip
    atomic_write_bytes(output, ("\n".join(lines) + "\n").encode("utf-8"), mode=0o644)


def _format(summary: dict) -> str:
    ledger = summary["ledger"] or "not charged to any ledger (no --ledger)"
    return "\n".join([
        f"{summary['mechanism']}: {summary['num_texts']} texts -> {summary['output']} in {summary['seconds']:.1f} s",
        f"  guarantee   {summary['guarantee']} ({summary['kind']}; epsilon={summary['epsilon']:.6g}, "
        f"delta={summary['delta']:g})" + ("  [VOID: seeded]" if summary["seeded"] else ""),
        f"  ledger      {ledger}",
    ])  # fmt: skip
