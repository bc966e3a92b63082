"""InvisibleInk against AugPE, utility against wall-clock seconds per text (issue 24, item 4), sized for a 2-core CPU.

The paper's comparison (§5 "AugPE", Figure ``fig:augpe``, App. C ``sec:augpe-expt``) at this machine's scale, and
labelled as such: SmolLM2-135M-Instruct (embedded) on the CPU, n texts per cell instead of the paper's 1,000, T
tokens per text instead of its full lengths. At ε ∈ {3, 10} (δ = 1e-6), each cell is one (dataset, method, ε,
compute setting, seed):

* **InvisibleInk** at B + 1 ∈ {4, 8, 16} forward rows per token: ``generate(references, GenerationConfig(...))``,
  the clip norm planned for (ε, δ, B, T, τ) by ``br-adaptive``; n texts from n disjoint batches of B references
  (refs[0 : n·B], parallel composition);
* **AugPE** (Xie et al. 2024, arXiv:2403.01749, Alg. 1) at T_AugPE ∈ {1, 3, 5} iterations, L = 7 variations (the
  paper's App. C): ``augpe_generate(refs[0 : 7n], AugPEConfig(...))``, σ planned for (ε, δ, T_AugPE), with the
  **correct** ℓ2 sensitivity √2 under replace-by-null (paper Property ``prop:augpe-sens``). The paper's own
  experiments grant AugPE sensitivity 1 (a √2 advantage, App. ``sec:adj-augpe``), which is **not a valid
  guarantee**; it runs only with ``--augpe-paper-convention``, as the separate method ``augpe-paper``, labelled so
  in every table and plot;
* **reference points** per (dataset, seed), neither a release nor compared for compute: the *floor* (the public
  prompt alone, no reference: the ε → 0 end) and the *ceiling* (the private prompt with one reference, B = 1, no
  clipping, no privacy), ``invink_audit.evaluation.generate_reference_points`` at InvisibleInk's k, τ and T.

Seeds: seed s fixes every random stream of its cells (generation, style draws, noise, selection) and nothing
else; every seed uses the same references, so intervals over seeds measure the mechanisms' randomness. Seeded
generation is reproducible and therefore carries **no privacy**: every cell says so (``"guarantee": null`` with
``"guarantee_void_reason"``, as ``generate`` and ``augpe_generate`` mark a seeded release); this measures utility
and cost, it releases nothing. The planned a-priori figures (C, σ, the sensitivity) are kept under ``mechanism``.

Each cell records its wall-clock seconds (around the one ``generate`` / ``augpe_generate`` call, the model and the
embedder already loaded; AugPE's includes embedding the references and the candidates) and seconds per synthetic
text, the machine's load average before and after, the texts, and their utility from
``invink_audit.evaluation.evaluate`` against held-out real texts (as many as there are synthetic texts): MAUVE in
the paper's setting (n/20 buckets, c = 0.9) and the library's (c = 5) with the project's embedder, perplexity
under SmolLM2 and ΔPPL, lengths. TSTR is not computed: every text here is prompted with one label (5-star
restaurant reviews; patient messages), so there is nothing to classify. The planning signal
(``invink_audit.evaluation.profile.run_profile``, InvisibleInk only: teacher-forced held-out text at each (ε, B))
runs once per dataset (``profile_<dataset>.json``), exact and sampling-free, so without seeds.

Data, read in place: **yelp** — references: the 5-star restaurant reviews of ../shared/data/yelp/dev.csv in file
order; held-out: those of test.csv. **medical** — the 24 fictional messages from patients to their doctor's
practice that the project ships (``invink_audit/resources/demo_references.jsonl``): the first 16 are references,
the last 8 held out. 16 references allow at most 16 // B InvisibleInk texts (5, 2, 1) and 16 // 7 = 2 AugPE
texts per cell: the medical cells check the pipeline; their MAUVE is not interpretable (a cell with one text has
no MAUVE at all). There is no MIMIC data here.

    python examples/compare_augpe.py --output audits/reports/augpe_comparison          # the full grid: hours
    python examples/compare_augpe.py --output /tmp/augpe_smoke --smoke                 # ~2 min: 1 seed, n = 4, 16 tokens, B + 1 = 4, T_AugPE = 1
    python examples/compare_augpe.py --output audits/reports/augpe_comparison --summarise-only

Cells are appended to ``cells.jsonl`` as each finishes (owner-only, each line marked NOT PRIVATE); a rerun skips
the cells already there and runs the rest. ``summary.json``, ``comparison.md`` (mean ± t·se over seeds, 95%) and
``comparison.png`` (utility against seconds per text) are then written from ``cells.jsonl`` alone: ``--summarise-only``
loads no model. Everything written is derived from the references and the held-out texts without privacy
protection: owner-only, marked NOT PRIVATE, never beside a release.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import subprocess
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DELTA = 1e-6
VARIATIONS = 7  # AugPE's L, fixed by the paper (App. C, sec:augpe-expt)
METHODS = ("invisibleink", "augpe", "augpe-paper")
REFERENCE_POINTS = ("floor", "ceiling")
LABELS = {
    "invisibleink": "InvisibleInk",
    "augpe": "AugPE (correct Δ = √2)",
    "augpe-paper": "AugPE (paper's Δ = 1: NOT a valid guarantee)",
    "floor": "floor (public prompt, no reference)",
    "ceiling": "ceiling (one reference, no privacy)",
}
#: the compute knob of each method: its name in the table and the cell field that holds it
KNOB = {"invisibleink": ("B+1", "rows"), "augpe": ("T_AugPE", "iterations"), "augpe-paper": ("T_AugPE", "iterations")}
DATASETS = ("yelp", "medical")
CATEGORY, STARS = "Business Category: Restaurants", "Review Stars: 5.0"
YELP_FIELDS = {"category": "Restaurants", "stars": "5.0"}
MEDICAL_FILE = ROOT / "invink_audit" / "resources" / "demo_references.jsonl"
MEDICAL_REFERENCES = 16  # the first 16 of the 24 shipped messages; the other 8 are held out
MEDICAL_DESCRIPTION = "messages from patients to their doctor's practice"  # as examples/measure_templates.py
SEED_OFFSET = 1000  # seed s draws with 1000 + s, as examples/compare_baselines.py
CONFIDENCE = 0.95
SEEDED_REFERENCE_POINT = ("a reference point for evaluation, not a release: the floor reads no reference, the ceiling "
                          "samples from one reference with no privacy protection; seeded")  # fmt: skip
NOTICE = ("NOT PRIVATE: texts generated from references with fixed seeds (no privacy) and evaluated against held-out "
          "real texts; a utility measurement, not a release. Do not publish.")  # fmt: skip


# --------------------------------------------------------------------------------------------
# the grid and resuming


@dataclasses.dataclass(frozen=True)
class CellSpec:
    """One cell to run: ``setting`` is B + 1 for InvisibleInk, T_AugPE for AugPE, ``None`` for a reference point
    (whose ``epsilon`` is ``None`` too: it spends nothing)."""

    dataset: str
    method: str
    epsilon: float | None
    setting: int | None
    seed: int
    max_new_tokens: int
    num_texts: int  # requested; a dataset with too few references gives fewer

    @property
    def key(self) -> tuple:
        return (self.dataset, self.method, self.epsilon, self.setting, self.seed, self.max_new_tokens, self.num_texts)


def cell_key(record: dict) -> tuple:
    """The :attr:`CellSpec.key` of a finished cell's record (what a rerun skips)."""
    return (record["dataset"], record["method"], record["epsilon"], record["setting"], record["seed"],
            record["max_new_tokens"], record["num_texts_requested"])  # fmt: skip


