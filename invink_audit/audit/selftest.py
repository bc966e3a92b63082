"""The auditor's self-test on planted bugs and on the paper's baselines.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.selftest", "Testing the auditor"); the baseline rows:
docs/guide/baselines.md ("Audits of the baselines").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

from accounting import PrivacyClaim, composed_epsilon
from invink_audit.audit import synthetic
from invink_audit.audit.analysis import analyse
from invink_audit.audit.records import REPORT_PRIVACY_NOTICE, WhiteBoxReport, to_jsonable
from invink_audit.audit.stats import Verdict
from invink_audit.audit.whitebox import WhiteBoxConfig
from invink_audit.not_private import mark_not_private, md_table

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
    # the paper's baselines through the mechanism interface
    baselines: bool = True
    amin_svt_threshold: float = 0.5
    amin_svt_noise: float = 1.0
    amin_max_private_tokens: int = 4
    amin_posterior_grid: int = 512
    adapmixed_stop_epsilon: float = 3.0
    adapmixed_within_epsilon: float = 60.0  # never reached within T = 10 steps on the synthetic sources (tested)
    adapmixed_screen_samples: int = 128
    # the adapter path (audit_generator on transformers' generate with a DP logits processor, the tiny model)
    adapters: bool = True
    adapter_references: tuple[str, ...] = ("alice lives in paris", "bob likes green tea")
    adapter_max_new_tokens: int = 4


@dataclasses.dataclass(frozen=True)
class SelfTestEntry:
    mechanism: str
    description: str
    expected: str
    verdict: str
    passed: bool
    sources: tuple[dict, ...]
    seconds: float
    guarantee: str = "a-priori"


@dataclasses.dataclass(frozen=True)
class SelfTestResult:
    entries: tuple[SelfTestEntry, ...]
    coverage: dict
    reports: tuple[WhiteBoxReport, ...]
    seconds: float
    #: the planted bugs audited black-box (:func:`blackbox_rows`): reported, not part of :attr:`passed`
    blackbox: tuple[dict, ...] = ()

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.entries) and self.coverage.get("passed", False)

    def to_json(self) -> list[dict]:
        """The issue's JSON: a list of {"mechanism", "verdict", ...}, each marked NOT PRIVATE like every audit
        report; coverage rides on "correct", each mechanism's black-box row on its entry (``"blackbox"``)."""
        rows: dict[str, list] = {}
        for r in self.blackbox:
            rows.setdefault(r["mechanism"], []).append(r)
        out = []
        for e in self.entries:
            d = to_jsonable(e)
            if e.mechanism == "correct":
                d["coverage"] = to_jsonable(self.coverage)
            if e.mechanism in rows:
                d["blackbox"] = to_jsonable(rows[e.mechanism])
            out.append(mark_not_private(d, REPORT_PRIVACY_NOTICE))
        return out


def baseline_mechanisms(s: SelfTestSettings) -> list:
    """The baseline rows (docs/guide/baselines.md, "Audits of the baselines") as
    :class:`~invink_audit.audit.synthetic.AuditedMechanism`."""
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism, AminSensitivity

    def amin(sensitivity):
        return AminMechanism(
            AminConfig(
                clip_norm=s.clip_norm, batch_size=s.batch_size, temperature=s.temperature, public_temperature=s.temperature,
                svt_threshold=s.amin_svt_threshold, svt_noise=s.amin_svt_noise,
                max_private_tokens=s.amin_max_private_tokens, sensitivity=sensitivity, posterior_grid=s.amin_posterior_grid,
            )
        )

    def ada(epsilon):
        return AdaPMixEDMechanism(
            AdaPMixEDConfig(batch_size=s.batch_size, epsilon=epsilon, screen_samples=s.adapmixed_screen_samples)
        )

    rows = [
        ("amin-paper-sensitivity",
         "Amin et al. 2024 accounted with C/B and 1/B under replace-by-null (the paper's convention; true: 2C/B, 2/B)",
         amin(AminSensitivity.PAPER), "VIOLATION"),
        ("amin-correct", "Amin et al. 2024 accounted with the replace-by-null sensitivities 2C/B and 2/B",
         amin(AminSensitivity.REPLACE_BY_NULL), "PASS"),
        ("adapmixed-stop-rule",
         f"AdaPMixED, data-dependent eps={s.adapmixed_stop_epsilon:g} reached within T: its stop rule is a function of "
         "the references (reported data-dependent eps vs measurement)", ada(s.adapmixed_stop_epsilon), "VIOLATION"),
        ("adapmixed-within-budget",
         f"AdaPMixED, data-dependent eps={s.adapmixed_within_epsilon:g} never reached: measured vs reported "
         "(a data-dependent guarantee is never a PASS)", ada(s.adapmixed_within_epsilon), "INCONCLUSIVE"),
    ]  # fmt: skip
    return [synthetic.AuditedMechanism(name, description, mechanism, s.max_new_tokens, expected)
            for name, description, mechanism, expected in rows]


