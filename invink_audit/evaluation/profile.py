"""Planning by teacher forcing: a paired, exact, sampling-free utility signal and a clip profile.

InvisibleInk's next-token distribution is known exactly (paper Algorithm 1, lines 3–5), so
:func:`run_profile` teacher-forces held-out real texts through the engine with proxy references and
scores every real token under each grid point (ε, B, k, τ), the public-only floor and the non-private
ensemble, all from one pass (paired); plus the clip profile of |φ_i − φ_pub| (paper Eq. (ourclip)).
Outputs are statistics of the data, not differentially private (:data:`PLANNING_NOTICE`).

Design: docs/guide/evaluating.md (§"Planning by teacher forcing"); results: docs/results/planning-signal.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from accounting import DEFAULT_ACCOUNTANT, plan_clip_norm
from accounting.limits import check_count
from invink_audit.evaluation.stats import DEFAULT_CONFIDENCE, Interval, percentile_interval
from invink_audit.mechanism import DEFAULT_TOP_K
from invink_audit.not_private import (
    agg_pyplot,
    mark_not_private,
    md_table,
    save_not_private_figure,
    write_not_private_json,
    write_not_private_text,
)

__all__ = [
    "PROFILE_MECHANISMS",
    "PLANNING_NOTICE",
    "SMOOTHING",
    "ClipProfile",
    "Comparison",
    "ComputeRatio",
    "ProfileConfig",
    "ProfilePoint",
    "ProfileResult",
    "GridPoint",
    "MIN_PROFILE_TEXTS",
    "grid_values",
    "rows_to_reach",
    "run_profile",
]

#: η: every distribution is scored mixed with the uniform one at this weight (docs/guide/evaluating.md, "coverage").
SMOOTHING = 1e-3
#: the bins of the per-token clip profile's histogram of |φ_i − φ_pub| (log-spaced, nats of logit)
_BINS = np.concatenate([[0.0], np.logspace(-3, 3, 241)])

#: what ``profile --mechanism`` scores: InvisibleInk, Amin et al. 2024 with the correct replace-by-null
#: sensitivities (2C/B, 2/B) or the paper's understated ones (C/B, 1/B), AdaPMixED (data-dependent budget)
PROFILE_MECHANISMS = ("invisibleink", "amin", "amin-paper", "adapmixed")

PLANNING_NOTICE = (
    "Planning runs on public or proxy data: these figures are statistics of the references and the held-out "
    "texts and are NOT differentially private. Run on private data, this is not a private release."
)


def grid_values(values, name: str) -> tuple:
    """One axis of a grid (``profile``'s, ``sweep``'s): a non-empty sequence without repeats, as a tuple."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"{name} must be a non-empty sequence; got {values!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} must not repeat a value; got {list(values)}")
    return tuple(values)


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """The grid (every combination of ``epsilons``, ``batch_sizes``, ``top_ks``, ``temperatures``) and
    what is shared by its points: ``max_new_tokens`` (T: the token budget each point's C is planned for),
    ``scored_tokens`` (the real tokens scored per text; default T), ``delta``, ``num_texts`` held-out texts, the prompt, the label columns
    that pair each text with references of its own group, and the bootstrap (``num_resamples``,
    ``confidence``). ``seed`` picks the texts and their references (reproducible, the same for every point)."""

    epsilons: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    top_ks: tuple[int | None, ...] = (DEFAULT_TOP_K,)
    temperatures: tuple[float, ...] = (1.0,)
    max_new_tokens: int = 64
    delta: float = 1e-6
    #: real tokens teacher-forced and scored per held-out text (``None``: ``max_new_tokens``)
    scored_tokens: int | None = None
    num_texts: int = 30
    seed: int = 0
    prompt: object = "generic"
    prompt_fields: Mapping[str, str] | None = None
    column: str = "text"
    label_columns: tuple[str, ...] = ()
    #: only the proxy references whose columns have these values (``{column: value}``, as ``generate`` takes it)
    where: Mapping[str, str] | None = None
    accountant: str = DEFAULT_ACCOUNTANT
    #: the unit of privacy (:class:`~invink_audit.data.PrivacyUnit`; ``None``: one reference): each point's C is
    #: planned per unit, and the proxy references are the slots its rule makes (docs/guide/privacy-unit.md)
    privacy_unit: object = None
    num_resamples: int = 2000
    confidence: float = DEFAULT_CONFIDENCE
    #: the mechanisms scored (:data:`PROFILE_MECHANISMS`), all on the same texts, references and resamples
    mechanisms: tuple[str, ...] = ("invisibleink",)
    #: Amin et al.'s r, the private tokens before it stops (``None``: T/4, the paper's calibration, App. D.5)
    amin_private_tokens: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mechanisms", grid_values(self.mechanisms, "mechanisms"))
        if unknown := [m for m in self.mechanisms if m not in PROFILE_MECHANISMS]:
            raise ValueError(f"mechanisms must be among {', '.join(PROFILE_MECHANISMS)}; got {unknown}")
        if self.amin_private_tokens is not None:
            check_count("amin_private_tokens", self.amin_private_tokens)
            if not {"amin", "amin-paper"} & set(self.mechanisms):
                raise ValueError(f"amin_private_tokens (--amin-private-tokens) applies to amin and amin-paper only; "
                                 f"mechanisms: {', '.join(self.mechanisms)}")
        for name in ("epsilons", "batch_sizes", "top_ks", "temperatures"):
            object.__setattr__(self, name, grid_values(getattr(self, name), name))
        for b in self.batch_sizes:
            check_count("batch_sizes", b)
        for k in self.top_ks:
            if k is not None:
                check_count("top_ks", k)
        object.__setattr__(self, "max_new_tokens", check_count("max_new_tokens", self.max_new_tokens))
        if self.scored_tokens is not None:
            object.__setattr__(self, "scored_tokens", check_count("scored_tokens", self.scored_tokens))
        object.__setattr__(self, "num_texts", check_count("num_texts", self.num_texts))
        object.__setattr__(self, "num_resamples", check_count("num_resamples", self.num_resamples))
        check_count("seed", self.seed, minimum=0)
        if not isinstance(self.confidence, float) or not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be a float in (0, 1); got {self.confidence!r}")
        object.__setattr__(self, "label_columns", tuple(self.label_columns))
        from invink_audit.data import PrivacyUnit

        object.__setattr__(self, "privacy_unit", PrivacyUnit.of(self.privacy_unit))
        if self.privacy_unit is not None and self.mechanisms != ("invisibleink",):
            raise ValueError("a privacy unit is supported for InvisibleInk only: profile the baselines per reference")
        if self.privacy_unit is not None and self.where:
            raise ValueError("where with a privacy unit is not supported: select the records into a file first")
        if not self.points():  # every point's C is planned now: an out-of-range point fails before any model loads
            raise ValueError(f"no grid point is feasible (no clip norm): {', '.join(self.infeasible())}")

    @property
    def tokens_scored(self) -> int:
        """Real tokens scored per held-out text: ``scored_tokens``, or T when it is not given."""
        return self.max_new_tokens if self.scored_tokens is None else self.scored_tokens

    @property
    def private_tokens(self) -> int:
        """Amin et al.'s r: ``amin_private_tokens``, or T/4 (at least 1)."""
        return self.amin_private_tokens or max(1, self.max_new_tokens // 4)

    def points(self) -> list[GridPoint]:
        """Every feasible grid point with its planned clip norm: InvisibleInk's by :func:`accounting.plan_clip_norm`,
        Amin et al.'s by :func:`~invink_audit.mechanisms.plan_amin` (r = :attr:`private_tokens`; :meth:`infeasible`
        lists where it finds none), AdaPMixED's none (it stops at ε instead; ``clip_norm`` NaN)."""
        return [p for p in self._grid if isinstance(p, GridPoint)]

    def infeasible(self) -> list[str]:
        """The (mechanism, ε, B, τ) where Amin et al.'s planner finds no clip norm (the SVT alone overspends)."""
        return [p for p in self._grid if isinstance(p, str)]

    @functools.cached_property  # planned once per config (its fields are frozen): each point, or why it has no C
    def _grid(self) -> tuple:
        from invink_audit.mechanisms import AminInfeasibleError, plan_amin

        out = []
        for mech, eps, b, tau in itertools.product(self.mechanisms, self.epsilons, self.batch_sizes, self.temperatures):
            if mech == "invisibleink":
                units = 1 if self.privacy_unit is None else self.privacy_unit.unit_contributions
                plan = plan_clip_norm(epsilon=eps, delta=self.delta, max_new_tokens=self.max_new_tokens, batch_size=b,
                                      temperature=tau, accountant=self.accountant, unit_contributions=units)
                out += [GridPoint(plan.epsilon, b, k, plan.temperature, plan.clip_norm) for k in self.top_ks]
            elif mech == "adapmixed":
                out.append(GridPoint(eps, b, None, tau, math.nan, mech))
            else:
                try:
                    acc = plan_amin(epsilon=eps, delta=self.delta, max_private_tokens=self.private_tokens, batch_size=b,
                                    temperature=tau, sensitivity="paper" if mech == "amin-paper" else "replace-by-null")
                    out.append(GridPoint(eps, b, None, tau, acc.clip_norm, mech))
                except AminInfeasibleError:
                    out.append(f"{mech} eps={eps:g} B={b} tau={tau:g}")
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class GridPoint:
    """One point of the grid: (ε, B, k, τ) and the clip norm C planned for it."""

    epsilon: float
    batch_size: int
    top_k: int | None
    temperature: float
    clip_norm: float
    mechanism: str = "invisibleink"

    @property
    def label(self) -> str:
        head = "" if self.mechanism == "invisibleink" else f"{self.mechanism} "
        return f"{head}eps={self.epsilon:g} B={self.batch_size} k={_k(self.top_k)} tau={self.temperature:g}"


@dataclasses.dataclass(frozen=True)
class ProfilePoint:
    """The signal at one grid point (all intervals paired: the same texts, tokens and resamples)."""

    point: GridPoint
    heldout_ce: Interval
    floor_ce: Interval
    ensemble_ce: Interval
    gain_over_floor: Interval
    #: gain over the same mechanism with every reference replaced by null (the public row over the same
    #: Top-k+ set): what the private references add, apart from the wider support a larger C gives
    gain_over_null: Interval
    gap_closed: Interval | None
    coverage: float
    floor_coverage: float
    clipped_share: float

    def to_json(self) -> dict:
        p = self.point
        return {
            "mechanism": p.mechanism, "epsilon": p.epsilon, "batch_size": p.batch_size, "top_k": p.top_k, "temperature": p.temperature,
            "clip_norm": None if math.isnan(p.clip_norm) else p.clip_norm, "heldout_ce": self.heldout_ce.to_json(), "floor_ce": self.floor_ce.to_json(),
            "ensemble_ce": self.ensemble_ce.to_json(), "gain_over_floor": self.gain_over_floor.to_json(),
            "gain_over_null": self.gain_over_null.to_json(),
            "gap_closed": None if self.gap_closed is None else self.gap_closed.to_json(),
            "coverage": self.coverage, "floor_coverage": self.floor_coverage, "clipped_share": self.clipped_share,
        }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Comparison:
    """``better`` against ``worse`` (gain of the first minus gain of the second, paired bootstrap):
    ``separated`` when the interval excludes 0; ``texts_needed`` the texts per point at which an
    interval of this width would exclude 0 (``n·(half-width/|difference|)²``), when it does not yet."""

    better: GridPoint
    worse: GridPoint
    difference: Interval
    separated: bool
    texts_needed: int | None

    def to_json(self) -> dict:
        return {"better": self.better.label, "worse": self.worse.label, "difference": self.difference.to_json(),
                "separated": self.separated, "texts_needed": self.texts_needed}


@dataclasses.dataclass(frozen=True)
class ComputeRatio:
    """Forward rows per token (B + 1) each mechanism needs to reach ``target_gain`` over the floor: the gain of
    ``baseline`` (a baseline's measured point), read off the baseline's and InvisibleInk's (full vocabulary: the
    same floor) gain curves over B + 1 at the same ε and τ (:func:`rows_to_reach`), and ``ratio`` = baseline rows / InvisibleInk rows: InvisibleInk's compute saving at equal
    held-out gain. Intervals: the same paired resamples over texts for everything (percentile, no interpolation).
    ``below_grid``/``above_grid``: the shares of resamples where InvisibleInk reaches the target already at its
    smallest B + 1 (its rows are then at most that: the ratio a lower bound) or not at its largest (its rows
    infinite, the ratio 0: only "less than baseline rows / largest B + 1" is known)."""

    baseline: GridPoint
    target_gain: Interval
    baseline_rows: Interval
    invisibleink_rows: Interval
    ratio: Interval
    below_grid: float
    above_grid: float

    def to_json(self) -> dict:
        return {"baseline": self.baseline.label, "epsilon": self.baseline.epsilon,
                **{k: getattr(self, k).to_json() for k in ("target_gain", "baseline_rows", "invisibleink_rows", "ratio")},
                "below_grid": self.below_grid, "above_grid": self.above_grid}


@dataclasses.dataclass(frozen=True)
class ClipProfile:
    """Per-step ℓ∞ of each reference's logit difference to the public row over the public top-``top_k``
    tokens (one value per text, reference and step), and a histogram of the per-token differences on the
    same tokens (``bin_edges``, ``counts``: bucket i holds ``[bin_edges[i], bin_edges[i+1])``, the last one
    everything from its lower edge up)."""

    top_k: int | None
    linf: np.ndarray
    bin_edges: np.ndarray
    counts: np.ndarray

    def to_json(self) -> dict:
        q = np.quantile(self.linf, [0.05, 0.25, 0.5, 0.75, 0.95]) if self.linf.size else [math.nan] * 5
        return {"top_k": self.top_k, "linf_quantiles": dict(zip(("p05", "p25", "p50", "p75", "p95"), map(float, q))),
                "num_linf": int(self.linf.size), "bin_edges": self.bin_edges.tolist(), "counts": self.counts.tolist()}


@dataclasses.dataclass(frozen=True)
class ProfileResult:
    """What :func:`run_profile` measured (``to_json``; :meth:`markdown`; :meth:`write` with plots)."""

    config: ProfileConfig
    points: tuple[ProfilePoint, ...]
    comparisons: tuple[Comparison, ...]
    recommendation: str
    clip_profile: ClipProfile
    num_texts: int
    num_tokens: int
    skipped_texts: int
    seconds: float
    #: what this sample is too small for (said in the report and on stderr)
    warnings: tuple[str, ...] = ()
    #: InvisibleInk's compute saving over each baseline point at equal held-out gain
    compute: tuple[ComputeRatio, ...] = ()
    #: the baseline points whose planner finds no clip norm (nothing scored there)
    infeasible: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """One JSON object, marked NOT PRIVATE (:func:`~invink_audit.not_private.mark_not_private`): what
        ``profile --json`` prints and ``profile.json`` holds."""
        return mark_not_private({
            "points": [p.to_json() for p in self.points],
            "comparisons": [c.to_json() for c in self.comparisons],
            "compute": [c.to_json() for c in self.compute], "infeasible": list(self.infeasible),
            "recommendation": self.recommendation,
            "clip_profile": self.clip_profile.to_json(),
            "num_texts": self.num_texts, "num_tokens": self.num_tokens, "skipped_texts": self.skipped_texts,
            "max_new_tokens": self.config.max_new_tokens, "scored_tokens": self.config.tokens_scored,
            "delta": self.config.delta, "smoothing": SMOOTHING,
            "seconds": self.seconds, "warnings": list(self.warnings), "notice": PLANNING_NOTICE,
        })  # fmt: skip

    def markdown(self) -> str:
        return profile_markdown(self)

    def write(self, directory: str | Path) -> list[Path]:
        """``profile.md``, ``profile.json`` and the plots into ``directory`` (owner-only, marked NOT PRIVATE)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True, mode=0o700)
        paths = [write_not_private_text(out / "profile.md", self.markdown(), markdown=True),
                 write_not_private_json(out / "profile.json", self.to_json())]
        return paths + write_profile_plots(self, out)


# --------------------------------------------------------------------------------------------
# the teacher-forced pass


@dataclasses.dataclass(frozen=True)
class _Text:
    """One held-out text: its forced ids (the scored tokens, then an end-of-sequence token when shorter
    than T), how many are scored, its references (``max(B)`` of them, best first) and its labels."""

    forced: tuple[int, ...]
    scored: int
    references: tuple[str, ...]
    labels: Mapping[str, str] | None


class _Scores:
    """Per-text sums filled by the observer, one tensor per quantity and key (length: number of texts), kept
    on the model's device until :meth:`finish` (no host transfer per step)."""

    def __init__(self, config: ProfileConfig, texts: Sequence[_Text], vocab_size: int, device) -> None:
        import torch

        self.config, self.n, self.vocab, self.device = config, len(texts), vocab_size, device
        self.scored = torch.tensor([t.scored for t in texts], device=device)
        self.points = config.points()
        self.sums: dict[tuple, object] = {}
        finite = [k for k in config.top_ks if k is not None]
        #: the clip profile's tokens: the grid's smallest k (the default k when the grid has only the full vocabulary)
        self.profile_k = min(finite) if finite else DEFAULT_TOP_K
        self.linf: list = []
        self.edges = torch.tensor(_BINS[1:-1], dtype=torch.float64, device=device)
        self.counts = torch.zeros(len(_BINS) - 1, dtype=torch.int64, device=device)
        # the baselines' mechanisms (for the point and its every-reference-null twin) and their recursions' states
        self.baselines = {p: _baseline(p, config) for p in self.points if p.mechanism != "invisibleink"}
        self.states = {(p, kind): m[kind].forced_state(self.n, device) for p, m in self.baselines.items() for kind in m}
        self.generator = torch.Generator(device=device).manual_seed(config.seed)  # AdaPMixED's screening draws

    def add(self, key: tuple, index, values) -> None:
        import torch

        if key not in self.sums:
            self.sums[key] = torch.zeros(self.n, dtype=torch.float64, device=self.device)
        self.sums[key].index_add_(0, index, values.to(torch.float64))

    def finish(self) -> tuple[dict[tuple, np.ndarray], np.ndarray, np.ndarray]:
        """The sums as numpy arrays, the per-step ℓ∞ values and the histogram counts (one transfer)."""
        import torch

        linf = torch.cat(self.linf).cpu().numpy() if self.linf else np.zeros(0)
        return {k: v.cpu().numpy() for k, v in self.sums.items()}, linf, self.counts.cpu().numpy()

    def observe(self, step) -> None:
        import torch

        from invink_audit.mechanism import ACCUMULATION_DTYPE, token_log_probs, top_k_log_softmax, topk_plus_mask

        keep = step.positions < self.scored[step.request_indices]
        index = step.request_indices[keep]
        if not index.numel():  # every text of this step is at its forced end-of-sequence token, past its scored ones
            return
        tokens = step.tokens[keep][:, None]
        public = step.public_logits[keep].to(ACCUMULATION_DTYPE)
        private = step.private_logits[keep]
        self.add(("tokens",), index, torch.ones_like(tokens[:, 0]))
        for k in set(self.config.top_ks) | ({None} if self.baselines else set()):
            for tau in self.config.temperatures:
                floor = top_k_log_softmax(public / tau, k)
                self.add(("floor", k, tau), index, _smoothed_loss(floor, tokens, self.vocab))
                self.add(("floor_in", k, tau), index, torch.isfinite(floor.gather(1, tokens)).squeeze(1))
        for b in self.config.batch_sizes:
            for tau in self.config.temperatures:
                mean = private[:, :b].to(ACCUMULATION_DTYPE).mean(dim=1) / tau
                self.add(("ensemble", b, tau), index, _smoothed_loss(torch.log_softmax(mean, dim=-1), tokens, self.vocab))
        differences = (private.to(ACCUMULATION_DTYPE) - public[:, None]).abs_()
        for p in self.points:
            b, key = p.batch_size, dataclasses.astuple(p)
            if p in self.baselines:
                self._baseline_step(p, key, index, tokens, private[:, :b], public)
                continue
            lp = token_log_probs(private[:, :b], public, clip_norm=p.clip_norm, temperature=p.temperature, top_k=p.top_k)
            self.add(("point", *key), index, _smoothed_loss(lp, tokens, self.vocab))
            self.add(("in", *key), index, torch.isfinite(lp.gather(1, tokens)).squeeze(1))
            support = topk_plus_mask(public, p.top_k, p.clip_norm, b)
            # every reference replaced by null: the public row over the same Top-k+ set (the support's share)
            null = torch.log_softmax((public / p.temperature).masked_fill(~support, -math.inf), dim=-1)
            self.add(("null", *key), index, _smoothed_loss(null, tokens, self.vocab))
            self.add(("clipped", *key), index, ((differences[:, :b] > p.clip_norm) & support[:, None]).sum(dim=(1, 2)))
            self.add(("entries", *key), index, support.sum(dim=1) * b)
        self._profile(differences, public)

    def _baseline_step(self, p: GridPoint, key: tuple, index, tokens, private, public) -> None:
        """A baseline's point and its every-reference-null twin, by its forward recursion (its ``forced_step``)."""
        import torch

        mechs = self.baselines[p]
        extra = {"generator": self.generator} if p.mechanism == "adapmixed" else {}
        for kind, rows in (("point", private), ("null", public[:, None].expand(-1, mechs["null"].batch_size, -1))):
            lp, after = mechs[kind].forced_step(rows, public, self.states[p, kind][index], tokens[:, 0], **extra)
            self.states[p, kind][index] = after
            self.add((kind, *key), index, _smoothed_loss(lp, tokens, self.vocab))
            if kind == "point":
                self.add(("in", *key), index, torch.isfinite(lp.gather(1, tokens)).squeeze(1))
        if p.mechanism != "adapmixed":  # recentred naive clipping (Amin et al.): below −C once shifted by max − C
            shifted = private - private.amax(dim=-1, keepdim=True)
            self.add(("clipped", *key), index, (shifted < -2 * p.clip_norm).sum(dim=(1, 2)))
            self.add(("entries", *key), index, torch.full_like(index, shifted[0].numel()))

    def _profile(self, differences, public) -> None:
        import torch

        k = self.profile_k
        if k >= public.shape[-1]:
            on = differences
        else:
            columns = torch.topk(public, k, dim=-1).indices[:, None].expand(-1, differences.shape[1], -1)
            on = differences.gather(-1, columns)
        self.linf.append(on.amax(dim=-1).flatten())
        # bucket i holds [_BINS[i], _BINS[i+1]); the last one everything from 1e3 up
        self.counts += torch.bincount(torch.bucketize(on.flatten(), self.edges, right=True), minlength=len(self.counts))


def _baseline(point: GridPoint, config: ProfileConfig) -> dict:
    """The baseline mechanism a point scores (as docs/guide/baselines.md configures it) and its every-reference-null
    twin: Amin et al.'s B null rows are one public row (the same mean of clipped rows and of softmaxes: B = 1, one
    row of work), AdaPMixED's stay B rows (its screening cost depends on B)."""
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism

    if point.mechanism == "adapmixed":
        mech = AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=point.batch_size, epsilon=point.epsilon, delta=config.delta,
                                                  temperature=point.temperature))
        return {"point": mech, "null": mech}
    sensitivity = "paper" if point.mechanism == "amin-paper" else "replace-by-null"
    return {kind: AminMechanism(AminConfig(clip_norm=point.clip_norm, batch_size=b, temperature=point.temperature,
                                           max_private_tokens=config.private_tokens, sensitivity=sensitivity))
            for kind, b in (("point", point.batch_size), ("null", 1))}


