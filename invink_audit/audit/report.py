"""Audit reports rendered and written: Markdown, PNG plots, and ``write_report`` (the records and their JSON
form are :mod:`invink_audit.audit.records`).

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.report").
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from invink_audit.audit.records import (
    REPORT_PRIVACY_NOTICE,
    BlackBoxReport,
    DeltaEstimate,
    ReportedClaim,
    StepCheckSummary,
    WhiteBoxReport,
    WorstNeighbour,
    CLAIM_BASE_FIELDS,
    format_number,
)
from invink_audit.not_private import agg_pyplot, md_table, save_not_private_figure, write_not_private_json, write_not_private_text

__all__ = ["whitebox_markdown", "write_report"]


# ---------------------------------------------------------------------------------------------
# rendering


def _md_header(r: WhiteBoxReport) -> list[str]:
    """Title, privacy notice, verdict and source."""
    return [
        f"# White-box privacy audit: {r.mechanism}",
        "",
        f"> **{REPORT_PRIVACY_NOTICE}**",
        "",
        f"**Verdict: {r.verdict.value}** at family-wise significance {r.significance:g} (Holm over "
        f"{len(r.tests)} tests; exact checks need no statistics). {r.reason}.",
        "",
        f"Source: {r.source}. Texts sampled: {r.num_texts}.",
        "",
    ]


def _md_claim(c: ReportedClaim) -> list[str]:
    """The claim's table: the headline figures first (:meth:`ReportedClaim.json_fields` writes them first), then every
    other key in the report's order."""
    note = ": holds only for the audited references, never a PASS)" if c.kind == "data-dependent" else ")"
    rows = [(k, format_number(v, 6) if k in CLAIM_BASE_FIELDS or isinstance(v, (int, float)) else v)
            for k, v in c.json_fields().items()]
    return [f"## Claim ({c.kind}{note}", "", *md_table("quantity | value", rows)]


def _md_step_checks(sc: StepCheckSummary) -> list[str]:
    """The exact per-step checks: failures, worst range and Rényi ratio, worst prefix."""
    w = sc.worst_prefix
    return [
        "",
        "## Exact per-step checks",
        "",
        f"{sc.num_checks} (text, step, neighbour) checks; failures: "
        + ", ".join(f"{k} {v}" for k, v in sc.failures.items())
        + ".",
        "",
        f"- max privacy-loss range {format_number(sc.max_loss_range)} vs ε0 = {format_number(sc.epsilon0)} "
        f"(headroom ε0/max = {format_number(sc.range_headroom)})",
        "- max per-step D_α / (α ρ_tok): "
        + ", ".join(f"α={format_number(float(a))}: {format_number(v)}" for a, v in sc.max_renyi_ratio.items()),
        f"- max per-step δ_t(ε) − δ_BR(ε): {format_number(sc.max_delta_excess)}",
        *_md_numerics(sc.numerics),
        f"- worst prefix (loss range): text {w.get('text')}, step {w.get('step')}, "
        f"neighbour {w.get('neighbour')}, value {format_number(w.get('value'))}"
        + (f", prefix `{w.get('prefix')}`" if w.get("prefix") else ""),
        "",
    ]


def _md_numerics(numerics: dict | None) -> list[str]:
    """The tolerance of the checks and the excesses within it (none for a report written before they were stated)."""
    if numerics is None:
        return []
    within = numerics["within_tolerance"]
    return [f"- numerics: distributions computed in {numerics['dtype']}, tolerance {format_number(numerics['tolerance'])} "
            f"nats; {sum(within.values())} check(s) exceed their claim within the tolerance (rounding, not counted as "
            "failures): " + ", ".join(f"{k} {v}" for k, v in within.items())]


def _md_sequence(r: WhiteBoxReport) -> list[str]:
    """The worst neighbour and the table of sequence-level Rényi estimates (with exact values if any)."""
    with_exact = any(s.exact is not None for s in r.sequence)
    lines = [
        "## Sequence-level Rényi divergences",
        "",
        f"Worst neighbour: {r.worst_neighbour.index} ({r.worst_neighbour.label}), "
        f"max estimate/claim {format_number(r.worst_neighbour.ratio)}.",
        "",
    ]
    rows = [
        (s.neighbour, s.direction, format_number(s.alpha), s.estimator, s.num_samples,
         *map(format_number, (s.lower, s.estimate, s.upper, s.claimed, s.headroom)), format_number(s.p_value, 3),
         "yes" if s.rejected else "no", *([format_number(s.exact)] if with_exact else []))
        for s in r.sequence
    ]
    return lines + md_table("neighbour | direction | α | estimator | n | lower | estimate | upper | claimed α·ρ_seq | headroom | p | "
                            "rejected" + (" | exact" if with_exact else ""), rows)