def grid(*, datasets, methods, epsilons, rows, iterations, seeds: int, max_new_tokens: int, num_texts: int,
         reference_points: bool = True) -> list[CellSpec]:  # fmt: skip
    """Every cell, seed-major (a run stopped early has whole seeds), then dataset, ε, method, setting; the
    reference points first in each (dataset, seed)."""
    out = []
    for seed in range(seeds):
        for dataset in datasets:
            if reference_points:
                out += [CellSpec(dataset, m, None, None, seed, max_new_tokens, num_texts) for m in REFERENCE_POINTS]
            for epsilon in epsilons:
                for method in methods:
                    settings = rows if method == "invisibleink" else iterations
                    out += [CellSpec(dataset, method, float(epsilon), int(s), seed, max_new_tokens, num_texts) for s in settings]
    return out


def pending(specs, done_keys) -> list[CellSpec]:
    """The cells of ``specs`` whose key is not among the finished ones, in order."""
    done = set(done_keys)
    return [s for s in specs if s.key not in done]


def read_cells(path: Path) -> list[dict]:
    """The finished cells of ``cells.jsonl`` (none when it does not exist); blank lines skipped."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def append_cell(path: Path, record: dict) -> None:
    """Append one finished cell as a JSON line: owner-only, never through a link, marked NOT PRIVATE."""
    from invink_audit.not_private import mark_not_private, open_no_follow

    fd = open_no_follow(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    with os.fdopen(fd, "a", encoding="utf-8") as f:
        f.write(json.dumps(mark_not_private(record, NOTICE), ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------------------
# data


@dataclasses.dataclass(frozen=True)
class Dataset:
    """References (private in a real release), held-out real texts, and each method's public prompts."""

    name: str
    references: tuple[str, ...]
    heldout: tuple[str, ...]
    prompt: object  # PromptSpec for InvisibleInk and the reference points
    augpe_prompts: object  # AugPEPrompts


