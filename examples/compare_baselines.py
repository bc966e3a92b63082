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

Every method runs on the same batches of references (seed s uses batch s of each B, refs[s·B:(s+1)·B]:
seed 0's batches are nested, seeds 1 and 2 mostly disjoint across B) and the same random stream per
seed, one text per (method, ε, B + 1, seed). Utility: tokens generated, texts produced (a text of 0
tokens is "no text"), perplexity under the same SmolLM2 (the utility evaluator's ``score_perplexity``,
``invink_audit.evaluation``; scored from BOS, so texts under 8 tokens are not scored), Amin et al.'s
private tokens and AdaPMixED's mixed-mode tokens, and ΔPPL against real reviews. Intervals over the 3
seeds: tokens, mean ± t-quantile × standard error clipped to [0, T]; perplexity, geometric mean with a
t-interval on log-perplexity. Seed-paired comparisons, because the methods share streams per seed.
Infeasible Amin et al. cells are computed by its accountant (``plan_amin``), not generated; the table
of feasible batch sizes also covers the paper's r = 100 private tokens. Every method runs through the one
release pipeline (``generate`` with a ``ReleaseConfig``).

**Null-reference anchors** (``--anchors``, ``anchors.jsonl``): for every feasible cell, the text the same
mechanism releases with the same seed and streams when every reference is null (from the public prompt
alone), generated at B = 1 with the parameters that keep the null-reference distribution (see
``anchor_mechanism``); the summary counts how often a text equals its anchor and how far they agree.

    python examples/compare_baselines.py --output audits/reports/baselines_comparison   # ~1-2 h on 2 CPU cores
    python examples/compare_baselines.py --summarise-only --anchors   # anchors only (~36 texts, ~7 min), then the summary
    python examples/compare_baselines.py --summarise-only             # no generation: the summary from the jsonl files

Results are appended to ``cells.jsonl`` as each cell finishes (re-running resumes), then
``summary.json``, ``comparison.md`` and ``comparison.png`` are written. Seeded generation: the texts
are reproducible and therefore carry no privacy; this measures utility, not a release, and each cell
says so (``"guarantee": null`` with ``"guarantee_void_reason"``, as ``generate`` marks a seeded
release). AdaPMixED's per-text spend is computed from the references, so it is private and never
written.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
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

    from invink_audit.generation import PromptSpec, ReleaseConfig, generate
    from invink_audit.mechanism import SeededGeneratorWarning
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
                        result = generate(batch, ReleaseConfig(mech, max_new_tokens=args.max_new_tokens, delta=DELTA),
                                          model=loaded, prompt=PromptSpec("yelp", fields=fields), seed=1000 + seed)
                        cell.update({
                            "feasible": True,
                            "seconds": time.perf_counter() - t0,
                            **result.guarantee.record_fields(),  # seeded: "guarantee": null and why
                            "model_dtype": result.dtype_choice.to_json(),
                            "mechanism": mech.describe(),
                            "texts": [  # never AdaPMixED's spend: it is computed from the references (private)
                                {"text": t.text, "num_tokens": t.num_tokens, "finish_reason": t.finish_reason,
                                 "modes": list(t.modes)}
                                for t in result.texts
                            ],
                        })
                    with open(cells_path, "a", encoding="utf-8") as f:
                        f.write(json.dumps(cell) + "\n")
                    print(f"{method:22s} eps={epsilon:<4g} rows={rows:<3d} seed={seed} "
                          + (f"{cell['texts'][0]['num_tokens']} tokens, {cell['seconds']:.1f} s" if cell["feasible"] else "infeasible"),
                          flush=True)


def anchor_mechanism(method: str, epsilon: float, batch_size: int, max_new_tokens: int):
    """The cell's mechanism with one placeholder reference (B = 1) and the same null-reference output.

    With every reference null, each method's next-outcome distribution depends on B only through
    quantities we keep fixed here, so the cheap B = 1 run with the same random streams gives the same text
    as the cell's mechanism with B null references: InvisibleInk's aggregate is the public logits and only
    the Top-k+ band 2C/B matters (kept by C' = C/B); Amin et al.'s SVT query is 0 and its private tokens
    come from clip_C of the public row (C kept); AdaPMixED mixes nothing (p = p_0) and its screening cost
    stays far below the budget over T tokens, so it never stops."""
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism, InvisibleInk

    mech = build_mechanism(method, epsilon, batch_size, max_new_tokens)
    if isinstance(mech, str):
        return None
    if method.startswith("invisibleink"):
        c = mech.config
        return InvisibleInk(MechanismConfig(clip_norm=c.clip_norm / batch_size, temperature=c.temperature, top_k=c.top_k, batch_size=1))
    if method.startswith("amin"):
        c = mech.config
        return AminMechanism(AminConfig(clip_norm=c.clip_norm, batch_size=1, max_private_tokens=c.max_private_tokens, sensitivity=c.sensitivity))
    return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=1, epsilon=epsilon, delta=DELTA))