def selftest_sources(settings: SelfTestSettings) -> list:
    """The self-test's two synthetic sources: random logits (reference 0 moves tokens in and out of the
    private top-k) and the hardest case (reference 0 moves every logit by the full clip)."""
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


def selftest_cases(s: SelfTestSettings, source) -> list:
    """The audited mechanisms on ``source`` (:class:`~invink_audit.audit.synthetic.AuditedMechanism`): the correct
    InvisibleInk, the four planted bugs (the data-dependent budget computed from the source's references), the
    per-unit bug (:func:`unit_two_slots`) and,
    with ``baselines``, :func:`baseline_mechanisms`."""
    params = dict(clip_norm=s.clip_norm, temperature=s.temperature, top_k=s.top_k, batch_size=s.batch_size,
                  max_new_tokens=s.max_new_tokens)
    return [synthetic.correct_mechanism(**params),
            *synthetic.mutants(**params, reference_lengths=source.reference_lengths), unit_two_slots(s),
            *(baseline_mechanisms(s) if s.baselines else [])]


def unit_two_slots(s: SelfTestSettings):
    """The planted per-unit bug (docs/guide/privacy-unit.md): unit 0 (the source's reference 0, the canary) placed in
    two slots of one batch, audited with per-unit neighbours (every slot of a unit null,
    :class:`~invink_audit.audit.units.UnitPlacement`), while the release claims the per-reference ε."""
    from invink_audit.audit.units import UnitPlacement

    config = synthetic.correct_mechanism(clip_norm=s.clip_norm, temperature=s.temperature, top_k=s.top_k,
                                         batch_size=s.batch_size, max_new_tokens=s.max_new_tokens).mechanism.config
    placement = (0, 0, *range(2, s.batch_size))  # unit 1 is displaced by unit 0's second reference
    return synthetic.AuditedMechanism(
        "unit-two-slots", "a unit's two references in two slots of one batch, claimed at the per-reference epsilon",
        UnitPlacement(config, placement, name="unit-two-slots"), s.max_new_tokens, "VIOLATION",
    )