def _yelp_reviews(split: str) -> list[str]:
    from invink_audit.audit.spec import yelp_dir

    with open(yelp_dir() / f"{split}.csv", newline="", encoding="utf-8") as f:
        return [r["text"] for r in csv.DictReader(f) if r["label1"] == CATEGORY and r["label2"] == STARS]


def medical_augpe_prompts():
    """AugPE's prompts for patient messages, in the style of the paper's MIMIC prompts (Table
    ``tab:augpe_prompts``) with the medical rephrase styles of the ``mimic`` preset: a public choice of this
    comparison (the paper has no such dataset)."""
    from invink_audit.augpe import AUGPE_PRESETS, AugPEPrompts

    return AugPEPrompts(
        name="patient-messages",
        system=("Please act as a sentence generator for the medical domain. Generated sentences should mimic the style "
                "of messages that patients send to their doctor's practice, using a variety of sentence structures."),
        generation="Using a variety of sentence structures, write a message that a patient sends to their doctor's practice.",
        variation=('Please rephrase the following message "{text}" as a message a patient sends to their doctor\'s '
                   'practice: "{style}"'),
        styles=AUGPE_PRESETS["mimic"].styles,
    )  # fmt: skip


def load_dataset(name: str) -> Dataset:
    from invink_audit.augpe import get_augpe_prompts
    from invink_audit.data import read_references
    from invink_audit.generation import PromptSpec

    if name == "yelp":
        return Dataset("yelp", tuple(_yelp_reviews("dev")), tuple(_yelp_reviews("test")),
                       PromptSpec("yelp", fields=YELP_FIELDS), get_augpe_prompts("yelp", **YELP_FIELDS))  # fmt: skip
    if name == "medical":
        messages = read_references(MEDICAL_FILE)
        return Dataset("medical", tuple(messages[:MEDICAL_REFERENCES]), tuple(messages[MEDICAL_REFERENCES:]),
                       PromptSpec("generic", fields={"description": MEDICAL_DESCRIPTION}), medical_augpe_prompts())  # fmt: skip
    raise ValueError(f"dataset must be one of {list(DATASETS)}; got {name!r}")


def texts_for(method: str, setting: int | None, requested: int, num_references: int) -> tuple[int, int]:
    """(texts, references used) of a cell: InvisibleInk n disjoint batches of B = setting − 1 (n·B references),
    AugPE 7n references (the paper's App. C), a reference point n batches of B = 3 (the floor reads none of
    them, the ceiling the first of each); n is the request, or fewer when the dataset is too small."""
    per_text = {"invisibleink": (setting or 0) - 1, "augpe": VARIATIONS, "augpe-paper": VARIATIONS}.get(method, 3)
    n = min(requested, num_references // per_text)
    return n, n * per_text


# --------------------------------------------------------------------------------------------
# running a cell


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor())


def _machine(threads: int) -> dict:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "torch_threads": threads, "commit": commit}


def _utility(texts, heldout, loaded, embedder, args):
    """``evaluate``'s JSON (without its NOT PRIVATE marker: the cell carries one), or ``None`` and why."""
    from invink_audit.evaluation import EvaluationConfig, evaluate
    from invink_audit.not_private import unmark

    if len(texts) < 2:
        return None, f"{len(texts)} text(s): MAUVE and the other metrics need at least 2"
    config = EvaluationConfig(embedding_model=args.embedder, embedding_cache=False, seed=0,
                              mauve_seeds=args.mauve_seeds, mauve_bootstrap=args.mauve_bootstrap)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-sample warnings: kept in the result's own "warnings"
        result = evaluate(list(texts), list(heldout), config, scorer_model=loaded, embedder=embedder)
    return unmark(result.to_json()), None


def _run_invisibleink(spec: CellSpec, data: Dataset, loaded, n: int, used: int, args) -> dict:
    from invink_audit.generation import GenerationConfig, generate

    config = GenerationConfig(batch_size=spec.setting - 1, max_new_tokens=spec.max_new_tokens, delta=DELTA,
                              epsilon=spec.epsilon, temperature=args.temperature, top_k=args.top_k, num_texts=n)  # fmt: skip
    t0 = time.perf_counter()
    result = generate(list(data.references[:used]), config, model=loaded, prompt=data.prompt, seed=SEED_OFFSET + spec.seed)
    seconds = time.perf_counter() - t0
    mechanism = config.mechanism.config
    return {
        "seconds": seconds,
        **result.guarantee.record_fields(),  # seeded: "guarantee": null and why
        "mechanism": {"batch_size": config.batch_size, "clip_norm": mechanism.clip_norm, "temperature": mechanism.temperature,
                      "top_k": mechanism.top_k, "accountant": config.mechanism.accountant.value, "planned_epsilon": spec.epsilon},
        "tokens_generated": result.tokens_generated,
        "texts": [{"text": t.text, "num_tokens": t.num_tokens, "finish_reason": t.finish_reason} for t in result.texts],
    }  # fmt: skip


