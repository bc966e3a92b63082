"""``invink-audit plan | epsilon | max-tokens | min-batch-size | table``: budget planning (torch-free);
``invink-audit memory``: capacity planning (:mod:`invink_audit.capacity`; reads the model's config).
"""

from __future__ import annotations

import functools
import json

from invink_audit.cli import parse_float, parse_int, parse_top_k, plural, shown
from invink_audit.cli._options import B_HELP, SHARED, add

#: command: (planner in :mod:`accounting`, its arguments in order (each required but --temperature), help,
#: description, headline, the field the JSON adds to the plan's summary)
_PLANNERS = {
    "plan": ("plan_clip_norm", ("--epsilon", "--delta", "--max-new-tokens", "--batch-size", "--temperature"),
             "clip norm C for a privacy budget",
             "The largest clip norm C for which T tokens are (epsilon, delta)-DP. ", "Clip norm for the budget", None),
    "epsilon": ("epsilon_for_clip_norm", ("--clip-norm", "--max-new-tokens", "--batch-size", "--temperature", "--delta"),
                "epsilon spent by a clip norm",
                "The certified epsilon at delta of texts of at most T tokens with clip norm C. ",
                "Privacy spent by this clip norm", None),
    "max-tokens": ("plan_max_new_tokens", ("--epsilon", "--delta", "--clip-norm", "--batch-size", "--temperature"),
                   "largest token budget T for a budget and clip norm",
                   "The largest T (at most 1e9) for which clip norm C stays within (epsilon, delta). ",
                   "Largest token budget", "max_new_tokens"),
    "min-batch-size": ("plan_min_batch_size", ("--epsilon", "--delta", "--max-new-tokens", "--clip-norm", "--temperature"),
                       "smallest B that reaches a target clip norm",
                       "The smallest number of references B (at most 1e9) whose planned clip norm reaches C. ",
                       "Smallest number of references", "batch_size"),
}


def register(subparsers) -> None:
    for name, (_, flags, help, description, _, _) in _PLANNERS.items():
        p = subparsers.add_parser(name, handler=functools.partial(_planned, name), help=help,
                                  description=description + B_HELP)
        for flag in flags:
            target = "target " if name == "min-batch-size" and flag == "--clip-norm" else ""  # B is planned for it
            add(p, flag, required=flag != "--temperature", help=target + SHARED[flag]["help"])
        add(p, "--accountant", "--json")
        add(p, "--unit-max-references", dest="unit_contributions", default="1",
            help="answer per privacy unit whose references fall in up to K batches (generate --unit-rule spread's K): "
            "K texts of T tokens composed (default 1: one reference, or a unit in one slot)")
    _register_table(subparsers)
    _register_memory(subparsers)


def _register_table(subparsers) -> None:
    """``table``: clip norms and compute cost over a grid of ε × B."""
    p = subparsers.add_parser(
        "table", handler=_table,
        help="clip norms over a grid of epsilon x B, with compute cost",
        description="Clip norm for each (epsilon, B) and its compute cost (B+1 forward rows per token). "
        + B_HELP,
    )
    add(p, "--epsilons", default="1,3,5,10",
        help="comma-separated epsilons, each in [1e-6, 1e4], at most 100 (default 1,3,5,10)")
    add(p, "--batch-sizes", default="4,8,16,32",
        help="comma-separated B values, each 1 .. 1e9, at most 100 (default 4,8,16,32)")
    add(p, "--delta", default="1e-6", help=SHARED["--delta"]["help"] + " (default 1e-6)")
    add(p, "--max-new-tokens", default="500", help="token budget T per text, 1 .. 1e9 (default 500)")
    add(p, "--temperature", "--accountant", "--json")


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
    if plan.unit_contributions > 1:
        k = plan.unit_contributions
        lines[1] += f" per privacy unit in up to {k} batches"
        lines[-1] = f"  per unit           rho = {k}*T*rho_token = {plan.rho_sequence:.6g} (zCDP, {k} texts composed)"
    return "\n".join(lines)