def run_selftest(
    settings: SelfTestSettings | None = None,
    *,
    generator: torch.Generator | None = None,
    progress: Callable[[str], None] | None = None,
) -> SelfTestResult:
    """Run the auditor against the correct mechanism, the planted bugs and the baselines on every synthetic source."""
    from invink_audit.mechanism import make_generator

    s = settings or SelfTestSettings()
    gen = generator if generator is not None else make_generator()
    say = progress if progress is not None else (lambda message: None)
    start = time.perf_counter()
    config = WhiteBoxConfig(
        alphas=s.alphas, num_samples=s.num_samples, num_is_samples=s.num_is_samples, significance=s.significance
    )
    sources = selftest_sources(s)
    cases = [selftest_cases(s, source) for source in sources]
    entries, reports = [], []
    for i, first in enumerate(cases[0]):
        t0 = time.perf_counter()
        per_source, verdicts = [], []
        for source, audited in zip(sources, (c[i] for c in cases)):
            say(f"{audited.name} on {source.name}")
            rep, rec = _audit_on_source(audited, source, config, s, gen)
            reports.append(rep)
            verdicts.append(rep.verdict)
            per_source.append(_source_row(rep, rec, source))
        verdict = Verdict.worst(verdicts)
        entries.append(
            SelfTestEntry(
                first.name, first.description, first.expected, verdict.value, verdict.value == first.expected,
                tuple(per_source), time.perf_counter() - t0, rec.claim.kind,
            )
        )
    if s.baselines:
        entries += augpe_entries(s)
    if s.adapters:
        say("the adapter path: a DP logits processor in transformers' generate, audited by audit_generator")
        entries += adapter_entries(s)
    say("coverage against exact enumeration")
    coverage = coverage_check(generator=gen, significance=s.significance)
    say("planted bugs, black-box (batched, 10^4 batches per mechanism and source)")
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    rows = blackbox_rows(s, seed=seed) + (augpe_blackbox_rows(s, seed=seed) if s.baselines else [])
    return SelfTestResult(tuple(entries), coverage, tuple(reports), time.perf_counter() - start, tuple(rows))


def _audit_on_source(audited, source, config: WhiteBoxConfig, s: SelfTestSettings, gen):
    """One mechanism audited on one source, with the config its claim allows: (report, record)."""
    t1 = time.perf_counter()
    rec = synthetic.run_synthetic_audit(source, audited, config.for_claim(audited.claim())[0], generator=gen)
    t2 = time.perf_counter()
    rep = analyse(
        rec,
        mechanism=audited.name,
        source=source.name,
        canaries=source.canaries,
        timings={"decode_seconds": t2 - t1},
        settings=dataclasses.asdict(s),
        claim_details={"claimed_by": audited.description},
    )
    return rep, rec


def _source_row(rep: WhiteBoxReport, rec, source) -> dict:
    """The self-test JSON's row for one source (a data-dependent claim's reported budget and measurements too)."""
    row = {
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
        "mean_length": float(rec.lengths.mean()),
    }
    if not rec.claim.a_priori:
        row.update({
            "reported_epsilon": rep.claim.epsilon_claimed,
            "reported_renyi_budget": rep.claim.renyi_budget,
            "renyi_order": rep.claim.renyi_order,
            "measured": [
                {"alpha": e.alpha, "neighbour": e.neighbour, "direction": e.direction, "lower": e.lower,
                 "estimate": e.estimate, "claimed": e.claimed}
                for e in rep.sequence
            ],
        })
    return row


def _source_cell(s: dict) -> str:
    """One source of a row in the Markdown table: (verdict, max loss range / ε0, rejected tests, step failures), or
    for AugPE's exact histogram check (no loss range, no statistical test) the realised ρ over the claimed ρ."""
    if "realised_over_claimed_rho" in s:
        return (f"{s['source']}: {s['verdict']}, realised/claimed ρ {s['realised_over_claimed_rho']:.3g} (exact), "
                f"{sum(s['step_failures'].values())}")
    return (f"{s['source']}: {s['verdict']}, {s['max_loss_range_over_epsilon0']:.3g}, {s['rejected_tests']}/{s['tests']}, "
            f"{sum(s['step_failures'].values())}")