#: δ(ε) rows with δ̂ > 0 shown in the Markdown report (the others are counted; all are in report.json)
_MD_DELTA_ROWS = 12


def _md_accountants(r: WhiteBoxReport) -> list[str]:
    """Each accountant's ε (the release's claim) against the measured curve, then δ(ε) at the accountants'
    ε, collapsed to its informative rows."""
    lines = [
        "",
        "## Accountants",
        "",
        "ε (measured): the RDP→DP conversion of the measured D_α on the α grid; the same conversion of the "
        "claimed curve is in the last columns (a claimed-grid ε above the accountant's means the conversion is "
        "loose on this grid, and the measured ε overstates the loss by as much).",
        "",
        *md_table(
            "accountant | δ | ε (accountant) | ε (measured) | ε (measured, upper) | accountant / measured | "
            "ε (claimed curve, α grid) | claimed grid / measured",
            [(a.accountant, *map(format_number, (a.delta, a.epsilon, a.epsilon_measured, a.epsilon_measured_upper,
                                                 a.epsilon / a.epsilon_measured if a.epsilon_measured > 0 else math.inf,
                                                 a.epsilon_claimed_grid, a.headroom))) for a in r.accountants],
        ),
    ]
    lines += [""] + [f"{line}." for line in r.headline()]
    if r.delta:
        lines += _md_delta(r.delta)
    return lines


def _md_delta(rows: Sequence[DeltaEstimate]) -> list[str]:
    """δ(ε): the first rows with δ̂ > 0 (at most :data:`_MD_DELTA_ROWS`), and one line each for the rows
    with δ̂ > 0 not shown and for those with δ̂ = 0 (every row is in report.json)."""
    positive = [d for d in rows if not d.delta_estimate <= 0]
    zero = [d for d in rows if d.delta_estimate <= 0]
    lines = ["", "## δ(ε) at the accountants' ε (DKW band, simultaneous over ε)", ""]
    if positive:
        lines += md_table("neighbour | direction | accountant | target δ | ε | δ̂ | band lower | band upper", [
            (d.neighbour, d.direction, d.accountant,
             *map(format_number, (d.target_delta, d.epsilon, d.delta_estimate, d.band_lower, d.band_upper)))
            for d in positive[:_MD_DELTA_ROWS]
        ])
        lines.append("")
        if len(positive) > _MD_DELTA_ROWS:
            lines.append(f"{len(positive) - _MD_DELTA_ROWS} more row(s) with δ̂ > 0 are in report.json.")
    if zero:
        widest = max(d.band_upper for d in zero)
        lines.append(
            f"{len(zero)} of {len(rows)} row(s) with δ̂ = 0 omitted (no sampled text's loss exceeds their ε; their "
            f"band's upper ends reach {format_number(widest)}); every row is in report.json."
        )
    return lines


def _md_appendix(r: WhiteBoxReport) -> list[str]:
    """Canaries, timings, settings, notes and the plots' legend."""
    lines = []
    if r.canaries:
        lines += ["", "## Canaries", ""] + [f"- neighbour {k}: {v}" for k, v in r.canaries.items()]
    lines += ["", "## Timings", ""] + [f"- {k}: {format_number(v)}" for k, v in r.timings.items()]
    if r.settings:
        lines += ["", "## Settings", ""] + [f"- {k}: {v}" for k, v in r.settings.items()]
    if r.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in r.notes]
    lines += [
        "",
        "Plots: `renyi.png` (estimated D_α with intervals against the claimed α·ρ_seq), "
        "`loss_histogram.png` (sequence privacy losses of the worst neighbour), "
        "`step_loss_range.png` (per-step maximum loss range against ε0).",
        "",
    ]
    return lines


