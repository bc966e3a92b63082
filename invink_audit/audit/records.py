"""Typed audit reports: the records (claim, measurements, verdict) and their JSON form.

Notes and sources: docs/auditing_notes.md ("invink_audit.audit.records").
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence

import numpy as np

from invink_audit.audit.stats import TestResult, Verdict
from invink_audit.not_private import mark_not_private, unmark

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
    "CLAIM_BASE_FIELDS",
    "format_number",
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
        return x if math.isfinite(x) else str(x)  # "nan", "inf", "-inf"
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


class _JsonRecord(Mapping):
    """A typed report record (a dataclass) whose JSON object is :meth:`json_fields` (default: its fields, in order);
    it also reads as that mapping (``record["key"]``, ``"key" in record``, ``record.get``)."""

    #: fields left out of the JSON object while ``None`` (a figure an older report did not state)
    _optional: tuple[str, ...] = ()

    def json_fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in self._optional or getattr(self, f.name) is not None}

    @classmethod
    def from_json(cls, data: Mapping):
        """The record from its JSON object (keys the record does not have are ignored, as a reader of newer reports)."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})

    def __getitem__(self, key):
        return self.json_fields()[key]

    def __iter__(self):
        return iter(self.json_fields())

    def __len__(self) -> int:
        return len(self.json_fields())


#: the claim's keys written whenever the claim is not an a-priori bounded-range one, in this order
_CLAIM_TRAILING = ("guarantee", "composition", "renyi_order", "renyi_budget", "epsilon_claimed")
#: the claim fields every report shows first, in this order
CLAIM_BASE_FIELDS = ("epsilon0", "rho_token", "rho_sequence", "max_new_tokens", "batch_size", "delta")


@dataclasses.dataclass(frozen=True, eq=False)
class ReportedClaim(_JsonRecord):
    """The audited :class:`~invink_audit.audit.whitebox.Claim` as a report states it (JSON: the ``claim`` object):
    the claim itself, ε at its δ certified by each accountant (``epsilons``, JSON keys ``epsilon[<accountant>]``)
    and the mechanism's own parameters (``details``, in its order). It reads as its claim (``reported.epsilon0``)
    and as its JSON object (``reported["epsilon0"]``); two are equal when their JSON is.

    JSON: the claim's figures (:data:`CLAIM_BASE_FIELDS`), the accountants' ε, the details, then ``guarantee`` (the
    kind), ``composition``, ``renyi_order``, ``renyi_budget`` and ``epsilon_claimed`` for a claim that is not an
    a-priori bounded-range one; a key the details also carry keeps its place among them. :meth:`from_json` rebuilds
    the claim's guarantee from these figures (its description is not written, so it is not read back)."""

    claim: object  # Claim
    epsilons: Mapping[str, float] = dataclasses.field(default_factory=dict)
    details: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def __getattr__(self, name: str):
        if name == "claim":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.claim, name)

    def __eq__(self, other) -> bool:
        return isinstance(other, ReportedClaim) and to_jsonable(self.json_fields()) == to_jsonable(other.json_fields())

    __hash__ = None

    def json_fields(self) -> dict:
        c = self.claim
        out = {k: getattr(c, k) for k in CLAIM_BASE_FIELDS}
        out.update({f"epsilon[{name}]": eps for name, eps in self.epsilons.items()})
        out.update(self.details)
        if c.composition != "bounded-range" or not c.a_priori:
            out.update(guarantee=c.kind, composition=c.composition)
            if c.composition == "renyi-filter":
                out.update(renyi_order=c.renyi_order, renyi_budget=c.renyi_budget)
            out["epsilon_claimed"] = c.epsilon_claimed
        return out

    @classmethod
    def from_json(cls, data: Mapping) -> ReportedClaim:
        """Inverse of :meth:`json_fields` (after :func:`_num`)."""
        from invink_audit.audit.whitebox import Claim
        from invink_audit.mechanisms.base import MechanismGuarantee

        rest = [k for k in data if k not in CLAIM_BASE_FIELDS and not k.startswith("epsilon[")]
        # the keys appended after the details: the longest tail of trailing keys in their own order
        # (a trailing key elsewhere was one of the mechanism's details, and keeps its place there)
        appended, rank = len(rest), len(_CLAIM_TRAILING)
        while appended and rest[appended - 1] in _CLAIM_TRAILING and _CLAIM_TRAILING.index(rest[appended - 1]) < rank:
            appended -= 1
            rank = _CLAIM_TRAILING.index(rest[appended])
        epsilons = {k[len("epsilon["):-1]: v for k, v in data.items() if k.startswith("epsilon[")}
        details = {k: data[k] for k in rest[:appended]}
        epsilon = data.get("epsilon_claimed", next(iter(epsilons.values()), math.nan))
        guarantee = MechanismGuarantee(
            kind=data.get("guarantee", "a-priori"), mechanism=str(details.get("mechanism", "")), epsilon=epsilon,
            delta=data["delta"], max_new_tokens=data["max_new_tokens"], composition=data.get("composition", "bounded-range"),
            rho_sequence=data["rho_sequence"], step_epsilon0=data["epsilon0"], step_rho=data["rho_token"],
            renyi_order=data.get("renyi_order"), renyi_budget=data.get("renyi_budget"),
        )  # fmt: skip
        return cls(Claim(guarantee, data["batch_size"]), epsilons, details)