def selftest_markdown(result: SelfTestResult) -> str:
    """A Markdown summary: one row per mechanism, then the coverage check."""
    rows = [(e.mechanism, e.guarantee, e.expected, f"**{e.verdict}**", "; ".join(_source_cell(s) for s in e.sources),
             e.description) for e in result.entries]
    lines = [
        "# Auditor self-test on planted bugs",
        "",
        f"{'PASSED' if result.passed else 'FAILED'}: the correct mechanism must get PASS and every mutant "
        f"VIOLATION; Amin et al. PASS when correctly accounted and VIOLATION with the paper's C/B; AdaPMixED's "
        f"data-dependent guarantee is compared with the measurement and never gets a PASS"
        f"{_AUGPE_SENTENCE if any(e.mechanism in AUGPE_ROWS for e in result.entries) else ''}"
        f"{_ADAPTER_SENTENCE if any(e.mechanism in ADAPTER_ROWS for e in result.entries) else ''} ({result.seconds:.1f} s).",
        "",
        *md_table("mechanism | guarantee | expected | verdict | per source (verdict, max loss range / ε0, rejected tests, "
                  "step failures) | what it does", rows),
    ]
    dd = [e for e in result.entries if e.guarantee == "data-dependent"]
    if dd:
        lines += ["", "Data-dependent guarantees, reported against the white-box measurement (never a PASS):", ""]
        for e in dd:
            for src in e.sources:
                rows = src.get("measured", [])
                worst = max(rows, key=lambda r: r["estimate"], default=None)
                measured = (
                    f"largest measured D_{worst['alpha']:g} {worst['estimate']:.4g} (lower end {worst['lower']:.4g}; "
                    f"neighbour {worst['neighbour']}, {worst['direction']})" if worst else "no estimate"
                )
                lines.append(
                    f"- {e.mechanism} on {src['source']}: reported ε = {src['reported_epsilon']:g}, i.e. D_{src['renyi_order']:g} ≤ "
                    f"{src['reported_renyi_budget']:.4g}; {measured}; {src['step_failures']['support']} support mismatches "
                    "(the stop outcome possible under one dataset only)"
                )
    if result.blackbox:
        rows = []
        for r in result.blackbox:
            gdp = "–" if r["gdp_epsilon"] is None else f"{r['gdp_epsilon']:.3g}"
            true = "–" if r["true_epsilon"] is None else f"{r['true_epsilon']:.3g}"
            curve = ("– (nothing certified)" if r["curve_epsilon_lower_bound"] <= 0 else
                     f"{r['curve_delta']:.2g}: {r['curve_epsilon_lower_bound']:.3g} vs {r['curve_claimed_epsilon']:.3g}")
            rows.append((r["mechanism"], r["source"], f"{r['claimed_epsilon']:.3g}", true, r["verdict"],
                         f"{r['epsilon_lower_bound']:.3g}", f"{r['ceiling']:.3g}", curve, gdp))
        lines += [
            "", "Black-box, batched (one trial per batch, the exact likelihood ratio, 10⁴ batches per source, tested "
            "against the claim's whole privacy curve ε(δ'); reported, not part of PASSED: a black box may miss a "
            "violation that is there):", "",
            *md_table("mechanism | source | claimed ε (δ = 1e-6) | true ε (exact) | verdict | ε lower bound at 1e-6 | ceiling | "
                      "tested on the curve: δ', ε lower bound vs claimed | GDP estimate of ε", rows),
        ]
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
    """Write report.json (the issue's list), report.md, and the per-audit reports and plots; like every
    audit report, owner-only and marked NOT PRIVATE (:func:`~invink_audit.audit.report.write_report`)."""
    from invink_audit.audit.report import whitebox_markdown, write_report
    from invink_audit.not_private import write_not_private_json, write_not_private_text

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_not_private_json(out / "report.json", result.to_json(), indent=2, notice=REPORT_PRIVACY_NOTICE)
    md = selftest_markdown(result) + "\n\n" + "\n\n".join(whitebox_markdown(r) for r in result.reports)
    write_not_private_text(out / "report.md", md, markdown=True)
    written = [out / "report.json", out / "report.md"]
    if plots:
        for r in result.reports:
            written += write_report(r, out / f"{r.mechanism}-{r.source}", plots=True)
    return written