def whitebox_markdown(r: WhiteBoxReport) -> str:
    """The Markdown section of one white-box report (as :func:`write_report` writes it into ``report.md``)."""
    return "\n".join(
        _md_header(r) + _md_claim(r.claim) + _md_step_checks(r.step_checks) + _md_sequence(r) + _md_accountants(r)
        + _md_appendix(r)
    )


def _blackbox_markdown(r: BlackBoxReport) -> str:
    lines = [
        f"# Black-box canary audit: {r.mechanism}",
        "",
        f"> **{REPORT_PRIVACY_NOTICE}**",
        "",
        f"**Verdict: {r.verdict.value}** at significance {r.significance:g}. {r.reason}.",
        "",
        f"- claimed (ε, δ) = ({format_number(r.claimed_epsilon)}, {format_number(r.claimed_delta)})",
        f"- ε lower bound (Clopper–Pearson; score and threshold chosen on the selection trials, bound computed on the held-out evaluation trials): {format_number(r.epsilon_lower_bound)}",
        f"- score: {r.score}; threshold {format_number(r.threshold)}",
        f"- evaluation: TP {r.true_positives}/{r.positives}, FP {r.false_positives}/{r.negatives}",
        f"- trials: {r.num_trials}",
    ]
    if r.ceiling is not None:
        lines.append(f"- ceiling: a perfect attack on these trials would certify ε ≥ {format_number(r.ceiling)} "
                     "(a bound near it is limited by the trial count, not by the generator)")
    if r.sequential is not None:
        looks = "; ".join(f"{m} trials at β={format_number(b)}: ε ≥ {format_number(e)}" for m, b, e in r.sequential["looks"])
        lines.append(f"- sequential looks ({r.sequential['stopped']}): {looks}")
    point = (r.sequential or {}).get("profile")
    if r.profile is not None and point is not None:
        lines.append(
            f"- the claim's privacy curve, tested at {len(r.profile['deltas'])} δ' from {format_number(r.profile['deltas'][0])} to "
            f"{format_number(r.profile['deltas'][-1])} (its accountant's ε(δ'); one Clopper–Pearson pair refutes the curve if it "
            f"lies above any point of it): strongest at δ' = {format_number(point['delta'])}, ε ≥ "
            f"{format_number(point['epsilon_lower_bound'])} against the claim's {format_number(point['claimed_epsilon'])} there"
        )
    if r.gdp is not None:
        g = r.gdp
        what = ("perfect separation: a **floor** set by the trial count, not a bound" if g.get("separated")
                else "an **estimate**, not a bound")
        lines.append(f"- Gaussian-DP fit over all thresholds ({what}): μ = {format_number(g['mu']['estimate'])} "
                     f"[{format_number(g['mu']['lower'])}, {format_number(g['mu']['upper'])}], ε(δ={format_number(g['delta'])}) = "
                     f"{format_number(g['epsilon']['estimate'])} [{format_number(g['epsilon']['lower'])}, "
                     f"{format_number(g['epsilon']['upper'])}]")
    if r.coins:
        lines.append(f"- coins (canary in the batch): {sum(r.coins)} of {len(r.coins)} batches, recorded in report.json")
    lines += ["", "## Timings", ""] + [f"- {k}: {format_number(v)}" for k, v in r.timings.items()]
    if r.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in r.notes]
    lines.append("")
    return "\n".join(lines)


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    save_not_private_figure(fig, out / name, dpi=110)
    agg_pyplot().close(fig)
    return name


_RENYI_MARKERS = {("forward", "importance-sampling"): "o", ("reverse", "importance-sampling"): "s",
                  ("forward", "monte-carlo"): "^", ("reverse", "monte-carlo"): "v"}


