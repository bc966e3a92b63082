"""Typed audit reports and their renderings (JSON, Markdown, PNG plots).

A report keeps the *a-priori* claim (what the accountant promised) and the *after-the-fact*
measurements in separate, named fields. ``to_dict`` is JSON-ready (``inf`` is written
as the string ``"inf"``); ``write_report`` writes ``report.json``, ``report.md`` and the plots.
Plots use matplotlib's Agg backend (no display needed).

Reports are **not private**: they are computed from the audited references with no privacy
protection (realised per-reference losses, the worst prefix chosen by its loss and decoded, canary
scores, texts sampled outside any ledger). Every rendering says so (:data:`REPORT_PRIVACY_NOTICE`; the
JSON is marked ``"not_private": true``), and ``write_report`` writes its files owner-only (0600), never
through a symbolic link, the Markdown opening with the NOT PRIVATE banner (:mod:`invink_audit.not_private`).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from invink_audit.audit.stats import TestResult, Verdict
from invink_audit.not_private import (
    mark_not_private,
    save_not_private_figure,
    unmark,
    write_not_private_json,
    write_not_private_text,
)

__all__ = [
    "REPORT_PRIVACY_NOTICE",
    "ReportedClaim",
    "WorstNeighbour",
    "LossHistogram",
    "AuditTimings",
    "StepCheckSummary",
    "SequenceEstimate",
    "DeltaEstimate",
    "AccountantComparison",
    "WhiteBoxReport",
    "BlackBoxReport",
    "headline_lines",
    "report_from_dict",
    "sampled_confirmations",
    "to_jsonable",
    "write_report",
    "whitebox_markdown",
]


#: Written at the top of every Markdown report and as ``privacy_notice`` in every JSON report.
REPORT_PRIVACY_NOTICE = (
    "NOT PRIVATE: this report is computed from the audited references without any privacy protection "
    "(realised per-reference privacy losses, the worst prefix chosen by its loss and decoded, canary scores, "
    "texts sampled outside any budget ledger and not charged to it). When the references are private, treat "
    "this report as private data: do not publish it with the synthetic texts."
)


def to_jsonable(obj):
    """Recursively convert dataclasses, enums, numpy values and non-finite floats for JSON."""
    if isinstance(obj, _JsonRecord):
        return to_jsonable(obj.json_fields())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj) if not f.name.startswith("_")}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return [to_jsonable(v) for v in obj.tolist()]
    if isinstance(obj, (np.floating, float)):
        x = float(obj)
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


class _JsonRecord(Mapping):
    """A typed report record whose JSON object is :meth:`json_fields` (keys in schema order).

    It also reads as that mapping (``record["key"]``, ``"key" in record``, ``record.get``), the form
    the report had when these fields were plain dicts.
    """

    def json_fields(self) -> dict:
        raise NotImplementedError

    def __getitem__(self, key):
        return self.json_fields()[key]

    def __iter__(self):
        return iter(self.json_fields())

    def __len__(self) -> int:
        return len(self.json_fields())


#: the claim's keys written whenever the claim is not an a-priori bounded-range one, in this order
_CLAIM_TRAILING = ("guarantee", "composition", "renyi_order", "renyi_budget", "epsilon_claimed")
_CLAIM_BASE = ("epsilon0", "rho_token", "rho_sequence", "max_new_tokens", "batch_size", "delta")


@dataclasses.dataclass(frozen=True, eq=True)
class ReportedClaim(_JsonRecord):
    """The audited claim as a report states it (JSON: the ``claim`` object).

    ``epsilons``: ε at ``delta`` certified by each accountant (JSON keys ``epsilon[<accountant>]``);
    ``details``: the mechanism's own parameters, in its order (InvisibleInk: ``clip_norm``,
    ``temperature``; another mechanism: ``mechanism``, ``guarantee_description`` and its guarantee's
    details). ``guarantee``, ``composition``, ``renyi_order``, ``renyi_budget`` and
    ``epsilon_claimed`` are set (and written) for a claim that is not an a-priori bounded-range one;
    a key the mechanism's details also carry keeps its place among the details.
    """

    epsilon0: float | None
    rho_token: float | None
    rho_sequence: float | None
    max_new_tokens: int
    batch_size: int
    delta: float
    epsilons: Mapping[str, float] = dataclasses.field(default_factory=dict)
    details: Mapping[str, object] = dataclasses.field(default_factory=dict)
    guarantee: str | None = None
    composition: str | None = None
    renyi_order: float | None = None
    renyi_budget: float | None = None
    epsilon_claimed: float | None = None

    @classmethod
    def of(cls, claim, epsilons: Mapping[str, float], details: Mapping[str, object] | None = None) -> ReportedClaim:
        """The record of a :class:`~invink_audit.audit.whitebox.Claim` with the accountants' ε."""
        trailing = {}
        if claim.composition != "bounded-range" or not claim.a_priori:
            trailing = {"guarantee": claim.guarantee, "composition": claim.composition}
            if claim.composition == "renyi-filter":
                trailing.update(renyi_order=claim.renyi_order, renyi_budget=claim.renyi_budget)
            if claim.epsilon_claimed is not None:
                trailing["epsilon_claimed"] = claim.epsilon_claimed
        return cls(
            epsilon0=claim.epsilon0, rho_token=claim.rho_token, rho_sequence=claim.rho_sequence,
            max_new_tokens=claim.max_new_tokens, batch_size=claim.batch_size, delta=claim.delta,
            epsilons=dict(epsilons), details=dict(details or {}), **trailing,
        )

    def json_fields(self) -> dict:
        out = {k: getattr(self, k) for k in _CLAIM_BASE}
        out.update({f"epsilon[{name}]": eps for name, eps in self.epsilons.items()})
        out.update(self.details)
        out.update({k: getattr(self, k) for k in _CLAIM_TRAILING if getattr(self, k) is not None})
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> ReportedClaim:
        """Inverse of :meth:`json_fields` (after :func:`_num`)."""
        rest = [k for k in data if k not in _CLAIM_BASE and not k.startswith("epsilon[")]
        # the keys appended after the details: the longest tail of trailing keys in their own order
        # (a trailing key elsewhere was one of the mechanism's details, and keeps its place there)
        appended, rank = len(rest), len(_CLAIM_TRAILING)
        while appended and rest[appended - 1] in _CLAIM_TRAILING and _CLAIM_TRAILING.index(rest[appended - 1]) < rank:
            appended -= 1
            rank = _CLAIM_TRAILING.index(rest[appended])
        return cls(
            **{k: data.get(k) for k in _CLAIM_BASE},
            epsilons={k[len("epsilon["):-1]: v for k, v in data.items() if k.startswith("epsilon[")},
            details={k: data[k] for k in rest[:appended]},
            **{k: data.get(k) for k in _CLAIM_TRAILING},
        )


