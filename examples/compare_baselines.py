"""The paper's comparison (§5, Table 2 (tab:result), Figure 4 (fig:mainplot)), small enough for a 2-core CPU.

At ε ∈ {3, 10} (δ = 1e-6), B + 1 ∈ {4, 8, 16, 32, 64} forward rows per token and a fixed token budget T,
SmolLM2-135M-Instruct (embedded) generates Yelp restaurant reviews (../shared/data/yelp/dev.csv, read in
place, 5-star restaurant reviews in file order) with

* InvisibleInk, k = |V| (τ = 1.0) and k = 100 (τ = 1.1): clip norm planned for (ε, δ, T, B) by
  ``br-adaptive`` (the paper's Table 2 (tab:result) temperatures);
* Amin et al. 2024 with the paper's accounting (C/B and 1/B under replace-by-null) and with the
  correct one (2C/B, 2/B): r = T/4 private tokens (the paper calibrates r ≈ T/4), SVT σ = 0.3, θ = 0.7
  (its re-implementation's defaults), clip norm planned for (ε, δ, r, B); infeasible cells produce nothing;
* AdaPMixED (data-dependent guarantee, the paper's App. D.5 defaults) stopped at ε.

Every method runs on the same batches of references (seed s uses batch s of each B: disjoint data,
and its own randomness), one text per (method, ε, B + 1, seed). Utility: tokens generated, texts
produced (a text of 0 tokens is "no text"), perplexity under the same SmolLM2 (the utility evaluator's
``score_perplexity``, ``invink_audit.evaluation``), private tokens (Amin), and ΔPPL against real
reviews. Intervals: mean ± t-quantile × standard error over seeds. Prefill is computed once per batch
and shared by every method (``Engine(prefill_cache=...)``: bitwise the same rows).

    python examples/compare_baselines.py --output audits/reports/baselines_comparison   # ~1-2 h on 2 CPU cores
    python examples/compare_baselines.py --summarise-only --output audits/reports/baselines_comparison

Results are appended to ``cells.jsonl`` as each cell finishes (re-running resumes), then
``summary.json``, ``comparison.md`` and ``comparison.png`` are written. Seeded generation: the texts
are reproducible and therefore carry no privacy; this measures utility, not a release.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

METHODS = ("invisibleink-full", "invisibleink-top100", "amin-paper", "amin-correct", "adapmixed")
LABELS = {
    "invisibleink-full": "InvisibleInk k=|V|",
    "invisibleink-top100": "InvisibleInk k=100",
    "amin-paper": "Amin et al. (paper's C/B)",
    "amin-correct": "Amin et al. (correct 2C/B)",
    "adapmixed": "AdaPMixED (data-dependent)",
}
DELTA = 1e-6
CATEGORY, STARS = "Business Category: Restaurants", "Review Stars: 5.0"


def yelp_references(limit: int) -> list[str]:
    import csv

    from invink_audit.audit.spec import yelp_dir

    path = yelp_dir() / "dev.csv"
    with open(path, newline="", encoding="utf-8") as f:
        rows = [r["text"] for r in csv.DictReader(f) if r["label1"] == CATEGORY and r["label2"] == STARS]
    if len(rows) < limit:
        raise ValueError(f"{path} has {len(rows)} 5-star restaurant reviews; {limit} needed")
    return rows[:limit]


def build_mechanism(method: str, epsilon: float, batch_size: int, max_new_tokens: int):
    """The method's mechanism for (ε, B, T), or a string saying why no text can be produced."""
    from accounting import plan_clip_norm
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import (
        AdaPMixEDConfig,
        AdaPMixEDMechanism,
        AminConfig,
        AminInfeasibleError,
        AminMechanism,
        InvisibleInk,
        plan_amin,
    )

    if method.startswith("invisibleink"):
        tau, top_k = (1.0, None) if method == "invisibleink-full" else (1.1, 100)
        plan = plan_clip_norm(epsilon=epsilon, delta=DELTA, max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=tau)
        return InvisibleInk(MechanismConfig(clip_norm=plan.clip_norm, temperature=tau, top_k=top_k, batch_size=batch_size))
    if method.startswith("amin"):
        r = max(1, max_new_tokens // 4)
        mode = "paper" if method == "amin-paper" else "replace-by-null"
        try:
            acc = plan_amin(epsilon=epsilon, delta=DELTA, max_private_tokens=r, batch_size=batch_size, svt_noise=0.3, sensitivity=mode)
        except AminInfeasibleError as err:
            return str(err)
        return AminMechanism(AminConfig(clip_norm=acc.clip_norm, batch_size=batch_size, max_private_tokens=r, sensitivity=mode))
    if method == "adapmixed":
        return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=batch_size, epsilon=epsilon, delta=DELTA))
    raise ValueError(f"unknown method {method!r}")