def _plot_renyi_estimates(ax, r: WhiteBoxReport, alphas: list[float]) -> None:
    """The claimed curve (or a Rényi filter's single point) and the worst neighbour's estimates."""
    grid = np.linspace(min(alphas) * 0.9, max(alphas) * 1.05, 100)
    rho_seq = r.claim.rho_sequence
    if rho_seq is not None:
        ax.plot(grid, grid * rho_seq, "k-", label="claimed α·ρ_seq")
    else:  # a Rényi-filter claim: one order, one budget
        rho_seq = float(r.claim.renyi_budget) / float(r.claim.renyi_order)
        ax.plot([r.claim.renyi_order], [r.claim.renyi_budget], "k*", ms=12, label="claimed D_α (data-dependent)")
    worst = r.worst_neighbour.index
    for key, m in _RENYI_MARKERS.items():
        rows = [s for s in r.sequence if (s.direction, s.estimator) == key and s.neighbour == worst]
        if not rows:
            continue
        x = np.array([s.alpha for s in rows]) * (1 + 0.01 * list(_RENYI_MARKERS).index(key))
        y = np.array([s.estimate for s in rows])
        finite_y = y[np.isfinite(y)]
        cap = 10.0 * max(float(finite_y.max()) if finite_y.size else 0.0, rho_seq * max(alphas))  # keep infinite ends on the plot
        lo = np.array([s.lower for s in rows])
        hi = np.minimum(np.array([s.upper for s in rows]), cap)
        y = np.minimum(y, cap)
        ax.errorbar(x, y, yerr=[np.maximum(y - lo, 0), np.maximum(hi - y, 0)], fmt=m, capsize=3,
                    label=f"{key[0]} {key[1]}")
    exact = [s for s in r.sequence if s.exact is not None and s.neighbour == worst and s.direction == "forward"]
    if exact:
        ax.plot([s.alpha for s in exact], [s.exact for s in exact], "rx", label="exact (enumeration)")
    ax.set_yscale("log")


def _plot_renyi(r: WhiteBoxReport, out: Path) -> str:
    """``renyi.png``: Rényi estimates with intervals vs the claimed curve."""
    fig, ax = agg_pyplot().subplots(figsize=(6, 4))
    alphas = sorted({s.alpha for s in r.sequence})
    if alphas:
        _plot_renyi_estimates(ax, r, alphas)
    ax.set_xlabel("Rényi order α")
    ax.set_ylabel("D_α (nats)")
    ax.set_title(_wrapped_title(r.worst_neighbour), fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, out, "renyi.png")


#: characters per line of a plot title (6-inch figures, 9-point type) and lines at most
_TITLE_WIDTH, _TITLE_LINES = 70, 3


def _wrapped_title(worst: WorstNeighbour) -> str:
    """``worst neighbour j: label``, wrapped to fit the figure (at most :data:`_TITLE_LINES` lines, the
    last one ending in … when the label is longer)."""
    label = str(worst.label or "")
    text = f"worst neighbour {worst.index}" + (f": {label}" if label else "")
    return "\n".join(textwrap.wrap(text, _TITLE_WIDTH, max_lines=_TITLE_LINES, placeholder=" …"))


def _plot_loss_histogram(r: WhiteBoxReport, out: Path) -> str:
    """``loss_histogram.png``: the worst neighbour's sequence privacy losses, with the a-priori bound on
    one text's loss (T·ε0, bounded-range claims) and the release's ε as vertical lines (a line beyond
    the losses' range by more than the range itself is drawn at the right edge, marked as such)."""
    h = r.loss_histogram
    fig, ax = agg_pyplot().subplots(figsize=(6, 4))
    right = None
    if h.counts:
        edges = np.asarray(h.edges, dtype=float)
        ax.stairs(np.asarray(h.counts, dtype=float), edges, fill=True, alpha=0.6, label="texts (finite loss)")
        right = float(edges[-1]) + (float(edges[-1] - edges[0]) or 1.0)  # lines further right are clipped to here
    c = r.claim
    lines = []
    if c.epsilon0 is not None and c.a_priori and c.composition == "bounded-range":
        bound = float(c.epsilon0) * c.max_new_tokens
        lines.append((bound, f"a-priori bound T·ε0 = {format_number(bound)}", "-"))
    if c.epsilons:
        name, eps = next(iter(c.epsilons.items()))
        lines.append((float(eps), f"claimed ε = {format_number(eps)} ({name}, δ = {format_number(c.delta)})", "--"))
    for i, (x, label, style) in enumerate(lines):
        if not math.isfinite(x):
            continue
        if right is not None and x > right:
            ax.axvline(right, color="k", ls=style, lw=1, label=f"{label} → beyond the axis")
            ax.annotate(f"{format_number(x)} →", (right, 0.5 - 0.08 * i), xycoords=("data", "axes fraction"), ha="right",
                        xytext=(-3, 0), textcoords="offset points", fontsize=7)
        else:
            ax.axvline(x, color="k", ls=style, lw=1, label=label)
    ax.set_xlabel(f"privacy loss L_j(x), neighbour {h.neighbour} (forward, x ~ P_R)")
    ax.set_ylabel("texts")
    if h.num_infinite:
        ax.set_title(f"{h.num_infinite} texts with infinite loss not shown")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    return _save(fig, out, "loss_histogram.png")