def _smoothed_loss(log_probs, tokens, vocab_size: int):
    r""":math:`-\log((1-\eta)\,p + \eta/|V|)` of the forced tokens (docs/guide/evaluating.md, "coverage")."""
    import torch

    lp = log_probs.gather(1, tokens).squeeze(1)
    return -torch.logaddexp(lp + math.log1p(-SMOOTHING), torch.full_like(lp, math.log(SMOOTHING / vocab_size)))


# --------------------------------------------------------------------------------------------
# choosing the texts and their references


def _read(path, config: ProfileConfig, *, where: Mapping[str, str] | None = None, unit=None):
    from invink_audit.data import ReferencesFile, select_references, unit_slots

    if where:
        records = select_references(path, where, column=config.column, label_columns=config.label_columns)
    else:
        records = ReferencesFile(path, config.column, config.label_columns or None, unit).read()
    if unit is not None:  # the proxy references as the unit's rule makes its slots (a release's references)
        texts, positions = unit_slots(records)
        return texts, None if records.labels is None else [dict(records.labels.labels[p]) for p in positions]
    if config.label_columns:
        return list(records.texts), [dict(m) for m in records.labels]
    return list(records), None


def _choose_texts(proxy, real, config: ProfileConfig, tokenizer, eos_ids) -> tuple[list[_Text], int]:
    """``num_texts`` held-out texts of ``real`` (seeded order) and, for each, ``max(B)`` distinct references of its
    label group drawn from ``proxy`` (never the text itself; both as :func:`_read` gives them: texts and their
    label mappings); texts whose group has too few are skipped. Each text is forced as a run would have
    drawn it (:func:`invink_audit.prompts.forced_text_ids`)."""
    from invink_audit.prompts import forced_text_ids

    (references, ref_labels), (texts, labels) = proxy, real
    need, rng = max(config.batch_sizes), np.random.default_rng(config.seed)
    groups: dict[tuple, list[int]] = {}
    for i, text in enumerate(references):
        if text.strip():
            groups.setdefault(_group(ref_labels, i), []).append(i)
    chosen, skipped = [], 0
    for i in rng.permutation(len(texts)):
        if len(chosen) == config.num_texts:
            break
        forced, scored = forced_text_ids(tokenizer, texts[i], eos_token_ids=eos_ids, max_new_tokens=config.tokens_scored)
        pool = [j for j in groups.get(_group(labels, i), []) if references[j] != texts[i]]
        if not scored or len(pool) < need:
            skipped += 1
            continue
        picked = tuple(references[pool[j]] for j in rng.permutation(len(pool))[:need])  # nested: B < max(B) takes a prefix
        chosen.append(_Text(forced, scored, picked, None if labels is None else labels[i]))
    return chosen, skipped