def anchors(args) -> None:
    """Null-reference anchors: for every feasible cell of ``cells.jsonl``, the text the same mechanism
    (same parameters, same seed, same random streams) releases when every reference is null, i.e. from
    the public prompt alone (``anchors.jsonl``; resumable). InvisibleInk k=|V| (sampling from the public
    model at τ = 1, whatever C and B) and AdaPMixED give one text per seed, InvisibleInk k=100 one per
    (ε, seed), Amin et al. one per cell (``_anchor_key``)."""
    import torch

    from invink_audit.generation import PromptSpec, ReleaseConfig, generate
    from invink_audit.mechanism import SeededGeneratorWarning
    from invink_audit.models import load_model

    warnings.simplefilter("ignore", SeededGeneratorWarning)
    out = Path(args.output)
    cells = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    path = out / "anchors.jsonl"
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            a = json.loads(line)
            done[a["anchor_key"]] = a
    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    fields = {"category": "Restaurants", "stars": "5.0"}
    for c in cells:
        if not c["feasible"]:
            continue
        method, epsilon, rows, seed = c["method"], c["epsilon"], c["rows"], c["seed"]
        key = _anchor_key(method, epsilon, rows, seed)
        if key in done:
            continue
        mech = anchor_mechanism(method, epsilon, rows - 1, c["max_new_tokens"])
        t0 = time.perf_counter()
        result = generate([None], ReleaseConfig(mech, max_new_tokens=c["max_new_tokens"], delta=DELTA, allow_all_null=True),
                          model=loaded, prompt=PromptSpec("yelp", fields=fields), seed=1000 + seed)
        t = result.texts[0]
        a = {"anchor_key": key, "method": method, "epsilon": epsilon, "rows": rows, "seed": seed,
             "seconds": time.perf_counter() - t0, "mechanism": mech.describe(),
             "text": t.text, "num_tokens": t.num_tokens, "token_ids": list(t.token_ids),
             "finish_reason": t.finish_reason, "modes": list(t.modes)}
        done[key] = a
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(a) + "\n")
        print(f"anchor {key}: {t.num_tokens} tokens, {a['seconds']:.1f} s", flush=True)


def _anchor_key(method: str, epsilon: float, rows: int, seed: int) -> str:
    """Cells whose null-reference text is the same share one anchor (``anchor_mechanism``)."""
    if method in ("invisibleink-full", "adapmixed"):  # no dependence on C, B or (within T) on ε
        return f"{method}/seed{seed}"
    if method == "invisibleink-top100":  # the Top-k+ band 2C/B is a function of ε alone (C ∝ B)
        return f"{method}/eps{epsilon:g}/seed{seed}"
    return f"{method}/eps{epsilon:g}/rows{rows}/seed{seed}"  # Amin et al.: private tokens from clip_C(public)


SHORT_TOKENS = 8  # texts shorter than this are not scored for perplexity (scored from BOS, 1-7 tokens say nothing)
PREAMBLE = re.compile(r"^\s*(sure\b|hello\b|hi\b|certainly\b|of course\b)|i'd be happy|i'm here to help|here's an example|here is an example", re.I)
MODE_LABEL = {"amin-paper": "private tokens", "amin-correct": "private tokens", "adapmixed": "mixed-mode tokens"}


def _t_interval(values, low=None, high=None):
    """(mean, lower, upper) of a 95% t-interval over seeds, clipped to [low, high]; (mean, None, None) with one value."""
    from scipy import stats

    n = len(values)
    if n == 0:
        return None, None, None
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    lo, hi = mean - half, mean + half
    if low is not None:
        lo = max(lo, low)
    if high is not None:
        hi = min(hi, high)
    return mean, lo, hi


