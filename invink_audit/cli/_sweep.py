"""``invink-audit sweep``: private generation + evaluation over a grid (ε, B, k, τ, T), with a
public-only floor and a non-private ceiling (under ``OUTPUT/reference_points/``, apart from the releases);
resumable; a table and plots (NOT PRIVATE: owner-only, marked).

Every grid point is a separate release: on private references give ``--ledger`` (each point is charged);
``--public-proxy`` states that the references are public or a proxy and charges nothing.
"""

from __future__ import annotations

import itertools
import sys

from invink_audit.cli import (
    add_label_arguments, label_columns, parse_float, parse_int, parse_list, parse_top_k, plural, progress_bar,
    shown,
)
from invink_audit.cli._evaluate import add_evaluation_arguments, evaluation_config, tqdm_progress
from invink_audit.cli._generate import add_prompt_arguments, add_where_argument, parse_fields, parse_where, prompt_template


def add_grid_arguments(parser) -> None:
    """The grid's axes and its δ, as ``sweep`` and ``profile`` take them (:func:`grid_arguments` reads them)."""
    parser.add_argument("--epsilons", required=True, help="comma-separated epsilons, e.g. 1,3,10")
    parser.add_argument("--batch-sizes", required=True, help="comma-separated B values, e.g. 4,8")
    parser.add_argument("--top-ks", default="100", help="comma-separated k values or 'full' (default 100)")
    parser.add_argument("--temperatures", default="1.0", help="comma-separated tau values (default 1.0)")
    parser.add_argument("--delta", default="1e-6", help="delta of every point (default 1e-6)")


def grid_arguments(args) -> dict:
    """:func:`add_grid_arguments` parsed, as ``SweepConfig`` and ``ProfileConfig`` take them."""
    return dict(
        epsilons=tuple(parse_list("--epsilons", args.epsilons, parse_float)),
        batch_sizes=tuple(parse_list("--batch-sizes", args.batch_sizes, parse_int)),
        top_ks=tuple(parse_list("--top-ks", args.top_ks, parse_top_k)),
        temperatures=tuple(parse_list("--temperatures", args.temperatures, parse_float)),
        delta=parse_float("--delta", args.delta),
    )


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="generation + evaluation over a grid of (epsilon, B, k, tau, T)",
        description="Generate private texts at every point of a grid and evaluate each against held-out real "
        "texts (MAUVE, ΔPPL, TSTR with --label-column), next to a public-only floor and a non-private ceiling on "
        "the same prompts (written to OUTPUT/reference_points/, owner-only and marked NOT PRIVATE: never release "
        "them); writes sweep.md, sweep.jsonl and plots (NOT PRIVATE too); rerun the same command to resume. Each point "
        "is one release: on private references every point spends budget (--ledger charges each); sweep on public "
        "or held-out proxy data (--public-proxy) and then make one release.",
    )
    p.add_argument("--input", required=True, help="references (.csv or .jsonl)")
    p.add_argument("--real", required=True, help="held-out real texts for evaluation (.csv or .jsonl)")
    p.add_argument("--output", required=True, help="sweep directory (created; reused to resume)")
    p.add_argument("--column", default="text", help="text column of --input and --real (default: text)")
    add_where_argument(p)
    add_grid_arguments(p)
    p.add_argument("--max-new-tokens", default="64", help="comma-separated T values (default 64)")
    p.add_argument("--num-texts", default=None, help="texts per point (without labels; default every full batch)")
    p.add_argument("--num-texts-per-group", default=None, help="texts per label group per point (with labels)")
    add_prompt_arguments(p)
    add_label_arguments(p, "label column (repeat): label-conditioned generation and TSTR")
    p.add_argument("--no-reference-points", action="store_true", help="skip the floor and the ceiling")
    p.add_argument("--profile-texts", default="30",
                   help="held-out texts of the planning signal that ranks the points (invink-audit profile; 0: none; default 30)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--ledger", default=None, help="budget ledger charged for every point (private references)")
    budget.add_argument("--public-proxy", action="store_true",
                        help="the references are public or a proxy: charge nothing (say so only if it is true)")
    p.add_argument("--model", default=None, help="generator and perplexity scorer (default: generate's, Gemma-3-270M)")
    add_evaluation_arguments(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=_sweep)


def _sweep(args) -> int:
    from invink_audit.evaluation.sweep import SweepConfig, run_sweep

    fields = parse_fields(args.prompt_field)
    config = SweepConfig(
        **grid_arguments(args),
        max_new_tokens=tuple(parse_list("--max-new-tokens", args.max_new_tokens, parse_int)),
        num_texts=None if args.num_texts is None else parse_int("--num-texts", args.num_texts),
        num_texts_per_group=None if args.num_texts_per_group is None else parse_int("--num-texts-per-group", args.num_texts_per_group),
        prompt=prompt_template(args),
        prompt_fields=fields or None,
        column=args.column,
        label_columns=tuple(label_columns(args)),
        reference_points=not args.no_reference_points,
        where=parse_where(args.where),
        profile_texts=parse_int("--profile-texts", args.profile_texts),
    )
    evaluation = evaluation_config(args)
    total = len(config.points())
    print(
        f"sweep: {plural(total, 'grid point')}"
        + ("" if args.public_proxy else f", each a separate release charged to {shown(args.ledger)} (sequential composition)")
        + (" on references declared public/proxy: nothing is charged" if args.public_proxy else ""),
        file=sys.stderr,
    )
    update, close = progress_bar("sweep points", not args.no_progress, unit="it")
    points, bars = itertools.count(), total + (0 if args.no_reference_points else 2)
    if update is not None:
        update(next(points), bars)  # drawn at once: a point takes a while
    rows = run_sweep(
        args.input, args.real, args.output, config, evaluation, ledger=args.ledger, public_proxy=args.public_proxy,
        model=args.model, on_point=update and (lambda _p: update(next(points), bars)),
        progress=tqdm_progress(not args.no_progress),
    )
    close()
    from pathlib import Path

    for line in dict.fromkeys(w for r in rows for w in r.evaluation.get("warnings", ())):
        print(f"invink-audit sweep: small sample: {line}", file=sys.stderr)

    print((Path(args.output) / "sweep.md").read_text())
    print(f"{plural(len(rows), 'row')}; table, jsonl and plots in {shown(args.output)} (NOT PRIVATE: keep them with the data)")
    return 0
