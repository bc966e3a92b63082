"""Check the capacity bound (invink_audit/capacity.py) against the engine's real memory on CPU.

For each configuration (B references per text, max_batch_rows R) a fresh process loads the embedded
model (SmolLM2-135M-Instruct), warms the release path up on one text of short references, records its resident set
size (RSS), resets the kernel's high-water mark (``/proc/self/clear_refs``) and generates ``G`` texts
(``G = R // (B+1)``: one full set of texts in flight) of real Yelp reviews with
:func:`invink_audit.generation.generate` (seeded, no ledger, no output file). It reports

* ``measured``: the peak RSS during generation minus the RSS before it (``VmHWM - VmRSS``);
* ``KV engine``: the engine's own KV-cache tensors at their peak, counted as they are allocated and
  freed (a second run in the same process, with ``torch.Tensor.new_zeros`` wrapped; ``--no-track``
  skips it);
* ``KV bound``: :func:`invink_audit.capacity.kv_bound_bytes` on the real prompts' token counts (an upper
  bound for any end-of-sequence pattern);
* ``predicted``: that plus :func:`~invink_audit.capacity.sampling_bytes` and
  :func:`~invink_audit.capacity.activation_bytes`; ``ratio`` = measured / predicted;
* ``CLI estimate``: what ``invink-audit memory`` says with the longest private prompt as ``--prompt-tokens``,
  less the weights.

Run from the repository root (the references are read in place, never copied)::

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python examples/measure_memory.py [--markdown]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

REFERENCES = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "yelp" / "test.csv"
CONFIGS = [(3, 16), (3, 64), (7, 16), (7, 64)]
MIB = 1024**2


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _references(path: Path, count: int) -> list[str]:
    """The first ``count`` non-empty texts of the ``text`` column."""
    with open(path, newline="", encoding="utf-8") as handle:
        texts = [row["text"] for row in csv.DictReader(handle) if row["text"].strip()]
    if len(texts) < count:
        raise SystemExit(f"{path} has {len(texts)} texts; {count} needed")
    return texts[:count]


class _KVTracker:
    """The engine's KV tensors (4-D, ``(.., kv_heads, .., head_dim)``, made by ``new_zeros`` in rows.py),
    summed as they are allocated and freed."""

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        import torch

        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.live = self.peak = 0
        self.original = torch.Tensor.new_zeros

    def __enter__(self) -> _KVTracker:
        import weakref

        import torch

        original, tracker = self.original, self

        def new_zeros(tensor, *size, **kwargs):
            out = original(tensor, *size, **kwargs)
            if out.dim() == 4 and out.shape[1] == tracker.kv_heads and out.shape[3] == tracker.head_dim:
                count = out.numel() * out.element_size()
                tracker.live += count
                tracker.peak = max(tracker.peak, tracker.live)
                weakref.finalize(out, tracker.free, count)
            return out

        torch.Tensor.new_zeros = new_zeros
        return self

    def free(self, count: int) -> None:
        self.live -= count

    def __exit__(self, *exc) -> None:
        import torch

        torch.Tensor.new_zeros = self.original


def _predict(loaded, references: list[str], batch_size: int, rows: int, max_new_tokens: int) -> dict:
    """The bound's numbers for these prompts (their real token counts)."""
    from invink_audit import capacity
    from invink_audit.prompts import encode_request, get_preset

    shape = capacity.shape_of(loaded)
    template = get_preset("generic")
    texts, prefixes, private = [], set(), []
    for start in range(0, len(references), batch_size):
        request = encode_request(loaded.tokenizer, template, references[start : start + batch_size])
        lengths = [len(request.public_ids)] + [None if p is None else len(p) for p in request.private_ids]
        texts.append(lengths)
        private += [n for n in lengths[1:] if n is not None]
        prefix = request.private_prefix
        if len(prefix) >= 4 and any(p is not None and p[: len(prefix)] == prefix for p in request.private_ids):
            prefixes.add(prefix)  # engine.py _Run._prefix_row: cached once per run
    kappa = capacity.kv_bytes_per_token(shape)
    workload = capacity.Workload(
        batch_size=batch_size, max_new_tokens=max_new_tokens, prompt_tokens=max(private),
        public_prompt_tokens=texts[0][0], max_batch_rows=rows, num_texts=len(texts),
    )
    kv = capacity.kv_bound_bytes(shape, texts, max_new_tokens, workload.texts_in_flight,
                                 prefix_tokens=sum(len(p) for p in prefixes))
    working = capacity.sampling_bytes(shape, workload) + capacity.activation_bytes(shape, workload)
    cli = capacity.estimate_memory(shape, workload)
    return {
        "kv_bound": kv, "working": working, "predicted": kv + working, "cli_estimate": cli.peak_bytes - cli.weights_bytes,
        "prompt_mean": sum(private) / len(private), "prompt_min": min(private), "prompt_max": max(private),
        "public_prompt": texts[0][0], "texts": len(texts), "kappa": kappa, "dtype": shape.dtype,
    }


