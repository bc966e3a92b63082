"""The auditor's self-test on planted bugs (issue 5, "Self-test on planted bugs").

The white-box auditor runs on synthetic logit sources (:mod:`invink_audit.audit.synthetic`) against
the correct InvisibleInk mechanism and four mutants; a working auditor says PASS for the first and
VIOLATION for every mutant. A mechanism's verdict is VIOLATION if any source shows one, PASS if
every source passes, INCONCLUSIVE otherwise. A last part enumerates a small mechanism's whole
output distribution and counts how many Monte Carlo / importance-sampling intervals cover the
exact divergences.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import torch

from invink_audit.audit import synthetic
from invink_audit.audit.analysis import analyse
from invink_audit.audit.report import WhiteBoxReport, to_jsonable
from invink_audit.audit.stats import Verdict
from invink_audit.audit.whitebox import WhiteBoxConfig

__all__ = ["SelfTestSettings", "SelfTestEntry", "SelfTestResult", "run_selftest", "coverage_check"]


@dataclasses.dataclass(frozen=True)
class SelfTestSettings:
    """Mechanism and audit parameters of the self-test (small, so it runs in well under 2 minutes)."""

    clip_norm: float = 0.5
    temperature: float = 1.0
    top_k: int = 3
    batch_size: int = 4
    max_new_tokens: int = 10
    num_samples: int = 300
    num_is_samples: int = 100
    alphas: tuple[float, ...] = (1.5, 2.0, 4.0, 8.0)
    significance: float = 0.05


@dataclasses.dataclass(frozen=True)
class SelfTestEntry:
    mechanism: str
    description: str
    expected: str
    verdict: str
    passed: bool
    sources: tuple[dict, ...]
    seconds: float


@dataclasses.dataclass(frozen=True)
class SelfTestResult:
    entries: tuple[SelfTestEntry, ...]
    coverage: dict
    reports: tuple[WhiteBoxReport, ...]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.entries) and self.coverage.get("passed", False)

    def to_json(self) -> list[dict]:
        """The issue's JSON: a list of {"mechanism", "verdict", ...}; coverage rides on "correct"."""
        out = []
        for e in self.entries:
            d = to_jsonable(e)
            if e.mechanism == "correct":
                d["coverage"] = to_jsonable(self.coverage)
            out.append(d)
        return out


def _combine(verdicts: list[Verdict]) -> Verdict:
    if any(v is Verdict.VIOLATION for v in verdicts):
        return Verdict.VIOLATION
    if all(v is Verdict.PASS for v in verdicts):
        return Verdict.PASS
    return Verdict.INCONCLUSIVE


def _sources(settings: SelfTestSettings):
    return [
        synthetic.RandomSource(vocab_size=8, batch_size=settings.batch_size, seed=0),
        synthetic.HardestCaseSource(vocab_size=6, batch_size=settings.batch_size, temperature=settings.temperature),
    ]


def coverage_check(
    *, generator: torch.Generator, significance: float = 0.05, num_samples: int = 400, num_is_samples: int = 200
) -> dict:
    """Audit an enumerable mechanism (V = 4, T = 4) and count intervals covering the exact values.

    Each interval is at level 1 − significance on its own, so about that fraction (or more: the
    bounds are conservative) must cover; ``passed`` requires at least 1 − 2·significance.
    """
    source = synthetic.RandomSource(vocab_size=4, batch_size=3, period=2, scale=1.5, private_scale=1.0, eos_shift=1.0, seed=3)
    mech = synthetic.correct_mechanism(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=3, max_new_tokens=4)
    config = WhiteBoxConfig(
        alphas=(1.5, 2.0, 4.0), num_samples=num_samples, num_is_samples=num_is_samples, significance=significance
    )
    rec = synthetic.run_synthetic_audit(source, mech, config, generator=generator)
    exact = synthetic.enumerate_outputs(source, mech)
    report = analyse(rec, mechanism="correct (enumerable)", source="random V=4, T=4", exact=exact)
    rows = [s for s in report.sequence if s.exact is not None]
    covered = [s.lower - 1e-12 <= s.exact <= s.upper + 1e-12 for s in rows]
    frac = sum(covered) / len(covered) if covered else 0.0
    return {
        "intervals": len(covered),
        "covered": int(sum(covered)),
        "fraction": frac,
        "level": 1 - significance,
        "passed": bool(covered) and frac >= 1 - 2 * significance,
        "num_outputs": int(exact.log_prob_actual.size),
        "max_abs_error_importance_sampling": max(
            (abs(s.estimate - s.exact) for s in rows if s.estimator == "importance-sampling"), default=math.nan
        ),
    }


