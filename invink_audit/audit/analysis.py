r"""From the measurements of a white-box audit to a report with a verdict.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.analysis").
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Mapping

import numpy as np

from accounting import ACCOUNTANTS, composed_epsilon, rdp_to_epsilon, zcdp_to_epsilon
from accounting.limits import check_count, check_delta, check_positive
from invink_audit.audit import stats
from invink_audit.audit.records import AccountantComparison, AuditTimings, DeltaEstimate, LossHistogram, ReportedClaim, SequenceEstimate, StepCheckSummary, WhiteBoxReport, WorstNeighbour, sampled_confirmations
from invink_audit.audit.whitebox import (
    KIND_ACTUAL,
    KIND_MIXTURE_FORWARD,
    KIND_MIXTURE_REVERSE,
    KIND_NEIGHBOUR,
    RESOLVABLE_SHARE,
    Direction,
    RecordedAudit,
)

__all__ = ["analyse", "sequence_losses", "accountant_epsilons", "claim_epsilons"]


def sequence_losses(rec: RecordedAudit, neighbour: int, direction: Direction) -> np.ndarray:
    r"""Exact privacy losses of the Monte Carlo texts: :math:`\log P(x)/P'(x)` with x ~ P.

    Forward: texts sampled from R, :math:`L = \log P_R(x) - \log P_{R'_j}(x)`; reverse: texts
    sampled from R'_j, :math:`L = \log P_{R'_j}(x) - \log P_R(x)`.
    """
    plan = rec.plan
    if direction is Direction.FORWARD:
        sel = plan.kind == KIND_ACTUAL
        lp, lq = rec.log_prob_actual[sel], rec.log_prob_neighbours[sel, neighbour]
    else:
        sel = (plan.kind == KIND_NEIGHBOUR) & (plan.neighbour == neighbour)
        lp, lq = rec.log_prob_neighbours[sel, neighbour], rec.log_prob_actual[sel]
    with np.errstate(invalid="ignore"):
        loss = lp - lq  # lq = -inf (impossible under the other) gives +inf
    if np.isnan(loss).any() or np.isneginf(lp).any():
        raise RuntimeError("a sampled text has probability 0 under its own sampling distribution")
    return loss


def _is_sums(rec: RecordedAudit, neighbour: int, direction: Direction, alpha_index: int) -> np.ndarray:
    kind = KIND_MIXTURE_FORWARD if direction is Direction.FORWARD else KIND_MIXTURE_REVERSE
    sel = (rec.plan.kind == kind) & (rec.plan.neighbour == neighbour) & (rec.plan.alpha_index == alpha_index)
    return rec.is_sums[sel]


@functools.cache
def _composed_epsilon(epsilon0: float, max_new_tokens: int, delta: float, name: str) -> float:
    return float(composed_epsilon(delta, epsilon0, max_new_tokens, name))


def accountant_epsilons(epsilon0: float, max_new_tokens: int, delta: float, accountants) -> dict:
    """ε(δ) of each named accountant of :mod:`accounting` for T tokens of an ε0-BR mechanism (checked as
    :func:`accounting.composed_epsilon` checks them, then cached on the checked values)."""
    names = tuple(accountants) if accountants is not None else ACCOUNTANTS
    delta = check_delta("delta", delta)
    epsilon0, max_new_tokens = check_positive("epsilon0", epsilon0), check_count("num_steps", max_new_tokens)
    return {name: _composed_epsilon(epsilon0, max_new_tokens, delta, name) for name in names}


def claim_epsilons(claim, delta: float, accountants=None) -> dict:
    """ε(δ) the claim certifies, by accountant: every BR accountant for a bounded-range claim
    (:func:`accountant_epsilons`); ``cks`` for a sequence zCDP claim (Canonne, Kamath & Steinke 2020,
    Prop. 12); ``rdp-filter`` for a Rényi-filter claim (its budget at its order, Balle et al. 2020,
    Thm. 21)."""
    if claim.composition == "bounded-range":
        return accountant_epsilons(claim.epsilon0, claim.max_new_tokens, delta, accountants)
    if claim.composition == "zcdp":
        return {"cks": float(zcdp_to_epsilon(claim.rho_sequence, delta, "cks"))}
    from invink_audit.mechanisms.adapmixed import rdp_to_epsilon

    return {"rdp-filter": float(rdp_to_epsilon(claim.renyi_budget, claim.renyi_order, delta))}


def _histogram(losses: np.ndarray, neighbour: int) -> LossHistogram:
    finite = losses[np.isfinite(losses)]
    if finite.size == 0:
        return LossHistogram(neighbour, (), (), int(losses.size))
    lo, hi = float(finite.min()), float(finite.max())
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    counts, edges = np.histogram(finite, bins=30, range=(lo, hi))
    return LossHistogram(
        neighbour, tuple(edges.tolist()), tuple(counts.tolist()), int((~np.isfinite(losses)).sum()), float(finite.mean())
    )


@dataclasses.dataclass(frozen=True)
class _Estimate:
    """One sequence-level Rényi estimate before the Holm decisions."""

    neighbour: int
    direction: Direction
    alpha: float
    estimate: stats.RenyiEstimate
    exact: float | None


def _renyi_estimates(rec: RecordedAudit, audited, exact) -> tuple[list[_Estimate], dict]:
    """Monte Carlo (and, for a bounded-range claim, importance-sampling) estimates of every audited
    (neighbour, direction, α) the claim speaks about; also the Monte Carlo losses by (neighbour, direction)."""
    cfg, claim = rec.config, rec.claim
    beta = cfg.significance
    # a-priori ranges under the claim: per-step loss <= epsilon0 (BR), per-step D_alpha <= alpha rho_tok
    # (other compositions bound no text's loss a priori: only the intervals' lower ends are used)
    loss_upper = claim.loss_upper()
    importance_sampling = claim.composition == "bounded-range"
    rows: list[_Estimate] = []
    losses_by_key: dict = {}
    for j in audited:
        for d in cfg.directions:
            losses = sequence_losses(rec, j, d)
            losses_by_key[(j, d)] = losses
            for ai, a in enumerate(cfg.alphas):
                claimed = claim.renyi(a)
                if not math.isfinite(claimed):
                    continue  # no claim at this order (a Rényi filter claims one order only)
                ex = None if exact is None else exact.renyi(a, j, reverse=d is Direction.REVERSE)
                if losses.size:
                    est = stats.renyi_monte_carlo(losses, a, beta, loss_upper=loss_upper, claimed=claimed)
                    rows.append(_Estimate(j, d, a, est, ex))
                sums = _is_sums(rec, j, d, ai)
                if sums.size and importance_sampling:
                    sum_upper = claim.max_new_tokens * a * claim.rho_token
                    est = stats.renyi_importance_sampling(sums, a, beta, sum_upper=sum_upper, claimed=claimed)
                    rows.append(_Estimate(j, d, a, est, ex))
    return rows, losses_by_key


def _renyi_tests(rows: list[_Estimate]) -> list[stats.TestResult]:
    r"""One test of :math:`D_\alpha \le \alpha\rho_{seq}` per estimate."""
    return [
        stats.TestResult(
            f"D_{r.alpha:g} {r.direction.value} neighbour {r.neighbour} ({r.estimate.estimator})",
            r.estimate.p_value,
            r.estimate.interval.estimate,
            r.estimate.claimed,
            details={"neighbour": r.neighbour, "direction": r.direction.value, "alpha": r.alpha, "estimator": r.estimate.estimator},
        )
        for r in rows
    ]


def _delta_tests(rec: RecordedAudit, losses_by_key: dict) -> tuple[list[stats.TestResult], list[DeltaEstimate]]:
    """δ(ε) against every accountant: one DKW test per (neighbour, direction), simultaneous over ε."""
    cfg, claim = rec.config, rec.claim
    beta = cfg.significance
    acc_eps = {dl: claim_epsilons(claim, dl, cfg.accountants) for dl in cfg.delta_grid}
    points = [(name, dl, eps) for dl, by_acc in acc_eps.items() for name, eps in by_acc.items()]
    tests: list[stats.TestResult] = []
    delta_rows: list[DeltaEstimate] = []
    for (j, d), losses in losses_by_key.items():
        if not losses.size:
            continue
        srt = np.sort(losses)

        def lower_at(b, srt=srt):
            eta = min(stats.dkw_radius(srt.size, b), 1.0)
            return max(stats.delta_band(srt, eps, eta)[0] - dl for _, dl, eps in points)

        p_val = stats.p_value_from_lower_bound(lower_at, 0.0)
        curve = stats.hockey_stick_delta(losses, [eps for _, _, eps in points], beta)
        worst_gap = max(e - dl for e, (_, dl, _) in zip(curve.estimate, points))
        tests.append(
            stats.TestResult(
                f"delta(eps) {d.value} neighbour {j} (all accountants)",
                p_val,
                worst_gap,
                0.0,
                details={"neighbour": j, "direction": d.value},
            )
        )
        bands = zip(points, curve.estimate, curve.band_lower, curve.band_upper)
        delta_rows += [DeltaEstimate(j, d.value, name, dl, eps, delta_estimate=estimate, band_lower=lower,
                                     band_upper=upper) for (name, dl, eps), estimate, lower, upper in bands]
    return tests, delta_rows


def _verdict(rec: RecordedAudit, tests: list[stats.TestResult]):
    """The verdict, the tests with their Holm decisions and the reason; a data-dependent guarantee is
    compared with the measurement, never confirmed (no PASS)."""
    cfg, claim = rec.config, rec.claim
    verdict, decided, reason = stats.decide_verdict(
        exact_failures=sum(dict(rec.failures).values()),
        tests=tests,
        significance=cfg.significance,
        exact_checks_run=rec.num_step_checks > 0,
        min_samples_met=cfg.num_samples >= cfg.min_samples,
    )
    nonfinite = rec.failures.get("nonfinite", 0)
    if nonfinite:
        reason = (f"{nonfinite} (text, step, neighbour) pair(s) hold NaN or +inf log-probabilities in a released "
                  f"distribution (the law a token is drawn from is undefined: a finding, never a PASS); {reason}")
    if not claim.a_priori:
        if verdict is stats.Verdict.VIOLATION:
            reason = f"the reported DATA-DEPENDENT guarantee is exceeded by the measurement: {reason}"
        else:
            verdict = stats.Verdict.INCONCLUSIVE
            reason = (
                "DATA-DEPENDENT guarantee: the measurement does not exceed it, but a guarantee computed from the "
                f"data is never a PASS ({reason})"
            )
    return verdict, decided, reason


def _sequence_estimates(rows: list[_Estimate], decided) -> list[SequenceEstimate]:
    """The sequence rows with their Holm decisions (``decided`` starts with the rows' tests)."""
    out = []
    for r, t in zip(rows, decided[: len(rows)]):
        est = r.estimate
        iv = est.interval
        headroom = est.claimed / iv.estimate if iv.estimate > 0 else math.inf
        out.append(
            SequenceEstimate(
                r.neighbour, r.direction.value, r.alpha, est.estimator, est.num_samples, iv.lower, iv.estimate, iv.upper,
                est.claimed, est.p_value, t.rejected, headroom, r.exact,
            )
        )
    return out


def _worst_neighbour(audited, seq_rows: list[SequenceEstimate], labels: dict) -> WorstNeighbour:
    """The audited neighbour with the largest estimate / claim (importance sampling preferred where present)."""
    worst_j, worst_ratio = (audited[0] if audited else -1), -math.inf
    for j in audited:
        mine = [s for s in seq_rows if s.neighbour == j]
        pref = [s for s in mine if s.estimator == "importance-sampling"] or mine
        if pref:
            ratio = max(s.estimate / s.claimed for s in pref)
            if ratio > worst_ratio:
                worst_j, worst_ratio = j, ratio
    return WorstNeighbour(worst_j, labels.get(worst_j, ""), worst_ratio)


def _measured_curves(alphas, seq_rows: list[SequenceEstimate]) -> tuple[list[float], list[float]]:
    """The worst estimate and upper end over audited neighbours and directions, at each α (importance
    sampling preferred where present)."""
    measured, measured_up = [], []
    for a in alphas:
        by_key = {}
        for s in (s for s in seq_rows if s.alpha == a):
            key = (s.neighbour, s.direction)
            if key not in by_key or s.estimator == "importance-sampling":
                by_key[key] = s
        measured.append(max((s.estimate for s in by_key.values()), default=math.nan))
        measured_up.append(max((s.upper for s in by_key.values()), default=math.nan))
    return measured, measured_up


def _accountant_comparisons(rec: RecordedAudit, seq_rows: list[SequenceEstimate]) -> list[AccountantComparison]:
    """Each accountant's ε at the claim's δ against the ε of the claimed and the measured curves."""
    cfg, claim = rec.config, rec.claim
    alphas = cfg.alphas
    e_grid = rdp_to_epsilon({a: claim.renyi(a) for a in alphas}, claim.delta)
    # a sampled estimate can fall below 0 where the divergence is small; D_α ≥ 0 bounds it (ε 0 there)
    e_meas, e_up = (rdp_to_epsilon({a: max(0.0, d) for a, d in zip(alphas, m)}, claim.delta)
                    if m and not any(map(math.isnan, m)) else math.nan for m in _measured_curves(alphas, seq_rows))
    ratio = e_grid / e_meas if e_meas and e_meas > 0 else math.inf
    return [AccountantComparison(name, claim.delta, eps, e_grid, e_meas, e_up, ratio)
            for name, eps in claim_epsilons(claim, claim.delta, cfg.accountants).items()]


def _with_prefix(rec: RecordedAudit, worst: dict, prefix_decoder) -> dict:
    """A worst-prefix record with its prefix rendered (decoded, or token ids)."""
    w = dict(worst)
    if w.get("text", -1) >= 0:
        ids = [int(t) for t in rec.tokens[w["text"], : w["step"]] if t >= 0]
        w["prefix"] = prefix_decoder(ids) if prefix_decoder is not None else " ".join(map(str, ids))
    return w


def _step_check_summary(rec: RecordedAudit, prefix_decoder) -> StepCheckSummary:
    """The exact per-step checks' summary: failures, worst loss range and Rényi ratio, worst prefixes."""
    claim, alphas = rec.claim, rec.config.alphas
    per_range = rec.max_loss_range_per_step
    max_range = float(per_range.max()) if per_range.size else 0.0
    ratios = rec.max_renyi_ratio_per_step
    eps0 = claim.epsilon0 if claim.step_checks else math.nan
    return StepCheckSummary(
        num_checks=rec.num_step_checks,
        failures=dict(rec.failures),
        epsilon0=eps0,
        max_loss_range=max_range,
        range_headroom=eps0 / max_range if max_range > 0 else math.inf,
        max_renyi_ratio={float(a): float(ratios[:, i].max()) if ratios.size else 0.0 for i, a in enumerate(alphas)},
        max_delta_excess=float(rec.max_delta_excess_per_step.max()) if rec.max_delta_excess_per_step.size else 0.0,
        worst_prefix=_with_prefix(rec, rec.worst_range, prefix_decoder),
        worst_renyi_prefix=_with_prefix(rec, rec.worst_renyi, prefix_decoder),
        max_loss_range_per_step=tuple(float(x) for x in per_range),
        max_renyi_ratio_per_step=tuple(tuple(float(y) for y in row) for row in ratios),
        numerics={"dtype": rec.config.numerics.dtype, "tolerance": rec.config.numerics.tolerance,
                  "within_tolerance": dict(rec.within_tolerance)},
    )


def _loss_histogram(losses_by_key: dict, worst: int) -> LossHistogram:
    """Forward losses of the worst neighbour (else the first audited pair's)."""
    first = next(iter(losses_by_key.values()), np.zeros(0))
    return _histogram(losses_by_key.get((worst, Direction.FORWARD), first), worst)


def _unresolved_by_numerics(rec: RecordedAudit) -> str | None:
    """Why a PASS cannot stand on the dtype's numerics (issue 35, "numerics stated"): some check exceeded its claim
    by at most the tolerance, and the tolerance is not small against the claim (bfloat16's is about 2 nats), so
    rounding cannot be told from a leak of that size. ``None``: it can (float64, float32 against most claims)."""
    tol = rec.config.numerics.tolerance
    if not sum(rec.within_tolerance.values()):
        return None
    smallest = rec.claim.step.unresolved_by(tol, rec.config.alphas)
    if smallest is None:
        return None
    return (f"{sum(rec.within_tolerance.values())} exact check(s) exceeded the claim by at most the tolerance of "
            f"{rec.config.numerics.dtype} ({tol:.3g} nats), which is over {RESOLVABLE_SHARE:.0%} of the smallest "
            f"per-step claim ({smallest:.3g}): rounding cannot be told from a leak of that size; audit in a wider dtype")


def _tested(rec: RecordedAudit, audited, exact) -> tuple[dict, dict]:
    r"""Every hypothesis in one Holm family and the verdict: :math:`D_\alpha \le \alpha\rho_{seq}` per Rényi
    estimate (:func:`_renyi_estimates`, :func:`_renyi_tests`), then :math:`\delta(\varepsilon_{acc}(\delta)) \le
    \delta` per (neighbour, direction) with the DKW band (:func:`_delta_tests`), decided by :func:`_verdict`. A PASS
    that no sampled estimate confirms says it rests on the exact per-step checks. Returns the :class:`WhiteBoxReport`
    fields of the tests (verdict, reason, sequence and δ(ε) rows, tests with their Holm decisions) and the Monte
    Carlo losses by (neighbour, direction)."""
    rows, losses_by_key = _renyi_estimates(rec, audited, exact)
    delta_tests, delta_rows = _delta_tests(rec, losses_by_key)
    verdict, decided, reason = _verdict(rec, _renyi_tests(rows) + delta_tests)
    if verdict is stats.Verdict.PASS and (unresolved := _unresolved_by_numerics(rec)):
        verdict, reason = stats.Verdict.INCONCLUSIVE, unresolved
    seq_rows = _sequence_estimates(rows, decided)
    if verdict is stats.Verdict.PASS and not sampled_confirmations(seq_rows, delta_rows):
        reason += (
            f"; the sampled part ({rec.plan.num_texts} texts) is too small to confirm anything (no upper confidence "
            "end falls below its claim): this PASS rests on the exact per-step checks"
        )
    fields = {"verdict": verdict, "reason": reason, "sequence": tuple(seq_rows), "delta": tuple(delta_rows),
              "tests": tuple(decided)}
    return fields, losses_by_key


def _analysis_timings(rec: RecordedAudit, timings: Mapping | AuditTimings | None, t0: float) -> AuditTimings:
    """The caller's timings (a mapping or :class:`AuditTimings`) with the analysis's own seconds since ``t0``
    and, unless given, the exact checks' seconds."""
    measured = dict(timings.json_fields() if isinstance(timings, AuditTimings) else (timings or {}))
    measured["analysis_seconds"] = time.perf_counter() - t0
    measured.setdefault("check_seconds", rec.check_seconds)
    return AuditTimings.from_json(measured)


def analyse(
    rec: RecordedAudit,
    *,
    mechanism: str,
    source: str,
    canaries: dict | None = None,
    neighbour_labels: dict | None = None,
    prefix_decoder=None,
    exact=None,
    timings: Mapping | None = None,
    settings: dict | None = None,
    notes: tuple[str, ...] = (),
    claim_details: dict | None = None,
) -> WhiteBoxReport:
    """Turn a :class:`RecordedAudit` into a :class:`WhiteBoxReport` with a verdict (Holm over every test).
    ``prefix_decoder(tokens) -> str`` renders the worst prefix; ``exact``: an
    :class:`invink_audit.audit.synthetic.ExactOutputs` to attach exact divergences (self-test and tests only);
    ``timings``: what the caller measured (a mapping or :class:`AuditTimings`), to which the analysis adds its own."""
    t0 = time.perf_counter()
    audited = rec.config.audited_neighbours(rec.batch_size)
    canaries = dict(canaries or {})
    labels = {**dict(neighbour_labels or {}), **canaries}
    tested, losses_by_key = _tested(rec, audited, exact)
    worst = _worst_neighbour(audited, tested["sequence"], labels)
    comparisons = _accountant_comparisons(rec, tested["sequence"])
    summary = _step_check_summary(rec, prefix_decoder)
    claim = ReportedClaim(rec.claim, {a.accountant: a.epsilon for a in comparisons}, dict(claim_details or {}))
    measured = _analysis_timings(rec, timings, t0)
    return WhiteBoxReport(
        kind="white-box",
        mechanism=mechanism,
        source=source,
        **tested,
        significance=rec.config.significance,
        claim=claim,
        step_checks=summary,
        accountants=tuple(comparisons),
        worst_neighbour=worst,
        canaries=canaries,
        num_texts=rec.plan.num_texts,
        timings=measured,
        loss_histogram=_loss_histogram(losses_by_key, worst.index),
        settings=dict(settings or {}),
        notes=tuple(notes),
    )
