"""``invink-audit bench``: per-token cost of private decoding against the bare forward passes."""

from __future__ import annotations

import dataclasses
import json
import sys

from invink_audit.cli import CliError, parse_float, parse_int, parse_top_k, plural
from invink_audit.cli._generate import add_where_argument, parse_where
from invink_audit.distributed import launch_world_size
from invink_audit.not_private import NOT_PRIVATE_BANNER, mark_not_private

#: the smallest value of each count flag: the same bounds as :func:`invink_audit.bench.benchmark`, checked before
#: anything is printed or loaded
_COUNT_MINIMUMS = {"--batch-size": 1, "--max-new-tokens": 3, "--num-texts": 1, "--repeats": 0}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time private decoding against bare forward passes",
        description="Measure, in one run, the per-token cost of private decoding of G texts x (B+1) rows and "
        "of the bare forward passes of the same rows, and report overhead_ratio = private / forward.",
    )
    p.add_argument("--model", default=None, help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bfloat16 on CUDA; on a CPU with native bfloat16, bfloat16 when a probe on public text finds it "
        "close to float32, else float32), float32, bfloat16",
    )
    p.add_argument("--batch-size", default="7", help="B private references per text (default 7)")
    p.add_argument("--max-new-tokens", default="32", help="tokens per text T (>= 3; default 32)")
    p.add_argument("--num-texts", default="1", help="texts decoded together G (default 1)")
    p.add_argument("--top-k", default="100", help="k of the Top-k+ set, or 'none' for the full vocabulary (default 100)")
    p.add_argument("--clip-norm", default="0.5", help="clip norm C (sets the Top-k+ band 2C/B; default 0.5)")
    p.add_argument("--temperature", default="1.0", help="temperature tau (default 1.0)")
    p.add_argument("--repeats", default="3", help="alternating private/forward step repeats (>= 0; default 3)")
    p.add_argument(
        "--references",
        default=None,
        help="private texts to use (.csv or .jsonl; default: the shipped fictional demo references); the first "
        "G x B texts (after --where) are used in file order",
    )
    p.add_argument("--column", default=None, help="column/field of --references holding the text (default text)")
    add_where_argument(p)
    _add_comparison_arguments(p)
    p.add_argument("--max-batch-rows", default=None, help="rows per decoding forward pass (default G x (B+1))")
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
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=_bench)


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


def _reference_model_dir(model: str | None) -> str:
    from pathlib import Path

    from invink_audit.models import EMBEDDED_MODEL, named_model_dir

    if model is None or model.lower() in {EMBEDDED_MODEL, "embedded", "default"}:
        return str(named_model_dir(EMBEDDED_MODEL))
    if Path(model).is_dir():
        return model
    raise CliError("--reference needs the embedded model or a local model directory as --model")


def _reference_configs(text: str) -> list[str]:
    allowed = ("shipped", "matched")
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or any(name not in allowed for name in names):
        raise CliError(f"--reference-config must be a comma-separated list of {', '.join(allowed)}; got {text!r}")
    return list(dict.fromkeys(names))


@dataclasses.dataclass(frozen=True)
class _Options:
    """The command's numbers, parsed and checked before anything is printed or loaded."""

    batch_size: int
    max_new_tokens: int
    num_texts: int
    repeats: int
    reference_configs: list[str]
    max_batch_rows: int | None
    references: list[str] | None
    top_k: int | None
    clip_norm: float
    temperature: float


def _options(args) -> _Options:
    """Parse and check the options (errors in flag order: counts, reference configs, rows, references, sampling)."""
    counts = {flag: parse_int(flag, getattr(args, flag[2:].replace("-", "_"))) for flag in _COUNT_MINIMUMS}
    for flag, minimum in _COUNT_MINIMUMS.items():
        if counts[flag] < minimum:
            raise CliError(f"{flag} must be an integer >= {minimum}; got {counts[flag]}")
    batch_size, max_new_tokens, num_texts, repeats = counts.values()
    reference_configs = _reference_configs(args.reference_config)
    max_batch_rows = None if args.max_batch_rows is None else parse_int("--max-batch-rows", args.max_batch_rows)
    if max_batch_rows is not None and max_batch_rows < 1:
        raise CliError(f"--max-batch-rows must be an integer >= 1; got {max_batch_rows}")
    references = _references(args, num_texts * batch_size)
    top_k = parse_top_k("--top-k", args.top_k, "none")
    clip_norm = parse_float("--clip-norm", args.clip_norm)
    temperature = parse_float("--temperature", args.temperature)
    for flag, value in (("--clip-norm", clip_norm), ("--temperature", temperature)):
        if not (value > 0 and value < float("inf")):
            raise CliError(f"{flag} must be a finite number > 0; got {value}")
    return _Options(
        batch_size, max_new_tokens, num_texts, repeats, reference_configs, max_batch_rows, references, top_k, clip_norm,
        temperature,
    )  # fmt: skip