@dataclasses.dataclass(frozen=True)
class WorstNeighbour(_JsonRecord):
    """The audited neighbour with the largest estimate / claim (importance sampling preferred)."""

    index: int
    label: str
    ratio: float

    def json_fields(self) -> dict:
        return {"index": self.index, "label": self.label, "ratio": self.ratio}

    @classmethod
    def from_json(cls, data: Mapping) -> WorstNeighbour:
        return cls(data["index"], data["label"], data["ratio"])


@dataclasses.dataclass(frozen=True)
class LossHistogram(_JsonRecord):
    """Histogram of one neighbour's forward sequence privacy losses (finite ones; ``mean``: of those,
    ``None`` when no loss is finite)."""

    neighbour: int
    edges: tuple[float, ...]
    counts: tuple[int, ...]
    num_infinite: int
    mean: float | None = None

    def json_fields(self) -> dict:
        out = {"neighbour": self.neighbour, "edges": self.edges, "counts": self.counts, "num_infinite": self.num_infinite}
        if self.mean is not None:
            out["mean"] = self.mean
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> LossHistogram:
        return cls(data["neighbour"], tuple(data["edges"]), tuple(data["counts"]), data["num_infinite"], data.get("mean"))


_TIMING_FIELDS = (
    "model_load_seconds", "generation_seconds", "audit_hook_seconds", "generation_without_audit_seconds",
    "audit_overhead_ratio", "decode_steps", "decode_step_engine_seconds", "decode_step_audit_seconds",
    "audit_overhead_ratio_decode_steps", "tokens_generated", "seconds_per_token_without_audit", "decode_seconds",
    "analysis_seconds", "check_seconds",
)