def _group(labels, i: int) -> tuple:
    return () if labels is None else tuple(sorted(labels[i].items()))


def _requests(loaded, texts: Sequence[_Text], config: ProfileConfig):
    from invink_audit.prompts import (
        encode_request,
        get_preset,
        label_fields_for,
        require_label_fields,
        template_for_labels,
        template_for_model,
    )

    template = template_for_model(get_preset(config.prompt, **dict(config.prompt_fields or {})), loaded.tokenizer)
    filled = tuple(r.field for r in label_fields_for(template, config.label_columns)) if config.label_columns else ()
    require_label_fields(template, tuple(config.prompt_fields or ()), filled)
    out = []
    for i, t in enumerate(texts):
        batch = template if t.labels is None else template_for_labels(template, t.labels)
        # the real text is forced whole: no stop string may end it early
        out.append(dataclasses.replace(encode_request(loaded.tokenizer, batch, list(t.references), key=i), stop=()))
    return out


# --------------------------------------------------------------------------------------------
# the profile


def run_profile(
    proxy: str | Path,
    real: str | Path,
    config: ProfileConfig,
    *,
    model=None,
    progress: Callable[[int, int], None] | None = None,
) -> ProfileResult:
    """Teacher-force ``config.num_texts`` texts of ``real`` (held out) with references from ``proxy`` through
    every grid point at once (docs/guide/evaluating.md). ``model``: as :func:`invink_audit.load_model` takes it
    (default: :data:`~invink_audit.models.DEFAULT_GENERATOR`, the model ``generate`` releases with, prompted as
    it is: :func:`~invink_audit.prompts.template_for_model`). ``progress(done, total)``: forced tokens so far."""
    import torch

    from invink_audit.engine import Engine
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.models import DEFAULT_GENERATOR, load_model

    if not isinstance(config, ProfileConfig):
        raise ValueError(f"config must be a ProfileConfig; got {type(config).__name__}")
    start = time.perf_counter()
    records = _read(Path(proxy), config, where=config.where, unit=config.privacy_unit), _read(Path(real), config)  # a bad file fails before the model loads
    loaded = load_model(DEFAULT_GENERATOR if model is None else model)
    texts, skipped = _choose_texts(*records, config, loaded.tokenizer, frozenset(loaded.eos_token_ids))
    if len(texts) < 2:
        raise ValueError(
            f"{len(texts)} held-out text(s) could be profiled ({skipped} skipped: each needs a non-empty text and "
            f"{max(config.batch_sizes)} proxy references of its label group, max of --batch-sizes); a paired bootstrap "
            "over texts needs at least 2"
        )
    requests = _requests(loaded, texts, config)
    # the engine's own mechanism only has to give every forced token a positive probability: the full
    # vocabulary; each grid point's distribution is computed from the logits by the observer
    engine = Engine(loaded, MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=max(config.batch_sizes)))
    scores = _Scores(config, texts, loaded.vocab_size, loaded.device)
    total, done = sum(len(t.forced) for t in texts), [0]

    def advance(n: int) -> None:
        done[0] = min(done[0] + n, total)
        progress(done[0], total)

    if progress is not None:
        progress(0, total)
    with torch.no_grad():
        engine.force(requests, [t.forced for t in texts], max_new_tokens=config.tokens_scored,
                     observer=scores.observe, progress=advance if progress is not None else None)
    return _summarise(scores, config, skipped, time.perf_counter() - start)