def run(args) -> None:
    import torch

    from invink_audit.mechanism import SeededGeneratorWarning, make_generator
    from invink_audit.mechanisms.run import generate_with_mechanism
    from invink_audit.models import load_model

    warnings.simplefilter("ignore", SeededGeneratorWarning)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    cells_path = out / "cells.jsonl"
    done = set()
    if cells_path.exists():
        for line in cells_path.read_text().splitlines():
            c = json.loads(line)
            done.add((c["method"], c["epsilon"], c["rows"], c["seed"]))
    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    rows_list = [int(x) for x in args.rows.split(",")]
    epsilons = [float(x) for x in args.epsilons.split(",")]
    methods = [m for m in args.methods.split(",")]
    refs = yelp_references(max(rows_list) * args.seeds)
    fields = {"category": "Restaurants", "stars": "5.0"}
    for rows in rows_list:
        b = rows - 1
        for seed in range(args.seeds):
            batch = refs[seed * b : (seed + 1) * b]
            cache: dict = {}  # this batch's prefilled prompts, shared by every method and epsilon
            for epsilon in epsilons:
                for method in methods:
                    if (method, epsilon, rows, seed) in done:
                        continue
                    mech = build_mechanism(method, epsilon, b, args.max_new_tokens)
                    cell = {"method": method, "epsilon": epsilon, "rows": rows, "batch_size": b, "seed": seed,
                            "max_new_tokens": args.max_new_tokens}
                    if isinstance(mech, str):
                        cell.update({"feasible": False, "reason": mech, "texts": []})
                    else:
                        t0 = time.perf_counter()
                        result = generate_with_mechanism(
                            batch, mech, max_new_tokens=args.max_new_tokens, delta=DELTA, model=loaded, prompt="yelp",
                            prompt_fields=fields, generator=make_generator(1000 + seed), prefill_cache=cache,
                        )
                        cell.update({
                            "feasible": True,
                            "seconds": time.perf_counter() - t0,
                            "guarantee": result.guarantee.label(),
                            "mechanism": mech.describe(),
                            "texts": [
                                {"text": t.text, "num_tokens": t.num_tokens, "finish_reason": t.finish_reason,
                                 "modes": list(t.modes), "spend": t.spend}
                                for t in result.texts
                            ],
                        })
                    with open(cells_path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(cell) + "\n")
                    print(f"{method:22s} eps={epsilon:<4g} rows={rows:<3d} seed={seed} "
                          + (f"{cell['texts'][0]['num_tokens']} tokens, {cell['seconds']:.1f} s" if cell["feasible"] else "infeasible"),
                          flush=True)
            cache.clear()


def _mean_interval(values):
    """Mean and half-width of a 95% t-interval over seeds (None with fewer than two values)."""
    from scipy import stats

    n = len(values)
    if n == 0:
        return None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)


def summarise(args) -> dict:
    from invink_audit.evaluation.perplexity import score_perplexity
    from invink_audit.models import load_model

    out = Path(args.output)
    cells = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    loaded = load_model(None)
    texts = [t["text"] for c in cells for t in c["texts"]]
    scores = score_perplexity(texts, loaded) if texts else None
    k = 0
    for c in cells:
        for t in c["texts"]:
            t["perplexity"] = scores.perplexities[k]
            k += 1
    real = yelp_references(args.real_references + 63 * args.seeds)[-args.real_references:]
    real_ppl = [p for p in score_perplexity(real, loaded, max_tokens=args.max_new_tokens).perplexities if p is not None]
    real_mean = sum(real_ppl) / len(real_ppl)
    groups: dict = {}
    for c in cells:
        groups.setdefault((c["method"], c["epsilon"], c["rows"]), []).append(c)
    summary = []
    for (method, epsilon, rows), cs in sorted(groups.items(), key=lambda kv: (kv[0][1], METHODS.index(kv[0][0]), kv[0][2])):
        row = {"method": method, "label": LABELS[method], "epsilon": epsilon, "rows": rows, "seeds": len(cs),
               "feasible": all(c["feasible"] for c in cs)}
        if not row["feasible"]:
            row["reason"] = cs[0].get("reason", "")
            summary.append(row)
            continue
        per_seed_len = [sum(t["num_tokens"] for t in c["texts"]) / len(c["texts"]) for c in cs]
        per_seed_ppl = [p for c in cs for p in [_mean([t["perplexity"] for t in c["texts"] if t["perplexity"] is not None])] if p is not None]
        per_seed_private = [sum(sum(1 for m in t["modes"] if m == 1) for t in c["texts"]) / len(c["texts"]) for c in cs]
        produced = sum(1 for c in cs for t in c["texts"] if t["num_tokens"] > 0)
        total = sum(len(c["texts"]) for c in cs)
        tokens = sum(t["num_tokens"] for c in cs for t in c["texts"])
        row.update({
            "length": _mean_interval(per_seed_len),
            "perplexity": _mean_interval(per_seed_ppl),
            "delta_ppl": abs(_mean(per_seed_ppl) - real_mean) if per_seed_ppl else None,
            "private_tokens": _mean_interval(per_seed_private) if method.startswith(("amin", "adapmixed")) else (None, None),
            "texts_produced": f"{produced}/{total}",
            "finish_reasons": _count([t["finish_reason"] for c in cs for t in c["texts"]]),
            "seconds_per_token": sum(c["seconds"] for c in cs) / tokens if tokens else None,
            "example": next((t["text"][:160] for c in cs for t in c["texts"] if t["num_tokens"] > 0), ""),
        })
        summary.append(row)
    result = {"real_reference_perplexity": real_mean, "real_references": len(real_ppl), "scorer": loaded.name,
              "max_new_tokens": args.max_new_tokens, "cells": summary}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "comparison.md").write_text(markdown(result))
    plot(result, out / "comparison.png")
    return result