@dataclasses.dataclass(frozen=True)
class AuditTimings(_JsonRecord):
    """What an audit measured about its own cost; a field is ``None`` (and not written) where the audit
    did not measure it (e.g. model figures in a synthetic self-test). ``extra``: any other figure a
    caller passed, written after these."""

    model_load_seconds: float | None = None
    generation_seconds: float | None = None
    audit_hook_seconds: float | None = None
    generation_without_audit_seconds: float | None = None
    audit_overhead_ratio: float | None = None
    decode_steps: int | None = None
    decode_step_engine_seconds: float | None = None
    decode_step_audit_seconds: float | None = None
    audit_overhead_ratio_decode_steps: float | None = None
    tokens_generated: int | None = None
    seconds_per_token_without_audit: float | None = None
    decode_seconds: float | None = None
    analysis_seconds: float | None = None
    check_seconds: float | None = None
    extra: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def json_fields(self) -> dict:
        out = {k: getattr(self, k) for k in _TIMING_FIELDS if getattr(self, k) is not None}
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> AuditTimings:
        """From a mapping of figures (a report's ``timings``, or what an audit measured)."""
        known = {k: v for k, v in data.items() if k in _TIMING_FIELDS}
        return cls(**known, extra={k: v for k, v in data.items() if k not in _TIMING_FIELDS})


@dataclasses.dataclass(frozen=True)
class StepCheckSummary:
    """Exact per-step checks over every visited (text, step, neighbour)."""

    num_checks: int
    failures: dict  # kind -> count ("support", "range", "renyi", "delta")
    epsilon0: float
    max_loss_range: float
    range_headroom: float  # epsilon0 / max_loss_range (>= 1: within the claim)
    max_renyi_ratio: dict  # alpha -> max over steps of D_alpha(p_t||p'_t) / (alpha rho_tok)
    max_delta_excess: float  # max over steps and eps of delta_t(eps) - delta_BR(eps) (<= 0: within)
    worst_prefix: dict  # {"value", "text", "step", "neighbour", "prefix"}
    worst_renyi_prefix: dict
    max_loss_range_per_step: tuple[float, ...]
    max_renyi_ratio_per_step: tuple[tuple[float, ...], ...]

    @property
    def total_failures(self) -> int:
        return int(sum(self.failures.values()))


@dataclasses.dataclass(frozen=True)
class SequenceEstimate:
    """One sequence-level Rényi divergence estimate with its test against the claim."""

    neighbour: int
    direction: str  # "forward" or "reverse"
    alpha: float
    estimator: str  # "monte-carlo" or "importance-sampling"
    num_samples: int
    lower: float
    estimate: float
    upper: float
    claimed: float
    p_value: float
    rejected: bool
    headroom: float  # claimed / estimate (inf when the estimate is 0)
    exact: float | None = None  # exact value when enumerable (self-test), else None


@dataclasses.dataclass(frozen=True)
class DeltaEstimate:
    """δ(ε) of one neighbour and direction at an accountant's ε(δ_target)."""

    neighbour: int
    direction: str
    accountant: str
    target_delta: float
    epsilon: float
    delta_estimate: float
    band_lower: float
    band_upper: float