def _planned(name: str, args) -> int:
    """``plan``, ``epsilon``, ``max-tokens`` and ``min-batch-size``: one planner of :data:`_PLANNERS`."""
    import accounting

    planner, flags, _, _, headline, field = _PLANNERS[name]
    names = [flag[2:].replace("-", "_") for flag in flags]  # the planner's keywords, in the command's order
    plan = getattr(accounting, planner)(**{name: getattr(args, name) for name in names}, accountant=args.accountant,
                                        unit_contributions=args.unit_contributions)
    added = {} if field is None else {field: getattr(plan, field)}
    print(json.dumps({**plan.summary(), **added}) if args.json else format_plan(plan, headline=headline))
    return 0


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

    rows = planning_table(epsilons=list(args.epsilons), batch_sizes=list(args.batch_sizes), delta=args.delta,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature, accountant=args.accountant)
    if args.json:
        print(json.dumps([{**r.plan.summary(), **r.as_dict()} for r in rows]))
        return 0
    first = rows[0].plan
    print(f"Planning table: delta={first.delta:g}, T={first.max_new_tokens}, tau={first.temperature:g}, "
          f"accountant={first.accountant} (rows = forward rows; B+1 per token)\n{format_table(rows)}")
    return 0


# --------------------------------------------------------------------------------------------
# memory: capacity planning (a top-level command: `plan` takes the privacy budget's required arguments)

_MEMORY_DESCRIPTION = (
    "Peak memory of a release and how to choose --max-batch-rows: the model's weights, its KV cache per text "
    "(B+1 rows, each sized for its prompt and T tokens while prefilled, in length buckets while decoding), the "
    "texts in flight (max_batch_rows // (B+1)), the sampling buffers and activations. Reads the model's config "
    "(not its weights). Formula and measurements: docs/guide/capacity.md. " + B_HELP
)