def _plot_step_loss_range(r: WhiteBoxReport, out: Path) -> str:
    """``step_loss_range.png``: per-step maximum loss range vs ε0."""
    fig, ax = agg_pyplot().subplots(figsize=(6, 4))
    per, eps0 = np.asarray(r.step_checks.max_loss_range_per_step, dtype=float), r.step_checks.epsilon0
    finite = np.where(np.isfinite(per), per, np.nan)
    finite_max = float(np.nanmax(finite)) if np.isfinite(per).any() else None
    if per.size:
        ax.plot(np.arange(per.size), finite, ".-", label="max over texts and neighbours")
        inf_steps = np.nonzero(~np.isfinite(per))[0]
        if inf_steps.size:
            top = eps0 if math.isfinite(eps0) else (1.0 if finite_max is None else finite_max)
            ax.plot(inf_steps, np.full(inf_steps.size, top * 1.5), "rx", label="infinite (support mismatch)")
    if math.isfinite(eps0):
        ax.axhline(eps0, color="k", ls="--", label="claimed per-step ε0")
    ax.set_ylim(0.0, 1.6 * max(eps0 if math.isfinite(eps0) else 0.0, finite_max or 0.0, 1e-12))
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("decoding step")
    ax.set_ylabel("privacy-loss range (nats)")
    ax.legend(fontsize=7)
    return _save(fig, out, "step_loss_range.png")


def _plots_blackbox(r: BlackBoxReport, out: Path) -> list[str]:
    fig, ax = agg_pyplot().subplots(figsize=(6, 4))
    if r.scores_with or r.scores_without:
        allv = np.asarray(list(r.scores_with) + list(r.scores_without), dtype=float)
        bins = np.linspace(allv.min(), allv.max() + 1e-9, 30)
        ax.hist(r.scores_without, bins=bins, alpha=0.6, label="without canary")
        ax.hist(r.scores_with, bins=bins, alpha=0.6, label="with canary")
        ax.axvline(r.threshold, color="k", ls="--", label="threshold (chosen on the selection half)")
    ax.set_xlabel(f"score ({r.score})")
    ax.set_ylabel("trials")
    ax.legend(fontsize=7)
    return [_save(fig, out, "scores.png")]


def write_report(report, output_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write ``report.json``, ``report.md`` and (``plots=True``) PNG plots into ``output_dir``.

    ``report`` is a :class:`WhiteBoxReport`, a :class:`BlackBoxReport`, or a sequence of them (the
    JSON is then a list and the Markdown a concatenation; plots of the first white-box report). Every
    file is NOT PRIVATE: owner-only (0600), never written through a symbolic link, the JSON marked and the
    Markdown opening with the banner (:mod:`invink_audit.not_private`).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True, mode=0o700)  # a new one: owner-only, like its files
    reports: Sequence = report if isinstance(report, (list, tuple)) else [report]
    payload = [r.to_dict() for r in reports]
    write_not_private_json(out / "report.json", payload if len(payload) > 1 else payload[0], indent=2)
    md = "\n\n".join(whitebox_markdown(r) if isinstance(r, WhiteBoxReport) else _blackbox_markdown(r) for r in reports)
    write_not_private_text(out / "report.md", md, markdown=True)
    written = [out / "report.json", out / "report.md"]
    if plots:
        wb = [r for r in reports if isinstance(r, WhiteBoxReport)]
        bb = [r for r in reports if isinstance(r, BlackBoxReport)]
        if wb:
            written += [out / plot(wb[0], out) for plot in (_plot_renyi, _plot_loss_histogram, _plot_step_loss_range)]
        if bb:
            written += [out / p for p in _plots_blackbox(bb[0], out)]
    return written
