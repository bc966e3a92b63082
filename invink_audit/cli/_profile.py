"""``invink-audit profile``: plan (ε, B) by an exact, paired, sampling-free utility signal and a clip
profile (:mod:`invink_audit.evaluation.profile`), on public or proxy data. Not a private release."""

from __future__ import annotations

import json
import sys

from invink_audit.cli import add_label_arguments, label_columns, parse_int, plural, progress_bar, shown
from invink_audit.cli._generate import add_prompt_arguments, add_where_argument, parse_fields, parse_where, prompt_template
from invink_audit.cli._sweep import add_grid_arguments, grid_arguments


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "profile",
        help="plan epsilon and B by teacher forcing held-out texts: exact, paired, no sampling",
        description="Teacher-force held-out real texts (--real) through the mechanism, each with B references of "
        "its label group from --input, at every grid point at once, and report per point the held-out "
        "cross-entropy, its paired gain over the public-only floor, the share of the floor-to-ensemble gap closed, "
        "Top-k+ coverage and the share of logit differences the planned C clips; then which points the signal "
        "separates, a recommendation, and a clip profile. Run it on public or proxy data: its output is not "
        "differentially private, and run on private data it is not a private release.",
    )
    p.add_argument("--input", required=True, help="proxy references (.csv or .jsonl): public, or held out from the private data")
    p.add_argument("--real", required=True, help="held-out real texts to teacher-force (.csv or .jsonl)")
    p.add_argument("--column", default="text", help="text column of --input and --real (default: text)")
    add_grid_arguments(p)
    p.add_argument("--max-new-tokens", default="64", help="T: the token budget each point's C is planned for (default 64)")
    p.add_argument("--scored-tokens", default=None, help="real tokens teacher-forced and scored per text (default: T)")
    add_where_argument(p)
    p.add_argument("--num-texts", default="30", help="held-out texts teacher-forced (default 30)")
    p.add_argument("--seed", default="0", help="picks the texts and their references (default 0)")
    add_label_arguments(p, "label column (repeat): each text gets references of its own group and its labels' prompt")
    add_prompt_arguments(p)
    p.add_argument("--model", default=None, help="the generator's model (default: generate's, Gemma-3-270M)")
    p.add_argument("--json", action="store_true", help='print {"points": [...], ...} instead of the table')
    p.add_argument("--output", default=None, metavar="DIR", help="write profile.md, profile.json and plots here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=_profile)


def _profile(args) -> int:
    from invink_audit.evaluation.profile import PLANNING_NOTICE, ProfileConfig, run_profile

    config = ProfileConfig(
        **grid_arguments(args),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        scored_tokens=None if args.scored_tokens is None else parse_int("--scored-tokens", args.scored_tokens),
        where=parse_where(args.where),
        num_texts=parse_int("--num-texts", args.num_texts),
        seed=parse_int("--seed", args.seed),
        prompt=prompt_template(args, private_input=False),  # proxy data: a profile is not a release
        prompt_fields=parse_fields(args.prompt_field) or None,
        column=args.column,
        label_columns=tuple(label_columns(args)),
    )
    points = len(config.points())
    print(f"profile: {plural(points, 'grid point')} from one teacher-forced pass. {PLANNING_NOTICE}", file=sys.stderr)
    progress, close = progress_bar("teacher forcing", not args.no_progress)
    try:
        result = run_profile(args.input, args.real, config, model=args.model, progress=progress)
    finally:
        close()
    for line in result.warnings:
        print(f"invink-audit profile: small sample: {line}", file=sys.stderr)
    if args.output:
        paths = result.write(args.output)
        print(f"wrote {', '.join(shown(p) for p in paths)} (NOT PRIVATE: keep them with the data)", file=sys.stderr)
    print(json.dumps(result.to_json(), indent=1) if args.json else result.markdown())
    return 0