# --------------------------------------------------------------------------------------------
# statistics


def _bootstrap(sums: Mapping[tuple, np.ndarray], n: int, config: ProfileConfig):
    """``ratio(numerator, denominator=tokens)``: the ratio of per-text sums with its percentile-bootstrap
    interval over texts (Efron & Tibshirani 1993, §13.3), every call on the *same* resamples (paired)."""
    tokens = sums[("tokens",)]
    resamples = _resamples(n, config)
    boot_tokens = tokens[resamples].sum(axis=1)

    def ratio(numerator: np.ndarray, denominator: np.ndarray | None = None) -> Interval | None:
        den, boot_den = (tokens.sum(), boot_tokens) if denominator is None else (
            denominator.sum(), denominator[resamples].sum(axis=1))
        usable = boot_den > 0
        # a ratio whose denominator is not positive in more than α/2 of the resamples is noise: no interval
        if den <= 0 or (~usable).mean() > (1 - config.confidence) / 2:
            return None
        reps = numerator[resamples].sum(axis=1)[usable] / boot_den[usable]
        return percentile_interval(float(numerator.sum() / den), reps, config.confidence, "paired bootstrap over texts")

    return ratio


def _resamples(n: int, config: ProfileConfig) -> np.ndarray:
    """The bootstrap's resamples of the n texts, (num_resamples, n): one seeded draw that every interval shares."""
    return np.random.default_rng(config.seed + 1).integers(0, n, size=(config.num_resamples, n))


