"""``invink-audit audit``: empirical privacy audits (white-box, black-box) and the auditor's self-test.

Exit status: 0 when the verdict is PASS (self-test: every mechanism got its expected verdict),
1 for VIOLATION (self-test: some mechanism did not), 3 for INCONCLUSIVE, 2 for bad input.
"""

from __future__ import annotations

import sys

from invink_audit.cli import CliError, integer, phase_progress, print_report, progress_bar
from invink_audit.cli._options import add, parse_where
from invink_audit.distributed import launch_rank

_EXIT = {"PASS": 0, "VIOLATION": 1, "INCONCLUSIVE": 3}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "audit", handler=_audit,
        help="audit the realised privacy loss (white-box, black-box) or self-test the auditor",
        description="Run an audit spec (TOML, see audits/) and write report.json, report.md and PNG plots to "
        "--output; or, with --selftest, run the auditor against the correct mechanism, the planted bugs and "
        "the paper's baselines (Amin et al. 2024 with both accountings, AdaPMixED's data-dependent guarantee, AugPE's "
        "histogram with both sensitivities). A spec's [mechanism] kind may be invisibleink, amin or adapmixed; a spec of "
        "kind augpe-histogram audits AugPE's noisy histogram. A data-dependent guarantee is never a "
        "PASS. Exit status: 0 PASS, 1 VIOLATION, 3 INCONCLUSIVE, 2 bad input.",
    )
    p.add_argument("spec", nargs="?", default=None, help="audit spec (TOML)")
    p.add_argument("--selftest", action="store_true", help="self-test on synthetic logits (about a minute)")
    p.add_argument("--release", default=None, metavar="OUT.jsonl",
                   help="quick-audit a release that `generate` wrote: every published record checked against its state "
                   "and journal (text drawn, claim, settings, missing or duplicated batches) and the model against its "
                   "recorded fingerprint, each finding named (never a PASS); exact checks of every released token "
                   "against every replace-by-null neighbour, then a sampled audit of one batch (texts drawn outside the ledger); "
                   "needs --input (and --column/--where) as generate was given, and the same --model")
    add(p, "--input", required=False, help="with --release: the references file the release was made from")
    add(p, "--column", default=None, help="with --release: the text column generate was given")
    add(p, "--where")
    add(p, "--privacy-unit", help="with --release: the unit its guarantee must protect (the column generate was given "
        "as --privacy-unit); a release of another unit is refused. The unit and its rule are read from the release")
    add(p, "--model", help="with --release: the model generate was given (default: the embedded one)")
    p.add_argument("--sampled-batch", default="0", type=_batch, help="with --release: the batch of the sampled audit, or 'none'")
    p.add_argument("--num-samples", default="16", type=integer, help="with --release: sampled texts (>= 16 for a sampled PASS)")
    add(p, "--output", "--json")
    add(p, "--seed", help="fixed seed (reproducible audit; default: OS entropy)")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")


def _batch(text: str) -> int | None:
    """``--sampled-batch``: a batch index, or ``none`` for no sampled audit."""
    return None if text.strip().lower() == "none" else integer(text)


def _audit(args) -> int:
    from invink_audit.audit.spec import load_spec, parse_spec, run_spec

    if sum((args.selftest, args.spec is not None, args.release is not None)) != 1:
        raise CliError("give one of: a spec file, --selftest, --release OUT.jsonl")
    if args.release is None and any(x is not None for x in (args.input, args.column, args.where, args.model,
                                                            args.privacy_unit)):  # fmt: skip
        raise CliError("--input, --column, --where, --privacy-unit and --model go with --release")
    if args.release is not None:
        return _audit_release(args)
    spec = parse_spec({"kind": "selftest", "name": "selftest"}) if args.selftest else load_spec(args.spec)
    quiet = args.json or launch_rank() != 0  # under torchrun, rank 0 reports
    status = None if quiet else (lambda msg: print(f"  auditing {msg} ...", file=sys.stderr))
    update, close = progress_bar(f"audit {spec.name}", not quiet, unit="it", leave=False)
    try:
        result = run_spec(spec, seed=args.seed, progress=update, status=status)
    finally:
        close()
    if launch_rank() != 0:  # under torchrun, rank 0 writes and prints the report
        return 0
    if spec.kind == "selftest":
        from invink_audit.audit.selftest import selftest_markdown, write_selftest

        if args.output:
            write_selftest(result, args.output, plots=not args.no_plots)
        print_report(args, result.to_json, lambda: selftest_markdown(result), indent=2, written="reports")
        return 0 if result.passed else 1
    from invink_audit.audit.report import write_report

    if args.output:
        write_report(result, args.output, plots=not args.no_plots)
    print_report(args, result.to_dict, lambda: _summary(spec, result), indent=2)
    return _EXIT[result.verdict.value]


def _summary(spec, result) -> str:
    """A spec's audit result as text: its verdict and its figures."""
    lines = [f"{spec.name}: {result.verdict.value} — {result.reason}"]
    if hasattr(result, "headroom_summary"):
        h = result.headroom_summary()
        lines.append(
            f"  per-step range headroom ε0/max {h['per_step_range']:.4g}; sequence Rényi headroom (min claim/estimate) "
            f"{h['sequence_renyi_min']:.4g}; accountants' ε "
            + ", ".join(f"{k} {v:.3g}" for k, v in h["accountant_epsilon"].items())
        )
        lines += [f"  {line}" for line in result.headline()]  # ε against the claim; whether sampling confirmed anything
        if "audit_overhead_ratio" in result.timings:
            lines.append(f"  per-step checks cost {result.timings['audit_overhead_ratio']:.1%} of generation time")
    else:
        lines.append(f"  ε lower bound {result.epsilon_lower_bound:.4g} (claimed {result.claimed_epsilon:g})")
    return "\n".join(lines)


def _audit_release(args) -> int:
    """``--release``: the quick audit of a release from its output file (:func:`invink_audit.audit.quick.audit_release_file`)."""
    from invink_audit.audit.quick import PHASE_EXACT, audit_release_file, write_quick_report

    if args.input is None:
        raise CliError("--release needs --input: the references file the release was made from")
    bars, close = phase_progress(not args.json, unit="it", leave=False)
    progress = bars and (lambda phase, *done: bars("exact checks" if phase == PHASE_EXACT else "sampled audit", *done))
    try:
        report = audit_release_file(
            args.release, args.input, column=args.column, where=parse_where(args.where), model=args.model,
            sampled_batch=args.sampled_batch, num_samples=args.num_samples, seed=args.seed, progress=progress,
            privacy_unit=args.privacy_unit,
        )  # fmt: skip
    finally:
        close()
    if args.output:
        write_quick_report(report, args.output, plots=not args.no_plots)
    print_report(args, report.to_dict, report.summary, indent=2)
    return _EXIT[report.verdict.value]
