"""``invink-audit ledger init | show | charge | fits``: the persisted privacy odometer of one dataset.

Exit statuses: 0 done (a replayed release id included), 2 bad input or an unusable ledger file,
4 (``EXIT_OVER_BUDGET``) a release over the budget, also for ``--dry-run``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from invink_audit.cli import EXIT_OK, EXIT_OVER_BUDGET, CliError, plural, shown
from invink_audit.cli._options import add

#: what a release is besides its clip norm (``charge`` and ``fits``), as ``accounting.Release.of`` takes it
_SHAPE = ("batch_size", "temperature", "max_new_tokens", "texts_per_batch", "num_batches", "unit_contributions")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ledger",
        help="privacy budget ledger of a dataset",
        description="A persisted privacy odometer: every release is charged before it starts and refused "
        "(exit status 4) when it would exceed the dataset's total budget.",
    )
    sub = p.add_subparsers(dest="ledger_command", metavar="ACTION", required=True)

    q = sub.add_parser("init", handler=_init, help="create a ledger with a total budget")
    add(q, "path", help="the ledger file to create (a file path, not a directory)")
    add(q, "--epsilon", required=True, help="total epsilon budget of the dataset, in [1e-6, 1e4]")
    add(q, "--delta", required=True, help="delta of the dataset's guarantee, in [1e-300, 1)")
    q.add_argument("--dataset", default="", help="free-text name of the dataset")
    add(q, "--accountant")
    add(q, "--privacy-unit", help="what the budget protects: all references sharing this column's value (e.g. a user "
        "id; default: one reference). The ledger then takes only releases of that unit, and each the other way")

    q = sub.add_parser("show", handler=_show, help="budget, spend, recorded releases and the hash-chain head")
    add(q, "path", "--json")

    release = argparse.ArgumentParser(add_help=False)  # charge's and fits': the ledger and the release's shape
    add(release, "path")
    add(release, "--batch-size", required=True, help="B private references per text (B+1 rows per token), 1 .. 1e9")
    add(release, "--temperature")
    add(release, "--max-new-tokens", required=True, help="token budget T per text, 1 .. 1e9")
    add(release, "--texts-per-batch", "--num-batches", "--json")
    add(release, "--unit-max-references", dest="unit_contributions", default="1",
        help="batches one privacy unit's references may fall in (generate --unit-rule spread's K; default 1); the "
        "release is charged K texts per unit")
    q = sub.add_parser("charge", parents=[release], handler=_charge,
                       help="record a release (refused with exit status 4 when over budget)")
    add(q, "--clip-norm", required=True)
    q.add_argument("--label", default="", help="a name for the release in the ledger")
    q.add_argument("--release-id", help="idempotency key (default: a new random id)")
    q.add_argument("--dry-run", action="store_true", help="report the spend without recording anything (exit 4 if over budget)")
    add(q, "--privacy-unit", help="the unit the release protects (its --privacy-unit; default: one reference): the "
        "ledger's own, or it is refused")
    sub.add_parser("fits", parents=[release], handler=_fits,
                   help="the largest clip norm C (and its epsilon) a next release can use")


def _release_shape(args) -> dict:
    return {name: getattr(args, name) for name in _SHAPE}


def _protects(unit: str | None) -> str:
    return "one reference" if unit is None else f"one privacy unit (all references sharing a {unit!r} value)"


def _ledger_file(path: str) -> Path:
    """``path`` as a ledger file's path: refused when it is a directory, with the file path to give instead."""
    target = Path(path)
    if target.is_dir():
        raise CliError(f"{path!r} is a directory, not a ledger file; give a file path such as {str(target / 'ledger.json')!r}")
    return target


def _open(path: str):
    """The ledger at ``path``, with a command-line hint when there is none."""
    from accounting import BudgetLedger

    target = _ledger_file(path)
    if not target.exists():
        hint = "a dangling symbolic link" if target.is_symlink() else "no such file"
        raise CliError(
            f"no ledger at {path!r} ({hint}); create one with `invink-audit ledger init {path} --epsilon E --delta D`"
        )
    return BudgetLedger(path)


def _init(args) -> int:
    from accounting import BudgetLedger

    _ledger_file(args.path)
    ledger = BudgetLedger.create(args.path, epsilon=args.epsilon, delta=args.delta, accountant=args.accountant,
                                 dataset=args.dataset, privacy_unit=args.privacy_unit)
    status = ledger.status()
    print(f"created ledger {shown(args.path)} (budget epsilon={status.epsilon_budget:g}, delta={status.delta:g}, "
          f"{status.accountant}, protecting {_protects(status.privacy_unit)}); head {status.head}")
    return EXIT_OK