def _mean(values):
    return sum(values) / len(values) if values else None


def _count(items):
    out: dict = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def _fmt(pair, digits=1):
    mean, half = pair
    if mean is None:
        return "–"
    return f"{mean:.{digits}f}" + (f" ± {half:.{digits}f}" if half is not None else "")


def markdown(result) -> str:
    lines = [
        f"Scorer {result['scorer']}; real 5-star restaurant reviews score PPL {result['real_reference_perplexity']:.1f} "
        f"(first {result['max_new_tokens']} tokens, {result['real_references']} reviews). T = {result['max_new_tokens']}.",
        "",
        "| ε | method | B+1 (rows/token) | texts produced | tokens (mean ± 95% t over seeds) | PPL | ΔPPL | private tokens | finish reasons | s/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cells"]:
        if not r["feasible"]:
            lines.append(f"| {r['epsilon']:g} | {r['label']} | {r['rows']} | 0/{r['seeds']} (infeasible: SVT alone exceeds the budget) | – | – | – | – | – | – |")
            continue
        spt = r["seconds_per_token"]
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))
        lines.append(
            f"| {r['epsilon']:g} | {r['label']} | {r['rows']} | {r['texts_produced']} | {_fmt(r['length'])} | {_fmt(r['perplexity'])} | "
            f"{'–' if r['delta_ppl'] is None else format(r['delta_ppl'], '.1f')} | {_fmt(r['private_tokens'])} | "
            f"{reasons} | {'–' if spt is None else format(spt, '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epsilons = sorted({r["epsilon"] for r in result["cells"]})
    fig, axes = plt.subplots(2, len(epsilons), figsize=(5.5 * len(epsilons), 7), squeeze=False)
    markers = dict(zip(METHODS, "osv^D"))
    for col, eps in enumerate(epsilons):
        for row, (key, ylabel) in enumerate((("length", "tokens generated"), ("perplexity", "perplexity (SmolLM2)"))):
            ax = axes[row][col]
            for method in METHODS:
                cells = [r for r in result["cells"] if r["method"] == method and r["epsilon"] == eps]
                ok = [r for r in cells if r["feasible"] and r[key][0] is not None]
                if ok:
                    x = [r["rows"] * (1 + 0.03 * (METHODS.index(method) - 2)) for r in ok]  # dodge overlapping bars
                    y = [r[key][0] for r in ok]
                    err = [r[key][1] or 0.0 for r in ok]
                    # intervals are symmetric in the value; on a log axis (perplexity) the lower end is cut at 5% of y
                    low = [min(e, 0.95 * v) if key == "perplexity" else min(e, v) for e, v in zip(err, y)]
                    ax.errorbar(x, y, yerr=[low, err], marker=markers[method], capsize=3, label=LABELS[method])
                bad = [r["rows"] for r in cells if not r["feasible"]]
                if bad and row == 0:
                    ax.plot(bad, [-1.5 - METHODS.index(method) + 2] * len(bad), "x", ms=9,
                            color="tab:green" if method == "amin-paper" else "tab:red",
                            label=f"{LABELS[method]}: infeasible (no text)")
            if key == "perplexity":
                ax.axhline(result["real_reference_perplexity"], color="k", ls=":", lw=1, label="real reviews")
                ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_xticks([4, 8, 16, 32, 64], ["4", "8", "16", "32", "64"])
            ax.set_xlabel("forward rows per token (B+1)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"ε = {eps:g}, δ = 1e-6, T = {result['max_new_tokens']}", fontsize=10)
    for ax in axes.flat:
        ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="audits/reports/baselines_comparison")
    parser.add_argument("--epsilons", default="3,10")
    parser.add_argument("--rows", default="4,8,16,32,64", help="B + 1 values")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--real-references", type=int, default=60)
    parser.add_argument("--summarise-only", action="store_true")
    args = parser.parse_args()
    if not args.summarise_only:
        run(args)
    result = summarise(args)
    print(markdown(result))


if __name__ == "__main__":
    main()
