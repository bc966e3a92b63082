"""``invink-audit evaluate``: utility of synthetic texts against real texts (MAUVE, ΔPPL, lengths, TSTR).

The report is not private (it reads the real texts in the clear): evaluate against held-out data.
"""

from __future__ import annotations

import sys

from invink_audit.cli import integer, phase_progress, print_report
from invink_audit.cli._options import add, label_columns


def add_evaluation_arguments(p) -> None:
    """Evaluation settings shared by ``evaluate`` and ``sweep`` (:func:`evaluation_config` reads them)."""
    p.add_argument("--embedding-model", default="mpnet", choices=("mpnet", "minilm"),
                   help="sentence embeddings for MAUVE: mpnet (all-mpnet-base-v2, the paper's; default) or minilm "
                   "(all-MiniLM-L6-v2, about 5x faster)")
    p.add_argument("--mauve-seeds", default="5", type=integer,
                   help="k-means seeds averaged for the MAUVE estimate, >= 1 (default 5)")
    p.add_argument("--mauve-bootstrap", default="20", type=integer,
                   help="bootstrap replicates for MAUVE's interval, >= 0 (default 20; 0: seed range)")
    p.add_argument("--max-real", type=integer, help="real texts used for MAUVE and perplexity, >= 2 (default: as "
                   "many as synthetic texts, as in the paper)")
    p.add_argument("--scorer", help="perplexity model (path, hub id or name; default the embedded SmolLM2)")
    p.add_argument("--no-perplexity", action="store_true", help="skip perplexity and ΔPPL (lengths then in words)")
    p.add_argument("--no-cache", "--no-embedding-cache", dest="no_cache", action="store_true",  # (its old name)
                   help="keep nothing derived from the texts on disk (by default each text's embedding and perplexity "
                   "are cached by text hash, owner-only, in the cache directory, so a text is embedded and scored once)")


def evaluation_config(args):
    from invink_audit.evaluation import EvaluationConfig

    return EvaluationConfig(
        embedding_model=args.embedding_model, mauve_seeds=args.mauve_seeds, mauve_bootstrap=args.mauve_bootstrap,
        max_real=args.max_real, scorer=args.scorer, perplexity=not args.no_perplexity,
        embedding_cache=not args.no_cache, perplexity_cache=not args.no_cache,
    )


def tqdm_progress(enabled: bool):
    """A progress factory for :func:`invink_audit.evaluation.evaluate`: one tqdm bar per stage on stderr
    (:func:`~invink_audit.cli.phase_progress`'s); ``factory(stage, total)`` returns ``update(n)``, n items done."""
    progress, close = phase_progress(enabled, unit="it", leave=False)
    if progress is None:
        return None

    def factory(stage: str, total: int):
        close()  # a new stage: a bar of its own, even under the name of the last one
        done = [0]
        progress(stage, 0, total)

        def update(n: int) -> None:
            done[0] += n
            if done[0] - n < total:  # its bar ends at the total (a count past it draws no new one)
                progress(stage, min(done[0], total), total)

        return update

    return factory


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "evaluate", handler=_evaluate,
        help="utility of synthetic texts against real texts (MAUVE, ΔPPL, lengths, TSTR)",
        description="Evaluate synthetic texts (this tool's generate output, or any .jsonl/.csv) against real "
        "texts: MAUVE in the paper's setting and the library default, each with an interval over k-means seeds "
        "and bootstrap resamples; perplexity under a scorer LM and ΔPPL; lengths; and, with --label-column, "
        "train-on-synthetic-test-on-real accuracy against a real-data ceiling and a labels-only floor. NOT "
        "PRIVATE: the report is computed from the real texts in the clear; use held-out real texts.",
    )
    p.add_argument("--synthetic", required=True, help="synthetic texts: .jsonl (e.g. generate's output) or .csv")
    add(p, "--real")
    add(p, "--column", help="text column/field in both files (default: text)")
    p.add_argument("--real-column", default=None, help="text column of --real when it differs from --column")
    add(p, "--label-column", help="label column (repeat for several; their values are joined): enables TSTR. In JSON "
        "Lines read from the record or its 'labels' object")
    add(p, "--label-columns")
    add_evaluation_arguments(p)
    add(p, "--output", "--json", "--no-progress")


def _evaluate(args) -> int:
    config = evaluation_config(args)  # validated before any file is read or model loaded
    args.label_column = label_columns(args)
    from invink_audit.evaluation import evaluate, read_text_set
    from invink_audit.evaluation.report import evaluation_markdown, write_evaluation_report

    synthetic = read_text_set(args.synthetic, column=args.column, label_columns=args.label_column)
    real = read_text_set(args.real, column=args.real_column or args.column, label_columns=args.label_column)
    result = evaluate(synthetic, real, config, progress=tqdm_progress(not args.no_progress and not args.json))
    if args.output:
        write_evaluation_report(result, args.output)
    for line in result.warnings:
        print(f"invink-audit evaluate: small sample: {line}", file=sys.stderr)
    print_report(args, result.to_json, lambda: evaluation_markdown(result))
    return 0