def _geometric_interval(values):
    """Geometric mean and the exp of a 95% t-interval on log values (positive bounds)."""
    mean, lo, hi = _t_interval([math.log(v) for v in values])
    if mean is None:
        return None, None, None
    return math.exp(mean), (None if lo is None else math.exp(lo)), (None if hi is None else math.exp(hi))


def amin_feasibility(epsilons=(1.0, 3.0, 5.0, 10.0), private_tokens=(8, 100), batches=(3, 7, 15, 31, 63, 127)):
    """Which B the Amin et al. planner (``plan_amin``) finds a clip norm for: computed, nothing generated.

    r = 8 is this comparison's (T/4 of T = 32); r = 100 (T_prv) is the paper's App. D.5 setting."""
    from invink_audit.mechanisms import AminInfeasibleError, plan_amin

    rows = []
    for eps in epsilons:
        for r in private_tokens:
            for mode in ("paper", "replace-by-null"):
                feasible = {}
                for b in batches:
                    try:
                        feasible[b] = plan_amin(epsilon=eps, delta=DELTA, max_private_tokens=r, batch_size=b, svt_noise=0.3, sensitivity=mode).clip_norm
                    except AminInfeasibleError:
                        feasible[b] = None
                rows.append({"epsilon": eps, "r": r, "sensitivity": mode, "clip_norm_by_batch": feasible})
    return rows


def _matches_anchor(t, anchor) -> bool:
    """The released text is what the same mechanism releases with every reference null (same streams):
    equal, or, for a text the stop rule cut short, a prefix of it."""
    if anchor is None:
        return False
    if t["finish_reason"] == "budget":
        return anchor["text"].startswith(t["text"])
    return anchor["text"] == t["text"]


def _overlap(seed: int, rows_a: int, rows_b: int) -> bool:
    """Do the reference batches of one seed at two batch sizes share references (batch s of each B)?"""
    a, b = rows_a - 1, rows_b - 1
    return max(seed * a, seed * b) < min((seed + 1) * a, (seed + 1) * b)