def _run_augpe(spec: CellSpec, data: Dataset, loaded, embedder, n: int, used: int, args) -> dict:
    from accounting import AugPESensitivity
    from invink_audit.augpe import AugPEConfig, augpe_generate

    sensitivity = AugPESensitivity.PAPER if spec.method == "augpe-paper" else AugPESensitivity.REPLACE_BY_NULL
    config = AugPEConfig(num_texts=n, iterations=spec.setting, delta=DELTA, epsilon=spec.epsilon, variations=VARIATIONS,
                         max_new_tokens=spec.max_new_tokens, sensitivity=sensitivity, prompts=data.augpe_prompts,
                         batch_size=args.augpe_batch)  # fmt: skip
    t0 = time.perf_counter()
    result = augpe_generate(list(data.references[:used]), config, model=loaded, embedder=embedder, seed=SEED_OFFSET + spec.seed)
    seconds = time.perf_counter() - t0
    settings = config.to_json()
    return {
        "seconds": seconds,
        **result.guarantee.record_fields(),  # seeded (and, for the paper's convention, invalid): null and why
        "mechanism": {k: settings[k] for k in ("iterations", "variations", "noise_std", "sensitivity", "l2_sensitivity",
                                               "epsilon", "accountant", "selection", "threshold", "sampling")},
        "accounting_valid": config.event.valid,
        "generations": result.stats.generations,
        "texts": [{"text": t} for t in result.texts],
    }  # fmt: skip


def _run_reference_points(spec: CellSpec, data: Dataset, loaded, n: int, used: int, args) -> dict[str, dict]:
    """Both reference points at once (one call generates both); the call's seconds are split evenly."""
    from invink_audit.evaluation import generate_reference_points

    refs = list(data.references[:used])
    batches = [refs[3 * i : 3 * i + 3] for i in range(n)]
    prompt = data.prompt
    t0 = time.perf_counter()
    points = generate_reference_points(batches, max_new_tokens=spec.max_new_tokens, temperature=args.temperature,
                                       top_k=args.top_k, model=loaded, prompt=prompt.template,
                                       prompt_fields=prompt.fields, seed=SEED_OFFSET + spec.seed)  # fmt: skip
    seconds = (time.perf_counter() - t0) / 2
    return {kind: {"seconds": seconds, "guarantee": None, "guarantee_void_reason": SEEDED_REFERENCE_POINT,
                   "mechanism": {"temperature": args.temperature, "top_k": args.top_k},
                   "texts": [{"text": t, "num_tokens": k, "finish_reason": r}
                             for t, k, r in zip(p.texts, p.num_tokens, p.finish_reasons)]}
            for kind, p in points.items()}  # fmt: skip


def run_cell(spec: CellSpec, data: Dataset, loaded, embedder, args, machine: dict) -> list[dict]:
    """The finished record(s) of one cell (two for a reference point: floor and ceiling)."""
    n, used = texts_for(spec.method, spec.setting, spec.num_texts, len(data.references))
    if n < 1:
        raise ValueError(f"{spec.dataset} has {len(data.references)} references: too few for one {spec.method} text")
    load_before = os.getloadavg()[0]
    if spec.method == "invisibleink":
        outputs = {spec.method: _run_invisibleink(spec, data, loaded, n, used, args)}
    elif spec.method in ("augpe", "augpe-paper"):
        outputs = {spec.method: _run_augpe(spec, data, loaded, embedder, n, used, args)}
    else:
        outputs = _run_reference_points(spec, data, loaded, n, used, args)
    load_after = os.getloadavg()[0]
    records = []
    for method, out in outputs.items():
        texts = [t["text"] for t in out["texts"]]
        utility, why = _utility(texts, data.heldout, loaded, embedder, args)
        records.append({
            **dataclasses.asdict(dataclasses.replace(spec, method=method)), "num_texts_requested": spec.num_texts,
            "num_texts": len(texts), "num_references_used": used, "delta": DELTA,
            "seconds_per_text": out["seconds"] / max(1, len(texts)), "loadavg_1min": [load_before, load_after],
            "smoke": args.smoke, "model": loaded.name, "embedder": args.embedder, **machine, **out,
            "utility": utility, "utility_void_reason": why,
        })  # fmt: skip
    return records


