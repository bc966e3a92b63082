"""``invink-audit profile``: plan (ε, B) by an exact, paired, sampling-free utility signal and a clip
profile (:mod:`invink_audit.evaluation.profile`), on public or proxy data. Not a private release."""

from __future__ import annotations

import argparse
import json
import sys

from invink_audit.cli import comma_list, integer, plural, progress_bar, shown
from invink_audit.cli._options import PROMPT, UNIT, add, add_grid, grid_options, privacy_unit


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
    add(p, "--input", help="proxy references (.csv or .jsonl): public, or held out from the private data")
    add(p, "--real", help="held-out real texts to teacher-force (.csv or .jsonl)")
    add(p, "--column")
    add_grid(p)
    add(p, "--max-new-tokens", default="64", help="T: the token budget each point's C is planned for (default 64)")
    p.add_argument("--scored-tokens", type=integer, help="real tokens teacher-forced and scored per text (default: T)")
    p.add_argument("--mechanism", type=comma_list(_mechanism), default=("invisibleink",),
                   help="comma-separated mechanisms scored on the same texts and references: invisibleink (default), "
                   "amin (Amin et al. 2024, correct sensitivities 2C/B, 2/B), amin-paper (the paper's C/B, 1/B), "
                   "adapmixed (data-dependent budget); with a baseline, the report adds the compute ratio at equal gain")
    p.add_argument("--amin-private-tokens", type=integer, help="Amin et al.'s r, private tokens before it stops (default T/4)")
    add(p, "--where")
    add(p, "--num-texts", default="30", help="held-out texts teacher-forced (default 30)")
    add(p, "--seed", default="0", help="picks the texts and their references (default 0)")
    add(p, "--label-column", help="label column (repeat): each text gets references of its own group and its labels' prompt")
    add(p, "--label-columns")
    add(p, *UNIT)
    add(p, *PROMPT)
    add(p, "--model")
    add(p, "--json", help='print {"points": [...], ...} instead of the table')
    add(p, "--output", help="write profile.md, profile.json and plots here")
    add(p, "--no-progress")
    p.set_defaults(handler=_profile)


def _profile(args) -> int:
    from invink_audit.evaluation.profile import PLANNING_NOTICE, ProfileConfig, run_profile

    config = ProfileConfig(
        **grid_options(args, private_input=False),  # proxy data: a profile is not a release
        max_new_tokens=args.max_new_tokens, scored_tokens=args.scored_tokens, num_texts=args.num_texts, seed=args.seed,
        privacy_unit=privacy_unit(args),  # each point's C per unit; the proxy references as the unit's rule makes them
        mechanisms=args.mechanism, amin_private_tokens=args.amin_private_tokens,
    )
    points = len(config.points())
    if infeasible := config.infeasible():
        print(f"profile: no clip norm (infeasible, not scored): {', '.join(infeasible)}", file=sys.stderr)
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


def _mechanism(text: str) -> str:
    from invink_audit.evaluation.profile import PROFILE_MECHANISMS

    if text not in PROFILE_MECHANISMS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(PROFILE_MECHANISMS)}; got {text!r}")
    return text
