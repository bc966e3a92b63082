"""``invink-audit bench``: its options checked before anything loads, the runs, and their reports (the per-token
cost of private decoding against the bare forward passes, a dtype comparison, the reference package beside)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path

from invink_audit.cli import CliError, parse_float, parse_int, parse_top_k, plural
from invink_audit.cli._options import parse_where
from invink_audit.distributed import launch_world_size
from invink_audit.not_private import NOT_PRIVATE_BANNER, mark_not_private

from . import dtypes, engine
from .reference import time_reference

#: the smallest value of each count flag: the same bounds as :func:`benchmarks.engine.benchmark`, checked before
#: anything is printed or loaded
_COUNT_MINIMUMS = {"--batch-size": 1, "--max-new-tokens": 3, "--num-texts": 1, "--repeats": 0}


def _reference_model_dir(model: str | None) -> str:
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
    stop_at_eos: bool = True  # False with --full-length


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
        temperature, not args.full_length,
    )  # fmt: skip


def _check_reference(args) -> str | None:
    """With ``--reference``: the model directory the reference package loads, checked before the long run
    (one process only, the package importable); ``None`` without it."""
    if args.reference and launch_world_size() > 1:
        raise CliError("--reference times the reference package in one process: run it without torchrun")
    if not args.reference:
        return None
    try:
        importlib.import_module("invink")
    except ImportError as err:
        raise CliError(
            f"--reference: the reference package is not importable ({err}); install invink==0.1.0 "
            "(on Python 3.11 it needs its nested-quote f-string in invink/utils.py fixed) and pandas"
        ) from err
    return _reference_model_dir(args.model)


def _reference_timings(result, options: _Options, model_dir: str, *, quiet: bool, device: str | None = None) -> tuple:
    """Time the reference package on the benchmark's workload, once per configuration: ``shipped`` (its defaults)
    or ``matched`` (the benchmark's dtype and device; ``result`` is a :class:`~benchmarks.engine.BenchResult`
    or, with ``device``, a :class:`~benchmarks.dtypes.DtypeRun`)."""
    import torch

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
                stop_at_eos=options.stop_at_eos,
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
    if not args.json:
        print(
            f"comparing float32 and bfloat16 on {options.num_texts} text(s) x ({options.batch_size}+1) rows, "
            f"{options.max_new_tokens} tokens, {rounds} round(s) ...",
            file=sys.stderr,
        )
    result = dtypes.compare_dtypes(
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
        stop_at_eos=options.stop_at_eos,
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


def run(args) -> int:
    """``invink-audit bench`` with its parsed ``args`` (``invink_audit/cli/_bench.py`` declares the flags)."""
    options = _options(args)
    rounds = _compare_rounds(args)
    reference_model_dir = _check_reference(args)  # before the long run, so a missing package costs nothing
    if args.compare_dtypes:
        return _compare_dtypes(args, options, rounds, reference_model_dir)
    if not args.json:
        print(
            f"benchmarking {options.num_texts} text(s) x ({options.batch_size}+1) rows, {options.max_new_tokens} "
            "tokens ...",
            file=sys.stderr,
        )
    result = engine.benchmark(
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
        stop_at_eos=options.stop_at_eos,
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
        f"({result.workload_tokens} tokens in {result.workload_seconds:.1f} s, prefill included, "
        + ("end-of-sequence stopping texts)" if result.stop_at_eos else "every text to T: --full-length)"),
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
            f"  kernel ops per step      {ops.engine:.0f} (forward + mechanism + sampling; rows in a {ops.layout}) "
            f"against {ops.padded:.0f} for a plain padded transformers decode of the same rows: {ops.ratio:.2f}x"
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
        f"{result.rounds} alternating round(s), "
        + ("stopping at end-of-sequence" if result.stop_at_eos else "every text to T (--full-length)"),
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