def run_profile_signal(dataset: str, data: Dataset, loaded, args, out: Path) -> None:
    """The planning signal for InvisibleInk's (ε, B) cells of ``dataset`` (``profile_<dataset>.json``; skipped
    when it exists): held-out texts teacher-forced through each point, gain over the public-only floor."""
    from invink_audit.evaluation.profile import ProfileConfig, run_profile
    from invink_audit.not_private import write_not_private_json, write_not_private_text

    path = out / f"profile_{dataset}.json"
    if path.exists() or args.profile_texts == 0:
        return
    batch_sizes = tuple(r - 1 for r in args.rows_list)
    common = dict(epsilons=tuple(args.epsilons_list), batch_sizes=batch_sizes, top_ks=(args.top_k,),
                  temperatures=(args.temperature,), max_new_tokens=args.max_new_tokens, delta=DELTA,
                  num_texts=min(args.profile_texts, len(data.heldout)))  # fmt: skip
    if dataset == "yelp":
        from invink_audit.audit.spec import yelp_dir

        config = ProfileConfig(**common, prompt="yelp", label_columns=("label1", "label2"),
                               where={"label1": CATEGORY, "label2": STARS})  # fmt: skip
        proxy, real = yelp_dir() / "dev.csv", yelp_dir() / "test.csv"
    else:
        config = ProfileConfig(**common, prompt="generic", prompt_fields={"description": MEDICAL_DESCRIPTION})
        split = out / "medical_split"
        split.mkdir(exist_ok=True, mode=0o700)
        proxy, real = split / "references.jsonl", split / "heldout.jsonl"
        for p, texts in ((proxy, data.references), (real, data.heldout)):
            write_not_private_text(p, "".join(json.dumps({"text": t}) + "\n" for t in texts))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # small-sample warnings: kept in the result
        result = run_profile(proxy, real, config, model=loaded)
    write_not_private_json(path, {"dataset": dataset, **result.to_json()})
    print(f"profile {dataset}: {result.num_texts} texts, {result.seconds:.1f} s", flush=True)


def run(args) -> None:
    import torch

    from invink_audit.evaluation import Embedder
    from invink_audit.mechanism import SeededGeneratorWarning
    from invink_audit.models import load_model

    warnings.simplefilter("ignore", SeededGeneratorWarning)  # every cell records that it carries no privacy
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    cells_path = out / "cells.jsonl"
    done = {cell_key(c) for c in read_cells(cells_path)}
    specs = grid(datasets=args.datasets_list, methods=args.methods_list, epsilons=args.epsilons_list,
                 rows=args.rows_list, iterations=args.iterations_list, seeds=args.seeds,
                 max_new_tokens=args.max_new_tokens, num_texts=args.num_texts)  # fmt: skip
    todo = pending(specs, done)
    print(f"{len(specs)} cells, {len(specs) - len(todo)} already in {cells_path}", flush=True)
    torch.set_num_threads(args.threads)
    loaded = load_model(None)
    embedder = Embedder(args.embedder, cache=False)  # nothing derived from the references kept on disk
    embedder.embed(["A warm-up sentence, so that no cell pays for loading the embedder."])
    machine = _machine(args.threads)
    data = {name: load_dataset(name) for name in args.datasets_list}
    for name in args.datasets_list:
        if "invisibleink" in args.methods_list:
            run_profile_signal(name, data[name], loaded, args, out)
    for spec in todo:
        if spec.key in done:  # the other reference point of a pair already run
            continue
        for record in run_cell(spec, data[spec.dataset], loaded, embedder, args, machine):
            if cell_key(record) in done:  # a reference point whose pair was interrupted between its two records
                continue
            append_cell(cells_path, record)
            done.add(cell_key(record))
            u = record["utility"]
            mauve = "–" if u is None else f"{u['mauve']['estimate']:.3f}"
            print(f"{record['dataset']:7s} {record['method']:12s} eps={record['epsilon'] or '-'!s:4s} "
                  f"setting={record['setting'] or '-'!s:3s} seed={record['seed']} n={record['num_texts']} "
                  f"{record['seconds']:.1f} s ({record['seconds_per_text']:.2f} s/text) MAUVE {mauve}", flush=True)  # fmt: skip


# --------------------------------------------------------------------------------------------
# summary: no model


def t_interval(values, low=None, high=None) -> dict:
    """Mean ± t_{0.975, n−1} · s/√n over seeds (95%), the ends clipped to [low, high]; with one value no interval."""
    from scipy import stats

    values = [float(v) for v in values if v is not None]
    n = len(values)
    if n == 0:
        return {"mean": None, "half_width": None, "lower": None, "upper": None, "n": 0}
    mean = sum(values) / n
    if n < 2:
        return {"mean": mean, "half_width": None, "lower": None, "upper": None, "n": 1}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * sd / math.sqrt(n)
    lower, upper = mean - half, mean + half
    if low is not None:
        lower = max(lower, low)
    if high is not None:
        upper = min(upper, high)
    return {"mean": mean, "half_width": half, "lower": lower, "upper": upper, "n": n}


def _metric(cell: dict, name: str):
    u = cell.get("utility")
    if u is None or u.get(name) is None:
        return None
    return u[name]["estimate"]


def _order(row: dict) -> tuple:
    methods = METHODS + REFERENCE_POINTS
    return (DATASETS.index(row["dataset"]) if row["dataset"] in DATASETS else len(DATASETS), row["dataset"],
            -1 if row["epsilon"] is None else row["epsilon"], methods.index(row["method"]), row["setting"] or 0)  # fmt: skip