def summarise(args) -> dict:
    """Summary, table and plot from ``cells.jsonl`` (and ``anchors.jsonl`` if present): no generation;
    the model is loaded only to score perplexity."""
    from invink_audit.evaluation.perplexity import score_perplexity
    from invink_audit.models import load_model

    out = Path(args.output)
    cells = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    anchor_path = out / "anchors.jsonl"
    anchor_list = [json.loads(line) for line in anchor_path.read_text().splitlines()] if anchor_path.exists() else []
    anchor_by_key = {a["anchor_key"]: a for a in anchor_list}
    loaded = load_model(None)
    T = args.max_new_tokens
    texts = [t["text"] for c in cells for t in c["texts"]] + [a["text"] for a in anchor_list]
    scores = score_perplexity(texts, loaded).perplexities if texts else []
    k = 0
    for c in cells:
        for t in c["texts"]:
            t["perplexity"] = scores[k]
            k += 1
    for a in anchor_list:
        a["perplexity"] = scores[k]
        k += 1
    real = yelp_references(args.real_references + 63 * args.seeds)[-args.real_references:]
    real_ppl = [p for p in score_perplexity(real, loaded, max_tokens=T).perplexities if p is not None]
    real_mean = sum(real_ppl) / len(real_ppl)
    real_geo = math.exp(sum(math.log(p) for p in real_ppl) / len(real_ppl))
    for c in cells:
        anchor = anchor_by_key.get(_anchor_key(c["method"], c["epsilon"], c["rows"], c["seed"])) if c["feasible"] else None
        for t in c["texts"]:
            t["short"] = t["num_tokens"] < SHORT_TOKENS
            t["preamble"] = bool(PREAMBLE.search(t["text"][:80]))
            t["anchor"] = None if anchor is None else anchor["anchor_key"]
            t["same_as_anchor"] = None if anchor is None else _matches_anchor(t, anchor)
            t["anchor_shared_chars"] = None if anchor is None else len(os.path.commonprefix([t["text"], anchor["text"]]))
    groups: dict = {}
    for c in cells:
        groups.setdefault((c["method"], c["epsilon"], c["rows"]), []).append(c)
    summary = []
    for (method, epsilon, rows), cs in sorted(groups.items(), key=lambda kv: (kv[0][1], METHODS.index(kv[0][0]), kv[0][2])):
        cs = sorted(cs, key=lambda c: c["seed"])
        row = {"method": method, "label": LABELS[method], "epsilon": epsilon, "rows": rows, "seeds": len(cs),
               "feasible": all(c["feasible"] for c in cs)}
        if not row["feasible"]:
            row["reason"] = cs[0].get("reason", "")
            summary.append(row)
            continue
        ts = [t for c in cs for t in c["texts"]]
        scored = [t["perplexity"] for t in ts if not t["short"] and t["perplexity"] is not None]
        tokens = sum(t["num_tokens"] for t in ts)
        geo = _geometric_interval(scored)
        row.update({
            "length": _t_interval([sum(t["num_tokens"] for t in c["texts"]) / len(c["texts"]) for c in cs], 0.0, float(T)),
            "per_seed": [{"seed": c["seed"], "num_tokens": t["num_tokens"], "perplexity": t["perplexity"], "short": t["short"],
                          "finish_reason": t["finish_reason"], "same_as_anchor": t["same_as_anchor"], "preamble": t["preamble"],
                          "mode_tokens": sum(1 for m in t["modes"] if m == 1) if method in MODE_LABEL else None}
                         for c in cs for t in c["texts"]],
            "perplexity": geo,
            "scored_texts": len(scored),
            "short_texts": sum(1 for t in ts if t["short"]),
            "delta_ppl": None if geo[0] is None else abs(geo[0] - real_mean),
            "mode_tokens": _t_interval([sum(1 for m in t["modes"] if m == 1) for t in ts], 0.0, float(T)) if method in MODE_LABEL else (None, None, None),
            "texts_produced": f"{sum(1 for t in ts if t['num_tokens'] > 0)}/{len(ts)}",
            "same_as_anchor": sum(1 for t in ts if t["same_as_anchor"]),
            "anchored": sum(1 for t in ts if t["same_as_anchor"] is not None),
            "preambles": sum(1 for t in ts if t["preamble"]),
            "finish_reasons": _count([t["finish_reason"] for t in ts]),
            "seconds_per_token": sum(c["seconds"] for c in cs) / tokens if tokens else None,
            "example": next((t["text"][:160] for t in ts if t["num_tokens"] > 0), ""),
        })
        summary.append(row)
    result = {
        "real_reference_perplexity": real_mean,
        "real_reference_perplexity_geometric": real_geo,
        "real_references": len(real_ppl),
        "scorer": loaded.name,
        "max_new_tokens": T,
        "short_tokens": SHORT_TOKENS,
        "cells": summary,
        "anchors": [{k2: a[k2] for k2 in ("anchor_key", "method", "seed", "text", "num_tokens", "finish_reason", "perplexity")}
                    for a in anchor_list],
        "reference_dependence": reference_dependence(cells, anchor_by_key),
        "paired": paired(summary, real_mean),
        "amin_feasibility": amin_feasibility(),
    }
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "comparison.md").write_text(markdown(result))
    plot(result, out / "comparison.png")
    return result


def reference_dependence(cells, anchor_by_key) -> dict:
    """How much the texts depend on the references: same text across batch sizes, same as the null-reference anchor, preambles."""
    by_group: dict = {}
    for c in cells:
        if c["feasible"]:
            by_group.setdefault((c["method"], c["epsilon"], c["seed"]), {})[c["rows"]] = c["texts"][0]["text"]
    identical = []
    for (method, eps, seed), texts in sorted(by_group.items(), key=lambda kv: (METHODS.index(kv[0][0]), kv[0][1], kv[0][2])):
        rows = sorted(texts)
        pairs = [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:] if texts[a] == texts[b]]
        if pairs:
            identical.append({"method": method, "epsilon": eps, "seed": seed, "rows_pairs": pairs,
                              "disjoint_pairs": [p for p in pairs if not _overlap(seed, *p)]})
    per_method = {}
    for method in METHODS:
        ts = [t for c in cells if c["method"] == method and c["feasible"] for t in c["texts"]]
        anchored = [t for t in ts if t.get("same_as_anchor") is not None]
        per_method[method] = {
            "texts": len(ts),
            "anchored": len(anchored),
            "same_as_anchor": sum(1 for t in anchored if t["same_as_anchor"]),
            "median_shared_chars": statistics.median(t["anchor_shared_chars"] for t in anchored) if anchored else None,
            "sharing_half": sum(1 for t in anchored if t["anchor_shared_chars"] >= 0.5 * max(1, len(t["text"]))),
            "preambles": sum(1 for t in ts if t["preamble"]),
            "short": sum(1 for t in ts if t["short"]),
        }
    return {"identical_across_rows": identical,
            "groups_with_identical_texts": len(identical),
            "groups_with_identical_texts_on_disjoint_batches": sum(1 for g in identical if g["disjoint_pairs"]),
            "per_method": per_method}


