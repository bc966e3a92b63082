"""``invink-audit bench``: per-token cost of private decoding against the bare forward passes."""

from __future__ import annotations

import json
import sys

from invink_audit.cli import CliError, parse_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time private decoding against bare forward passes",
        description="Measure, in one run, the per-token cost of private decoding of G texts x (B+1) rows and "
        "of the bare forward passes of the same rows, and report overhead_ratio = private / forward.",
    )
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16")
    p.add_argument("--batch-size", default="7", help="B private references per text (default 7)")
    p.add_argument("--max-new-tokens", default="32", help="tokens per text T (>= 3; default 32)")
    p.add_argument("--num-texts", default="1", help="texts decoded together G (default 1)")
    p.add_argument("--repeats", default="3", help="alternating private/forward repeats (default 3)")
    p.add_argument(
        "--reference",
        action="store_true",
        help="also time the reference `invink` package on the same workload (must be importable)",
    )
    p.add_argument(
        "--reference-dtype",
        default="float32",
        help="dtype for the reference package (default float32, like ours on CPU; its own default is bfloat16)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_bench)


def _reference_model_dir(model: str | None) -> str:
    from pathlib import Path

    from invink_audit.models import EMBEDDED_MODEL, _cached_gguf_conversion, embedded_gguf_path

    if model is None or model.lower() in {EMBEDDED_MODEL, "embedded", "default"}:
        return str(_cached_gguf_conversion(embedded_gguf_path()))
    if Path(model).is_dir():
        return model
    raise CliError("--reference needs the embedded model or a local model directory as --model")


def _bench(args) -> int:
    import dataclasses

    from invink_audit.bench import benchmark, time_reference

    batch_size = parse_int("--batch-size", args.batch_size)
    max_new_tokens = parse_int("--max-new-tokens", args.max_new_tokens)
    num_texts = parse_int("--num-texts", args.num_texts)
    if not args.json:
        print(
            f"benchmarking {num_texts} text(s) x ({batch_size}+1) rows, {max_new_tokens} tokens ...", file=sys.stderr
        )
    result = benchmark(
        args.model,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        num_texts=num_texts,
        repeats=parse_int("--repeats", args.repeats),
        device=args.device,
        dtype=args.dtype,
    )
    if args.reference:
        try:
            import invink  # noqa: F401
        except ImportError as err:
            raise CliError(
                f"--reference: the reference package is not importable ({err}); install invink==0.1.0 "
                "(on Python 3.11 it needs its nested-quote f-string in invink/utils.py fixed) and pandas"
            ) from err
        if not args.json:
            print("timing the reference invink package on the same workload ...", file=sys.stderr)
        reference = time_reference(
            _reference_model_dir(args.model),
            batch_size=batch_size,
            max_new_tokens=max_new_tokens,
            num_texts=num_texts,
            dtype=args.reference_dtype,
        )
        result = dataclasses.replace(result, reference=reference)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    lines = [
        f"model {result.model} on {result.device}, {result.dtype} ({result.threads} threads)",
        f"  workload                 G = {result.num_texts} text(s) x (B+1) = {result.batch_size + 1} rows "
        f"= {result.rows_per_step} rows per step, {result.max_new_tokens} tokens, {result.repeats} repeats",
        f"  private step             {result.private_step_seconds * 1e3:.1f} ms (forward + mechanism + sampling)",
        f"  bare forward step        {result.forward_step_seconds * 1e3:.1f} ms (same rows and tokens)",
        f"  overhead_ratio           {result.overhead_ratio:.3f}",
        f"  tokens_per_second        {result.tokens_per_second:.2f} (private, all texts)",
        f"  non-private step         {result.nonprivate_step_seconds * 1e3:.1f} ms (one text, one row)",
        f"  cost vs non-private      {result.relative_to_nonprivate:.2f}x per token of one text",
    ]
    if result.reference is not None:
        lines += [
            f"  reference invink         {result.reference.token_seconds * 1e3:.1f} ms per token "
            f"({result.reference.tokens} tokens, {result.reference.dtype}, version {result.reference.version})",
            f"  speedup vs reference     {result.speedup_vs_reference:.1f}x",
        ]
    print("\n".join(lines))
    return 0