def run_selftest(
    settings: SelfTestSettings | None = None,
    *,
    generator: torch.Generator | None = None,
    progress: Callable[[str], None] | None = None,
) -> SelfTestResult:
    """Run the auditor against the correct mechanism and the four mutants on every synthetic source."""
    from invink_audit.mechanism import make_generator

    s = settings or SelfTestSettings()
    gen = generator if generator is not None else make_generator()
    start = time.perf_counter()
    config = WhiteBoxConfig(
        alphas=s.alphas, num_samples=s.num_samples, num_is_samples=s.num_is_samples, significance=s.significance
    )
    params = dict(clip_norm=s.clip_norm, temperature=s.temperature, top_k=s.top_k, batch_size=s.batch_size, max_new_tokens=s.max_new_tokens)
    mechanisms = [synthetic.correct_mechanism(**params), *synthetic.mutants(**params)]
    entries, reports = [], []
    for mech in mechanisms:
        t0 = time.perf_counter()
        per_source, verdicts = [], []
        for source in _sources(s):
            if progress is not None:
                progress(f"{mech.name} on {source.name}")
            t1 = time.perf_counter()
            rec = synthetic.run_synthetic_audit(source, mech, config, generator=gen)
            t2 = time.perf_counter()
            rep = analyse(
                rec,
                mechanism=mech.name,
                source=source.name,
                canaries=source.canaries,
                timings={"decode_seconds": t2 - t1},
                settings=dataclasses.asdict(s),
                claim_details={"claimed_by": mech.description},
            )
            reports.append(rep)
            verdicts.append(rep.verdict)
            per_source.append(
                {
                    "source": source.name,
                    "verdict": rep.verdict.value,
                    "reason": rep.reason,
                    "step_failures": rep.step_checks.failures,
                    "rejected_tests": sum(t.rejected for t in rep.tests),
                    "tests": len(rep.tests),
                    "max_loss_range_over_epsilon0": (
                        rep.step_checks.max_loss_range / rep.step_checks.epsilon0 if rep.step_checks.epsilon0 else math.nan
                    ),
                    "headroom": rep.headroom_summary(),
                    "worst_neighbour": rep.worst_neighbour,
                    "budgets": {"R": rec.extra.get("budget_actual"), "R'_j": rec.extra.get("budget_neighbours")},
                }
            )
        verdict = _combine(verdicts)
        entries.append(
            SelfTestEntry(
                mech.name, mech.description, mech.expected, verdict.value, verdict.value == mech.expected,
                tuple(per_source), time.perf_counter() - t0,
            )
        )
    if progress is not None:
        progress("coverage against exact enumeration")
    coverage = coverage_check(generator=gen, significance=s.significance)
    return SelfTestResult(tuple(entries), coverage, tuple(reports), time.perf_counter() - start)


def selftest_markdown(result: SelfTestResult) -> str:
    """A Markdown summary: one row per mechanism, then the coverage check."""
    lines = [
        "# Auditor self-test on planted bugs",
        "",
        f"{'PASSED' if result.passed else 'FAILED'}: the correct mechanism must get PASS and every mutant "
        f"VIOLATION ({result.seconds:.1f} s).",
        "",
        "| mechanism | expected | verdict | per source (verdict, max loss range / ε0, rejected tests) | what it does |",
        "|---|---|---|---|---|",
    ]
    for e in result.entries:
        per = "; ".join(
            f"{s['source']}: {s['verdict']}, {s['max_loss_range_over_epsilon0']:.3g}, {s['rejected_tests']}/{s['tests']}"
            for s in e.sources
        )
        lines.append(f"| {e.mechanism} | {e.expected} | **{e.verdict}** | {per} | {e.description} |")
    c = result.coverage
    lines += [
        "",
        f"Coverage against exact enumeration ({c['num_outputs']} outputs): {c['covered']} of {c['intervals']} "
        f"intervals (each at level {c['level']:g}) contain the exact Rényi divergence; largest importance-sampling "
        f"error {c['max_abs_error_importance_sampling']:.4f} nats.",
        "",
    ]
    return "\n".join(lines)


def write_selftest(result: SelfTestResult, output_dir, *, plots: bool = True) -> list:
    """Write report.json (the issue's list), report.md, and the per-audit reports and plots."""
    import json
    from pathlib import Path

    from invink_audit.audit.report import _whitebox_markdown, write_report

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")
    md = selftest_markdown(result) + "\n\n" + "\n\n".join(_whitebox_markdown(r) for r in result.reports)
    (out / "report.md").write_text(md)
    written = [out / "report.json", out / "report.md"]
    if plots:
        for r in result.reports:
            sub = out / f"{r.mechanism}-{r.source}"
            written += write_report(r, sub, plots=True)
    return written