def blackbox_rows(settings: SelfTestSettings | None = None, *, num_batches: int = 10_000, seed: int = 0) -> list[dict]:
    """The planted bugs audited **black-box** (:mod:`invink_audit.audit.batched`, the exact log-likelihood ratio) on
    each self-test source (reference 0 the canary), against the claim's whole curve
    (:class:`~invink_audit.audit.tradeoff.PrivacyProfile`). One row per (mechanism, source): claimed ε at δ = 1e-6,
    verdict, bounds at that δ and on the curve, ceiling, GDP estimate and, on the stationary hardest-case source, the
    **true** ε (:func:`~invink_audit.audit.synthetic.exact_epsilon_stationary`; None elsewhere). Not part of
    :func:`run_selftest`'s pass criterion: a black box may miss a violation that is there."""
    from invink_audit.audit.batched import LLR_SCORE, batched_canary_audit
    from invink_audit.audit.targets import SyntheticTarget

    s = settings or SelfTestSettings()
    rows = []
    for source in selftest_sources(s):
        for mechanism in selftest_cases(dataclasses.replace(s, baselines=False), source):  # the correct one, the bugs
            claim = mechanism.claim()

            def curve(d, e0=claim.epsilon0, steps=claim.max_new_tokens):
                return composed_epsilon(d, e0, steps, "br-adaptive")

            try:
                true_epsilon = synthetic.exact_epsilon_stationary(source, mechanism, 1e-6)
            except ValueError:  # a source whose logits follow the prefix, or a data-dependent budget
                true_epsilon = None
            start = time.perf_counter()
            with synthetic.torch_threads(1):
                report = batched_canary_audit(
                    SyntheticTarget(source, mechanism, seed=seed), ["(a null reference)"], "the canary",
                    batch_size=s.batch_size, num_batches=num_batches, claimed_epsilon=curve(1e-6), claimed_delta=1e-6,
                    scores=[LLR_SCORE], significance=s.significance, seed=seed + 1, claimed_profile=curve,
                )
            rows.append(_blackbox_row(mechanism.name, source.name, mechanism.expected, true_epsilon, report, start))
    return rows


def _blackbox_row(mechanism: str, source: str, expected: str, true_epsilon, report, start: float) -> dict:
    """One black-box self-test row: the batched audit's verdict, its bounds at the quoted δ and on the claim's
    curve, its ceiling and GDP estimate, beside the exact true ε where known."""
    point = report.sequential["profile"]
    return {
        "mechanism": mechanism, "source": source, "expected": expected, "claimed_epsilon": report.claimed_epsilon,
        "true_epsilon": true_epsilon, "verdict": report.verdict.value, "epsilon_lower_bound": report.epsilon_lower_bound,
        "curve_delta": point["delta"], "curve_epsilon_lower_bound": point["epsilon_lower_bound"],
        "curve_claimed_epsilon": point["claimed_epsilon"], "ceiling": report.ceiling,
        "gdp_epsilon": None if report.gdp is None else report.gdp["epsilon"]["estimate"],
        "trials": report.num_trials, "stopped": report.sequential["stopped"], "seconds": time.perf_counter() - start,
    }  # fmt: skip


#: AugPE's self-test rows (mechanism name → (sensitivity accounted, expected verdict, description))
AUGPE_ROWS = {
    "augpe-correct": ("replace-by-null", "PASS",
                      "AugPE's noisy histogram accounted with Δ = √2 under replace-by-null (correct)"),
    "augpe-paper-sensitivity": ("paper", "VIOLATION",
                                "AugPE's noisy histogram accounted with Δ = 1 under replace-by-null (the paper's "
                                "convention; true: √2)"),
}
_AUGPE_SENTENCE = "; AugPE's histogram PASS with Δ = √2 and VIOLATION with the paper's Δ = 1 (exact check)"


