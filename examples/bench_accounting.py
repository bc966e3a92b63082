"""Benchmark the accountants side by side: clip norms and plan times in one run.

    .venv/bin/python examples/bench_accounting.py [--max-new-tokens 500] [--batch-size 7] [--temperature 1.2]

Prints, for ε = 1/3/5/10 at δ = 1e-6, the clip norm each accountant certifies, the ratio of br-adaptive
to cks (the gain), and the wall time of each plan (the first br-adaptive plan of a fresh install also
compiles the numba kernel; it is timed separately).
"""

from __future__ import annotations

import argparse
import time

from accounting import plan_clip_norm

ACCOUNTANTS = ("bun-steinke", "cks", "rdp", "br-adaptive")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=7)
    parser.add_argument("--temperature", type=float, default=1.2)
    parser.add_argument("--delta", type=float, default=1e-6)
    args = parser.parse_args()
    common = dict(delta=args.delta, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                  temperature=args.temperature)
    t0 = time.perf_counter()
    plan_clip_norm(epsilon=1.0, accountant="br-adaptive", **{**common, "max_new_tokens": 2})
    print(f"warm-up (numba kernel load/compile): {time.perf_counter() - t0:.2f} s")
    print(f"T={args.max_new_tokens} B={args.batch_size} tau={args.temperature} delta={args.delta:g}")
    header = "".join(f"{a:>14}" for a in ACCOUNTANTS)
    print(f"{'epsilon':>8}{header}{'br/cks':>9}{'br plan s':>11}{'cks plan s':>11}")
    for eps in (1.0, 3.0, 5.0, 10.0):
        clip, secs = {}, {}
        for acc in ACCOUNTANTS:
            t = time.perf_counter()
            clip[acc] = plan_clip_norm(epsilon=eps, accountant=acc, **common).clip_norm
            secs[acc] = time.perf_counter() - t
        cells = "".join(f"{clip[a]:>14.4f}" for a in ACCOUNTANTS)
        print(f"{eps:>8g}{cells}{clip['br-adaptive'] / clip['cks']:>9.4f}{secs['br-adaptive']:>11.2f}{secs['cks']:>11.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