def paired(summary, real_mean) -> list:
    """Seed-by-seed comparisons (the methods share batches and random streams per seed): for each ε, each
    InvisibleInk cell against each feasible Amin et al. cell, in how many seeds InvisibleInk's perplexity is
    closer to the real reviews' (|log PPL − log real|; texts under SHORT_TOKENS tokens not scored)."""
    out = []
    cells = {(r["method"], r["epsilon"], r["rows"]): r for r in summary if r["feasible"]}
    for (m_a, eps, rows_a), a in sorted(cells.items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        if not m_a.startswith("invisibleink"):
            continue
        for (m_b, eps_b, rows_b), b in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][2])):
            if eps_b != eps or not m_b.startswith("amin"):
                continue
            wins = ties = n = 0
            ratios = []
            for sa, sb in zip(a["per_seed"], b["per_seed"]):
                if sa["short"] or sb["short"] or sa["perplexity"] is None or sb["perplexity"] is None:
                    continue
                n += 1
                da, db = abs(math.log(sa["perplexity"] / real_mean)), abs(math.log(sb["perplexity"] / real_mean))
                wins += da < db
                ties += da == db
                ratios.append(sa["perplexity"] / sb["perplexity"])
            out.append({"epsilon": eps, "invisibleink": m_a, "invisibleink_rows": rows_a, "amin": m_b, "amin_rows": rows_b,
                        "seeds": n, "invisibleink_closer": wins, "ties": ties,
                        "ppl_ratio_geometric": math.exp(sum(math.log(x) for x in ratios) / len(ratios)) if ratios else None})
    return out


def _count(items):
    out: dict = {}
    for i in items:
        out[i] = out.get(i, 0) + 1
    return out


def _fmt(triple, digits=1):
    mean, lo, hi = triple
    if mean is None:
        return "–"
    return f"{mean:.{digits}f}" + (f" [{lo:.{digits}f}, {hi:.{digits}f}]" if lo is not None else "")


def _md(label: str) -> str:
    """A label inside a markdown table cell (``|V|`` would split the cell)."""
    return label.replace("|", "\\|")