def _summarise(scores: _Scores, config: ProfileConfig, skipped: int, seconds: float) -> ProfileResult:
    s, linf, counts = scores.finish()
    n, tokens = scores.n, s[("tokens",)]
    ratio = _bootstrap(s, n, config)
    points = []
    for p in scores.points:
        key, floor, ens = dataclasses.astuple(p), s[("floor", p.top_k, p.temperature)], s[("ensemble", p.batch_size, p.temperature)]
        own, null = s[("point", *key)], s[("null", *key)]
        points.append(ProfilePoint(
            point=p, heldout_ce=ratio(own), floor_ce=ratio(floor), ensemble_ce=ratio(ens), gain_over_floor=ratio(floor - own),
            gain_over_null=ratio(null - own), gap_closed=ratio(floor - own, floor - ens),
            coverage=float(s[("in", *key)].sum() / tokens.sum()),
            floor_coverage=float(s[("floor_in", p.top_k, p.temperature)].sum() / tokens.sum()),
            clipped_share=float(s[("clipped", *key)].sum() / max(s[("entries", *key)].sum(), 1))
            if ("clipped", *key) in s else math.nan,  # AdaPMixED does not clip
        ))  # fmt: skip
    comparisons = _comparisons(points, s, ratio, n)
    profile = ClipProfile(scores.profile_k, linf, _BINS, counts)
    return ProfileResult(config, tuple(points), tuple(comparisons), _recommendation(points, comparisons, n), profile,
                         n, int(tokens.sum()), skipped, seconds, _warnings(n, config),
                         tuple(_compute_ratios(points, s, config)), tuple(config.infeasible()))


