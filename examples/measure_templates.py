"""Which prompt template keeps a small model's private texts in the genre of the data?

On Yelp restaurant reviews (``../shared/data/yelp``, read in place), label-conditioned on ``label1``,
``label2`` (five star groups), the embedded SmolLM2-135M-Instruct writes, for each template,

* the **floor** (public prompt, no reference) and the **ceiling** (one reference, no privacy):
  :func:`invink_audit.evaluation.reference_points.generate_reference_points`;
* private texts at each ε (InvisibleInk, B = 7, T = 64, top-k 100, τ = 1, δ = 1e-6): :func:`generate`,

and the script counts off-genre texts (:func:`invink_audit.evaluation.genre.off_genre`, with a Wilson
interval) and evaluates each point (:func:`invink_audit.evaluation.evaluate`: MAUVE in two settings,
TSTR on the star label, perplexity under SmolLM2). Templates (``--templates``): ``yelp-paper`` (the
paper's Table 4 prompt), ``yelp`` (the same with the answer started as a quoted review and cut at the
closing quote), ``yelp+fewshot`` (``yelp`` with three public example reviews from the public slice),
``yelp+invented`` (``yelp`` with three reviews invented for the study) and ``yelp-completion`` (a
completion prompt on the chat model). ``--gemma`` adds Gemma-3-270M (a base model) with
``--gemma-templates`` (``yelp-completion``, with ``+invented`` or ``+fewshot`` examples);
``--generic-texts N`` tries variants of ``generic`` on the shipped demo messages.

Data splits (declared here, never changed by a result):

* **references** (the "private" input): the restaurant reviews of ``dev.csv`` in file order, less its
  last ``--public-slice`` restaurant reviews; each star group's first batches are used;
* **public** (few-shot examples only, never evaluated on): those last ``--public-slice`` restaurant
  reviews of ``dev.csv``; the examples are the first review of at most ``--example-words`` words at
  5, 3 and 1 stars, in that order;
* **held-out real** (MAUVE, perplexity, TSTR, and the off-genre rate of real reviews): the restaurant
  reviews of ``test.csv``.

Texts are seeded (``--seed``): reproducible, and therefore carrying no privacy; this measures
templates, it is not a release, and no ledger is charged. Everything written under ``--output`` is
derived from the data in the clear and is NOT PRIVATE (owner-only files, each record marked); keep the
directory out of the repository. Files: ``references.csv`` (the reference split, a working copy that
:func:`generate` reads), ``texts.jsonl`` (every text with its point, labels and off-genre reason),
``summary.json`` (one row per point), ``summary.md`` (the table).

    python examples/measure_templates.py --output /tmp/templates            # small: about 5 minutes
    python examples/measure_templates.py --output /tmp/templates --reference-texts-per-group 10 \\
        --private-texts-per-group 4 --gemma --gemma-reference-texts-per-group 4 \\
        --gemma-private-texts-per-group 2 --generic-texts 12     # docs/results/templates.md: 43 min, 2 busy cores
    python examples/measure_templates.py --output /tmp/templates --rescore  # recount with the current rule

Torch runs on one thread by default (``--threads``): on a 2-core machine shared with other jobs, two
threads made a decode step 6-7x slower (docs/results/templates.md).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import time
import warnings
from pathlib import Path

CATEGORY = "Business Category: Restaurants"
LABEL_COLUMNS = ("label1", "label2")
STAR_COLUMN = "label2"
EXAMPLE_STARS = ("Review Stars: 5.0", "Review Stars: 3.0", "Review Stars: 1.0")
DEMO_DESCRIPTION = "messages from patients to their doctor's practice"
NOTICE = "NOT PRIVATE: texts and measurements derived from Yelp reviews in the clear (a template study, not a release)"

#: Three restaurant reviews invented for this study (5, 3 and 1 stars; no real place or person): public by
#: construction, the few-shot examples of the `yelp+invented` candidate (a preset could ship them; the
#: measurement in docs/results/templates.md says it should not).
YELP_EXAMPLES = (
    "Tiny place, huge flavor. The green curry had real heat and the staff kept our water glasses full "
    "without being asked. We came back two days later for the mango sticky rice. Worth the wait for a table.",
    "Food was fine but nothing special. The burger came out lukewarm and the fries needed salt, though the "
    "milkshake was great. Service was friendly but slow on a quiet Tuesday. Might try it again for brunch.",
    "Waited forty minutes for two sandwiches and one of them was wrong. When we mentioned it the manager "
    "shrugged and said the kitchen was busy. The bread was stale too. Won't be back.",
)

_START = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f}s] {message}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="directory for the NOT PRIVATE outputs (outside the repo)")
    parser.add_argument("--yelp", default=None, help="Yelp data directory (default ../shared/data/yelp)")
    parser.add_argument("--templates", default="yelp-paper,yelp,yelp+fewshot")
    parser.add_argument("--reference-texts-per-group", type=int, default=2, help="floor and ceiling texts per star group")
    parser.add_argument("--private-texts-per-group", type=int, default=1, help="private texts per star group and ε")
    parser.add_argument("--epsilons", default="10,3")
    parser.add_argument("--batch-size", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-6)
    parser.add_argument("--public-slice", type=int, default=200)
    parser.add_argument("--example-words", type=int, default=40)
    parser.add_argument("--gemma", action="store_true", help="also Gemma-3-270M (--gemma-templates: floor, ceiling, every ε)")
    parser.add_argument("--gemma-templates", default="yelp-completion",
                        help="comma-separated: yelp-completion, yelp-completion+invented, yelp-completion+fewshot")
    parser.add_argument("--gemma-reference-texts-per-group", type=int, default=None, help="default: as for SmolLM2")
    parser.add_argument("--gemma-private-texts-per-group", type=int, default=None, help="default: as for SmolLM2")
    parser.add_argument("--generic-texts", type=int, default=0, help="texts per generic variant on the demo messages (0: skip)")
    parser.add_argument("--no-evaluate", action="store_true", help="off-genre shares only (no MAUVE, TSTR, perplexity)")
    parser.add_argument("--rescore", action="store_true",
                        help="generate nothing: recount the off-genre texts of an earlier run in --output with the "
                             "current rule (texts.jsonl, summary.json and summary.md rewritten)")
    parser.add_argument("--embedding-model", default="minilm", choices=("minilm", "mpnet"))
    parser.add_argument("--mauve-bootstrap", type=int, default=10)
    parser.add_argument("--tstr-bootstrap", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: on a 2-core machine shared with other jobs, 2 threads spin-wait "
                             "for a busy core and a decode step took 6-7x longer than on 1)")
    args = parser.parse_args(argv)
    for name in ("reference_texts_per_group", "private_texts_per_group", "batch_size", "max_new_tokens", "public_slice"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# --------------------------------------------------------------------------------------------
# data


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return [r for r in csv.DictReader(f) if r["label1"] == CATEGORY]


def pick_examples(public_rows: list[dict], max_words: int) -> tuple[str, ...]:
    """The first review of at most ``max_words`` words at each of :data:`EXAMPLE_STARS` in the public slice."""
    examples = []
    for stars in EXAMPLE_STARS:
        found = next((r["text"] for r in public_rows if r["label2"] == stars and len(r["text"].split()) <= max_words), None)
        if found is None:
            raise SystemExit(f"the public slice has no {stars} review of <= {max_words} words; raise --public-slice")
        examples.append(" ".join(found.split()))
    return tuple(examples)


def write_owner_only_csv(path: Path, rows: list[dict]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["text", *LABEL_COLUMNS])
        writer.writeheader()
        writer.writerows({k: r[k] for k in ("text", *LABEL_COLUMNS)} for r in rows)


# --------------------------------------------------------------------------------------------
# one point: texts in, off-genre share and evaluation out


@dataclasses.dataclass
class Point:
    model: str
    template: str
    point: str
    texts: list[str]
    stars: list[str]
    num_tokens: list[int]
    finish_reasons: list[str]
    seconds_generation: float
    epsilon: float | None = None
    clip_norm: float | None = None


class Study:
    def __init__(self, args, out: Path, real_rows: list[dict]):
        self.args, self.out, self.real_rows = args, out, real_rows
        self.rows: list[dict] = []
        self.records: list[dict] = []
        self._embedder = None
        self._scorer = None

    def scorer(self):
        if self._scorer is None:
            from invink_audit.models import load_model

            self._scorer = load_model(None)
        return self._scorer

    def add(self, p: Point, *, evaluate: bool = True) -> dict:
        from invink_audit.evaluation.genre import off_genre, off_genre_share

        reasons = [off_genre(t) for t in p.texts]
        share = off_genre_share(p.texts)
        counts: dict[str, int] = {}
        for r in reasons:
            if r is not None:
                counts[str(r)] = counts.get(str(r), 0) + 1
        for i, (text, stars, n, fin, reason) in enumerate(zip(p.texts, p.stars, p.num_tokens, p.finish_reasons, reasons)):
            self.records.append({"model": p.model, "template": p.template, "point": p.point, "index": i, "stars": stars,
                                 "text": text, "num_tokens": n, "finish_reason": fin,
                                 "off_genre": None if reason is None else str(reason)})
        row = {"model": p.model, "template": p.template, "point": p.point, "num_texts": len(p.texts),
               "epsilon": p.epsilon, "clip_norm": p.clip_norm, "off_genre": share.to_json(), "off_genre_reasons": counts,
               "mean_tokens": sum(p.num_tokens) / len(p.num_tokens),
               "finish_reasons": {f: p.finish_reasons.count(f) for f in sorted(set(p.finish_reasons))},
               "seconds_generation": p.seconds_generation}
        say(f"{p.model} {p.template} {p.point}: {len(p.texts)} texts, off-genre {share.format(2)} {counts}, "
            f"{row['mean_tokens']:.1f} tokens/text, generated in {p.seconds_generation:.0f}s")
        if evaluate and not self.args.no_evaluate:
            row.update(self.evaluate(p))
        self.rows.append(row)
        self.flush()
        return row

    def evaluate(self, p: Point) -> dict:
        from invink_audit.evaluation import EvaluationConfig, TextSet, evaluate

        if sum(1 for t in p.texts if t.strip()) < 2:
            return {"evaluation": "skipped: fewer than 2 non-empty texts"}
        config = EvaluationConfig(embedding_model=self.args.embedding_model, mauve_bootstrap=self.args.mauve_bootstrap,
                                  tstr_bootstrap=self.args.tstr_bootstrap, seed=self.args.seed)
        if self._embedder is None:
            self._embedder = config.make_embedder()
        synthetic = TextSet(texts=p.texts, labels=p.stars, num_tokens=p.num_tokens,
                            finish_reasons=[f if f in ("eos", "length") else "eos" for f in p.finish_reasons])
        real = TextSet(texts=[r["text"] for r in self.real_rows], labels=[r[STAR_COLUMN] for r in self.real_rows])
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # empty texts are counted by off_genre already
            result = evaluate(synthetic, real, config, scorer_model=self.scorer(), embedder=self._embedder)
        seconds = time.perf_counter() - start
        tstr = result.tstr
        out = {
            "mauve": result.mauve.to_json(),
            "mauve_c5": result.mauve_c5.to_json(),
            "perplexity": None if result.perplexity_synthetic is None else result.perplexity_synthetic.to_json(),
            "perplexity_real": None if result.perplexity_real is None else result.perplexity_real.to_json(),
            "delta_ppl": None if result.delta_ppl is None else result.delta_ppl.to_json(),
            "tstr_accuracy": tstr.accuracy_synthetic.to_json(),
            "tstr_chance": tstr.accuracy_floor.to_json(),
            "tstr_real": tstr.accuracy_ceiling.to_json(),
            "tstr_num_train_real": tstr.num_train_real,
            "tstr_num_test": tstr.num_test,
            "num_real_mauve": result.num_real,
            "seconds_evaluation": seconds,
        }
        say(f"   MAUVE {result.mauve.interval.estimate:.3f} (c=5 {result.mauve_c5.interval.estimate:.3f}), TSTR "
            f"{tstr.accuracy_synthetic.format(2)} (chance {tstr.accuracy_floor.estimate:.2f}, real "
            f"{tstr.accuracy_ceiling.estimate:.2f}), PPL {out['perplexity'] and round(out['perplexity']['estimate'], 1)}; "
            f"evaluated in {seconds:.0f}s")
        return out

    def flush(self) -> None:
        from invink_audit.not_private import write_not_private_json, write_not_private_jsonl

        write_not_private_jsonl(self.out / "texts.jsonl", self.records, notice=NOTICE)
        write_not_private_json(self.out / "summary.json", {"settings": vars(self.args), "points": self.rows}, notice=NOTICE)


# --------------------------------------------------------------------------------------------
# generation


def reference_points(loaded, template, batches, labels, args, seed: int) -> tuple[dict, float]:
    from invink_audit.evaluation.reference_points import generate_reference_points

    start = time.perf_counter()
    points = generate_reference_points(
        batches, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, model=loaded,
        prompt=template, batch_labels=labels, seed=seed, generation_batch=16,
    )
    return points, time.perf_counter() - start


def private_point(loaded, template, references_csv: Path, args, epsilon: float, seed: int, per_group: int):
    from invink_audit.data import ReferencesFile
    from invink_audit.generation import GenerationConfig, GenerationHooks, generate
    from invink_audit.mechanism import SeededGeneratorWarning

    done = []
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)  # deliberate: a measurement, not a release
        config = GenerationConfig(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, delta=args.delta,
                                  epsilon=epsilon, temperature=args.temperature, top_k=args.top_k,
                                  num_texts_per_group=per_group)
        result = generate(
            ReferencesFile(str(references_csv), label_columns=LABEL_COLUMNS), config, model=loaded, prompt=template,
            seed=seed, hooks=GenerationHooks(
                on_text=lambda t: done.append(t) or (len(done) % 5 == 0 and say(f"   {len(done)} private texts"))),
        )
    return result, time.perf_counter() - start


def star(labels) -> str:
    return labels[STAR_COLUMN] if labels is not None else ""


def run_yelp_template(study: Study, loaded, model_name: str, name: str, template, reference_rows, references_csv, args,
                      epsilons, seed_base: int) -> None:
    from invink_audit.data import partition_by_labels

    grouped = partition_by_labels([r["text"] for r in reference_rows], [{c: r[c] for c in LABEL_COLUMNS} for r in reference_rows],
                                  args.batch_size, num_texts_per_group=args.reference_texts_per_group)
    batches = [b.references for b in grouped.batches]
    labels = [dict(b.labels) for b in grouped.batches]
    say(f"{model_name} {name}: floor and ceiling, {len(batches)} texts each")
    points, seconds = reference_points(loaded, template, batches, labels, args, seed_base)
    for kind in ("floor", "ceiling"):
        texts = points[kind]
        study.add(Point(model_name, name, kind, list(texts.texts), [star(l) for l in texts.labels], list(texts.num_tokens),
                        list(texts.finish_reasons), seconds / 2))
    for j, epsilon in enumerate(epsilons):
        say(f"{model_name} {name}: private ε = {epsilon:g}, {args.private_texts_per_group} texts per star group")
        result, seconds = private_point(loaded, template, references_csv, args, epsilon, seed_base + 10 + j,
                                        args.private_texts_per_group)
        texts = result.texts
        study.add(Point(model_name, name, f"eps{epsilon:g}", [t.text for t in texts], [star(t.labels) for t in texts],
                        [t.num_tokens for t in texts], [t.finish_reason for t in texts], seconds, epsilon,
                        result.mechanism.config.clip_norm))


def run_generic(study: Study, loaded, args) -> None:
    """Variants of ``generic`` on the shipped demo messages: floor and ceiling (one reference each) and
    private ε = first of ``--epsilons`` at B = 2 (24 messages make 12 batches); off-genre shares only."""
    import dataclasses as dc

    from invink_audit.data import read_references
    from invink_audit.prompts import get_preset

    path = Path(__file__).resolve().parents[1] / "invink_audit" / "resources" / "demo_references.jsonl"
    messages = read_references(path)
    n = min(args.generic_texts, len(messages) // 2)
    generic = get_preset("generic", description=DEMO_DESCRIPTION)
    variants = {
        "generic": generic,
        'generic+Text:"': dc.replace(generic, answer_prefix='Text: "', stop=('"',)),
        "generic-completion": get_preset("generic-completion", description=DEMO_DESCRIPTION),
    }
    refs_file = study.out / "demo_references.csv"
    fd = os.open(refs_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        writer.writerows([m] for m in messages[: 2 * n])
    batches = [messages[2 * i : 2 * i + 2] for i in range(n)]
    epsilon = float(args.epsilons.split(",")[0])
    for k, (name, template) in enumerate(variants.items()):
        say(f"generic variant {name}: floor, ceiling, private ε = {epsilon:g} (B = 2), {n} texts each")
        points, seconds = reference_points(loaded, template, batches, None, args, 500 + k)
        for kind in ("floor", "ceiling"):
            t = points[kind]
            study.add(Point("smollm2", name, kind, list(t.texts), [""] * len(t.texts), list(t.num_tokens),
                            list(t.finish_reasons), seconds / 2), evaluate=False)
        from invink_audit.generation import GenerationConfig, generate
        from invink_audit.mechanism import SeededGeneratorWarning

        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SeededGeneratorWarning)
            config = GenerationConfig(batch_size=2, max_new_tokens=args.max_new_tokens, delta=args.delta,
                                      epsilon=epsilon, temperature=args.temperature, top_k=args.top_k, num_texts=n)
            result = generate(str(refs_file), config, model=loaded, prompt=template, seed=600 + k)
        study.add(Point("smollm2", name, f"eps{epsilon:g}-B2", [t.text for t in result.texts], [""] * len(result.texts),
                        [t.num_tokens for t in result.texts], [t.finish_reason for t in result.texts],
                        time.perf_counter() - start, epsilon, result.mechanism.config.clip_norm), evaluate=False)


# --------------------------------------------------------------------------------------------
# table


def _fmt(iv, digits=2) -> str:
    if not iv:
        return "–"
    return f"{iv['estimate']:.{digits}f} [{iv['lower']:.{digits}f}, {iv['upper']:.{digits}f}]"


def markdown(rows: list[dict], real_share: dict) -> str:
    lines = [
        f"Real held-out restaurant reviews flagged off-genre: {_fmt(real_share['share'], 3)} "
        f"({real_share['flagged']} of {real_share['n']})",
        "",
        "| model | template | point | n | off-genre | reasons | tokens | MAUVE (paper) | MAUVE (c=5) | TSTR stars | PPL | gen s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r["off_genre_reasons"].items(), key=lambda kv: -kv[1]))
        lines.append(
            f"| {r['model']} | {r['template']} | {r['point']} | {r['num_texts']} | {_fmt(r['off_genre'])} | {reasons or '–'} "
            f"| {r['mean_tokens']:.0f} | {_fmt(r.get('mauve'))} | {_fmt(r.get('mauve_c5'), 3)} | {_fmt(r.get('tstr_accuracy'))} "
            f"| {_fmt(r.get('perplexity'), 1)} | {r['seconds_generation']:.0f} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------


def rescore(out: Path) -> int:
    """Recount the off-genre texts of the run in ``out`` with the current rule (nothing is generated)."""
    from invink_audit.evaluation.genre import off_genre, off_genre_share
    from invink_audit.not_private import unmark, write_not_private_json, write_not_private_jsonl, write_not_private_text

    records = [unmark(json.loads(line)) for line in (out / "texts.jsonl").read_text(encoding="utf-8").splitlines() if line]
    summary = unmark(json.loads((out / "summary.json").read_text(encoding="utf-8")))
    for record in records:
        reason = off_genre(record["text"])
        record["off_genre"] = None if reason is None else str(reason)
    for row in summary["points"]:
        texts = [r for r in records if (r["model"], r["template"], r["point"]) == (row["model"], row["template"], row["point"])]
        row["off_genre"] = off_genre_share([r["text"] for r in texts]).to_json()
        row["off_genre_reasons"] = {}
        for r in texts:
            if r["off_genre"] is not None:
                row["off_genre_reasons"][r["off_genre"]] = row["off_genre_reasons"].get(r["off_genre"], 0) + 1
    real = summary["real_off_genre"]
    data = Path(summary["settings"]["yelp"]) if summary["settings"].get("yelp") else None
    if data is None:
        from invink_audit.audit.spec import yelp_dir

        data = yelp_dir()
    test = read_rows(data / "test.csv")
    real.update({"share": off_genre_share([r["text"] for r in test]).to_json(),
                 "flagged": sum(off_genre(r["text"]) is not None for r in test), "n": len(test)})
    summary["rescored"] = True
    write_not_private_jsonl(out / "texts.jsonl", records, notice=NOTICE)
    write_not_private_json(out / "summary.json", summary, notice=NOTICE)
    table = markdown(summary["points"], real)
    write_not_private_text(out / "summary.md", table, markdown=True)
    print(table)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rescore:
        return rescore(Path(args.output))
    import dataclasses as dc

    from invink_audit.audit.spec import yelp_dir
    from invink_audit.evaluation.genre import off_genre, off_genre_share
    from invink_audit.models import load_model
    from invink_audit.not_private import write_not_private_json, write_not_private_text
    from invink_audit.prompts import get_preset

    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.output)
    repo = Path(__file__).resolve().parents[1]
    if out.resolve() == repo or repo in out.resolve().parents:
        raise SystemExit(f"--output {out} is inside the repository; its files are NOT PRIVATE (a copy of the "
                         "references among them): write them elsewhere, e.g. /tmp/templates")
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    data = Path(args.yelp) if args.yelp else yelp_dir()
    dev, test = read_rows(data / "dev.csv"), read_rows(data / "test.csv")
    if len(dev) <= args.public_slice:
        raise SystemExit(f"dev.csv has {len(dev)} restaurant reviews; --public-slice {args.public_slice} leaves none")
    reference_rows, public_rows = dev[: -args.public_slice], dev[-args.public_slice :]
    examples = pick_examples(public_rows, args.example_words)
    references_csv = out / "references.csv"
    write_owner_only_csv(references_csv, reference_rows)
    epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
    flagged = sum(off_genre(r["text"]) is not None for r in test)
    real_share = {"share": off_genre_share([r["text"] for r in test]).to_json(), "flagged": flagged, "n": len(test)}
    say(f"references: {len(reference_rows)} restaurant reviews of dev.csv; public slice: its last {len(public_rows)}; "
        f"held-out: {len(test)} of test.csv, {flagged} flagged off-genre ({flagged / len(test):.1%})")
    say("few-shot examples (public slice): " + " | ".join(examples))

    study = Study(args, out, test)
    loaded = load_model(None)
    study._scorer = loaded
    yelp = dc.replace(get_preset("yelp"), examples=())  # the candidates differ only in their examples
    templates = {
        "yelp-paper": get_preset("yelp-paper"),
        "yelp": yelp,
        # named "yelp" so that the preset's label rule (prefixes removed) applies; shown as yelp+fewshot
        "yelp+fewshot": dc.replace(yelp, examples=examples),
        # three reviews invented for this study (YELP_EXAMPLES above), public by construction
        "yelp+invented": dc.replace(yelp, examples=YELP_EXAMPLES),
        # a completion prompt on the chat model (no chat template)
        "yelp-completion": get_preset("yelp-completion"),
    }
    for k, name in enumerate(n.strip() for n in args.templates.split(",") if n.strip()):
        if name not in templates:
            raise SystemExit(f"unknown template {name!r}; choose from {sorted(templates)}")
        run_yelp_template(study, loaded, "smollm2", name, templates[name], reference_rows, references_csv, args,
                          epsilons, 100 * (k + 1))
    if args.gemma:
        say("loading Gemma-3-270M")
        gemma = load_model("gemma3-270m")
        gemma_args = argparse.Namespace(**vars(args))
        for name in ("reference_texts_per_group", "private_texts_per_group"):
            if getattr(args, f"gemma_{name}") is not None:
                setattr(gemma_args, name, getattr(args, f"gemma_{name}"))
        completion = get_preset("yelp-completion")
        gemma_templates = {"yelp-completion": completion,
                           "yelp-completion+invented": dc.replace(completion, examples=YELP_EXAMPLES),
                           "yelp-completion+fewshot": dc.replace(completion, examples=examples)}
        for k, name in enumerate(n.strip() for n in args.gemma_templates.split(",") if n.strip()):
            if name not in gemma_templates:
                raise SystemExit(f"unknown Gemma template {name!r}; choose from {sorted(gemma_templates)}")
            run_yelp_template(study, gemma, "gemma3-270m", name, gemma_templates[name], reference_rows,
                              references_csv, gemma_args, epsilons, 900 + 100 * k)
        del gemma
    if args.generic_texts:
        run_generic(study, loaded, args)
    study.flush()
    write_not_private_json(out / "summary.json", {"settings": vars(args), "few_shot_examples": list(examples),
                                                   "real_off_genre": real_share, "points": study.rows}, notice=NOTICE)
    table = markdown(study.rows, real_share)
    write_not_private_text(out / "summary.md", table, markdown=True)
    print(table)
    say(f"done; outputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