def markdown(result) -> str:
    T = result["max_new_tokens"]
    lines = [
        f"Scorer {result['scorer']}; real 5-star restaurant reviews score PPL {result['real_reference_perplexity']:.1f} "
        f"(arithmetic mean; geometric {result['real_reference_perplexity_geometric']:.1f}; first {T} tokens, "
        f"{result['real_references']} reviews). T = {T}. One text per seed, 3 seeds.",
        "",
        f"* **tokens**: mean [95% t-interval over seeds, clipped to [0, {T}]];",
        f"* **PPL**: geometric mean [exp of a 95% t-interval on log-perplexity] over the texts of at least "
        f"{result['short_tokens']} tokens (perplexity is scored from BOS: a 1–7-token text's score says nothing about "
        "quality); `scored` says how many of the 3 texts that is; with one scored text no interval;",
        "* **same as null anchor**: texts equal to what the same mechanism releases, with the same seed and random "
        "streams, when every reference is null (a budget-stopped text: a prefix of it); see `anchors.jsonl`;",
        "* **private/mixed**: Amin et al.'s private tokens, AdaPMixED's mixed-mode tokens (not comparable);",
        "* infeasible cells are **computed** by the accountant (`plan_amin`), nothing was generated;",
        "* MAUVE: not computable at n = 3 texts per cell.",
        "",
        "| ε | method | B+1 | texts | tokens | PPL (scored) | ΔPPL | private/mixed | same as null anchor | preambles | finish reasons | s/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["cells"]:
        if not r["feasible"]:
            lines.append(f"| {r['epsilon']:g} | {_md(r['label'])} | {r['rows']} | 0/{r['seeds']} (infeasible, computed by plan_amin) | – | – | – | – | – | – | – | – |")
            continue
        spt = r["seconds_per_token"]
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["finish_reasons"].items()))
        lines.append(
            f"| {r['epsilon']:g} | {_md(r['label'])} | {r['rows']} | {r['texts_produced']} | {_fmt(r['length'])} | "
            f"{_fmt(r['perplexity'])} ({r['scored_texts']}) | {'–' if r['delta_ppl'] is None else format(r['delta_ppl'], '.1f')} | "
            f"{_fmt(r['mode_tokens'])} | {r['same_as_anchor']}/{r['anchored']} | {r['preambles']} | {reasons} | "
            f"{'–' if spt is None else format(spt, '.2f')} |"
        )
    lines += ["", "Per seed (tokens · PPL; `*` under 8 tokens, not scored; `=` same as the null anchor):", "",
              "| ε | method | B+1 | seed 0 | seed 1 | seed 2 |", "|---|---|---|---|---|---|"]
    for r in result["cells"]:
        if r["feasible"]:
            cells = [f"{s['num_tokens']} · {s['perplexity']:.0f}{'*' if s['short'] else ''}{' =' if s['same_as_anchor'] else ''}"
                     for s in r["per_seed"]]
            lines.append(f"| {r['epsilon']:g} | {_md(r['label'])} | {r['rows']} | " + " | ".join(cells) + " |")
    lines += ["", "Null-reference anchors (same mechanism, seed and streams, every reference null):", "",
              "| anchor | tokens | PPL | text |", "|---|---|---|---|"]
    for a in result["anchors"]:
        text = a["text"][:70].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {a['anchor_key']} | {a['num_tokens']} | {a['perplexity']:.0f} | {text} |")
    dep = result["reference_dependence"]
    lines += ["", f"Same text at two batch sizes (same method, ε, seed): {dep['groups_with_identical_texts']} groups, "
              f"{dep['groups_with_identical_texts_on_disjoint_batches']} of them on disjoint reference batches.", "",
              "| method | ε | seed | B+1 pairs with the same text | of which disjoint batches |", "|---|---|---|---|---|"]
    for g in dep["identical_across_rows"]:
        pairs = "; ".join(f"{a} & {b}" for a, b in g["rows_pairs"])
        disjoint = "; ".join(f"{a} & {b}" for a, b in g["disjoint_pairs"]) or "none"
        lines.append(f"| {LABELS[g['method']]} | {g['epsilon']:g} | {g['seed']} | {pairs} | {disjoint} |")
    lines += ["", "Per method: texts equal to their null-reference anchor; the median number of characters a text shares with its "
              "anchor before they diverge; texts that share at least half their characters with it; chat preambles "
              "(\"Sure\", \"Hello\", \"I'd be happy\", ... in the first 80 characters); texts under 8 tokens.", "",
              "| method | texts | same as null anchor | median shared characters | sharing ≥ half | chat preambles | under 8 tokens |",
              "|---|---|---|---|---|---|---|"]
    for m, d in dep["per_method"].items():
        lines.append(f"| {_md(LABELS[m])} | {d['texts']} | {d['same_as_anchor']}/{d['anchored']} | {d['median_shared_chars']:g} | "
                     f"{d['sharing_half']}/{d['anchored']} | {d['preambles']} | {d['short']} |")
    lines += ["", "Seed-paired: in how many seeds InvisibleInk's PPL is closer to the real reviews' than Amin et al.'s "
              "(both texts ≥ 8 tokens); geometric mean of the PPL ratio InvisibleInk/Amin.", "",
              "| ε | InvisibleInk | B+1 | Amin et al. | B+1 | closer | PPL ratio |", "|---|---|---|---|---|---|---|"]
    for p in result["paired"]:
        ratio = "–" if p["ppl_ratio_geometric"] is None else f"{p['ppl_ratio_geometric']:.2f}"
        lines.append(f"| {p['epsilon']:g} | {LABELS[p['invisibleink']]} | {p['invisibleink_rows']} | {LABELS[p['amin']]} | "
                     f"{p['amin_rows']} | {p['invisibleink_closer']}/{p['seeds']} | {ratio} |")
    lines += ["", "Amin et al.'s feasibility (computed by `plan_amin`, σ = 0.3, δ = 1e-6; r = private tokens; "
              "C = the planned clip norm, ✗ = infeasible):", ""]
    batches = list(result["amin_feasibility"][0]["clip_norm_by_batch"])
    lines += ["| ε | r | sensitivity | " + " | ".join(f"B={b}" for b in batches) + " |", "|---" * (3 + len(batches)) + "|"]
    for f in result["amin_feasibility"]:
        vals = [("✗" if c is None else f"{c:.3g}") for c in f["clip_norm_by_batch"].values()]
        lines.append(f"| {f['epsilon']:g} | {f['r']} | {f['sensitivity']} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def plot(result, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = result["max_new_tokens"]
    epsilons = sorted({r["epsilon"] for r in result["cells"]})
    fig, axes = plt.subplots(2, len(epsilons), figsize=(5.5 * len(epsilons), 7.5), squeeze=False)
    markers = dict(zip(METHODS, "osv^D"))
    public = [a["perplexity"] for a in result["anchors"] if a["method"] == "invisibleink-full" and a["perplexity"]]
    for col, eps in enumerate(epsilons):
        for row, (key, ylabel) in enumerate((("length", f"tokens generated (95% t, clipped to [0, {T}])"),
                                              ("perplexity", f"PPL, geometric mean (texts ≥ {result['short_tokens']} tokens;\nno whisker: under 3 such texts)"))):
            ax = axes[row][col]
            for method in METHODS:
                cells = [r for r in result["cells"] if r["method"] == method and r["epsilon"] == eps]
                ok = [r for r in cells if r["feasible"] and r[key][0] is not None]
                if ok:
                    x = [r["rows"] * (1 + 0.03 * (METHODS.index(method) - 2)) for r in ok]  # dodge overlapping bars
                    y = [r[key][0] for r in ok]
                    # whiskers: the interval in the table; none for a perplexity from fewer than 3 scored texts
                    # (with 2 the t-quantile is 12.7: uninformative), nothing clipped
                    full = [key == "length" or r["scored_texts"] == r["seeds"] for r in ok]
                    lo = [0.0 if r[key][1] is None or not f else y_ - r[key][1] for r, y_, f in zip(ok, y, full)]
                    hi = [0.0 if r[key][2] is None or not f else r[key][2] - y_ for r, y_, f in zip(ok, y, full)]
                    ax.errorbar(x, y, yerr=[lo, hi], marker=markers[method], capsize=3, label=LABELS[method])
                bad = [r["rows"] for r in cells if not r["feasible"]]
                if bad and row == 0:
                    ax.plot(bad, [-1.5 - METHODS.index(method) + 2] * len(bad), "x", ms=9,
                            color="tab:green" if method == "amin-paper" else "tab:red",
                            label=f"{LABELS[method]}: infeasible (computed)")
            if key == "perplexity":
                ax.axhline(result["real_reference_perplexity"], color="k", ls=":", lw=1, label="real reviews")
                if public:
                    ax.axhline(math.exp(sum(map(math.log, public)) / len(public)), color="grey", ls="--", lw=1,
                               label="public model alone (no references)")
                ax.set_yscale("log")
            ax.set_xscale("log", base=2)
            ax.set_xticks([4, 8, 16, 32, 64], ["4", "8", "16", "32", "64"])
            ax.set_xlabel("forward rows per token (B+1)")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(f"ε = {eps:g}, δ = 1e-6, T = {T}; 3 texts per point", fontsize=10)
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
    parser.add_argument("--summarise-only", action="store_true", help="no generation: summarise cells.jsonl (and anchors.jsonl)")
    parser.add_argument("--anchors", action="store_true", help="also generate the null-reference anchors (anchors.jsonl)")
    args = parser.parse_args()
    if not args.summarise_only:
        run(args)
    if args.anchors:
        anchors(args)
    result = summarise(args)
    print(markdown(result))


if __name__ == "__main__":
    main()