def _check_reference(args) -> str | None:
    """With ``--reference``: the model directory the reference package loads, checked before the long run
    (one process only, the package importable); ``None`` without it."""
    if args.reference and launch_world_size() > 1:
        raise CliError("--reference times the reference package in one process: run it without torchrun")
    if not args.reference:
        return None
    try:
        import invink  # noqa: F401
    except ImportError as err:
        raise CliError(
            f"--reference: the reference package is not importable ({err}); install invink==0.1.0 "
            "(on Python 3.11 it needs its nested-quote f-string in invink/utils.py fixed) and pandas"
        ) from err
    return _reference_model_dir(args.model)


def _reference_timings(result, options: _Options, model_dir: str, *, quiet: bool, device: str | None = None) -> tuple:
    """Time the reference package on the benchmark's workload, once per configuration: ``shipped`` (its defaults)
    or ``matched`` (the benchmark's dtype and device; ``result`` is a :class:`~invink_audit.bench.BenchResult`
    or, with ``device``, a :class:`~invink_audit.bench.DtypeRun`)."""
    import torch

    from invink_audit.bench import time_reference

    timings = []
    for config in options.reference_configs:
        if not quiet:
            print(f"timing the reference invink package ({config}) ...", file=sys.stderr)
        if config == "shipped":
            dtype, device_map = None, None
        else:
            where = torch.device(device or result.device)
            dtype, device_map = result.dtype, -1 if where.type == "cpu" else (where.index or 0)
        timings.append(
            time_reference(
                model_dir,
                batch_size=options.batch_size,
                max_new_tokens=options.max_new_tokens,
                num_texts=options.num_texts,
                references=options.references,
                temperature=options.temperature,
                top_k=options.top_k if options.top_k is not None else 10**9,
                dtype=dtype,
                device_map=device_map,
            )
        )
    return tuple(timings)


def _compare_rounds(args) -> int:
    """--rounds, checked (with --compare-dtypes only, and --dtype left at auto)."""
    if not args.compare_dtypes:
        if args.rounds is not None:
            raise CliError("--rounds needs --compare-dtypes")
        return 0
    rounds = 2 if args.rounds is None else parse_int("--rounds", args.rounds)
    if rounds < 1:
        raise CliError(f"--rounds must be an integer >= 1; got {rounds}")
    if args.dtype != "auto":
        raise CliError(f"--compare-dtypes runs float32 and bfloat16: leave --dtype at auto; got --dtype {args.dtype}")
    if launch_world_size() > 1:
        raise CliError("--compare-dtypes compares dtypes in one process: run it without torchrun")
    return rounds


def _compare_dtypes(args, options: _Options, rounds: int, reference_model_dir: str | None) -> int:
    from invink_audit.bench import compare_dtypes

    if not args.json:
        print(
            f"comparing float32 and bfloat16 on {options.num_texts} text(s) x ({options.batch_size}+1) rows, "
            f"{options.max_new_tokens} tokens, {rounds} round(s) ...",
            file=sys.stderr,
        )
    result = compare_dtypes(
        args.model,
        rounds=rounds,
        batch_size=options.batch_size,
        max_new_tokens=options.max_new_tokens,
        num_texts=options.num_texts,
        clip_norm=options.clip_norm,
        temperature=options.temperature,
        top_k=options.top_k,
        references=options.references,
        device=args.device,
        max_batch_rows=options.max_batch_rows,
    )
    if args.reference:
        timings = []
        for run in result.runs:
            matched = dataclasses.replace(options, reference_configs=["matched"])
            timings += _reference_timings(run, matched, reference_model_dir, quiet=args.json, device=result.device)
        if "shipped" in options.reference_configs:
            shipped = dataclasses.replace(options, reference_configs=["shipped"])
            timings += _reference_timings(result.runs[0], shipped, reference_model_dir, quiet=args.json)
        result = dataclasses.replace(result, references=tuple(timings))
    _print_result(args, result.to_json, lambda: format_dtype_comparison(result))
    return 0