def _show(args) -> int:
    status = _open(args.path).status()
    if args.json:
        fields = ("epsilon_budget", "delta", "accountant", "epsilon_spent", "epsilon_remaining", "rho_spent",
                  "rho_remaining", "format_version", "head", "privacy_unit")
        print(json.dumps({**{name: getattr(status, name) for name in fields}, "releases": list(status.releases)}))
        return EXIT_OK
    print(f"ledger {shown(args.path)}: spent epsilon={status.epsilon_spent:.6g} of {status.epsilon_budget:g} "
          f"at delta={status.delta:g} ({status.accountant}), protecting {_protects(status.privacy_unit)}")
    print(f"  remaining epsilon {status.epsilon_remaining:.6g} is not what a next release can spend: epsilons do not "
          f"add up (releases add zCDP rho); a next release fits if it costs at most rho={status.rho_remaining:.6g}. "
          f"`invink-audit ledger fits {shown(args.path)} --batch-size B --max-new-tokens T` gives its largest C")
    if status.head is None:
        print(f"  format {status.format_version}: no hash chain yet; the next charge adds one")
    elif status.format_version < 3:
        print(f"  head {status.head} (format {status.format_version}: it does not bind the number of releases; "
              "the next charge writes format 3 and a new head)")
    else:
        print(f"  head {status.head} after {len(status.releases)} release(s) (keep both elsewhere to detect a "
              "rewritten or truncated ledger)")
    for entry in status.releases:
        r = entry["release"]
        if r.get("kind") == "zcdp":
            what = f"{r['mechanism']}, rho={r['rho']:.6g} (zCDP)"
        else:
            what = (f"C={r['clip_norm']:g} B={r['batch_size']} tau={r['temperature']:g} T={r['max_new_tokens']} "
                    f"x{r['texts_per_batch']}{f' x{k} batches per unit' if (k := r.get('unit_contributions', 1)) > 1 else ''}")
        print(f"  {entry['recorded_at']}  {r['label'] or r['release_id']}: {what} "
              f"({plural(r['num_batches'], 'batch', 'batches')}) -> total epsilon {entry['epsilon_spent_after']:.6g}")
    return EXIT_OK


def _charge(args) -> int:
    from accounting import Release

    kwargs = dict(clip_norm=args.clip_norm, **_release_shape(args), label=args.label, privacy_unit=args.privacy_unit)
    if args.release_id is not None:
        kwargs["release_id"] = args.release_id
    release = Release.of(**kwargs)  # every range checked before the ledger is read
    ledger = _open(args.path)
    name = release.label or release.release_id
    if args.dry_run:
        status = ledger.status()
        recorded = ledger.recorded(release.release_id)
        projected = ledger.preview(release)  # raises when the id is recorded with other parameters
        already = recorded is not None
        fits = projected <= status.epsilon_budget
        if args.json:
            print(json.dumps({"epsilon_spent_after": projected, "fits": fits, "already_recorded": already}))
        elif already:
            print(f"dry run: release {name!r} is already recorded ({recorded['recorded_at']}); charging it again "
                  f"spends nothing: total epsilon stays {projected:.6g} of {status.epsilon_budget:g}")
        else:
            verdict = "fits" if fits else "would EXCEED the budget"
            print(f"dry run: total epsilon after this release {projected:.6g} of {status.epsilon_budget:g}: {verdict}")
        return EXIT_OK if fits else EXIT_OVER_BUDGET
    outcome = ledger.charge_once(release)
    if args.json:
        print(json.dumps({**outcome.entry, "already_recorded": outcome.already_recorded}))
    elif outcome.already_recorded:
        print(f"already charged: release {name!r} was recorded at {outcome.entry['recorded_at']}; nothing more spent "
              f"(total epsilon spent {outcome.epsilon_spent:.6g})")
    else:
        print(f"charged {shown(name)}: total epsilon spent {outcome.epsilon_spent:.6g}")
    return EXIT_OK


def _fits(args) -> int:
    from accounting import epsilon_for_clip_norm

    shape = _release_shape(args)  # every range checked before the ledger is read
    ledger = _open(args.path)
    release = ledger.largest_clip_norm(**shape)
    status = ledger.status()
    if release is None:
        if args.json:
            print(json.dumps({"fits": False, "clip_norm": None, "epsilon_release": None,
                              "epsilon_spent_after": None, "epsilon_budget": status.epsilon_budget}))
        else:
            print(f"nothing fits: even the smallest supported clip norm would exceed the budget of {shown(args.path)} "
                  f"(spent epsilon={status.epsilon_spent:.6g} of {status.epsilon_budget:g})")
        return EXIT_OVER_BUDGET
    event = release.event
    alone = epsilon_for_clip_norm(clip_norm=event.clip_norm, max_new_tokens=event.num_steps, batch_size=event.batch_size,
                                  temperature=event.temperature, delta=status.delta, accountant=status.accountant)
    after = ledger.preview(release)
    if args.json:
        print(json.dumps({"fits": True, "clip_norm": event.clip_norm, "epsilon_release": alone.epsilon,
                          "epsilon_spent_after": after, "epsilon_budget": status.epsilon_budget}))
        return EXIT_OK
    print(f"the next release (B={event.batch_size}, T={event.max_new_tokens}, tau={event.temperature:g}"
          f"{f', {event.texts_per_batch} texts per batch' if event.texts_per_batch > 1 else ''}"
          f"{f', {event.unit_contributions} batches per unit' if event.unit_contributions > 1 else ''}) fits with clip "
          f"norm C <= {event.clip_norm!r}: alone it is (epsilon={alone.epsilon:.6g}, delta={status.delta:g})-DP for "
          f"{_protects(status.privacy_unit)}; the "
          f"ledger's total after it is epsilon={after:.6g} of {status.epsilon_budget:g}")
    return EXIT_OK