def summarise_cells(cells, profiles=None) -> dict:
    """Group the cells by everything but the seed and give each group its intervals over seeds (pure: no model).
    ``profiles``: ``{dataset: profile JSON}``, whose points are attached to InvisibleInk's groups."""
    groups: dict = {}
    for c in cells:
        key = (c["dataset"], c["method"], c["epsilon"], c["setting"], c["max_new_tokens"], c["num_texts_requested"])
        groups.setdefault(key, {})[c["seed"]] = c  # a seed run twice: the last record counts
    rows = []
    for (dataset, method, epsilon, setting, max_new_tokens, requested), by_seed in groups.items():
        cs = [by_seed[s] for s in sorted(by_seed)]
        row = {
            "dataset": dataset, "method": method, "label": LABELS.get(method, method), "epsilon": epsilon,
            "setting": setting, "knob": KNOB.get(method, ("", ""))[0], "max_new_tokens": max_new_tokens,
            "num_texts_requested": requested, "seeds": [c["seed"] for c in cs],
            "texts_per_seed": sorted({c["num_texts"] for c in cs}),
            "seconds_per_text": t_interval([c["seconds_per_text"] for c in cs], low=0.0),
            "mauve": t_interval([_metric(c, "mauve") for c in cs], 0.0, 1.0),
            "mauve_c5": t_interval([_metric(c, "mauve_c5") for c in cs], 0.0, 1.0),
            "delta_ppl": t_interval([_metric(c, "delta_ppl") for c in cs], low=0.0),
            "perplexity": t_interval([_metric(c, "perplexity_synthetic") for c in cs], low=0.0),
            "length_tokens": t_interval([_metric(c, "length_synthetic_tokens") for c in cs], low=0.0),
            "seeds_evaluated": sum(1 for c in cs if c.get("utility") is not None),
            "utility_void_reasons": sorted({c["utility_void_reason"] for c in cs if c.get("utility_void_reason")}),
            "guarantees_void": sum(1 for c in cs if c.get("guarantee") is None),
            "accounting_valid": method != "augpe-paper",
            "loadavg_1min_max": max((max(c.get("loadavg_1min") or [0.0]) for c in cs), default=None),
            "smoke": any(c.get("smoke") for c in cs),
            "mechanism": cs[0].get("mechanism"),
        }  # fmt: skip
        profile = (profiles or {}).get(dataset)
        if method == "invisibleink" and profile:
            row["planning_signal"] = next(
                ({"gain_over_floor": p["gain_over_floor"], "gain_over_null": p["gain_over_null"], "clip_norm": p["clip_norm"]}
                 for p in profile["points"] if p["epsilon"] == epsilon and p["batch_size"] == setting - 1), None)  # fmt: skip
        rows.append(row)
    rows.sort(key=_order)
    first = cells[0] if cells else {}
    return {
        "notice": NOTICE,
        "smoke": any(c.get("smoke") for c in cells),
        "cells": len(cells),
        "machine": {k: sorted({str(c.get(k)) for c in cells}) for k in ("cpu", "cores", "torch_threads", "commit", "model", "embedder")},
        "delta": first.get("delta", DELTA),
        "confidence": CONFIDENCE,
        "groups": rows,
        "profiles": {d: {"num_texts": p["num_texts"], "seconds": p["seconds"], "max_new_tokens": p["max_new_tokens"]}
                     for d, p in (profiles or {}).items()},
    }  # fmt: skip