def augpe_entries(settings: SelfTestSettings | None = None) -> list[SelfTestEntry]:
    """AugPE's histogram release checked exactly (:func:`invink_audit.audit.augpe.exact_histogram_check`: every
    replace-by-null neighbour, the exact Rényi divergence of the released Gaussians against the claim's α·ρ) on the
    self-test's embeddings (:func:`~invink_audit.audit.augpe.selftest_datasets`), one entry per accounting of
    :data:`AUGPE_ROWS` with the claim :func:`~invink_audit.audit.augpe.selftest_claim`. Exact: no sampling."""
    from invink_audit.audit.augpe import exact_histogram_check, selftest_claim, selftest_datasets

    s = settings or SelfTestSettings()
    entries = []
    for name, (sensitivity, expected, description) in AUGPE_ROWS.items():
        t0, claim = time.perf_counter(), selftest_claim(sensitivity)
        per_source, verdicts = [], []
        for source, references, candidates, null in selftest_datasets():
            check = exact_histogram_check(references, candidates, null, claim, alphas=s.alphas)
            verdicts.append(check.verdict)
            per_source.append({
                "source": source, "verdict": check.verdict.value, "reason": check.reason,
                "step_failures": {"renyi": check.failures}, "rejected_tests": 0, "tests": 0,
                "realised_over_claimed_rho": check.ratio, "max_l2_shift": check.max_l2_shift,
                "claimed_l2_sensitivity": claim.l2_sensitivity, "worst_neighbour": check.worst_neighbour,
                "renyi": check.renyi_table(),
            })  # fmt: skip
        verdict = Verdict.worst(verdicts)
        entries.append(SelfTestEntry(name, f"{description}; {claim.describe()}", expected, verdict.value,
                                     verdict.value == expected, tuple(per_source), time.perf_counter() - t0))
    return entries


def augpe_blackbox_rows(settings: SelfTestSettings | None = None, *, num_batches: int = 10_000, seed: int = 0) -> list[dict]:
    """AugPE's histogram audited **black-box** (:func:`invink_audit.audit.augpe.histogram_canary_audit`: one trial
    per batch, the exact log-likelihood ratio, the claim's exact μ-GDP curve) on the worst-case canary, one row per
    accounting of :data:`AUGPE_ROWS`, in :func:`blackbox_rows`' format. The true ε is exact (μ-GDP of the realised
    shift); reported, not part of :func:`run_selftest`'s pass criterion."""
    from invink_audit.audit.augpe import histogram_canary_audit, selftest_claim, true_epsilon, worst_case_canary
    from invink_audit.audit.targets import HistogramTarget

    s = settings or SelfTestSettings()
    rows = []
    for name, (sensitivity, expected, _) in AUGPE_ROWS.items():
        claim, start = selftest_claim(sensitivity), time.perf_counter()
        target = HistogramTarget(worst_case_canary(), noise_std=claim.noise_std, iterations=claim.iterations, seed=seed)
        report = histogram_canary_audit(target, claim, num_batches=num_batches, significance=s.significance, seed=seed + 1)
        rows.append(_blackbox_row(name, "worst-case canary", expected, true_epsilon(target, report.claimed_delta), report,
                                  start))  # fmt: skip
    return rows


#: the adapter path's rows (name → (expected verdict, description)): one generator, a DP logits processor in
#: transformers' ``generate``, audited through its intercepted draws (:func:`~invink_audit.audit.audit_generator`)
ADAPTER_ROWS = {
    "adapter-dp-processor": ("PASS", "a DClip logits processor (InvisibleInk's full-vocabulary step) in transformers' "
                                     "generate with top_k=0: every draw within its ε0-bounded range"),
    "adapter-default-top-k": ("VIOLATION", "the same processor followed by generate's default top_k=50 (the generation "
                                           "config sets none): a support chosen by the private aggregate"),
    "adapter-claim-omits-a-step": ("VIOLATION", "the correct generator claimed for T - 1 draws (its first draw not "
                                                "counted, as DP-Fusion's accounting does)"),
}


_ADAPTER_SENTENCE = ("; through audit_generator, a DP logits processor in transformers' generate PASS, VIOLATION when "
                     "generate's default top-k follows it and when its claim omits a step")


