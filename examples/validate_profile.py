"""Does the planning signal decide where sampled metrics cannot? (docs/results/planning-signal.md)

On Yelp proxy data (one label group: 4-star restaurant reviews; references from dev.csv, held-out texts from
test.csv), one ``invink-audit profile`` pass scores 30 held-out texts at ε ∈ {1, 3, 10} (B = 4, k = 100 and the
full vocabulary, τ = 1, T = 48); then, at each ε, InvisibleInk generates as many texts as fit in two minutes of
generation per point (the planning budget the issue allows: ``--texts-per-point``, default 20) and MAUVE scores
them against as many held-out texts. Prints both tables and the time each took.

    python examples/validate_profile.py [--yelp ../shared/data/yelp] [--texts-per-point 20] [--num-texts 30]

Everything runs on proxy data: nothing here is a private release.
"""

from __future__ import annotations

import argparse
import csv
import warnings
import tempfile
import time
from pathlib import Path

GROUP = {"label1": "Business Category: Restaurants", "label2": "Review Stars: 4.0"}
EPSILONS = (1.0, 3.0, 10.0)
B, T = 4, 48


def _subset(source: Path, target: Path) -> int:
    with source.open(encoding="utf-8") as f, target.open("w", encoding="utf-8", newline="") as g:
        reader = csv.DictReader(f)
        writer = csv.DictWriter(g, fieldnames=reader.fieldnames)
        writer.writeheader()
        rows = [r for r in reader if all(r[k] == v for k, v in GROUP.items())]
        writer.writerows(rows)
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yelp", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/yelp"))
    parser.add_argument("--texts-per-point", type=int, default=20)
    parser.add_argument("--num-texts", type=int, default=30)
    args = parser.parse_args()

    from invink_audit.data import read_labelled_references
    from invink_audit.evaluation import EvaluationConfig, evaluate
    from invink_audit.evaluation.profile import ProfileConfig, run_profile
    from invink_audit.generation import GenerationConfig, generate
    from invink_audit.mechanism import SeededGeneratorWarning
    from invink_audit.models import load_model

    work = Path(tempfile.mkdtemp(prefix="validate-profile-"))
    proxy, real = work / "proxy.csv", work / "real.csv"
    print(f"proxy references: {_subset(Path(args.yelp) / 'dev.csv', proxy)}, held-out texts: "
          f"{_subset(Path(args.yelp) / 'test.csv', real)} (4-star restaurant reviews)")
    warnings.simplefilter("ignore", SeededGeneratorWarning)  # seeded on purpose: proxy data, a reproducible table
    loaded = load_model()
    columns = ("label1", "label2")

    config = ProfileConfig(epsilons=EPSILONS, batch_sizes=(B,), top_ks=(100, None), max_new_tokens=T,
                           num_texts=args.num_texts, prompt="yelp", label_columns=columns)
    start = time.perf_counter()
    profile = run_profile(proxy, real, config, model=loaded)
    seconds = time.perf_counter() - start
    profile.write(work / "profile")  # the plots of docs/results/planning-signal.md
    print(f"\n## planning signal: {profile.num_texts} texts, {len(profile.points)} points, {seconds:.0f} s "
          f"({seconds / len(profile.points):.0f} s per point)\n")
    print(profile.markdown())

    references = read_labelled_references(proxy, label_columns=columns)
    held_out = read_labelled_references(real, label_columns=columns).texts
    print(f"(profile report and plots: {work / 'profile'})")
    print(f"\n## MAUVE at {args.texts_per_point} generated texts per point (minilm embeddings)\n")
    print("| ε | C | generation s | MAUVE [95%] |\n|---|---|---|---|")
    evaluation = EvaluationConfig(embedding_model="minilm", perplexity=False)
    for eps in EPSILONS:
        start = time.perf_counter()
        config = GenerationConfig(batch_size=B, max_new_tokens=T, epsilon=eps, delta=1e-6, top_k=100,
                                  num_texts_per_group=args.texts_per_point)
        released = generate(references, config, model=loaded, prompt="yelp", seed=int(eps))  # reproducible; proxy data
        gen = time.perf_counter() - start
        texts = [t.text for t in released.texts]
        result = evaluate(texts, list(held_out), evaluation)  # n real texts: as many as synthetic
        print(f"| {eps:g} | {released.mechanism.config.clip_norm:.3g} | {gen:.0f} | {result.mauve.interval.format()} |", flush=True)


if __name__ == "__main__":
    main()