@dataclasses.dataclass(frozen=True)
class AccountantComparison:
    """An accountant's ε at the claim's δ, against the ε certified by the *measured* divergences.

    ``epsilon_measured``: RDP→DP conversion (dp-accounting ``compute_epsilon``; Canonne, Kamath &
    Steinke 2020 / Balle et al. 2020) of the worst measured curve :math:`\\hat D_\\alpha` on the
    audit's α grid (``_upper``: of the upper confidence ends); ``epsilon_claimed_grid``: the same
    conversion of the claimed curve :math:`\\alpha\\rho_{seq}` on the same grid. ``headroom`` =
    epsilon_claimed_grid / epsilon_measured compares the two curves through the *same* conversion
    (how far the realised loss on this data sits below the claim, in ε units); comparing a measured
    RDP curve with the tight bounded-range accountant directly would mix in the looseness of the RDP
    conversion itself.
    """

    accountant: str
    delta: float
    epsilon: float
    epsilon_claimed_grid: float
    epsilon_measured: float
    epsilon_measured_upper: float
    headroom: float


@dataclasses.dataclass(frozen=True)
class WhiteBoxReport:
    """Result of a white-box audit (see :func:`invink_audit.audit.analysis.analyse`)."""

    kind: str
    mechanism: str
    source: str
    verdict: Verdict
    reason: str
    significance: float
    # a-priori claim
    claim: ReportedClaim
    # after-the-fact measurements
    step_checks: StepCheckSummary
    sequence: tuple[SequenceEstimate, ...]
    delta: tuple[DeltaEstimate, ...]
    accountants: tuple[AccountantComparison, ...]
    worst_neighbour: WorstNeighbour
    canaries: Mapping[int, str]  # neighbour index -> label
    tests: tuple[TestResult, ...]
    num_texts: int
    timings: AuditTimings
    loss_histogram: LossHistogram
    # the audit's inputs as given (model, prompt, mechanism parameters as the mechanism describes them, ...)
    settings: Mapping[str, object] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready, marked first (``not_private``, ``privacy_notice``: the report is not private)."""
        return mark_not_private(to_jsonable(self), REPORT_PRIVACY_NOTICE)

    @property
    def sampled_confirmations(self) -> int:
        """How many sampled rows confirm their claim (:func:`sampled_confirmations`); 0: the sampled part
        confirms nothing, and a PASS rests on the exact per-step checks alone."""
        return sampled_confirmations(self.sequence, self.delta)

    def headroom_summary(self) -> dict:
        """The headline figures: per-step range headroom, sequence Rényi headroom (min over rows), and ε
        against the release's claimed ε (the first accountant's).

        ``epsilon`` = the accountant's ε / the ε of the measured curve (``epsilon_measured``: the RDP→DP
        conversion of the measured D_α on the audit's α grid). That conversion is looser than the
        accountant, so the ratio errs low (toward less headroom); ``epsilon_claimed_grid`` (the same
        conversion of the claimed curve) shows by how much. ``sampled_confirmations``: see the property.
        """
        seq = [s.headroom for s in self.sequence if s.estimator == "importance-sampling"] or [
            s.headroom for s in self.sequence
        ]
        first = self.accountants[0] if self.accountants else None
        out = {
            "per_step_range": self.step_checks.range_headroom,
            "sequence_renyi_min": min(seq) if seq else math.nan,
            "epsilon": math.nan,
            "accountant_epsilon": {a.accountant: a.epsilon for a in self.accountants},
            "sampled_confirmations": self.sampled_confirmations,
            "num_texts": self.num_texts,
            "alphas": sorted({s.alpha for s in self.sequence}),
        }
        if first is not None:
            measured = first.epsilon_measured
            out.update(
                epsilon=first.epsilon / measured if measured > 0 else (math.inf if measured == 0 else math.nan),
                accountant=first.accountant,
                epsilon_accountant=first.epsilon,
                epsilon_measured=measured,
                epsilon_measured_upper=first.epsilon_measured_upper,
                epsilon_claimed_grid=first.epsilon_claimed_grid,
            )
        return out

    def headline(self) -> list[str]:
        """The lines a summary prints after the verdict: ε against the release's claim, and whether the
        sampled part confirmed anything (:func:`headline_lines`)."""
        return headline_lines(self.headroom_summary(), self.verdict)


def sampled_confirmations(sequence: Sequence[SequenceEstimate], delta: Sequence[DeltaEstimate]) -> int:
    """How many rows of a sampled audit confirm their claim: a sequence estimate whose upper confidence
    end is at most its claimed D_α, or a δ(ε) row whose band's upper end is at most its target δ.

    With too few samples every upper end is ∞ (or above its claim): the sampled part then confirms
    nothing, whatever its verdict, and a PASS rests on the exact per-step checks alone.
    """
    rows = sum(1 for s in sequence if math.isfinite(s.upper) and s.upper <= s.claimed)
    return rows + sum(1 for d in delta if d.band_upper <= d.target_delta)


def headline_lines(h: Mapping, verdict: Verdict | None = None) -> list[str]:
    """A sampled audit's headline from its :meth:`WhiteBoxReport.headroom_summary`: the measured ε next to
    the release's claimed ε (the accountant's, never the claimed curve's conversion on the α grid), and a
    line saying so when the sampled part confirmed nothing."""
    lines = []
    claimed, measured = h.get("epsilon_accountant", math.nan), h.get("epsilon_measured", math.nan)
    if math.isfinite(claimed):
        alphas = ", ".join(f"{a:g}" for a in h.get("alphas", ()))
        line = (
            f"ε: the release claims {_fmt(claimed)} ({h.get('accountant')}); the measured D_α on α ∈ {{{alphas}}} "
            f"gives {_fmt(measured)} (upper confidence end {_fmt(h.get('epsilon_measured_upper'))}), claimed / "
            f"measured = {_fmt(h.get('epsilon'), 3)}"
        )
        grid = h.get("epsilon_claimed_grid", math.nan)
        if math.isfinite(grid) and grid > claimed:
            line += (
                f" (that RDP→DP conversion is loose on this α grid: it turns the claimed curve itself into "
                f"{_fmt(grid)}, so the measured ε overstates the loss)"
            )
        lines.append(line)
    if h.get("sampled_confirmations", 1) == 0:
        rests = "; this PASS rests on the exact per-step checks alone" if verdict is Verdict.PASS else ""
        lines.append(
            f"the sampled part ({h.get('num_texts', '?')} texts) is too small to confirm anything: no upper "
            f"confidence end falls below its claim{rests}"
        )
    return lines


@dataclasses.dataclass(frozen=True)
class BlackBoxReport:
    """Result of a black-box canary audit (see :mod:`invink_audit.audit.blackbox`)."""

    kind: str
    mechanism: str
    verdict: Verdict
    reason: str
    significance: float
    claimed_epsilon: float
    claimed_delta: float
    epsilon_lower_bound: float
    threshold: float
    score: str
    num_trials: dict  # {"selection": {...}, "evaluation": {...}}
    true_positives: int
    false_positives: int
    positives: int
    negatives: int
    timings: dict
    notes: tuple[str, ...] = ()
    scores_with: tuple[float, ...] = ()
    scores_without: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        """JSON-ready, marked first (``not_private``, ``privacy_notice``: the report is not private)."""
        return mark_not_private(to_jsonable(self), REPORT_PRIVACY_NOTICE)


def _num(x):
    """Inverse of :func:`to_jsonable` for floats written as strings."""
    if isinstance(x, str) and x in ("inf", "-inf", "nan"):
        return float(x)
    if isinstance(x, list):
        return [_num(v) for v in x]
    if isinstance(x, dict):
        return {k: _num(v) for k, v in x.items()}
    return x


def report_from_dict(data: dict):
    """Rebuild a :class:`WhiteBoxReport` or :class:`BlackBoxReport` from its ``to_dict()`` (e.g. to
    re-render a committed ``report.json``)."""
    d = _num(unmark(data))  # the NOT PRIVATE marker is a label, re-added by to_dict
    d["verdict"] = Verdict(d["verdict"])
    if d.get("kind") == "black-box":
        for k in ("notes", "scores_with", "scores_without"):
            d[k] = tuple(d.get(k, ()))
        return BlackBoxReport(**d)
    if d.get("kind") != "white-box":
        raise ValueError(f"not an audit report: kind={d.get('kind')!r}")
    sc = dict(d["step_checks"])
    sc["max_renyi_ratio"] = {float(k): v for k, v in sc["max_renyi_ratio"].items()}
    sc["max_loss_range_per_step"] = tuple(sc["max_loss_range_per_step"])
    sc["max_renyi_ratio_per_step"] = tuple(tuple(row) for row in sc["max_renyi_ratio_per_step"])
    d["step_checks"] = StepCheckSummary(**sc)
    d["sequence"] = tuple(SequenceEstimate(**row) for row in d["sequence"])
    d["delta"] = tuple(DeltaEstimate(**row) for row in d["delta"])
    d["accountants"] = tuple(AccountantComparison(**row) for row in d["accountants"])
    d["tests"] = tuple(TestResult(**row) for row in d["tests"])
    d["canaries"] = {int(k): v for k, v in d["canaries"].items()}
    d["notes"] = tuple(d.get("notes", ()))
    d["claim"] = ReportedClaim.from_json(d["claim"])
    d["worst_neighbour"] = WorstNeighbour.from_json(d["worst_neighbour"])
    d["timings"] = AuditTimings.from_json(d["timings"])
    d["loss_histogram"] = LossHistogram.from_json(d["loss_histogram"])
    return WhiteBoxReport(**d)


# ---------------------------------------------------------------------------------------------
# rendering


def _fmt(x, digits=4) -> str:
    if isinstance(x, str):
        return x
    if x is None:
        return "–"
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "∞" if x > 0 else "−∞"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


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
    """The claim's table: the headline figures first, then every other key in the report's order."""
    guarantee = c.guarantee or "a-priori"
    lines = [
        f"## Claim ({guarantee}"
        + (": holds only for the audited references, never a PASS)" if guarantee == "data-dependent" else ")"),
        "",
        "| quantity | value |",
        "|---|---|",
    ]
    fields = c.json_fields()
    lines += [f"| {k} | {_fmt(fields[k], 6)} |" for k in _CLAIM_BASE if k in fields]
    lines += [
        f"| {k} | {_fmt(v, 6) if isinstance(v, (int, float)) else v} |" for k, v in fields.items() if k not in _CLAIM_BASE
    ]
    return lines


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
        f"- max privacy-loss range {_fmt(sc.max_loss_range)} vs ε0 = {_fmt(sc.epsilon0)} "
        f"(headroom ε0/max = {_fmt(sc.range_headroom)})",
        "- max per-step D_α / (α ρ_tok): "
        + ", ".join(f"α={_fmt(float(a))}: {_fmt(v)}" for a, v in sc.max_renyi_ratio.items()),
        f"- max per-step δ_t(ε) − δ_BR(ε): {_fmt(sc.max_delta_excess)}",
        f"- worst prefix (loss range): text {w.get('text')}, step {w.get('step')}, "
        f"neighbour {w.get('neighbour')}, value {_fmt(w.get('value'))}"
        + (f", prefix `{w.get('prefix')}`" if w.get("prefix") else ""),
        "",
    ]


def _md_sequence(r: WhiteBoxReport) -> list[str]:
    """The worst neighbour and the table of sequence-level Rényi estimates (with exact values if any)."""
    with_exact = any(s.exact is not None for s in r.sequence)
    lines = [
        "## Sequence-level Rényi divergences",
        "",
        f"Worst neighbour: {r.worst_neighbour.index} ({r.worst_neighbour.label}), "
        f"max estimate/claim {_fmt(r.worst_neighbour.ratio)}.",
        "",
        "| neighbour | direction | α | estimator | n | lower | estimate | upper | claimed α·ρ_seq | headroom | p | rejected |"
        + (" exact |" if with_exact else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if with_exact else ""),
    ]
    for s in r.sequence:
        row = (
            f"| {s.neighbour} | {s.direction} | {_fmt(s.alpha)} | {s.estimator} | {s.num_samples} | {_fmt(s.lower)} | "
            f"{_fmt(s.estimate)} | {_fmt(s.upper)} | {_fmt(s.claimed)} | {_fmt(s.headroom)} | {_fmt(s.p_value, 3)} | "
            f"{'yes' if s.rejected else 'no'} |"
        )
        if with_exact:
            row += f" {_fmt(s.exact)} |"
        lines.append(row)
    return lines


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
        "| accountant | δ | ε (accountant) | ε (measured) | ε (measured, upper) | accountant / measured | "
        "ε (claimed curve, α grid) | claimed grid / measured |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in r.accountants:
        ratio = a.epsilon / a.epsilon_measured if a.epsilon_measured > 0 else math.inf
        lines.append(
            f"| {a.accountant} | {_fmt(a.delta)} | {_fmt(a.epsilon)} | {_fmt(a.epsilon_measured)} | "
            f"{_fmt(a.epsilon_measured_upper)} | {_fmt(ratio)} | {_fmt(a.epsilon_claimed_grid)} | {_fmt(a.headroom)} |"
        )
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
        lines += [
            "| neighbour | direction | accountant | target δ | ε | δ̂ | band lower | band upper |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for d in positive[:_MD_DELTA_ROWS]:
            lines.append(
                f"| {d.neighbour} | {d.direction} | {d.accountant} | {_fmt(d.target_delta)} | {_fmt(d.epsilon)} | "
                f"{_fmt(d.delta_estimate)} | {_fmt(d.band_lower)} | {_fmt(d.band_upper)} |"
            )
        lines.append("")
        if len(positive) > _MD_DELTA_ROWS:
            lines.append(f"{len(positive) - _MD_DELTA_ROWS} more row(s) with δ̂ > 0 are in report.json.")
    if zero:
        widest = max(d.band_upper for d in zero)
        lines.append(
            f"{len(zero)} of {len(rows)} row(s) with δ̂ = 0 omitted (no sampled text's loss exceeds their ε; their "
            f"band's upper ends reach {_fmt(widest)}); every row is in report.json."
        )
    return lines


def _md_appendix(r: WhiteBoxReport) -> list[str]:
    """Canaries, timings, settings, notes and the plots' legend."""
    lines = []
    if r.canaries:
        lines += ["", "## Canaries", ""] + [f"- neighbour {k}: {v}" for k, v in r.canaries.items()]
    lines += ["", "## Timings", ""] + [f"- {k}: {_fmt(v)}" for k, v in r.timings.items()]
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
        f"- claimed (ε, δ) = ({_fmt(r.claimed_epsilon)}, {_fmt(r.claimed_delta)})",
        f"- ε lower bound (Clopper–Pearson; score and threshold chosen on the selection half, bound computed on the held-out half): {_fmt(r.epsilon_lower_bound)}",
        f"- score: {r.score}; threshold {_fmt(r.threshold)}",
        f"- evaluation: TP {r.true_positives}/{r.positives}, FP {r.false_positives}/{r.negatives}",
        f"- trials: {r.num_trials}",
    ]
    lines += ["", "## Timings", ""] + [f"- {k}: {_fmt(v)}" for k, v in r.timings.items()]
    if r.notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in r.notes]
    lines.append("")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    save_not_private_figure(fig, out / name, dpi=110)
    _pyplot().close(fig)
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
    fig, ax = _pyplot().subplots(figsize=(6, 4))
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
    import textwrap

    label = str(worst.label or "")
    text = f"worst neighbour {worst.index}" + (f": {label}" if label else "")
    return "\n".join(textwrap.wrap(text, _TITLE_WIDTH, max_lines=_TITLE_LINES, placeholder=" …"))


