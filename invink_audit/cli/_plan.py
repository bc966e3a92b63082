"""``invink-audit plan | epsilon | max-tokens | min-batch-size | table``: budget planning (torch-free).

Every argument has a documented range (:mod:`accounting.limits`, README "Valid ranges and exit codes");
a value outside it is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from invink_audit.cli import parse_float, parse_int, parse_list, plural

_B_HELP = (
    "B: private references per generated text (the paper's B), 1 .. 1e9. Each token costs B+1 forward rows "
    "(B private prompts + 1 public prompt); the reference package's batch_size is B+1."
)
_EPSILON_HELP = "target epsilon, in [1e-6, 1e4]"
_DELTA_HELP = "delta, in [1e-300, 1)"
_T_HELP = "token budget T per text, 1 .. 1e9"
_TAU_HELP = "sampling temperature tau, in [1e-4, 1e4] (default 1.0)"
_C_HELP = "clip norm C, in [1e-6, 1e6]"


def _accountant_arg(parser: argparse.ArgumentParser) -> None:
    from accounting import ACCOUNTANTS, DEFAULT_ACCOUNTANT

    parser.add_argument(
        "--accountant",
        default=DEFAULT_ACCOUNTANT.value,
        choices=ACCOUNTANTS,
        help=f"privacy accountant (default: {DEFAULT_ACCOUNTANT.value})",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="clip norm C for a privacy budget",
        description="The largest clip norm C for which T tokens are (epsilon, delta)-DP. " + _B_HELP,
    )
    p.add_argument("--epsilon", required=True, help=_EPSILON_HELP)
    p.add_argument("--delta", required=True, help=_DELTA_HELP)
    p.add_argument("--max-new-tokens", required=True, help=_T_HELP)
    p.add_argument("--batch-size", required=True, help=_B_HELP)
    p.add_argument("--temperature", default="1.0", help=_TAU_HELP)
    _accountant_arg(p)
    p.set_defaults(handler=_plan)

    p = subparsers.add_parser(
        "epsilon",
        help="epsilon spent by a clip norm",
        description="The certified epsilon at delta of texts of at most T tokens with clip norm C. " + _B_HELP,
    )
    p.add_argument("--clip-norm", required=True, help=_C_HELP)
    p.add_argument("--max-new-tokens", required=True, help=_T_HELP)
    p.add_argument("--batch-size", required=True, help=_B_HELP)
    p.add_argument("--temperature", default="1.0", help=_TAU_HELP)
    p.add_argument("--delta", required=True, help=_DELTA_HELP)
    _accountant_arg(p)
    p.set_defaults(handler=_epsilon)

    p = subparsers.add_parser(
        "max-tokens",
        help="largest token budget T for a budget and clip norm",
        description="The largest T (at most 1e9) for which clip norm C stays within (epsilon, delta). " + _B_HELP,
    )
    p.add_argument("--epsilon", required=True, help=_EPSILON_HELP)
    p.add_argument("--delta", required=True, help=_DELTA_HELP)
    p.add_argument("--clip-norm", required=True, help=_C_HELP)
    p.add_argument("--batch-size", required=True, help=_B_HELP)
    p.add_argument("--temperature", default="1.0", help=_TAU_HELP)
    _accountant_arg(p)
    p.set_defaults(handler=_max_tokens)

    p = subparsers.add_parser(
        "min-batch-size",
        help="smallest B that reaches a target clip norm",
        description="The smallest number of references B (at most 1e9) whose planned clip norm reaches C. "
        + _B_HELP,
    )
    p.add_argument("--epsilon", required=True, help=_EPSILON_HELP)
    p.add_argument("--delta", required=True, help=_DELTA_HELP)
    p.add_argument("--max-new-tokens", required=True, help=_T_HELP)
    p.add_argument("--clip-norm", required=True, help="target " + _C_HELP)
    p.add_argument("--temperature", default="1.0", help=_TAU_HELP)
    _accountant_arg(p)
    p.set_defaults(handler=_min_batch)

    p = subparsers.add_parser(
        "table",
        help="clip norms over a grid of epsilon x B, with compute cost",
        description="Clip norm for each (epsilon, B) and its compute cost (B+1 forward rows per token). "
        + _B_HELP,
    )
    p.add_argument(
        "--epsilons", default="1,3,5,10", help="comma-separated epsilons, each in [1e-6, 1e4], at most 100 (default 1,3,5,10)"
    )
    p.add_argument(
        "--batch-sizes", default="4,8,16,32", help="comma-separated B values, each 1 .. 1e9, at most 100 (default 4,8,16,32)"
    )
    p.add_argument("--delta", default="1e-6", help=_DELTA_HELP + " (default 1e-6)")
    p.add_argument("--max-new-tokens", default="500", help=_T_HELP + " (default 500)")
    p.add_argument("--temperature", default="1.0", help=_TAU_HELP)
    _accountant_arg(p)
    p.set_defaults(handler=_table)


def _print_plan(plan, args, *, headline: str) -> int:
    if args.json:
        print(json.dumps(plan.summary()))
        return 0
    print(format_plan(plan, headline=headline))
    return 0


def format_plan(plan, *, headline: str = "InvisibleInk privacy plan") -> str:
    """A human-readable block describing a :class:`accounting.Plan`."""
    B = plan.batch_size
    lines = [
        f"{headline} (accountant: {plan.accountant})",
        f"  guarantee          ({plan.epsilon:.6g}, {plan.delta:g})-DP per dataset, replace-by-null adjacency",
        f"  token budget       T = {plural(plan.max_new_tokens, 'token')} per text (never derived from the data)",
        f"  references         B = {B} per text; each token costs B+1 = {B + 1} forward rows",
        f"  temperature        tau = {plan.temperature:g}",
        f"  clip norm          C = {plan.clip_norm:.6g}",
        f"  per token          epsilon0 = 2C/(B*tau) = {plan.epsilon0:.6g}, rho_token = {plan.rho_token:.6g}",
        f"  per text           rho_sequence = T*rho_token = {plan.rho_sequence:.6g} (zCDP)",
    ]
    return "\n".join(lines)


def _plan(args) -> int:
    from accounting import plan_clip_norm

    plan = plan_clip_norm(
        epsilon=parse_float("--epsilon", args.epsilon),
        delta=parse_float("--delta", args.delta),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        batch_size=parse_int("--batch-size", args.batch_size),
        temperature=parse_float("--temperature", args.temperature),
        accountant=args.accountant,
    )
    return _print_plan(plan, args, headline="Clip norm for the budget")


def _epsilon(args) -> int:
    from accounting import epsilon_for_clip_norm

    plan = epsilon_for_clip_norm(
        clip_norm=parse_float("--clip-norm", args.clip_norm),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        batch_size=parse_int("--batch-size", args.batch_size),
        temperature=parse_float("--temperature", args.temperature),
        delta=parse_float("--delta", args.delta),
        accountant=args.accountant,
    )
    return _print_plan(plan, args, headline="Privacy spent by this clip norm")


def _max_tokens(args) -> int:
    from accounting import plan_max_new_tokens

    plan = plan_max_new_tokens(
        epsilon=parse_float("--epsilon", args.epsilon),
        delta=parse_float("--delta", args.delta),
        clip_norm=parse_float("--clip-norm", args.clip_norm),
        batch_size=parse_int("--batch-size", args.batch_size),
        temperature=parse_float("--temperature", args.temperature),
        accountant=args.accountant,
    )
    if args.json:
        print(json.dumps({**plan.summary(), "max_new_tokens": plan.max_new_tokens}))
        return 0
    return _print_plan(plan, args, headline="Largest token budget")


def _min_batch(args) -> int:
    from accounting import plan_min_batch_size

    plan = plan_min_batch_size(
        epsilon=parse_float("--epsilon", args.epsilon),
        delta=parse_float("--delta", args.delta),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        clip_norm=parse_float("--clip-norm", args.clip_norm),
        temperature=parse_float("--temperature", args.temperature),
        accountant=args.accountant,
    )
    if args.json:
        print(json.dumps({**plan.summary(), "batch_size": plan.batch_size}))
        return 0
    return _print_plan(plan, args, headline="Smallest number of references")


def format_table(rows) -> str:
    """A fixed-width planning table (one row per epsilon x B)."""
    header = f"{'epsilon':>8} {'B':>4} {'clip_norm':>10} {'rho_seq':>9} {'rows/token':>10} {'rows/text':>10}"
    lines = [header, "-" * len(header)]
    for row in rows:
        d = row.as_dict()
        lines.append(
            f"{d['epsilon']:>8g} {d['batch_size']:>4d} {d['clip_norm']:>10.4f} {d['rho_sequence']:>9.4g} "
            f"{d['forward_rows_per_token']:>10d} {d['forward_rows_per_text']:>10d}"
        )
    return "\n".join(lines)


def _table(args) -> int:
    from accounting import planning_table

    rows = planning_table(
        epsilons=parse_list("--epsilons", args.epsilons, parse_float),
        batch_sizes=parse_list("--batch-sizes", args.batch_sizes, parse_int),
        delta=parse_float("--delta", args.delta),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        temperature=parse_float("--temperature", args.temperature),
        accountant=args.accountant,
    )
    if args.json:
        print(json.dumps([{**r.plan.summary(), **r.as_dict()} for r in rows]))
        return 0
    first = rows[0].plan
    print(
        f"Planning table: delta={first.delta:g}, T={first.max_new_tokens}, tau={first.temperature:g}, "
        f"accountant={first.accountant} (rows = forward rows; B+1 per token)",
        file=sys.stdout,
    )
    print(format_table(rows))
    return 0
