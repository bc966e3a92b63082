"""``invink-audit bench``: per-token cost of private decoding against the bare forward passes.

The command's flags are declared here; the measurement harness lives beside the package, in the ``benchmarks/``
folder of a source checkout (:mod:`benchmarks.command`), which this command finds next to ``invink_audit`` and
runs. An install without it (a wheel) says so in one line, exit status 2.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from invink_audit.cli import CliError
from invink_audit.cli._options import add

#: where a source checkout keeps the harness: beside the ``invink_audit`` package
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", handler=_bench,
        help="time private decoding against bare forward passes",
        description="Measure, in one run, the per-token cost of private decoding of G texts x (B+1) rows and "
        "of the bare forward passes of the same rows, and report overhead_ratio = private / forward. Needs a "
        "source checkout (its benchmarks/ folder).",
    )
    add(p, "--model", help="model (default: the embedded SmolLM2-135M-Instruct)")
    add(p, "--device", help="auto, cpu, cuda, cuda:N")
    add(p, "--dtype")
    add(p, "--batch-size", default="7", help="B private references per text (default 7)")
    add(p, "--max-new-tokens", default="32", help="tokens per text T (>= 3; default 32)")
    add(p, "--num-texts", default="1", help="texts decoded together G (default 1)")
    add(p, "--top-k", default="100", help="k of the Top-k+ set, or 'none' for the full vocabulary (default 100)")
    add(p, "--clip-norm", default="0.5", help="clip norm C (sets the Top-k+ band 2C/B; default 0.5)")
    add(p, "--temperature", help="temperature tau (default 1.0)")
    p.add_argument("--repeats", default="3", help="alternating private/forward step repeats (>= 0; default 3)")
    p.add_argument(
        "--references",
        default=None,
        help="private texts to use (.csv or .jsonl; default: the shipped fictional demo references); the first "
        "G x B texts (after --where) are used in file order",
    )
    add(p, "--column", default=None, help="column/field of --references holding the text (default text)")
    add(p, "--where")
    _add_comparison_arguments(p)
    add(p, "--max-batch-rows", help="rows per decoding forward pass (default G x (B+1))")
    p.add_argument(
        "--full-length",
        action="store_true",
        help="every text draws T tokens, end-of-sequence not stopping it, in our runs and the reference's: equal "
        "work for the per-token comparison (stopping at end-of-sequence, two runs draw different numbers of tokens "
        "and share their prefill over them)",
    )
    p.add_argument(
        "--compare-dtypes",
        action="store_true",
        help="run the whole workload in float32 and in bfloat16 side by side, alternating (float32, bfloat16, "
        "bfloat16, float32, ...), and say what --dtype auto chooses here and why; only the whole workload is run "
        "(--repeats, the one-at-a-time, floor and full-logits runs do not apply); with --reference, the reference "
        "package is timed in each of our dtypes",
    )
    p.add_argument("--rounds", default=None, help="with --compare-dtypes: workload runs per dtype (>= 1; default 2)")
    p.add_argument(
        "--reference",
        action="store_true",
        help="also time the reference `invink` package's decode loop on the same workload (must be importable)",
    )
    p.add_argument(
        "--reference-config",
        default="shipped,matched",
        help="comma-separated configurations of the reference package to time: 'shipped' (its default dtype "
        "and device_map='auto') and 'matched' (our dtype and device) (default: shipped,matched)",
    )
    add(p, "--json", help="print one JSON object")


def _add_comparison_arguments(p) -> None:
    """The runs measured beside the workload, each skipped or added by its flag."""
    p.add_argument("--no-one-at-a-time", action="store_true", help="skip the one-text-at-a-time run")
    p.add_argument("--no-floor", action="store_true", help="skip the bare unpadded forward (floor) run")
    p.add_argument(
        "--no-op-count",
        action="store_true",
        help="skip counting kernel-launching operations per decoding step (ours and a plain padded decode's; "
        "one more prefill of each)",
    )
    p.add_argument(
        "--compare-full-logits",
        action="store_true",
        help="also run the workload with full private logits, to show what the Top-k+ columns save",
    )


def _bench(args) -> int:
    return harness("command").run(args)


def harness(name: str):
    """The module ``benchmarks.<name>`` of this source checkout (:data:`BENCHMARKS`); a :class:`CliError` where
    there is none (an installed wheel)."""
    if not (BENCHMARKS / "__init__.py").is_file():
        raise CliError(f"bench needs a source checkout of invink-audit (its benchmarks/ folder); there is none at "
                       f"{BENCHMARKS}")
    root = str(BENCHMARKS.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    module = importlib.import_module(f"benchmarks.{name}")
    if Path(module.__file__).resolve().parent != BENCHMARKS:
        raise CliError(f"bench: 'benchmarks' is imported from {Path(module.__file__).parent}, not this checkout's "
                       f"{BENCHMARKS}")
    return module