def _register_memory(subparsers) -> None:
    p = subparsers.add_parser("memory", handler=_memory, help="peak memory per text and per --max-batch-rows",
                              description=_MEMORY_DESCRIPTION)
    # values as text, as _memory reads them (--max-batch-rows, --num-texts and --public-prompt-tokens take 'none')
    add(p, "--model", help="model name (smollm2-135m-instruct, the default; gemma3-270m), local directory, hub id or "
        ".gguf file")
    add(p, "--batch-size", "--max-new-tokens", required=True)
    p.add_argument("--prompt-tokens", required=True,
                   help="P: tokens of a private row's prompt (template and reference), an integer >= 1")
    p.add_argument("--public-prompt-tokens", default=None,
                   help="P0: tokens of the public row's prompt (the template alone); default P, an upper bound")
    add(p, "--dtype", choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype the model runs in; auto: bfloat16 on cuda, float32 on cpu (default auto)")
    add(p, "--device", default="cuda", choices=["cuda", "cpu"],
        help="device planned for (the dtype auto picks, the default --max-batch-rows, and the KV layout the engine "
        "uses there: one pool on cuda, length buckets on cpu; default cuda)")
    rows = p.add_mutually_exclusive_group()
    add(rows, "--max-batch-rows", type=str, help="R: rows per forward pass (default: 256 on cuda, 64 on cpu)")
    rows.add_argument("--memory-budget", default=None, metavar="GIB",
                      help="instead: the largest --max-batch-rows whose upper bound on the peak fits GIB GiB")
    p.add_argument("--equal-prompts", action="store_true",
                   help="accepted for compatibility; changes nothing (the bound holds for prompts of any lengths)")
    add(p, "--num-texts", type=str,
        help="texts to generate (fewer than max_batch_rows // (B+1) limits the texts in flight)")
    add(p, "--top-k", default="100", help="top_k of the mechanism, an integer >= 1, or 'none' (default 100)")
    add(p, "--json")


def _optional_int(flag: str, text: str | None) -> int | None:
    return None if text is None or str(text).lower() == "none" else parse_int(flag, text)


def _memory(args) -> int:
    import dataclasses

    from invink_audit.capacity import GIB, Workload, estimate_memory, max_batch_rows_for_budget, read_model_shape
    from invink_audit.rows import default_kv_layout, default_max_batch_rows

    budget = None if args.memory_budget is None else parse_float("--memory-budget", args.memory_budget)
    if budget is not None and not 0 < budget < 1e9:
        raise ValueError(f"--memory-budget must be a number of GiB in (0, 1e9); got {args.memory_budget!r}")
    rows = _optional_int("--max-batch-rows", args.max_batch_rows)
    if rows is None:
        rows = default_max_batch_rows(args.device)
    workload = Workload(
        batch_size=parse_int("--batch-size", args.batch_size),
        max_new_tokens=parse_int("--max-new-tokens", args.max_new_tokens),
        prompt_tokens=parse_int("--prompt-tokens", args.prompt_tokens),
        public_prompt_tokens=_optional_int("--public-prompt-tokens", args.public_prompt_tokens),
        max_batch_rows=rows, num_texts=_optional_int("--num-texts", args.num_texts),
        top_k=parse_top_k("--top-k", args.top_k, "none"),
        kv_layout=default_kv_layout(args.device),
    )
    shape = read_model_shape(args.model, dtype=args.dtype, device=args.device)
    if budget is not None:
        fitted = max_batch_rows_for_budget(shape, workload, int(budget * GIB))  # --equal-prompts: the same bound
        if not fitted:
            one = estimate_memory(shape, dataclasses.replace(workload, max_batch_rows=workload.rows_per_text))
            need = one.peak_bytes
            raise ValueError(f"even one text (B+1 = {workload.rows_per_text} rows) needs about {need / GIB:.3g} GiB, "
                             f"more than --memory-budget {budget:g} GiB")
        workload = dataclasses.replace(workload, max_batch_rows=fitted)
    estimate = estimate_memory(shape, workload)
    fit = None if budget is None else "upper bound"
    print(json.dumps({**estimate.to_json(), "memory_budget_gib": budget, "fitted_with": fit}) if args.json
          else format_memory(estimate, budget, equal_prompts=args.equal_prompts))
    return 0


def format_memory(estimate, budget: float | None = None, *, equal_prompts: bool = False) -> str:
    """A human-readable block describing a :class:`invink_audit.capacity.MemoryEstimate` (``equal_prompts``
    changes nothing: the upper bound holds for prompts of any lengths up to P, equal or not)."""
    from invink_audit.capacity import FORMULA, format_bytes

    m, w = estimate.shape, estimate.workload
    g, per_row = w.texts_in_flight, w.rows_per_text
    chosen = "given or the default" if budget is None else f"the largest that fits {budget:g} GiB, upper bound"
    lines = [
        f"Memory plan: {shown(m.name)} in {m.dtype} ({m.num_layers} layers, {m.num_kv_heads} KV heads x {m.head_dim}, "
        f"hidden {m.hidden_size}, vocabulary {m.vocab_size}, {m.num_parameters / 1e6:.1f}M parameters)",
        f"  workload           B = {w.batch_size}, T = {w.max_new_tokens}, prompts P = {w.prompt_tokens} tokens "
        f"(public P0 = {w.public_prompt_tokens}), top_k = {w.top_k}",
        f"  max_batch_rows     R = {w.max_batch_rows} ({chosen}): G = {plural(g, 'text')} in flight x {per_row} rows "
        f"= {g * per_row} rows per decoding pass",
        f"  weights            {format_bytes(estimate.weights_bytes):>12}  parameters x {m.dtype_bytes} B",
        f"  KV per row, token  {format_bytes(estimate.kv_bytes_per_token):>12}  kappa = 2 x {m.num_layers} layers x "
        f"{m.num_kv_heads} KV heads x {m.head_dim} x {m.dtype_bytes} B",
        f"  KV per text        {format_bytes(estimate.kv_text_bytes):>12}  ((P0+T) + B(P+T)) x kappa, "
        "while it is prefilled",
        f"  KV layout          {w.kv_layout:>12}  " + ("one pool, every slot as wide as the longest row (CUDA's default)"
                                                     if w.kv_layout == "pool" else "length buckets (the CPU's default)"),
        f"  KV, decoding       {format_bytes(estimate.kv_decoding_bytes):>12}  per text at most, "
        + ("(B+1) x W'(max(P0,P)+T-1) x kappa, its slots in the pool" if w.kv_layout == "pool"
           else "4 x (W(P0+T-1) + B x W(P+T-1)) x kappa, in length buckets"),
        f"  KV cache peak      {format_bytes(estimate.kv_peak_bytes):>12}  upper bound: {g} texts, prompts of at most "
        f"P tokens ({estimate.kv_peak_bytes / max(g * estimate.kv_text_bytes, 1):.2f}x the texts' prefill size)",
        f"  sampling buffers   {format_bytes(estimate.sampling_bytes):>12}",
        f"  activations        {format_bytes(estimate.activation_bytes):>12}  (approximate)",
        f"  peak estimate      {format_bytes(estimate.peak_bytes):>12}  KV cache bounded, prompts of any lengths "
        "(allocator overhead, CUDA context and Python not included)",
        "  formula: " + FORMULA,
    ]
    return "\n".join(lines)