def _compute_ratios(points: Sequence[ProfilePoint], sums, config: ProfileConfig) -> list[ComputeRatio]:
    """Every baseline point against InvisibleInk's full-vocabulary curve at its (ε, τ) (:class:`ComputeRatio`)."""
    n = len(sums[("tokens",)])
    index = np.vstack([np.arange(n), _resamples(n, config)])  # row 0: the data itself; then the shared resamples

    def gains(p: ProfilePoint) -> np.ndarray:  # (1 + resamples,) gain over the floor, per resample
        g = p.point
        diff = sums[("floor", g.top_k, g.temperature)] - sums[("point", *dataclasses.astuple(g))]
        return diff[index].sum(axis=1) / sums[("tokens",)][index].sum(axis=1)

    def curve(row: Sequence[ProfilePoint]) -> tuple[np.ndarray, np.ndarray]:
        row = sorted(row, key=lambda q: q.point.batch_size)
        return np.array([q.point.batch_size + 1.0 for q in row]), np.stack([gains(q) for q in row])

    def same(q: ProfilePoint, b: GridPoint, mechanism: str) -> bool:  # InvisibleInk: its full-vocabulary points
        return (q.point.mechanism, q.point.epsilon, q.point.temperature) == (mechanism, b.epsilon, b.temperature) and (
            mechanism != "invisibleink" or q.point.top_k is None)

    out = []
    for base in (p for p in points if p.point.mechanism != "invisibleink"):
        b = base.point
        if ours := [q for q in points if same(q, b, "invisibleink")]:
            own = curve([q for q in points if same(q, b, b.mechanism)])
            out.append(_ratio(b, gains(base), own, curve(ours), config.confidence))
    return out


