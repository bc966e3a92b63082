"""``invink-audit sweep``: private generation + evaluation over a grid (ε, B, k, τ, T), with a public-only floor and
a non-private ceiling; every grid point is a separate release (``--ledger`` charges each; ``--public-proxy`` states
that the references are public or a proxy). Guide: docs/guide/evaluating.md (§"invink-audit sweep").
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from invink_audit.cli import comma_list, integer, plural, progress_bar, shown
from invink_audit.cli._evaluate import add_evaluation_arguments, evaluation_config, tqdm_progress
from invink_audit.cli._options import PROMPT, add, add_grid, grid_options


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep", handler=_sweep,
        help="generation + evaluation over a grid of (epsilon, B, k, tau, T)",
        description="Generate private texts at every point of a grid and evaluate each against held-out real "
        "texts (MAUVE, ΔPPL, TSTR with --label-column), next to a public-only floor and a non-private ceiling on "
        "the same prompts (written to OUTPUT/reference_points/, owner-only and marked NOT PRIVATE: never release "
        "them); writes sweep.md, sweep.jsonl and plots (NOT PRIVATE too); rerun the same command to resume. Each point "
        "is one release: on private references every point spends budget (--ledger charges each); sweep on public "
        "or held-out proxy data (--public-proxy) and then make one release.",
    )
    add(p, "--input", help="references (.csv or .jsonl)")
    add(p, "--real", help="held-out real texts for evaluation (.csv or .jsonl)")
    add(p, "--output", required=True, metavar=None, help="sweep directory (created; reused to resume)")
    add(p, "--column", "--where")
    add_grid(p)
    add(p, "--max-new-tokens", type=comma_list(integer), default="64", help="comma-separated T values (default 64)")
    add(p, "--num-texts", help="texts per point (without labels; default every full batch)")
    add(p, "--num-texts-per-group", help="texts per label group per point (with labels)")
    add(p, *PROMPT)
    add(p, "--label-column", help="label column (repeat): label-conditioned generation and TSTR")
    add(p, "--label-columns")
    p.add_argument("--no-reference-points", action="store_true", help="skip the floor and the ceiling")
    p.add_argument("--profile-texts", default="30", type=integer, help="held-out texts of the planning signal that "
                   "ranks the points (invink-audit profile; 0: none; default 30)")
    budget = p.add_mutually_exclusive_group(required=True)
    add(budget, "--ledger", help="budget ledger charged for every point (private references)")
    budget.add_argument("--public-proxy", action="store_true",
                        help="the references are public or a proxy: charge nothing (say so only if it is true)")
    add(p, "--model", help="generator and perplexity scorer (default: generate's, Gemma-3-270M)")
    add_evaluation_arguments(p)
    add(p, "--no-progress")


def _sweep(args) -> int:
    from invink_audit.evaluation.sweep import SweepConfig, run_sweep

    config = SweepConfig(
        **grid_options(args), max_new_tokens=args.max_new_tokens, num_texts=args.num_texts,
        num_texts_per_group=args.num_texts_per_group, reference_points=not args.no_reference_points,
        profile_texts=args.profile_texts,
    )
    evaluation = evaluation_config(args)
    total = len(config.points())
    charged = f", each a separate release charged to {shown(args.ledger)} (sequential composition)"
    print(f"sweep: {plural(total, 'grid point')}"
          + (" on references declared public/proxy: nothing is charged" if args.public_proxy else charged), file=sys.stderr)
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
    for line in dict.fromkeys(w for r in rows for w in r.evaluation.get("warnings", ())):
        print(f"invink-audit sweep: small sample: {line}", file=sys.stderr)
    print((Path(args.output) / "sweep.md").read_text())
    print(f"{plural(len(rows), 'row')}; table, jsonl and plots in {shown(args.output)} (NOT PRIVATE: keep them with the data)")
    return 0