def child(batch_size: int, rows: int, max_new_tokens: int, dtype: str, track: bool) -> dict:
    """One configuration, in this (fresh) process."""
    import torch

    from invink_audit.generation import GenerationConfig, ModelSpec, generate
    from invink_audit.mechanism import SeededGeneratorWarning
    from invink_audit.models import load_model

    warnings.simplefilter("ignore", SeededGeneratorWarning)
    loaded = load_model(None, device="cpu", dtype=dtype)
    texts = max(1, rows // (batch_size + 1))
    references = _references(REFERENCES, texts * batch_size)
    config = GenerationConfig(batch_size=batch_size, max_new_tokens=max_new_tokens, epsilon=3.0, delta=1e-6)
    options = dict(model=ModelSpec(loaded, max_batch_rows=rows), seed=0, prompt="generic")
    # warm-up: imports and one-time set-up of the release path, on one text of short references (what it
    # allocates and frees stays in the allocator's free lists, so it is kept small)
    generate(["Good food, friendly staff."] * batch_size, dataclasses.replace(config, max_new_tokens=2), **options)
    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current RSS
    result = generate(references, config, **options)
    measured = _status("VmHWM") - before
    drawn = [0] * texts
    for text in result.texts:
        drawn[text.batch_index] = text.num_tokens
    engine_kv = None
    if track:
        gc.collect()
        shape = loaded.model.config  # (not `config`: the release's, used just below)
        head_dim = getattr(shape, "head_dim", None) or shape.hidden_size // shape.num_attention_heads
        with _KVTracker(shape.num_key_value_heads, head_dim) as tracker:
            generate(references, config, **options)
        engine_kv = tracker.peak
    return {
        "batch_size": batch_size, "max_batch_rows": rows, "max_new_tokens": max_new_tokens, "measured": measured,
        "rss_before": before, "engine_kv": engine_kv, "tokens": sum(drawn), "torch": torch.__version__,
        **_predict(loaded, references, batch_size, rows, max_new_tokens),
    }


def _table(results: list[dict]) -> str:
    header = ("| B | max_batch_rows | texts | prompt tokens (mean, min-max) | KV bound | KV engine | predicted "
              "| measured | ratio | CLI estimate |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for r in results:
        engine = "n/a" if r["engine_kv"] is None else f"{r['engine_kv'] / MIB:.1f}"
        lines.append(
            f"| {r['batch_size']} | {r['max_batch_rows']} | {r['texts']} | {r['prompt_mean']:.0f} "
            f"({r['prompt_min']}-{r['prompt_max']}), public {r['public_prompt']} | {r['kv_bound'] / MIB:.1f} "
            f"| {engine} | {r['predicted'] / MIB:.1f} | {r['measured'] / MIB:.1f} "
            f"| {r['measured'] / r['predicted']:.2f} | {r['cli_estimate'] / MIB:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--configs", default=",".join(f"{b}x{r}" for b, r in CONFIGS),
                        help="comma-separated BxR (B references, max_batch_rows R); default 3x16,3x64,7x16,7x64")
    parser.add_argument("--no-track", action="store_true",
                        help="skip the second run that counts the engine's KV tensors")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        b, r = (int(x) for x in args.child.split("x"))
        print(json.dumps(child(b, r, args.max_new_tokens, args.dtype, not args.no_track)))
        return 0
    if not REFERENCES.is_file():
        raise SystemExit(f"references not found: {REFERENCES}")
    results = []
    for config in args.configs.split(","):
        command = [sys.executable, __file__, "--child", config.strip(), "--max-new-tokens", str(args.max_new_tokens),
                   "--dtype", args.dtype] + (["--no-track"] if args.no_track else [])
        done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy(), check=False)
        if done.returncode:
            raise SystemExit(f"configuration {config} failed:\n{done.stderr[-3000:]}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        last = results[-1]
        print(f"{config}: measured {last['measured'] / MIB:.1f} MiB, predicted {last['predicted'] / MIB:.1f} MiB",
              file=sys.stderr, flush=True)
    print(f"dtype {args.dtype}, T = {args.max_new_tokens}, torch {results[0]['torch']}; MiB")
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
