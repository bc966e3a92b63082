"""How long an evaluation takes on real data, cold and with the per-text caches warm.

A sweep evaluates every point against the same real texts: the first evaluation embeds and scores them,
the later ones find them in the caches and pay only for their own synthetic texts. This benchmark times
both on Yelp reviews (long-tailed lengths: real reviews as the "real" side, other real reviews standing
in for synthetic texts, cut to about T generated tokens as a generator would), in one run:

1. **cold**: empty caches (a fresh cache directory), N synthetic against N real texts;
2. **warm real**: new synthetic texts against the same real texts (the sweep's second point);

and prints each phase's seconds and the ratio cold / warm. Nothing is downloaded; the per-text caches live
in a temporary directory that is removed afterwards (the models' own cache is used as usual).

    python examples/bench_evaluate.py --num-texts 500 [--embedding-model mpnet] [--yelp ../shared/data/yelp]
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


def _reviews(path: Path, count: int, offset: int) -> list[dict]:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    if len(rows) < offset + count:
        raise SystemExit(f"{path} has {len(rows)} rows; need {offset + count}")
    return rows[offset : offset + count]


def _as_generated(rows: list[dict], tokenizer, max_new_tokens: int):
    """Texts cut to ``max_new_tokens`` tokens (what a generator with T = max_new_tokens releases)."""
    from invink_audit.evaluation import TextSet

    texts, counts = [], []
    for row in rows:
        ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"][:max_new_tokens]
        texts.append(tokenizer.decode(ids))
        counts.append(len(ids))
    return TextSet(texts=tuple(texts), labels=tuple(r["label2"] for r in rows), num_tokens=tuple(counts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-texts", type=int, default=500, help="synthetic texts and real texts each (default 500)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="length cap of the synthetic texts (T)")
    parser.add_argument("--embedding-model", default="mpnet", choices=["mpnet", "minilm"])
    parser.add_argument("--yelp", type=Path, default=Path(__file__).resolve().parents[2] / "shared" / "data" / "yelp")
    args = parser.parse_args(argv)
    n = args.num_texts
    cache = tempfile.mkdtemp(prefix="invink-bench-evaluate-")  # fresh per-text caches: the first run is cold
    from invink_audit.evaluation import EvaluationConfig, TextSet, evaluate
    from invink_audit.models import load_model

    start = time.perf_counter()
    scorer = load_model(None)
    load_seconds = time.perf_counter() - start
    real_rows = _reviews(args.yelp / "test.csv", n, 0)
    real = TextSet(texts=tuple(r["text"] for r in real_rows), labels=tuple(r["label2"] for r in real_rows))
    config = EvaluationConfig(embedding_model=args.embedding_model, cache_dir=cache)
    from invink_audit.evaluation.embeddings import Embedder, embedding_model_dir

    embedding_model_dir(args.embedding_model)  # assembled and hash-checked once, outside the timings
    embedder = config.make_embedder()  # kept to report the dtype it chose
    runs = {}
    for name, offset in (("cold", 0), ("warm real", n)):
        synthetic = _as_generated(_reviews(args.yelp / "dev.csv", n, offset), scorer.tokenizer, args.max_new_tokens)
        start = time.perf_counter()
        result = evaluate(synthetic, real, config, scorer_model=scorer, embedder=embedder)
        runs[name] = (time.perf_counter() - start, result)
    real_tokens = sum(len(scorer.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in real.texts)
    print(f"evaluate: {n} synthetic (<= {args.max_new_tokens} tokens) vs {n} real Yelp texts ({real_tokens / n:.0f} "
          f"tokens on average, longest cut to 512 for perplexity), embeddings {args.embedding_model}, scorer SmolLM2; "
          f"torch threads {__import__('torch').get_num_threads()}, cpus {os.cpu_count()}; scorer load {load_seconds:.1f} s")  # fmt: skip
    print(f"embedding dtype: {embedder.dtype} (auto: bfloat16 only where native and within cosine "
          f"{Embedder.BF16_MIN_COSINE} of float32 on a probe)")
    embedder.close()
    phases = sorted({k for _, r in runs.values() for k in r.seconds})
    print(f"{'run':<10} {'total s':>8} " + " ".join(f"{p + ' s':>13}" for p in phases))
    for name, (seconds, result) in runs.items():
        print(f"{name:<10} {seconds:>8.1f} " + " ".join(f"{result.seconds.get(p, 0.0):>13.1f}" for p in phases))
    cold, warm = runs["cold"][0], runs["warm real"][0]
    print(f"ratio cold / warm: {cold / warm:.2f}x (the real texts' embeddings and perplexities come from the caches)")
    for name, (_, result) in runs.items():
        m, d = result.mauve.interval, result.delta_ppl
        print(f"{name}: MAUVE (paper) {m.estimate:.3f} [{m.lower:.3f}, {m.upper:.3f}], ΔPPL {d.estimate:.1f}")
    shutil.rmtree(cache, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