def _bench(args) -> int:
    options = _options(args)
    rounds = _compare_rounds(args)

    from invink_audit.bench import benchmark

    reference_model_dir = _check_reference(args)  # before the long run, so a missing package costs nothing
    if args.compare_dtypes:
        return _compare_dtypes(args, options, rounds, reference_model_dir)
    if not args.json:
        print(
            f"benchmarking {options.num_texts} text(s) x ({options.batch_size}+1) rows, {options.max_new_tokens} "
            "tokens ...",
            file=sys.stderr,
        )
    result = benchmark(
        args.model,
        batch_size=options.batch_size,
        max_new_tokens=options.max_new_tokens,
        num_texts=options.num_texts,
        repeats=options.repeats,
        device=args.device,
        dtype=args.dtype,
        references=options.references,
        top_k=options.top_k,
        clip_norm=options.clip_norm,
        temperature=options.temperature,
        max_batch_rows=options.max_batch_rows,
        one_at_a_time=not args.no_one_at_a_time,
        floor=not args.no_floor,
        compare_full_logits=args.compare_full_logits,
        count_ops=not args.no_op_count,
    )
    if args.reference:
        timings = _reference_timings(result, options, reference_model_dir, quiet=args.json)
        result = dataclasses.replace(result, references=timings)
    if result.rank != 0:  # under torchrun / accelerate launch, rank 0 reports for all
        return 0
    _print_result(args, result.to_json, lambda: format_bench(result))
    return 0


def _print_result(args, data, text) -> None:
    """``data()`` as JSON with ``--json``, else ``text()``; measured on ``--references`` (their lengths and the
    tokens generated from them show in it), marked NOT PRIVATE (:mod:`invink_audit.not_private`)."""
    private = args.references is not None
    if args.json:
        print(json.dumps(mark_not_private(data()) if private else data()))
    else:
        print(f"{NOT_PRIVATE_BANNER}\n\n{text()}" if private else text())


def _references(args, needed: int) -> list[str] | None:
    """The texts of --references (filtered by --where), in file order; None for the demo references."""
    from pathlib import Path

    from invink_audit.data import read_references, select_references

    if args.references is None:
        if args.column is not None or args.where is not None:
            raise CliError("--column and --where need --references")
        return None
    where = parse_where(args.where)
    if where is None:
        texts = read_references(Path(args.references), column=args.column)
    else:
        texts = select_references(Path(args.references), where, column=args.column)
    texts = [t for t in texts if t]
    if not texts:
        raise CliError("--references: no non-empty text is selected")
    if len(texts) < needed:
        raise CliError(f"--references: {plural(len(texts), 'non-empty text')} selected; G x B = {needed} are needed")
    return texts[:needed]


def _process_lines(result) -> list[str]:
    """The per-process lines of a benchmark under torchrun (none for one process)."""
    if not result.processes:
        return []
    lines = [
        f"  {len(result.processes)} processes          {result.workload_tokens_per_second:.1f} tokens/s in all "
        f"(total tokens / slowest process); prefill / decode and padding efficiency above are process 0's; lockstep, one-at-a-time, floor and reference runs are skipped"
    ]
    for p in result.processes:
        rate = p["tokens"] / p["seconds"] if p["seconds"] > 0 else float("nan")
        lines.append(
            f"    process {p['rank']:<14} {plural(p['texts'], 'text')}, {plural(p['tokens'], 'token')} in "
            f"{p['seconds']:.1f} s ({rate:.1f} tokens/s) on {p['device']}"
        )
    return lines


