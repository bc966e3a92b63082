"""One process with N threads against N processes with one thread each, on the same release.

    .venv/bin/python examples/scale_out_cpu.py [--references ../shared/data/yelp/dev.csv] [--processes 2]

Runs ``invink-audit generate`` on real, long-tailed references (Yelp restaurant reviews, SmolLM2,
float32, CPU) twice per repeat, alternating: once as one process with ``--processes`` threads, once under
``torchrun`` as ``--processes`` processes with one thread each. Same seed, so the releases must be the
same texts (batch index, token ids, text); prints tokens per second of each (generation only: from the
first decoded token to the last, model loading excluded; and wall time including startup), their
ratio, and whether the outputs are equal. Seeded output is not private: this is a measurement.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from invink_audit.outputs import read_generation_output


def _select(references: Path, where: str, count: int, out: Path) -> None:
    column, _, value = where.partition("=")
    with references.open(newline="", encoding="utf-8") as handle, out.open("w", newline="", encoding="utf-8") as sink:
        writer = csv.writer(sink)
        writer.writerow(["text"])
        kept = 0
        for row in csv.DictReader(handle):
            if row.get(column) == value and row["text"].strip():
                writer.writerow([row["text"]])
                kept += 1
                if kept == count:
                    return
    raise SystemExit(f"only {kept} references match {where!r}; {count} are needed")


def _run(command: list[str], threads: int, env: dict) -> tuple[dict, float]:
    started = time.perf_counter()
    done = subprocess.run(command, env={**env, "OMP_NUM_THREADS": str(threads)}, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--references", default="../shared/data/yelp/dev.csv")
    parser.add_argument("--where", default="label1=Business Category: Restaurants")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--num-texts", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        refs = tmp / "refs.csv"
        _select(Path(args.references), args.where, args.num_texts * args.batch_size, refs)
        common = ["generate", "--input", str(refs), "--batch-size", str(args.batch_size), "--max-new-tokens",
                  str(args.max_new_tokens), "--clip-norm", "1.62641", "--delta", "1e-6", "--top-k", "50",
                  "--seed", "1", "--device", "cpu", "--dtype", "float32", "--no-progress", "--json"]  # fmt: skip
        if args.model:
            common += ["--model", args.model]
        single_rates, multi_rates, single_walls, multi_walls, equal = [], [], [], [], []
        for repeat in range(args.repeats):
            one, many = tmp / f"one-{repeat}.jsonl", tmp / f"many-{repeat}.jsonl"
            summary, wall = _run([sys.executable, "-m", "invink_audit.cli", *common, "--output", str(one)],
                                 args.processes, env)  # fmt: skip
            single_rates.append(summary["tokens_per_second"])
            single_walls.append(wall)
            summary, wall = _run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.processes),
                 "-m", "invink_audit.cli", *common, "--output", str(many)], 1, env,
            )  # fmt: skip
            multi_rates.append(summary["tokens_per_second"])
            multi_walls.append(wall)
            texts = [[(r["batch_index"], r["token_ids"]) for r in read_generation_output(p)] for p in (one, many)]
            equal.append(texts[0] == texts[1])
            print(
                f"repeat {repeat}: 1 process x {args.processes} threads {single_rates[-1]:.2f} tok/s "
                f"(wall {single_walls[-1]:.0f} s); {args.processes} processes x 1 thread {multi_rates[-1]:.2f} tok/s "
                f"(wall {multi_walls[-1]:.0f} s); per-process {[round(p['tokens_per_second'], 2) for p in summary['processes']]}; "
                f"same texts: {equal[-1]}",
                flush=True,
            )
    median = statistics.median
    print(
        f"\nG = {args.num_texts} texts, B = {args.batch_size}, T = {args.max_new_tokens}, {args.repeats} repeats (medians)\n"
        f"  1 process, {args.processes} threads      {median(single_rates):.2f} tokens/s  (wall {median(single_walls):.0f} s)\n"
        f"  {args.processes} processes, 1 thread each  {median(multi_rates):.2f} tokens/s  (wall {median(multi_walls):.0f} s)\n"
        f"  ratio (processes / threads)   {median(multi_rates) / median(single_rates):.2f}x generation, "
        f"{median(single_walls) / median(multi_walls):.2f}x wall\n"
        f"  same texts in every repeat    {all(equal)}"
    )


if __name__ == "__main__":
    main()