def _pm(iv: dict, digits: int = 2) -> str:
    """``mean ± half`` (t·se over seeds); ``mean (1 seed)`` with one; ``–`` with none."""
    if iv["mean"] is None:
        return "–"
    if iv["half_width"] is None:
        return f"{iv['mean']:.{digits}f} (1 seed)"
    return f"{iv['mean']:.{digits}f} ± {iv['half_width']:.{digits}f}"


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def markdown(summary: dict) -> str:
    """The results table (``comparison.md`` without its NOT PRIVATE banner, which the writer adds)."""
    from invink_audit.not_private import md_table

    m = summary["machine"]
    lines = []
    if summary["smoke"]:
        lines += ["**SMOKE RUN: a check that the pipeline runs, not a result.** Tiny n, one seed.", ""]
    lines += [
        f"Machine: {', '.join(m['cpu'])} ({', '.join(m['cores'])} cores, torch threads {', '.join(m['torch_threads'])}); "
        f"commit {', '.join(m['commit'])}; model {', '.join(m['model'])}; embedder {', '.join(m['embedder'])}. "
        f"δ = {summary['delta']:g}; {summary['cells']} cells. Sized for this CPU: not the paper's scale.",
        "",
        f"Each entry: mean ± t·se over seeds ({summary['confidence']:.0%} t-interval half-width; `(1 seed)`: no "
        "interval). **s/text**: wall-clock seconds per synthetic text (model and embedder loaded; AugPE's includes its "
        "embeddings), on a shared machine: see the load average. **MAUVE** against as many held-out real texts, "
        "paper setting (n/20 buckets, c = 0.9) and c = 5. **ΔPPL**: |PPL(synthetic) − PPL(real)|, geometric means, under "
        "the scorer. **signal**: InvisibleInk's planning signal, gain over the public-only floor in nats per token "
        "[bootstrap 95%] (`profile`, one pass, no seeds). Every cell is seeded: no privacy guarantee (`guarantee: "
        "null`); AugPE (paper's Δ = 1) would not be private even unseeded.",
    ]  # fmt: skip
    header = ["ε", "method", "knob", "texts/seed", "seeds", "s/text", "MAUVE", "MAUVE c=5", "ΔPPL", "tokens",
              "signal", "load ≤"]  # fmt: skip
    for dataset in dict.fromkeys(r["dataset"] for r in summary["groups"]):
        rows = [r for r in summary["groups"] if r["dataset"] == dataset]
        lines += ["", f"## {dataset}", ""]
        table = []
        for r in rows:
            signal = r.get("planning_signal")
            g = signal["gain_over_floor"] if signal else None
            table.append([
                "–" if r["epsilon"] is None else f"{r['epsilon']:g}", _md(r["label"]),
                "–" if r["setting"] is None else f"{r['knob']} = {r['setting']}",
                "/".join(map(str, r["texts_per_seed"])), len(r["seeds"]), _pm(r["seconds_per_text"], 1),
                _pm(r["mauve"], 3), _pm(r["mauve_c5"], 3), _pm(r["delta_ppl"], 1), _pm(r["length_tokens"], 0),
                "–" if g is None else f"{g['estimate']:.3f} [{g['lower']:.3f}, {g['upper']:.3f}]",
                "–" if r["loadavg_1min_max"] is None else f"{r['loadavg_1min_max']:.1f}",
            ])  # fmt: skip
        lines += md_table(header, table)
        void = sorted({v for r in rows for v in r["utility_void_reasons"]})
        if void:
            lines += ["", "No utility for some seeds: " + "; ".join(void) + "."]
    if summary["profiles"]:
        lines += ["", "Planning signal runs: " + "; ".join(f"{d}: {p['num_texts']} held-out texts, {p['seconds']:.0f} s"
                                                         for d, p in summary["profiles"].items()) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Utility against seconds per text: one row of panels per (dataset, MAUVE setting), one column per ε; whiskers
    ± t·se over seeds; the reference points as horizontal lines. At n of a few dozen texts the paper's setting
    (n/20 buckets) has two or three buckets and sits near 1: read the c = 5 row too."""
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    from invink_audit.not_private import agg_pyplot, save_not_private_figure

    plt = agg_pyplot()
    groups = summary["groups"]
    datasets = list(dict.fromkeys(r["dataset"] for r in groups))
    epsilons = sorted({r["epsilon"] for r in groups if r["epsilon"] is not None})
    if not datasets or not epsilons:
        return
    metrics = (("mauve", "MAUVE (n/20 buckets, c = 0.9)"), ("mauve_c5", "MAUVE (n/10 buckets, c = 5)"))
    panels = [(d, m) for d in datasets for m in metrics]
    fig, axes = plt.subplots(len(panels), len(epsilons), figsize=(5.5 * len(epsilons), 3.8 * len(panels)), squeeze=False)
    style = {"invisibleink": ("o-", "tab:blue"), "augpe": ("s-", "tab:orange"), "augpe-paper": ("s--", "tab:red")}
    smoke = "SMOKE RUN, " if summary["smoke"] else ""
    for i, (dataset, (metric, ylabel)) in enumerate(panels):
        for j, eps in enumerate(epsilons):
            ax = axes[i][j]
            for method, (fmt, color) in style.items():
                pts = [r for r in groups if r["dataset"] == dataset and r["method"] == method and r["epsilon"] == eps
                       and r[metric]["mean"] is not None and r["seconds_per_text"]["mean"]]  # fmt: skip
                if not pts:
                    continue
                x = [r["seconds_per_text"]["mean"] for r in pts]
                y = [r[metric]["mean"] for r in pts]
                xerr = [r["seconds_per_text"]["half_width"] or 0.0 for r in pts]
                yerr = [r[metric]["half_width"] or 0.0 for r in pts]
                ax.errorbar(x, y, xerr=xerr, yerr=yerr, fmt=fmt, color=color, capsize=3, label=LABELS[method])
                for r, xi, yi in zip(pts, x, y):
                    ax.annotate(f"{r['knob']}={r['setting']}", (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
            for kind, ls in (("floor", ":"), ("ceiling", "-.")):
                ref = [r for r in groups if r["dataset"] == dataset and r["method"] == kind and r[metric]["mean"] is not None]
                if ref:
                    ax.axhline(ref[0][metric]["mean"], color="grey", ls=ls, lw=1, label=LABELS[kind])
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_ylim(0.0, 1.02)
            ax.margins(x=0.2)
            ax.set_xlabel("wall-clock seconds per synthetic text (this CPU)")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.set_title(f"{smoke}{dataset}, ε = {eps:g}, δ = {summary['delta']:g}", fontsize=10)
            ax.legend(fontsize=6, loc="best")
    fig.tight_layout()
    save_not_private_figure(fig, path, dpi=100)
    plt.close(fig)


def summarise(out: Path) -> dict:
    """``summary.json``, ``comparison.md`` and ``comparison.png`` from ``cells.jsonl`` and the profiles: no model."""
    from invink_audit.not_private import unmark, write_not_private_json, write_not_private_text

    cells = [unmark(c) for c in read_cells(out / "cells.jsonl")]
    profiles = {d: unmark(json.loads((out / f"profile_{d}.json").read_text(encoding="utf-8")))
                for d in DATASETS if (out / f"profile_{d}.json").exists()}  # fmt: skip
    summary = summarise_cells(cells, profiles)
    write_not_private_json(out / "summary.json", summary)
    write_not_private_text(out / "comparison.md", markdown(summary), markdown=True)
    plot(summary, out / "comparison.png")
    return summary


# --------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="audits/reports/augpe_comparison")
    parser.add_argument("--datasets", default=",".join(DATASETS))
    parser.add_argument("--methods", default="invisibleink,augpe", help="of " + ",".join(METHODS))
    parser.add_argument("--augpe-paper-convention", action="store_true",
                        help="also run AugPE with the paper's sensitivity 1 under replace-by-null (a √2 advantage; "
                             "NOT a valid guarantee), labelled so")  # fmt: skip
    parser.add_argument("--epsilons", default="3,10")
    parser.add_argument("--rows", default="4,8,16", help="InvisibleInk's B + 1 values")
    parser.add_argument("--iterations", default="1,3,5", help="AugPE's T_AugPE values")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--num-texts", type=int, default=16, help="synthetic texts per cell (fewer where the data is short)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=100, help="InvisibleInk's k (and the reference points')")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--augpe-batch", type=int, default=16, help="AugPE's texts per model.generate call")
    parser.add_argument("--embedder", default="mpnet", choices=("mpnet", "minilm"),
                        help="for AugPE's histogram and for MAUVE (one instance, no disk cache)")  # fmt: skip
    parser.add_argument("--mauve-seeds", type=int, default=5)
    parser.add_argument("--mauve-bootstrap", type=int, default=20)
    parser.add_argument("--profile-texts", type=int, default=16, help="held-out texts for the planning signal (0: skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny grid (1 seed, 4 texts, 16 tokens, B + 1 = 4, T_AugPE = 1, MiniLM, 3 profile texts): "
                             "checks the pipeline in about 2 minutes; its cells are marked smoke")  # fmt: skip
    parser.add_argument("--summarise-only", action="store_true", help="no generation: summarise cells.jsonl")
    args = parser.parse_args(argv)
    if args.smoke:
        args.seeds, args.num_texts, args.max_new_tokens, args.rows, args.iterations = 1, 4, 16, "4", "1"
        args.embedder, args.profile_texts, args.mauve_bootstrap = "minilm", 3, 5
    methods = [m for m in args.methods.split(",") if m]
    if args.augpe_paper_convention and "augpe-paper" not in methods:
        methods.append("augpe-paper")
    for m in methods:
        if m not in METHODS:
            parser.error(f"--methods: {m!r} is not one of {', '.join(METHODS)}")
    if "augpe-paper" in methods and not args.augpe_paper_convention:
        parser.error("augpe-paper (the paper's sensitivity, not a valid guarantee) runs only with --augpe-paper-convention")
    args.methods_list = methods
    args.datasets_list = [d for d in args.datasets.split(",") if d]
    for d in args.datasets_list:
        if d not in DATASETS:
            parser.error(f"--datasets: {d!r} is not one of {', '.join(DATASETS)}")
    args.epsilons_list = [float(x) for x in args.epsilons.split(",") if x.strip()]
    args.rows_list, args.iterations_list = _ints(args.rows), _ints(args.iterations)
    if any(r < 2 for r in args.rows_list):
        parser.error("--rows: every B + 1 must be at least 2")
    return args


def main(argv=None) -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # a shared machine (docs/results/cpu_threads.md); before torch loads
    args = parse_args(argv)
    out = Path(args.output)
    start = time.perf_counter()
    if not args.summarise_only:
        run(args)
    summary = summarise(out)
    print(markdown(summary))
    print(f"total {time.perf_counter() - start:.0f} s; {out}/summary.json, comparison.md, comparison.png", flush=True)


if __name__ == "__main__":
    main()