def format_bench(result) -> str:
    """The benchmark's report: the workload, its split, efficiency, and every ratio against it."""
    ms = 1e3
    lines = [
        f"model {result.model} on {result.device}, {result.dtype} ({result.threads} threads)",
        *([f"  dtype                    {result.dtype_choice.reason}"] if result.dtype_choice is not None else []),
        f"  workload                 G = {result.num_texts} text(s) x (B+1) = {result.batch_size + 1} rows, "
        f"T = {result.max_new_tokens}; {result.prompt_tokens} prompt tokens, longest prompt {result.longest_prompt}"
        + (" (plain-text prompts: no chat template)" if result.plain_prompts else ""),
        f"  whole workload           {result.workload_token_seconds * ms:.1f} ms per token "
        f"({result.workload_tokens} tokens in {result.workload_seconds:.1f} s, prefill and EOS included)",
        f"    prefill / decode       {result.prefill_seconds:.1f} s / {result.decode_seconds:.1f} s "
        f"({result.prefill_tokens_computed} prompt tokens computed: the template prefix is computed once)",
        f"  padding efficiency       prefill {result.prefill_efficiency:.2f}, KV {result.kv_efficiency:.2f}, "
        f"decode rows {result.decode_row_efficiency:.2f} (left-padded layout: prefill "
        f"{result.left_padded_prefill_efficiency:.2f}, KV {result.left_padded_kv_efficiency:.2f})",
    ]
    lines += _process_lines(result)
    if result.one_at_a_time_tokens:
        lines.append(
            f"  one text at a time       {result.one_at_a_time_token_seconds * ms:.1f} ms per token "
            f"({result.one_at_a_time_tokens} tokens in {result.one_at_a_time_seconds:.1f} s); "
            f"batched is {result.speedup_over_one_at_a_time:.2f}x faster"
        )
    if result.floor_seconds == result.floor_seconds:  # not NaN
        lines.append(
            f"  bare unpadded forward    {result.floor_seconds:.1f} s (prefill {result.floor_prefill_seconds:.1f} s, "
            f"decode {result.floor_decode_seconds:.1f} s); workload / floor = {result.floor_ratio:.2f}"
        )
    if result.full_logits_tokens:
        lines.append(
            f"  full private logits      {result.full_logits_token_seconds * ms:.1f} ms per token; the Top-k+ columns "
            f"only ({'on' if result.support_only else 'off'}, V = {result.vocab_size}) are "
            f"{result.speedup_over_full_logits:.2f}x faster"
        )
    if result.repeats:
        lines += [
            f"  private step             {result.private_step_seconds * ms:.1f} ms (forward + mechanism + sampling)",
            f"  bare forward step        {result.forward_step_seconds * ms:.1f} ms (same rows and tokens)",
            f"  overhead_ratio           {result.overhead_ratio:.3f}",
            f"  non-private step         {result.nonprivate_step_seconds * ms:.1f} ms (one text, one row); "
            f"private costs {result.relative_to_nonprivate:.2f}x per token of one text",
        ]
    if result.decode_ops is not None:
        ops = result.decode_ops
        lines.append(
            f"  kernel ops per step      {ops.engine:.0f} (forward + mechanism + sampling) against {ops.padded:.0f} "
            f"for a plain padded transformers decode of the same rows: {ops.ratio:.2f}x"
        )
    for reference in result.references:
        lines += [
            f"  reference invink         {reference.token_seconds * ms:.1f} ms per token in its decode loop "
            f"({reference.tokens} tokens; {reference.configuration}: model in {reference.dtype}; "
            f"version {reference.version})",
            f"    speedup                {result.speedup(reference):.2f}x",
        ]
    return "\n".join(lines)


def format_dtype_comparison(result) -> str:
    """The dtype comparison's report: what auto chooses and why, each dtype's rounds, and the ratios."""
    lines = [
        f"model {result.model} on {result.device} ({result.threads} threads): G = {result.num_texts} text(s) x "
        f"(B+1 = {result.batch_size + 1}) = {result.num_texts * (result.batch_size + 1)} rows, T = {result.max_new_tokens}; "
        f"{result.rounds} alternating round(s)",
        f"  --dtype auto chooses     {result.auto.dtype}: {result.auto.reason}",
        f"  {'dtype':<10} {'workload s (each round)':<26} {'median s':>9} {'prefill s':>10} {'tokens':>7} {'ms/token':>9}",
    ]
    for run in result.runs:
        rounds = ", ".join(f"{s:.1f}" for s in run.seconds)
        lines.append(
            f"  {run.dtype:<10} {rounds:<26} {run.median_seconds:>9.1f} {run.median_prefill_seconds:>10.1f} "
            f"{run.tokens[0]:>7} {run.token_seconds * 1e3:>9.1f}"
        )
    dtypes = [run.dtype for run in result.runs]
    if "float32" in dtypes and "bfloat16" in dtypes:
        fp32, bf16 = result.run("float32"), result.run("bfloat16")
        lines.append(
            f"  bfloat16 speedup         {result.speedup():.2f}x per token over float32 ({result.workload_speedup():.2f}x "
            f"the whole workload, {fp32.median_prefill_seconds / bf16.median_prefill_seconds:.2f}x its prefill); "
            "the mechanism runs in float64 in both"
        )
    for reference in result.references:
        ours = next((run for run in result.runs if run.dtype == reference.requested_dtype), None)
        speedup = f"; ours in {ours.dtype} is {reference.token_seconds / ours.token_seconds:.2f}x faster" if ours else ""
        lines.append(
            f"  reference invink         {reference.token_seconds * 1e3:.1f} ms per token ({reference.configuration}: "
            f"model in {reference.dtype}; version {reference.version}){speedup}"
        )
    return "\n".join(lines)