def rows_to_reach(rows: np.ndarray, gains: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per resample (columns of ``gains`` (points, resamples)), the rows at which the curve first reaches ``target``:
    linear in gain and log rows between the measured points; ``rows[0]`` when the first point already does, ∞ when
    none does."""
    reached = gains >= target[None]
    first = np.where(reached.any(axis=0), reached.argmax(axis=0), len(rows))
    out = np.where(first == len(rows), math.inf, rows[np.minimum(first, len(rows) - 1)])
    cols = np.nonzero((first > 0) & (first < len(rows)))[0]
    lo, hi = first[cols] - 1, first[cols]
    g_lo, g_hi = gains[lo, cols], gains[hi, cols]
    share = (target[cols] - g_lo) / (g_hi - g_lo)  # in (0, 1]: g_lo < target <= g_hi
    out[cols] = np.where(share >= 1, rows[hi], np.exp(np.log(rows[lo]) + share * (np.log(rows[hi]) - np.log(rows[lo]))))
    return out


def _ratio(base: GridPoint, target: np.ndarray, own, ours, confidence: float) -> ComputeRatio:
    base_rows, our_rows = rows_to_reach(*own, target), rows_to_reach(*ours, target)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(np.isinf(our_rows), 0.0, base_rows / our_rows)

    def interval(values: np.ndarray) -> Interval:
        a = (1.0 - confidence) / 2
        lo, hi = np.quantile(values[1:], [a, 1 - a], method="inverted_cdf")  # no interpolation: ∞ stays ∞
        est = float(values[0])
        return Interval(est, min(float(lo), est), max(float(hi), est), confidence,
                        f"paired bootstrap over texts, {values.size - 1} replicates")

    return ComputeRatio(base, interval(target), interval(base_rows), interval(our_rows), interval(ratio),
                        float((our_rows[1:] == ours[0][0]).mean()), float(np.isinf(our_rows[1:]).mean()))


#: below this many held-out texts the percentile bootstrap over texts under-covers (Efron & Tibshirani
#: 1993, §13.3, on small samples): the report says so
MIN_PROFILE_TEXTS = 20


def _warnings(n: int, config: ProfileConfig) -> tuple[str, ...]:
    if n >= MIN_PROFILE_TEXTS:
        return ()
    short = f" (asked for {config.num_texts}: too few texts with enough references of their group)" if n < config.num_texts else ""
    return (f"{n} held-out texts{short}, below {MIN_PROFILE_TEXTS}: a percentile bootstrap over so few texts "
            "under-covers, so intervals are too narrow and separations may not hold",)


def _compare(a: ProfilePoint, b: ProfilePoint, sums, ratio, n: int) -> Comparison:
    """``a`` against ``b`` by gain over the floor (paired: the same texts, tokens, resamples)."""
    if b.gain_over_floor.estimate > a.gain_over_floor.estimate:
        a, b = b, a
    floor_a = sums[("floor", a.point.top_k, a.point.temperature)]
    floor_b = sums[("floor", b.point.top_k, b.point.temperature)]
    diff = (floor_a - sums[("point", *dataclasses.astuple(a.point))]) - (floor_b - sums[("point", *dataclasses.astuple(b.point))])
    interval = ratio(diff)  # a difference over tokens: its denominator is always positive
    separated = interval.lower > 0
    needed = None
    if not separated and interval.estimate > 0:
        # the lower half-width shrinks as 1/√n (the bootstrap's standard error of a mean over texts), so it
        # falls below the difference at n·(half/difference)² texts: a planning figure, not a guarantee
        half = interval.estimate - interval.lower
        needed = int(math.ceil(n * (half / interval.estimate) ** 2))
    return Comparison(a.point, b.point, interval, separated, needed)


def _comparisons(points: Sequence[ProfilePoint], sums, ratio, n: int) -> list[Comparison]:
    """Neighbouring ε at every (B, k, τ), and the two best B at every (ε, k, τ): only points that share
    their floor (k, τ) are ranked against each other (docs/guide/evaluating.md, "comparisons")."""
    out = []
    by_setting: dict[tuple, list[ProfilePoint]] = {}
    by_budget: dict[tuple, list[ProfilePoint]] = {}
    for p in points:
        g = p.point
        by_setting.setdefault((g.mechanism, g.batch_size, g.top_k, g.temperature), []).append(p)
        by_budget.setdefault((g.mechanism, g.epsilon, g.top_k, g.temperature), []).append(p)
    for row in by_setting.values():
        row = sorted(row, key=lambda q: q.point.epsilon)
        out += [_compare(low, high, sums, ratio, n) for low, high in zip(row, row[1:])]
    for row in by_budget.values():
        if len(row) > 1:
            best, second = sorted(row, key=lambda q: -q.gain_over_floor.estimate)[:2]
            out.append(_compare(best, second, sums, ratio, n))
    return out


def _recommendation(points: Sequence[ProfilePoint], comparisons: Sequence[Comparison], n: int) -> str:
    """Per (ε, k, τ), the cheapest B whose gain interval overlaps the best point's (each token costs B + 1
    forward rows) and whether the best separates from the runner-up; then how many neighbouring ε the signal
    tells apart."""
    lines = []
    budget = lambda p: (p.point.mechanism, p.point.epsilon, _order(p.point.top_k), p.point.temperature)  # noqa: E731
    for key in sorted({budget(p) for p in points}):
        row = [p for p in points if budget(p) == key]
        lines.append(_budget_line(row, comparisons, n))
    ladder = [c for c in comparisons if c.better.epsilon != c.worse.epsilon]
    if ladder:
        told = sum(c.separated and c.better.epsilon > c.worse.epsilon for c in ladder)
        reversed_ = sum(c.separated and c.better.epsilon < c.worse.epsilon for c in ladder)
        lines.append(f"{told} of {len(ladder)} neighbouring-epsilon pairs are separated at n={n} texts, the larger "
                     "epsilon ahead" + (f"; {reversed_} separated the other way round (check the data)" if reversed_ else ""))
    if len({p.point.top_k for p in points}) > 1 or len({p.point.temperature for p in points}) > 1:
        lines.append("k and tau are not ranked against each other: each has its own floor, and held-out CE favours the "
                     "full vocabulary and tau near 1 by construction (truncation trades coverage of real text for the "
                     "quality of samples); choose them by reading samples, and B and epsilon here")
    return "\n".join(lines)


def _cost(point: GridPoint) -> str:
    return f"{point.batch_size + 1} rows per token"


def _budget_line(row: Sequence[ProfilePoint], comparisons: Sequence[Comparison], n: int) -> str:
    """The recommendation at one (ε, k, τ): the cheapest point whose gain interval overlaps the best one's
    (a point whose interval lies wholly below the best's is worse at this sample size; among the rest the
    cheapest costs least), with every cost beside its gain."""
    best = max(row, key=lambda q: q.gain_over_floor.estimate)
    where = best.point.label.replace(f" B={best.point.batch_size}", "")
    near = [q for q in row if q.gain_over_floor.upper >= best.gain_over_floor.lower]
    cheap = min(near, key=lambda q: q.point.batch_size)
    line = (f"{where}: use B={cheap.point.batch_size} ({_cost(cheap.point)}, C={_num(cheap.point.clip_norm, '.3g')}, gain "
            f"{cheap.gain_over_floor.format()} nats/token)")
    if cheap is not best:
        ratio = (best.point.batch_size + 1) / (cheap.point.batch_size + 1)
        line += (f": the cheapest point whose gain interval overlaps the best one's, B={best.point.batch_size} "
                 f"({_cost(best.point)}, {ratio:.1f}x the cost, gain {best.gain_over_floor.format()})")
    elif len(row) > 1:
        line += ": the best gain, and no cheaper point's gain interval reaches it"
    if len(row) == 1:
        return line
    c = next(c for c in comparisons if c.better == best.point and c.worse.epsilon == best.point.epsilon)
    if c.separated:
        return line + f"; B={c.better.batch_size} beats B={c.worse.batch_size} by {c.difference.format()} nats/token (paired)"
    more = f"about {c.texts_needed} texts per point would tell" if c.texts_needed else "no number of texts in reach would tell"
    return line + (f"; B={c.better.batch_size} and B={c.worse.batch_size} are not distinguishable at n={n} "
                   f"({c.difference.format()}, paired); {more}")


def _order(top_k: int | None) -> float:
    return math.inf if top_k is None else top_k


def _k(top_k: int | None) -> str:
    return "full" if top_k is None else str(top_k)


# --------------------------------------------------------------------------------------------
# rendering


def profile_markdown(result: ProfileResult) -> str:
    """The table per point, the comparisons, the recommendation and the clip profile, as Markdown."""
    c = result.config
    lines = [
        "# Planning profile (teacher-forced, exact, paired)", "", f"> **NOT PRIVATE**: {PLANNING_NOTICE}", "",
        f"{result.num_texts} held-out texts, {result.num_tokens} scored tokens (at most {c.tokens_scored} per text; "
        f"C planned for T = {c.max_new_tokens}, δ = {c.delta:g}"
        f"{', ' + str(result.skipped_texts) + ' skipped' if result.skipped_texts else ''}); {result.seconds:.0f} s. "
        f"Cross-entropies in nats per token; intervals: {c.confidence:.0%} paired bootstrap over texts; "
        f"smoothing η = {SMOOTHING:g} for tokens outside the support.", "",
        *md_table("mechanism | ε | B | rows/token | k | τ | C | held-out CE | floor CE | ensemble CE | gain over floor | gain over null | gap closed | "
                  "coverage | clipped", [
            (p.point.mechanism, f"{p.point.epsilon:g}", p.point.batch_size, p.point.batch_size + 1, _k(p.point.top_k), f"{p.point.temperature:g}", _num(p.point.clip_norm, ".3g"),
             p.heldout_ce.format(), f"{p.floor_ce.estimate:.3f}", f"{p.ensemble_ce.estimate:.3f}", p.gain_over_floor.format(),
             p.gain_over_null.format(), "–" if p.gap_closed is None else p.gap_closed.format(2), f"{p.coverage:.1%}",
             _num(p.clipped_share, ".1%"))
            for p in result.points
        ]),
    ]  # fmt: skip
    lines += ["", "Gain over null: over the same mechanism with every reference null (the public row on the same Top-k+ "
              "set), i.e. what the references add beyond the wider support a larger C allows.", ""]
    lines += _baseline_markdown(result)
    if result.warnings:
        lines += ["**Small sample**:", *[f"- {w}" for w in result.warnings], ""]
    lines += ["## Comparisons (paired)", ""]
    for cmp in result.comparisons:
        verdict = "separated" if cmp.separated else (
            f"not separated; ~{cmp.texts_needed} texts per point would" if cmp.texts_needed else "not separated")
        lines.append(f"- {cmp.better.label} vs {cmp.worse.label}: {cmp.difference.format()} ({verdict})")
    lines += ["", "## Recommendation", "", *[f"- {x}" for x in result.recommendation.splitlines()], ""]
    q = result.clip_profile.to_json()["linf_quantiles"]
    top = "full vocabulary" if result.clip_profile.top_k is None else f"public top-{result.clip_profile.top_k}"
    lines += [
        "## Clip profile", "",
        f"Per-step ℓ∞ of |φ_i − φ_pub| over the {top} tokens: median {q['p50']:.2f}, 5–95% [{q['p05']:.2f}, "
        f"{q['p95']:.2f}]. Share of per-token differences each point's C clips (on its Top-k+ set) is the table's "
        "last column; `clip_profile.png` shows where each C falls.", "",
    ]  # fmt: skip
    return "\n".join(lines)


def _num(value: float, spec: str) -> str:
    return "–" if math.isnan(value) else format(value, spec)


def _baseline_markdown(result: ProfileResult) -> list[str]:
    """The baselines' notes, where Amin et al.'s planner found no clip norm, and the compute ratios."""
    mechs, lines = {p.point.mechanism for p in result.points}, []
    if mechs & {"amin", "amin-paper"}:
        lines.append(f"Amin et al. 2024: r = {result.config.private_tokens} private tokens, then it stops (σ = 0.3, θ = 0.7); "
                     "`amin` with the correct replace-by-null sensitivities 2C/B, 2/B, `amin-paper` with the paper's C/B, "
                     "1/B (understated by 2). Exact marginal over its sparse-vector state.")
    if "adapmixed" in mechs:
        lines.append("AdaPMixED: its ε is a **DATA-DEPENDENT** budget (its stop rule's running Rényi spend, computed "
                     "from the references: no a-priori guarantee); the probability its stop rule ends a text before a "
                     "token is lost from that token's probability.")
    if result.infeasible:
        lines.append("Infeasible (the planner finds no clip norm: the sparse-vector step alone overspends; nothing "
                     f"scored): {', '.join(result.infeasible)}.")
    if not result.compute:
        return lines + [""] if lines else []
    lines += ["", "## Compute to reach the same gain (forward rows per token, paired)", "",
              *md_table("baseline point | target gain | baseline rows | InvisibleInk rows (full vocabulary) | "
                        "ratio baseline : InvisibleInk | InvisibleInk at its smallest / beyond its largest B + 1", [
                  (c.baseline.label, c.target_gain.format(), c.baseline_rows.format(1),
                   c.invisibleink_rows.format(1), c.ratio.format(2), f"{c.below_grid:.0%} / {c.above_grid:.0%}")
                  for c in result.compute]),
              "", "Rows interpolated log-linearly between measured B + 1 on each curve; a share of resamples at the "
              "smallest B + 1 makes the ratio there a lower bound, beyond the largest an upper one.", ""]  # fmt: skip
    return lines


def write_profile_plots(result: ProfileResult, directory: str | Path) -> list[Path]:
    """``gain.png`` (gain over the floor against ε, one line per (B, k, τ)) and ``clip_profile.png``."""
    plt = agg_pyplot()
    out = Path(directory)
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[tuple, list[ProfilePoint]] = {}
    for p in result.points:
        series.setdefault((p.point.mechanism, p.point.batch_size, p.point.top_k, p.point.temperature), []).append(p)
    for (mech, b, k, tau), row in series.items():
        row = sorted(row, key=lambda q: q.point.epsilon)
        x = [q.point.epsilon for q in row]
        y = [q.gain_over_floor.estimate for q in row]
        err = [[q.gain_over_floor.estimate - q.gain_over_floor.lower for q in row],
               [q.gain_over_floor.upper - q.gain_over_floor.estimate for q in row]]
        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=f"{mech} B={b} k={_k(k)} τ={tau:g}")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("ε")
    ax.set_ylabel("gain over the public floor (nats/token)")
    ax.set_title("Held-out gain over the floor (paired, 95%)")
    ax.legend(fontsize=8)
    paths = [save_not_private_figure(fig, out / "gain.png", dpi=120, bbox_inches="tight")]
    plt.close(fig)
    paths.append(_clip_plot(plt, result, out / "clip_profile.png"))
    return paths


def _clip_plot(plt, result: ProfileResult, path: Path) -> Path:
    profile = result.clip_profile
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    linf = np.sort(profile.linf)
    if linf.size:
        left.plot(linf, np.arange(1, linf.size + 1) / linf.size, color="black")
    edges = profile.bin_edges[1:]
    total = max(profile.counts.sum(), 1)
    right.plot(edges, 1.0 - np.cumsum(profile.counts) / total, color="black")
    seen = edges[profile.counts > 0]
    if seen.size:
        right.set_xlim(max(seen[0], 1e-3) / 2, seen[-1] * 2)
    for p in result.points:
        for ax in (left, right):
            ax.axvline(p.point.clip_norm, ls="--", lw=0.8, color="tab:red")
        right.annotate(f"ε={p.point.epsilon:g},B={p.point.batch_size}", (p.point.clip_norm, 0.5), rotation=90,
                       fontsize=7, color="tab:red")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_xlabel("|φ_i − φ_pub| (logit)")
    left.set_ylabel("share of (reference, step)")
    left.set_title("per-step ℓ∞ over the public top-k (CDF)")
    right.set_ylabel("share of per-token differences above x")
    right.set_title("clipped at C = x (dashed: each point's planned C)")
    path = save_not_private_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