def _plot_loss_histogram(r: WhiteBoxReport, out: Path) -> str:
    """``loss_histogram.png``: the worst neighbour's sequence privacy losses, with the a-priori bound on
    one text's loss (T·ε0, bounded-range claims) and the release's ε as vertical lines (a line beyond
    the losses' range by more than the range itself is drawn at the right edge, marked as such)."""
    h = r.loss_histogram
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    right = None
    if h.counts:
        edges = np.asarray(h.edges, dtype=float)
        ax.stairs(np.asarray(h.counts, dtype=float), edges, fill=True, alpha=0.6, label="texts (finite loss)")
        right = float(edges[-1]) + (float(edges[-1] - edges[0]) or 1.0)  # lines further right are clipped to here
    c = r.claim
    lines = []
    if c.epsilon0 is not None and c.guarantee in (None, "a-priori") and c.composition in (None, "bounded-range"):
        bound = float(c.epsilon0) * c.max_new_tokens
        lines.append((bound, f"a-priori bound T·ε0 = {_fmt(bound)}", "-"))
    if c.epsilons:
        name, eps = next(iter(c.epsilons.items()))
        lines.append((float(eps), f"claimed ε = {_fmt(eps)} ({name}, δ = {_fmt(c.delta)})", "--"))
    for i, (x, label, style) in enumerate(lines):
        if not math.isfinite(x):
            continue
        if right is not None and x > right:
            ax.axvline(right, color="k", ls=style, lw=1, label=f"{label} → beyond the axis")
            ax.annotate(f"{_fmt(x)} →", (right, 0.5 - 0.08 * i), xycoords=("data", "axes fraction"), ha="right",
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
    fig, ax = _pyplot().subplots(figsize=(6, 4))
    per = np.asarray(r.step_checks.max_loss_range_per_step, dtype=float)
    if per.size:
        finite = np.where(np.isfinite(per), per, np.nan)
        ax.plot(np.arange(per.size), finite, ".-", label="max over texts and neighbours")
        inf_steps = np.nonzero(~np.isfinite(per))[0]
        if inf_steps.size:
            top = r.step_checks.epsilon0 if math.isfinite(r.step_checks.epsilon0) else (np.nanmax(np.where(np.isfinite(per), per, np.nan)) if np.isfinite(per).any() else 1.0)
            ax.plot(inf_steps, np.full(inf_steps.size, top * 1.5), "rx", label="infinite (support mismatch)")
    eps0 = r.step_checks.epsilon0
    if math.isfinite(eps0):
        ax.axhline(eps0, color="k", ls="--", label="claimed per-step ε0")
    finite_max = float(np.nanmax(np.where(np.isfinite(per), per, np.nan))) if per.size and np.isfinite(per).any() else 0.0
    ax.set_ylim(0.0, 1.6 * max(eps0 if math.isfinite(eps0) else 0.0, finite_max, 1e-12))
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("decoding step")
    ax.set_ylabel("privacy-loss range (nats)")
    ax.legend(fontsize=7)
    return _save(fig, out, "step_loss_range.png")


def _plots_whitebox(r: WhiteBoxReport, out: Path) -> list[str]:
    return [_plot_renyi(r, out), _plot_loss_histogram(r, out), _plot_step_loss_range(r, out)]


def _plots_blackbox(r: BlackBoxReport, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    if r.scores_with or r.scores_without:
        allv = np.asarray(list(r.scores_with) + list(r.scores_without), dtype=float)
        bins = np.linspace(allv.min(), allv.max() + 1e-9, 30)
        ax.hist(r.scores_without, bins=bins, alpha=0.6, label="without canary")
        ax.hist(r.scores_with, bins=bins, alpha=0.6, label="with canary")
        ax.axvline(r.threshold, color="k", ls="--", label="threshold (chosen on the selection half)")
    ax.set_xlabel(f"score ({r.score})")
    ax.set_ylabel("trials")
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_not_private_figure(fig, out / "scores.png", dpi=110)
    plt.close(fig)
    return ["scores.png"]


def write_report(report, output_dir: str | Path, *, plots: bool = True) -> list[Path]:
    """Write ``report.json``, ``report.md`` and (``plots=True``) PNG plots into ``output_dir``.

    ``report`` is a :class:`WhiteBoxReport`, a :class:`BlackBoxReport`, or a sequence of them (the
    JSON is then a list and the Markdown a concatenation; plots of the first white-box report). Every
    file is NOT PRIVATE: owner-only (0600), never written through a symbolic link, the JSON marked and the
    Markdown opening with the banner (:mod:`invink_audit.not_private`).
    """
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
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
            written += [out / p for p in _plots_whitebox(wb[0], out)]
        if bb:
            written += [out / p for p in _plots_blackbox(bb[0], out)]
    return written
