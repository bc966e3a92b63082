"""``invink-audit ledger init | show | charge``: the persisted privacy odometer of one dataset."""

from __future__ import annotations

import json

from invink_audit.cli import parse_float, parse_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ledger",
        help="privacy budget ledger of a dataset",
        description="A persisted privacy odometer: every release is charged before it starts and refused "
        "when it would exceed the dataset's total budget.",
    )
    sub = p.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)

    q = sub.add_parser("init", help="create a ledger with a total budget")
    q.add_argument("path")
    q.add_argument("--epsilon", required=True, help="total epsilon budget of the dataset")
    q.add_argument("--delta", required=True, help="delta of the dataset's guarantee")
    q.add_argument("--dataset", default="", help="free-text name of the dataset")
    _accountant(q)
    q.set_defaults(handler=_init)

    q = sub.add_parser("show", help="budget, spend and recorded releases")
    q.add_argument("path")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=_show)

    q = sub.add_parser("charge", help="record a release (refused when over budget)")
    q.add_argument("path")
    q.add_argument("--clip-norm", required=True)
    q.add_argument("--batch-size", required=True, help="B private references per text (B+1 rows per token)")
    q.add_argument("--temperature", default="1.0")
    q.add_argument("--max-new-tokens", required=True)
    q.add_argument("--texts-per-batch", default="1", help="texts generated from each batch (default 1)")
    q.add_argument("--num-batches", default="1", help="disjoint batches in the release (parallel; default 1)")
    q.add_argument("--label", default="")
    q.add_argument("--release-id", default=None, help="idempotency key (default: a new random id)")
    q.add_argument("--dry-run", action="store_true", help="report the spend without recording anything")
    q.add_argument("--json", action="store_true")
    q.set_defaults(handler=_charge)


def _accountant(parser) -> None:
    from accounting import ACCOUNTANTS, DEFAULT_ACCOUNTANT

    parser.add_argument("--accountant", default=DEFAULT_ACCOUNTANT.value, choices=ACCOUNTANTS)


def _init(args) -> int:
    from accounting import BudgetLedger

    BudgetLedger.create(
        args.path,
        epsilon=parse_float("--epsilon", args.epsilon),
        delta=parse_float("--delta", args.delta),
        accountant=args.accountant,
        dataset=args.dataset,
    )
    print(f"created ledger {args.path} (budget epsilon={args.epsilon}, delta={args.delta}, {args.accountant})")
    return 0


def _show(args) -> int:
    from accounting import BudgetLedger

    status = BudgetLedger(args.path).status()
    if args.json:
        print(
            json.dumps(
                {
                    "epsilon_budget": status.epsilon_budget,
                    "delta": status.delta,
                    "accountant": status.accountant,
                    "epsilon_spent": status.epsilon_spent,
                    "epsilon_remaining": status.epsilon_remaining,
                    "releases": list(status.releases),
                }
            )
        )
        return 0
    print(
        f"ledger {args.path}: spent epsilon={status.epsilon_spent:.6g} of {status.epsilon_budget:g} "
        f"at delta={status.delta:g} ({status.accountant}); remaining {status.epsilon_remaining:.6g}"
    )
    for entry in status.releases:
        r = entry["release"]
        print(
            f"  {entry['recorded_at']}  {r['label'] or r['release_id']}: C={r['clip_norm']:g} B={r['batch_size']} "
            f"tau={r['temperature']:g} T={r['max_new_tokens']} x{r['texts_per_batch']} "
            f"({r['num_batches']} batches) -> total epsilon {entry['epsilon_spent_after']:.6g}"
        )
    return 0


def _charge(args) -> int:
    from accounting import BudgetLedger, Release

    kwargs = dict(
        clip_norm=parse_float("--clip-norm", args.clip_norm),
        batch_size=parse_int("--batch-size", args.batch_size),
        temperature=parse_float("--temperature", args.temperature),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        texts_per_batch=parse_int("--texts-per-batch", args.texts_per_batch),
        num_batches=parse_int("--num-batches", args.num_batches),
        label=args.label,
    )
    if args.release_id is not None:
        kwargs["release_id"] = args.release_id
    release = Release(**kwargs)
    ledger = BudgetLedger(args.path)
    if args.dry_run:
        projected = ledger.preview(release)
        status = ledger.status()
        fits = projected <= status.epsilon_budget
        if args.json:
            print(json.dumps({"epsilon_spent_after": projected, "fits": fits}))
        else:
            verdict = "fits" if fits else "would EXCEED the budget"
            print(f"dry run: total epsilon after this release {projected:.6g} of {status.epsilon_budget:g}: {verdict}")
        return 0 if fits else 1
    entry = ledger.charge(release)
    if args.json:
        print(json.dumps(entry))
    else:
        print(
            f"charged {entry['release']['label'] or entry['release']['release_id']}: total epsilon spent "
            f"{entry['epsilon_spent_after']:.6g}"
        )
    return 0
