"""How tight the black-box audit is on synthetic logits, and how often it refutes each planted bug.

Two tables, written to ``audits/reports/tightness/`` (report.md, report.json; docs/guide/auditing.md quotes them):

1. The correct mechanism with the worst-case (hardest-case) canary at accountant's ε ∈ {1, 2, 4} (δ = 1e-6),
   T ∈ {10, 30}, B = 4, 10,000 batches in one look: the accountant's ε, the **true** ε (exact:
   ``synthetic.exact_epsilon_stationary``), the GDP estimate over all thresholds, the rigorous bound at the
   quoted δ, the tested point of the claim's curve, and the ceiling.
2. Each planted bug of the self-test on each source over ``--seeds`` seeds (10,000 batches, four looks, the
   claim's curve): how many runs are a VIOLATION, beside the bug's true ε where it is exact.

    .venv/bin/python examples/audit_tightness.py [--seeds 10] [--output audits/reports/tightness]

About 3 minutes on a 2-core CPU (one thread per run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from accounting import composed_epsilon, plan_clip_norm
from invink_audit.audit import synthetic
from invink_audit.audit.batched import LLR_SCORE, batched_canary_audit
from invink_audit.audit.selftest import SelfTestSettings, selftest_sources
from invink_audit.audit.targets import SyntheticTarget

DELTA = 1e-6


def _audit(source, mechanism, *, seed: int, num_looks: int):
    claim = mechanism.claim()

    def curve(d):
        return composed_epsilon(d, claim.epsilon0, claim.max_new_tokens, "br-adaptive")

    with synthetic.torch_threads(1):
        return batched_canary_audit(
            SyntheticTarget(source, mechanism, seed=seed), ["(a null reference)"], "the canary",
            batch_size=source.batch_size, num_batches=10_000, claimed_epsilon=curve(DELTA), claimed_delta=DELTA,
            scores=[LLR_SCORE], seed=seed + 1, claimed_profile=curve, num_looks=num_looks,
        )


def _true_epsilon(source, mechanism):
    try:
        return synthetic.exact_epsilon_stationary(source, mechanism, DELTA)
    except ValueError:
        return None


def tightness_rows() -> list[dict]:
    rows = []
    for epsilon in (1.0, 2.0, 4.0):
        for steps in (10, 30):
            c = plan_clip_norm(epsilon=epsilon, delta=DELTA, max_new_tokens=steps, batch_size=4, temperature=1.0).clip_norm
            mechanism = synthetic.correct_mechanism(clip_norm=c, temperature=1.0, top_k=3, batch_size=4, max_new_tokens=steps)
            source = synthetic.HardestCaseSource(vocab_size=6, batch_size=4)
            report = _audit(source, mechanism, seed=1, num_looks=1)
            point, gdp = report.sequential["profile"], report.gdp["epsilon"]
            rows.append({
                "target_epsilon": epsilon, "T": steps, "clip_norm": c, "claimed_epsilon": report.claimed_epsilon,
                "true_epsilon": _true_epsilon(source, mechanism), "gdp_epsilon": gdp["estimate"],
                "gdp_lower": gdp["lower"], "gdp_upper": gdp["upper"], "verdict": report.verdict.value,
                "epsilon_lower_bound": report.epsilon_lower_bound, "curve_point": point, "ceiling": report.ceiling,
            })  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def power_rows(num_seeds: int) -> list[dict]:
    s = SelfTestSettings()
    kw = dict(clip_norm=s.clip_norm, temperature=s.temperature, top_k=s.top_k, batch_size=s.batch_size,
              max_new_tokens=s.max_new_tokens)
    rows = []
    for source in selftest_sources(s):
        for mechanism in [synthetic.correct_mechanism(**kw), *synthetic.mutants(**kw, reference_lengths=source.reference_lengths)]:
            start = time.perf_counter()
            reports = [_audit(source, mechanism, seed=seed, num_looks=4) for seed in range(num_seeds)]
            rows.append({
                "mechanism": mechanism.name, "source": source.name, "claimed_epsilon": reports[0].claimed_epsilon,
                "true_epsilon": _true_epsilon(source, mechanism),
                "violations": sum(r.verdict.value == "VIOLATION" for r in reports), "runs": num_seeds,
                "mean_trials": sum(r.num_trials["evaluation"] for r in reports) / num_seeds,
                "seconds_per_run": (time.perf_counter() - start) / num_seeds,
            })  # fmt: skip
            print(rows[-1], flush=True)
    return rows


def _markdown(tight: list[dict], power: list[dict]) -> str:
    def num(x):
        return "–" if x is None else f"{x:.3g}"

    lines = [
        "# Black-box audit: tightness and power on synthetic logits", "",
        "Written by `examples/audit_tightness.py` (synthetic logits: no private data).", "",
        "## The correct mechanism, worst-case canary (B = 4, 10,000 batches, one look, δ = 1e-6)", "",
        "| accountant's ε | T | true ε (exact) | GDP estimate [95%] | estimate / claim | bound at δ | curve: δ', bound vs claim | ceiling |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in tight:
        p = r["curve_point"]
        lines.append(
            f"| {num(r['claimed_epsilon'])} | {r['T']} | {num(r['true_epsilon'])} | {num(r['gdp_epsilon'])} "
            f"[{num(r['gdp_lower'])}, {num(r['gdp_upper'])}] | {r['gdp_epsilon'] / r['claimed_epsilon']:.2f} | "
            f"{num(r['epsilon_lower_bound'])} | "
            + ("– (nothing certified)" if p["epsilon_lower_bound"] <= 0 else
               f"{p['delta']:.2g}: {num(p['epsilon_lower_bound'])} vs {num(p['claimed_epsilon'])}")
            + f" | {num(r['ceiling'])} |"
        )
    lines += [
        "", f"## Planted bugs: VIOLATION in how many runs (10,000 batches, four looks, the claim's curve, {power[0]['runs']} seeds)", "",
        "| mechanism | source | claimed ε | true ε (exact) | true / claimed | VIOLATION | mean evaluation trials | s per run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in power:
        ratio = "–" if r["true_epsilon"] is None else f"{r['true_epsilon'] / r['claimed_epsilon']:.2f}"
        lines.append(
            f"| {r['mechanism']} | {r['source']} | {num(r['claimed_epsilon'])} | {num(r['true_epsilon'])} | {ratio} | "
            f"{r['violations']} of {r['runs']} | {r['mean_trials']:.0f} | {r['seconds_per_run']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--output", default="audits/reports/tightness")
    args = parser.parse_args()
    tight, power = tightness_rows(), power_rows(args.seeds)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    # synthetic logits, no references: nothing private to mark
    (out / "report.json").write_text(json.dumps({"tightness": tight, "power": power}, indent=1) + "\n")
    (out / "report.md").write_text(_markdown(tight, power))
    print(_markdown(tight, power))


if __name__ == "__main__":
    main()