def _dclip_generate(loaded, references, *, clip_norm: float, max_new_tokens: int, top_k: int | None):
    """``generate(references)`` for :func:`~invink_audit.audit.audit_generator`: transformers' sampling with a logits
    processor that replaces the public prompt's scores by the DClip aggregate of each reference's prompt (a ``None``
    reference: the public prompt, replace-by-null) given the text so far; ``top_k=None`` leaves generate's default."""
    from transformers import LogitsProcessor

    from invink_audit.mechanism import dclip_aggregate

    model, tokenizer = loaded.model, loaded.tokenizer

    class DClip(LogitsProcessor):
        def __init__(self, prompts):
            self.prompts = prompts

        def __call__(self, input_ids, scores):
            suffix = input_ids[:, self.prompts[0].shape[1]:]
            rows = torch.stack([model(torch.cat([p, suffix], 1)).logits[:, -1] for p in self.prompts[1:]], 1)
            return dclip_aggregate(rows.double(), scores.double(), clip_norm).to(scores.dtype)

    def encode(text):
        return tokenizer(text, return_tensors="pt").input_ids

    def generate(refs):
        public = "Write a short text:"
        prompts = [encode(public)] + [encode(public if r is None else f"{public} like '{r}'") for r in refs]
        options = {} if top_k is None else {"top_k": top_k}
        with torch.no_grad():
            out = model.generate(prompts[0], do_sample=True, max_new_tokens=max_new_tokens,
                                 logits_processor=[DClip(prompts)], pad_token_id=tokenizer.pad_token_id, **options)
        return out[0, prompts[0].shape[1]:].tolist()

    return generate


def adapter_entries(settings: SelfTestSettings | None = None) -> list[SelfTestEntry]:
    """:data:`ADAPTER_ROWS` on the tiny model: the claim the processor states (per step the exponential mechanism's
    ε0 = 2C/(Bτ)-bounded range, Durfee & Rogers 2019; ρ = ε0²/8, Cesar & Rogers 2021, Lemma 3.2; T draws) or, for the
    last row, the same for T - 1 draws; each audited by :func:`~invink_audit.audit.audit_generator` (every neighbour)."""
    from invink_audit.audit.intercept import audit_generator
    from invink_audit.models import build_tiny_model

    s = settings or SelfTestSettings()
    loaded, refs, steps = build_tiny_model(seed=5), list(s.adapter_references), s.adapter_max_new_tokens
    e0 = 2 * s.clip_norm / len(refs)  # temperature 1: generate's default

    def claim(claimed_steps):
        return PrivacyClaim.per_step(steps=claimed_steps, epsilon0=e0, rho=e0**2 / 8, source="DClip logits processor")

    cases = {"adapter-dp-processor": (0, steps), "adapter-default-top-k": (None, steps),
             "adapter-claim-omits-a-step": (0, steps - 1)}  # fmt: skip
    entries = []
    for name, (top_k, claimed) in cases.items():
        t0 = time.perf_counter()
        generate = _dclip_generate(loaded, refs, clip_norm=s.clip_norm, max_new_tokens=steps, top_k=top_k)
        torch.manual_seed(0)
        audit = audit_generator(generate, refs, claim(claimed))
        expected, description = ADAPTER_ROWS[name]
        source = {"source": "tiny model, transformers generate", "verdict": audit.verdict.value, "reason": audit.reason,
                  "step_failures": {"over_tolerance": sum(v > audit.tolerance for v in audit.excesses.values())},
                  "rejected_tests": 0, "tests": 0, "max_loss_range_over_epsilon0": float(audit.loss_range.max()) / e0,
                  "excesses": dict(audit.excesses), "tolerance": audit.tolerance, "dtypes": list(audit.dtypes)}  # fmt: skip
        entries.append(SelfTestEntry(name, description, expected, audit.verdict.value, audit.verdict.value == expected,
                                     (source,), time.perf_counter() - t0))
    return entries