@dataclasses.dataclass(frozen=True)
class WorstNeighbour(_JsonRecord):
    """The audited neighbour with the largest estimate / claim (importance sampling preferred)."""

    index: int
    label: str
    ratio: float


@dataclasses.dataclass(frozen=True)
class LossHistogram(_JsonRecord):
    """Histogram of one neighbour's forward sequence privacy losses (finite ones; ``mean``: of those,
    ``None`` when no loss is finite)."""

    neighbour: int
    edges: tuple[float, ...]
    counts: tuple[int, ...]
    num_infinite: int
    mean: float | None = None
    _optional = ("mean",)

    @classmethod
    def from_json(cls, data: Mapping) -> LossHistogram:
        return cls(data["neighbour"], tuple(data["edges"]), tuple(data["counts"]), data["num_infinite"], data.get("mean"))


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


#: the figures :class:`AuditTimings` names, in their JSON order (``extra`` follows them)
_TIMING_FIELDS = tuple(f.name for f in dataclasses.fields(AuditTimings) if f.name != "extra")


@dataclasses.dataclass(frozen=True)
class StepCheckSummary(_JsonRecord):
    """Exact per-step checks over every visited (text, step, neighbour). ``numerics``: the dtype the audited
    distributions were computed in, the tolerance (nats) and how many checks exceeded their claim by at most it
    (``within_tolerance``: kind -> count; not failures); ``None`` (not written) in a report from before they were
    stated."""

    num_checks: int
    failures: dict  # kind -> count ("support", "range", "renyi", "delta", "nonfinite": NaN or +inf released)
    epsilon0: float
    max_loss_range: float
    range_headroom: float  # epsilon0 / max_loss_range (>= 1: within the claim)
    max_renyi_ratio: dict  # alpha -> max over steps of D_alpha(p_t||p'_t) / (alpha rho_tok)
    max_delta_excess: float  # max over steps and eps of delta_t(eps) - delta_BR(eps) (<= 0: within)
    worst_prefix: dict  # {"value", "text", "step", "neighbour", "prefix"}
    worst_renyi_prefix: dict
    max_loss_range_per_step: tuple[float, ...]
    max_renyi_ratio_per_step: tuple[tuple[float, ...], ...]
    numerics: dict | None = None  # {"dtype", "tolerance", "within_tolerance"}
    _optional = ("numerics",)


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

    ``epsilon_measured``: RDP→DP conversion (:func:`accounting.rdp_to_epsilon`; Canonne, Kamath &
    Steinke 2020, Prop. 12) of the worst measured curve :math:`\\hat D_\\alpha` on the
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
        """The headline figures: per-step range headroom, sequence Rényi headroom (min over rows), and ``epsilon``,
        the first accountant's ε over the measured curve's (its RDP→DP conversion on the α grid, looser than the
        accountant: the ratio errs low; ``epsilon_claimed_grid``, the claimed curve's conversion, shows by how much)."""
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
    """How many rows of a sampled audit confirm their claim: a sequence estimate whose upper confidence end is at
    most its claimed D_α, or a δ(ε) row whose band's upper end is at most its target δ (0: a PASS rests on the exact
    per-step checks alone)."""
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
            f"ε: the release claims {format_number(claimed)} ({h.get('accountant')}); the measured D_α on α ∈ {{{alphas}}} "
            f"gives {format_number(measured)} (upper confidence end {format_number(h.get('epsilon_measured_upper'))}), claimed / "
            f"measured = {format_number(h.get('epsilon'), 3)}"
        )
        grid = h.get("epsilon_claimed_grid", math.nan)
        if math.isfinite(grid) and grid > claimed:
            line += (
                f" (that RDP→DP conversion is loose on this α grid: it turns the claimed curve itself into "
                f"{format_number(grid)}, so the measured ε overstates the loss)"
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
    #: a batched audit (:mod:`invink_audit.audit.batched`): the ε lower bound a perfect attack on the trials
    #: used would certify, the Gaussian-DP fit (an estimate), the sequential looks, and each batch's coin
    ceiling: float | None = None
    gdp: dict | None = None
    sequential: dict | None = None
    coins: tuple[bool, ...] = ()
    #: the claim's privacy curve that was tested (``deltas``, ``epsilons``: :class:`~invink_audit.audit.tradeoff.PrivacyProfile`);
    #: None when only the quoted (ε, δ) was; the tested point is ``sequential["profile"]``
    profile: dict | None = None

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
        for k in ("notes", "scores_with", "scores_without", "coins"):
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


def format_number(x, digits=4) -> str:
    """A number as the reports print it: ``–`` for None, ``∞``, scientific below 1e-3 or from 1e5, else ``digits``
    significant digits; a string as it is."""
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
