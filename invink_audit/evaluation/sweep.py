"""A sweep: private generation + evaluation over a grid of (ε, B, k, τ, T), with reference points; every point is
a release (sequential composition: a ledger charges each, or ``public_proxy=True``). Forward rows per text: (B + 1)
× generated tokens (paper §4, Algorithm 1). Guide: docs/guide/evaluating.md (§"invink-audit sweep").
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from accounting.limits import check_count
from invink_audit.evaluation.evaluator import (
    EVALUATION_PRIVACY_NOTICE,
    EvaluationConfig,
    TextSet,
    evaluate,
    read_text_set,
)
from invink_audit.evaluation.profile import grid_values
from invink_audit.not_private import (
    agg_pyplot,
    md_table,
    save_not_private_figure,
    unmark,
    write_not_private_json,
    write_not_private_jsonl,
    write_not_private_text,
)
from invink_audit.prompts import PromptTemplate

__all__ = ["EVALUATIONS_DIR", "REFERENCE_POINTS_DIR", "SweepConfig", "SweepPoint", "run_sweep", "sweep_markdown", "write_sweep_plots"]

_LOG = logging.getLogger(__name__)

#: The sub-directory of a sweep's output that holds its non-private reference points (``floor/``,
#: ``ceiling/``), apart from the grid points' release directories.
REFERENCE_POINTS_DIR = "reference_points"
#: The sub-directory of a sweep's output that holds each grid point's non-private records (``NAME/point.json``,
#: its evaluation; ``NAME/generation.json``, its generation seconds), apart from its release ``NAME/texts.jsonl``.
EVALUATIONS_DIR = "evaluations"
#: what an earlier version wrote into a grid point's release directory, beside ``texts.jsonl``
_LEGACY_RECORDS = ("point.json", "generation.json")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    """The grid and the generation settings shared by its points (validated here; each point's
    parameters are validated again by ``generate``)."""

    epsilons: tuple[float, ...]
    batch_sizes: tuple[int, ...]
    top_ks: tuple[int | None, ...] = (100,)
    temperatures: tuple[float, ...] = (1.0,)
    max_new_tokens: tuple[int, ...] = (64,)
    delta: float = 1e-6
    num_texts: int | None = None
    num_texts_per_group: int | None = None
    #: a preset name or a :class:`~invink_audit.prompts.PromptTemplate` (e.g. a preset with an answer
    #: prefix, stop strings or public few-shot examples of the user's), the same for every point
    prompt: str | PromptTemplate = "generic"
    prompt_fields: Mapping[str, str] | None = None
    column: str = "text"
    label_columns: tuple[str, ...] = ()
    reference_points: bool = True
    seed: int = 0
    #: only the references whose columns have these values (public attributes, like labels:
    #: :func:`invink_audit.data.select_references`)
    where: Mapping[str, str] | None = None
    #: held-out texts of the planning signal that ranks the points (:mod:`invink_audit.evaluation.profile`;
    #: 0: none)
    profile_texts: int = 30

    def __post_init__(self) -> None:
        check_count("profile_texts", self.profile_texts, minimum=0)
        for name in ("epsilons", "batch_sizes", "top_ks", "temperatures", "max_new_tokens"):
            object.__setattr__(self, name, grid_values(getattr(self, name), name))
        for e in self.epsilons:
            if isinstance(e, bool) or not isinstance(e, (int, float)) or not e > 0:
                raise ValueError(f"every epsilon must be > 0; got {e!r}")
        for name in ("batch_sizes", "max_new_tokens"):
            for v in getattr(self, name):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"every value of {name} must be an integer >= 1; got {v!r}")
        for k in self.top_ks:
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
                raise ValueError(f"every top_k must be an integer >= 1 or None; got {k!r}")
        for t in self.temperatures:
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
                raise ValueError(f"every temperature must be > 0; got {t!r}")
        object.__setattr__(self, "label_columns", tuple(self.label_columns))
        if self.where is not None:
            if not isinstance(self.where, Mapping) or not self.where or not all(
                isinstance(k, str) and k and isinstance(v, str) for k, v in self.where.items()
            ):
                raise ValueError(f"where must map column names to string values; got {self.where!r}")
            if self.column in self.where:
                raise ValueError(f"where must not select on the text column {self.column!r}")
        if self.label_columns and self.num_texts is not None:
            raise ValueError("with label_columns give num_texts_per_group, not num_texts")
        if not self.label_columns and self.num_texts_per_group is not None:
            raise ValueError("num_texts_per_group needs label_columns")
        self._require_label_fields()

    def _require_label_fields(self) -> None:
        """``generate``'s refusal of a preset's example label values (``yelp``: every text a 4-star
        restaurant review), here before any point runs (the floor and the ceiling included)."""
        from invink_audit.prompts import get_preset, label_fields_for, require_label_fields

        try:
            template = get_preset(self.prompt, **dict(self.prompt_fields or {}))
            filled = [r.field for r in label_fields_for(template, list(self.label_columns))] if self.label_columns else []
        except ValueError:
            return  # an unknown preset, field or label column: generate names it, in its own words
        require_label_fields(template, given=tuple(self.prompt_fields or ()), filled=filled)

    def points(self) -> list[dict]:
        """The grid, ε varying fastest within each (B, k, τ, T)."""
        return [
            {"epsilon": float(e), "batch_size": b, "top_k": k, "temperature": float(t), "max_new_tokens": n}
            for b, k, t, n, e in itertools.product(
                self.batch_sizes, self.top_ks, self.temperatures, self.max_new_tokens, self.epsilons
            )
        ]


def _point_name(p: Mapping) -> str:
    k = "full" if p["top_k"] is None else p["top_k"]
    return f"eps{p['epsilon']:g}-B{p['batch_size']}-k{k}-tau{p['temperature']:g}-T{p['max_new_tokens']}"


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    """One row of the sweep table: the point's parameters, its a-priori guarantee, cost and utility."""

    name: str
    kind: str  # "invisibleink", "floor" or "ceiling"
    params: Mapping
    guarantee: Mapping | None
    forward_rows_per_text: float | None
    evaluation: Mapping
    seconds_generation: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"params": dict(self.params)}


def run_sweep(
    references: str | Path,
    real: str | Path,
    output_dir: str | Path,
    config: SweepConfig,
    evaluation: EvaluationConfig | None = None,
    *,
    ledger: str | Path | None = None,
    public_proxy: bool = False,
    model=None,
    real_column: str | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
    progress=None,
    on_tokens: Callable[[int], None] | None = None,
) -> list[SweepPoint]:
    """Run (or resume) the sweep into ``output_dir``: the NOT PRIVATE ``reference_points/floor/`` and
    ``reference_points/ceiling/`` (when ``config.reference_points``), one release directory per grid point
    (``NAME/texts.jsonl``) and its NOT PRIVATE records (``evaluations/NAME/``), and ``sweep.jsonl`` (one
    :class:`SweepPoint` per line). ``ledger`` or ``public_proxy=True`` is required
    (module docstring)."""
    from invink_audit.models import DEFAULT_GENERATOR, load_model

    if (ledger is None) == (not public_proxy):
        raise ValueError(
            "a sweep on private references spends budget for every point: give a ledger to charge (one release "
            "per point), or public_proxy=True to state that the references are public or a proxy (nothing is "
            "charged); not both"
        )
    evaluation = evaluation or EvaluationConfig()
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    real_set = read_text_set(real, column=real_column or "text", label_columns=tuple(config.label_columns))
    # after the real texts: a bad file fails before the model load; by default the generator generate uses
    loaded = load_model(DEFAULT_GENERATOR if model is None else model)
    run = _SweepRun(
        references=Path(references), output=output, config=config, evaluation=evaluation, real=real_set,
        loaded=loaded, scorer=loaded if evaluation.scorer is None else None,
        embedder=evaluation.make_embedder(),
        progress=progress, on_point=on_point,
    )  # fmt: skip
    try:
        if config.reference_points:
            run.reference_points()
        for params in config.points():
            run.private_point(params, ledger=ledger, on_tokens=on_tokens)
    finally:
        run.embedder.close()
    # planning runs on proxy data only: on private references (a ledger) its statistics would be unaccounted
    profile = _profile(references, real, output, config, loaded, real_column) if public_proxy else None
    rows = [row.to_json() for row in run.rows]
    write_not_private_jsonl(output / "sweep.jsonl", rows, notice=EVALUATION_PRIVACY_NOTICE)
    table = sweep_markdown(run.rows, ledger=ledger, public_proxy=public_proxy, profile=profile)
    write_not_private_text(output / "sweep.md", table, markdown=True)
    write_sweep_plots(run.rows, output)
    return run.rows


def _profile(references, real, output: Path, config: SweepConfig, loaded, real_column: str | None):
    """The planning signal on the sweep's grid (:mod:`invink_audit.evaluation.profile`, its first T), written to
    ``OUTPUT/profile/``; ``None`` when ``config.profile_texts`` is 0, the real texts are read from another column
    than the references, or there are too few references per group for its largest B (said in the log)."""
    from invink_audit.evaluation.profile import ProfileConfig, run_profile

    if not config.profile_texts or (real_column or "text") != config.column:
        return None
    profile_config = ProfileConfig(
        epsilons=config.epsilons, batch_sizes=config.batch_sizes, top_ks=config.top_ks,
        temperatures=config.temperatures, max_new_tokens=config.max_new_tokens[0], delta=config.delta,
        num_texts=config.profile_texts, prompt=config.prompt, prompt_fields=config.prompt_fields, column=config.column,
        label_columns=tuple(config.label_columns), where=config.where,
    )  # fmt: skip
    try:
        result = run_profile(references, real, profile_config, model=loaded)
    except ValueError as err:
        _LOG.warning("sweep: no planning signal: %s", err)
        return None
    result.write(output / "profile")
    return result


def _cached_point(directory: Path) -> Mapping | None:
    """A finished point's record (``point.json``, without its NOT PRIVATE marker), or ``None``."""
    path = directory / "point.json"
    return unmark(json.loads(path.read_text())) if path.is_file() else None


@dataclasses.dataclass
class _SweepRun:
    """The state of one :func:`run_sweep` call: what every point shares, and the rows so far."""

    references: Path
    output: Path
    config: SweepConfig
    evaluation: EvaluationConfig
    real: TextSet
    loaded: object
    scorer: object
    embedder: object
    progress: object
    on_point: Callable[[SweepPoint], None] | None
    rows: list[SweepPoint] = dataclasses.field(default_factory=list)
    _selected: object = None  # the references as read (see _input)

    def finish(self, point: SweepPoint, directory: Path | None = None) -> None:
        if directory is not None:
            write_not_private_json(directory / "point.json", point.to_json(), notice=EVALUATION_PRIVACY_NOTICE)
        self.rows.append(point)
        if self.on_point is not None:
            self.on_point(point)

    def evaluate_file(self, path: Path) -> tuple[dict, TextSet]:
        synthetic = read_text_set(path, label_columns=tuple(self.config.label_columns))
        result = evaluate(
            synthetic, self.real, self.evaluation, scorer_model=self.scorer, embedder=self.embedder, progress=self.progress
        )
        return result.to_json(), synthetic

    def reference_points(self) -> None:
        """The floor and the ceiling at the smallest B and the first k, τ, T (resumed when finished)."""
        config = self.config
        first = {"top_k": config.top_ks[0], "temperature": float(config.temperatures[0]),
                 "max_new_tokens": config.max_new_tokens[0], "batch_size": min(config.batch_sizes)}  # fmt: skip
        directories = {kind: self.output / REFERENCE_POINTS_DIR / kind for kind in ("floor", "ceiling")}
        stale = [kind for kind in directories if (self.output / kind / "texts.jsonl").exists()]
        if stale:
            _LOG.warning(
                "%s holds reference points written beside the releases by an earlier version (%s): they are not "
                "private, are ignored (new ones go to %s/), and should be deleted",
                self.output, ", ".join(f"{kind}/" for kind in stale), REFERENCE_POINTS_DIR,
            )
        generated = {k: d / "generation.json" for k, d in directories.items()}
        if all(_cached_point(d) for d in directories.values()):
            for d in directories.values():
                self.finish(SweepPoint(**_cached_point(d)))
            return
        if not all(generated[k].is_file() and (d / "texts.jsonl").is_file() for k, d in directories.items()):
            self._generate_reference_points(first, directories, generated)
        for kind, directory in directories.items():
            seconds = json.loads(generated[kind].read_text())["seconds"]
            result, synthetic = self.evaluate_file(directory / "texts.jsonl")
            tokens = sum(synthetic.num_tokens) / len(synthetic.num_tokens)
            point = SweepPoint(
                name=kind, kind=kind, params=first, guarantee=None,
                forward_rows_per_text=float(tokens),  # one row per token: the public or one private prompt
                evaluation=result, seconds_generation=seconds,
            )  # fmt: skip
            self.finish(point, directory)

    def _input(self):
        """The references as ``generate`` takes them, and the column to read: the file, or with ``where``
        the selected records (read once)."""
        from invink_audit.data import ReferencesFile, select_references

        config = self.config
        if self._selected is None:
            columns = tuple(config.label_columns)
            if config.where:
                self._selected = select_references(self.references, config.where, column=config.column,
                                                   label_columns=columns)
            else:
                self._selected = ReferencesFile(self.references, config.column, columns or None).read()
        return self._selected

    def _generate_reference_points(self, first: Mapping, directories: Mapping, generated: Mapping) -> None:
        from invink_audit.data import partition_by_labels, partition_references
        from invink_audit.evaluation.reference_points import generate_reference_points

        config, columns, b = self.config, tuple(self.config.label_columns), first["batch_size"]
        if columns:
            labelled = self._input()
            part = partition_by_labels(labelled.texts, labelled.labels, b, num_texts_per_group=config.num_texts_per_group)
            batches, batch_labels = [x.references for x in part.batches], [dict(x.labels) for x in part.batches]
        else:
            part = partition_references(self._input(), b, num_texts=config.num_texts)
            batches, batch_labels = list(part.batches), None
        start = time.perf_counter()
        texts = generate_reference_points(
            batches, max_new_tokens=first["max_new_tokens"], temperature=first["temperature"],
            top_k=first["top_k"], model=self.loaded, prompt=config.prompt, prompt_fields=config.prompt_fields,
            batch_labels=batch_labels, seed=config.seed,
        )  # fmt: skip
        seconds = (time.perf_counter() - start) / 2
        for kind, ref in texts.items():
            _closed_directory(directories[kind])
            ref.write_jsonl(directories[kind] / "texts.jsonl")  # owner-only, marked NOT PRIVATE
            write_not_private_json(generated[kind], {"seconds": seconds}, indent=None)

    def private_point(self, params: Mapping, *, ledger, on_tokens) -> None:
        """One InvisibleInk release at ``params`` (resumed through ``generate``'s own resume) and its evaluation."""
        from invink_audit.generation import GenerationConfig, GenerationHooks, PromptSpec, generate

        config, name = self.config, _point_name(params)
        directory, records = self.output / name, _closed_directory(self.output / EVALUATIONS_DIR / name)
        _move_legacy_records(directory, records)
        previous = _cached_point(records)
        if previous is not None:
            self.finish(SweepPoint(**previous))
            return
        directory.mkdir(exist_ok=True)
        timing = records / "generation.json"  # generation seconds, summed over resumed runs
        before = json.loads(timing.read_text())["seconds"] if timing.is_file() else 0.0
        start = time.perf_counter()
        labelled = bool(config.label_columns)
        release = GenerationConfig(
            batch_size=params["batch_size"], max_new_tokens=params["max_new_tokens"], delta=config.delta,
            epsilon=params["epsilon"], temperature=params["temperature"], top_k=params["top_k"],
            num_texts=None if labelled else config.num_texts,
            num_texts_per_group=config.num_texts_per_group if labelled else None,
        )  # fmt: skip
        released = generate(self._input(), release, model=self.loaded,
                            prompt=PromptSpec(config.prompt, fields=config.prompt_fields),
                            output=directory / "texts.jsonl", ledger=ledger, hooks=GenerationHooks(on_tokens=on_tokens))
        seconds = before + time.perf_counter() - start
        write_not_private_json(timing, {"seconds": seconds}, indent=None)
        result, synthetic = self.evaluate_file(directory / "texts.jsonl")
        tokens = None if synthetic.num_tokens is None else sum(synthetic.num_tokens) / len(synthetic.num_tokens)
        point = SweepPoint(
            name=name, kind="invisibleink", params=params, guarantee=released.guarantee.to_json(),
            forward_rows_per_text=None if tokens is None else float(tokens) * (params["batch_size"] + 1),
            evaluation=result, seconds_generation=seconds,
        )  # fmt: skip
        self.finish(point, records)


def _closed_directory(directory: Path) -> Path:
    """``directory`` and its parent, created owner-only (0700) like the NOT PRIVATE files they hold."""
    directory.parent.mkdir(exist_ok=True, mode=0o700)
    directory.mkdir(exist_ok=True, mode=0o700)
    return directory


def _move_legacy_records(release: Path, records: Path) -> None:
    """An earlier version's ``point.json`` and ``generation.json`` (0644 and unmarked) in the release directory
    ``release``, rewritten owner-only and marked into ``records`` (unless already there), then removed."""
    for name in _LEGACY_RECORDS:
        legacy = release / name
        if legacy.is_symlink() or not legacy.is_file():
            continue
        if not (records / name).exists():
            notice = EVALUATION_PRIVACY_NOTICE if name == "point.json" else None
            write_not_private_json(records / name, unmark(json.loads(legacy.read_text())), notice=notice)
        legacy.unlink()
        _LOG.warning("%s: a NOT PRIVATE record beside the release, written by an earlier version: moved to %s",
                     legacy, records / name)


def _cell(metric: Mapping | None, digits: int = 3) -> str:
    if not metric:
        return "n/a"
    return f"{metric['estimate']:.{digits}f} [{metric['lower']:.{digits}f}, {metric['upper']:.{digits}f}]"


def sweep_markdown(rows: Sequence[SweepPoint], *, ledger=None, public_proxy: bool = False, profile=None) -> str:
    """The sweep table (Markdown): one row per point, reference points first; then which sampled differences
    are significant, the n that would separate the closest points, the small-sample warnings, and (``profile``:
    a :class:`~invink_audit.evaluation.profile.ProfileResult` on the same grid) the planning signal's ranking."""
    budget = ("References declared public/proxy: nothing was charged." if public_proxy else
              f"Every InvisibleInk row is a separate release charged to the ledger {ledger} (sequential composition).")
    table = []
    for r in rows:
        p, g, e = r.params, r.guarantee or {}, r.evaluation
        eps = f"{g['epsilon']:.3g}" if g else ("0 (no refs)" if r.kind == "floor" else "∞ (non-private)")
        tokens = e.get("generated_tokens") or e.get("length_synthetic_tokens")
        table.append((
            r.name, eps, f"{g['clip_norm']:.3g}" if g else "–", p["batch_size"] if r.kind == "invisibleink" else "–",
            p["top_k"] or "full", f"{p['temperature']:g}", p["max_new_tokens"], f"{r.forward_rows_per_text:.0f}",
            f"{tokens['estimate']:.1f}", _cell(e.get("mauve")), _cell(e.get("mauve_c5")), _cell(e.get("delta_ppl"), 1),
            _cell(e.get("tstr_gap_closed"), 2), f"{r.seconds_generation:.0f}",
        ))
    lines = [
        "# Sweep", "", "NOT PRIVATE: evaluations are computed from the real texts in the clear. " + budget, "",
        *md_table("point | ε (certified) | C | B | k | τ | T | fwd rows/text | tokens | MAUVE (paper) | MAUVE (c=5) | ΔPPL | "
                  "TSTR gap closed | gen s", table),
    ]
    lines += _significance_lines(rows)
    warned = dict.fromkeys(w for r in rows for w in r.evaluation.get("warnings", ()))
    if warned:
        lines += ["", "## Small samples", "", *[f"- {w}" for w in warned]]
    if profile is None and not public_proxy:
        lines += ["", "Planning signal: not run on references charged to a ledger (they are private, and the signal's "
                  "statistics are not); run `invink-audit profile` on proxy data."]
    if profile is not None:
        lines += ["", "## Planning signal (teacher-forced, paired; OUTPUT/profile/)", "",
                  "Points ranked by held-out gain over the public floor (nats/token), from one teacher-forced pass of "
                  f"{profile.num_texts} held-out texts at T = {profile.config.max_new_tokens}:", ""]
        ranked = sorted(profile.points, key=lambda q: -q.gain_over_floor.estimate)
        lines += [f"{i}. {q.point.label}: {q.gain_over_floor.format()}" for i, q in enumerate(ranked, 1)]
        lines += ["", *[f"- {x}" for x in profile.recommendation.splitlines()]]
    return "\n".join(lines) + "\n"


def _significance_lines(rows: Sequence[SweepPoint]) -> list[str]:
    """Which pairs of private points MAUVE (paper) separates (intervals that do not overlap), and about how
    many texts per point the closest pair would need: half-widths shrink as 1/√n (a mean's standard error;
    MAUVE's is at best that, so the figure is a lower bound), so two intervals of half-widths h_a, h_b stop
    overlapping at ``n·((h_a + h_b)/|Δ|)²`` texts."""
    private = [r for r in rows if r.kind == "invisibleink" and r.evaluation.get("mauve")]
    pairs = [(a, b) for i, a in enumerate(private) for b in private[i + 1 :]]
    if not pairs:
        return []
    separated = 0
    closest = None
    for a, b in pairs:
        ma, mb = a.evaluation["mauve"], b.evaluation["mauve"]
        separated += ma["lower"] > mb["upper"] or mb["lower"] > ma["upper"]
        gap = abs(ma["estimate"] - mb["estimate"])
        if closest is None or gap < closest[0]:
            closest = (gap, a, b)
    gap, a, b = closest
    n = min(a.evaluation["num_synthetic"], b.evaluation["num_synthetic"])
    half = sum((x.evaluation["mauve"]["upper"] - x.evaluation["mauve"]["lower"]) / 2 for x in (a, b))
    need = "no number of texts (equal estimates)" if gap == 0 else f"about {math.ceil(n * (half / gap) ** 2)} texts per point"
    return ["", "## Which differences are significant", "",
            f"MAUVE (paper) separates {separated} of {len(pairs)} pairs of private points (intervals that do not overlap). "
            f"The closest pair, {a.name} and {b.name}, differ by {gap:.3f} at n = {n}: their intervals would stop "
            f"overlapping at {need}."]


def write_sweep_plots(rows: Sequence[SweepPoint], directory: str | Path) -> list[Path]:
    """``sweep_utility.png`` (MAUVE, TSTR gap closed, ΔPPL against ε, one line per B, floor and ceiling
    dashed) and ``sweep_cost.png`` (MAUVE against forward rows per text).

    Every group (B, k, τ, T) has its own marker and a small offset along ε, so that one never hides
    another at the same ε. Each y axis spans the estimates (and the intervals up to one span beyond
    them): an interval cut by the axis ends in an arrow at the edge with its end written beside it, and
    the panel's title says so (an interval is never cut silently)."""
    plt = agg_pyplot()
    directory = Path(directory)
    private = [r for r in rows if r.kind == "invisibleink"]
    refs = {r.kind: r for r in rows if r.kind != "invisibleink"}
    utility = _write_utility_plot(plt, rows, private, refs, directory / "sweep_utility.png")
    cost = _write_cost_plot(plt, private, directory / "sweep_cost.png")
    return [utility, cost]


def _write_utility_plot(plt, rows: Sequence[SweepPoint], private: Sequence[SweepPoint],
                        refs: Mapping[str, SweepPoint], utility: Path) -> Path:  # fmt: skip
    """``sweep_utility.png``: one panel per metric against ε, one line per group (B, k, τ, T)."""
    metrics = [("mauve", "MAUVE (paper setting)"), ("mauve_c5", "MAUVE (c = 5)"), ("delta_ppl", "ΔPPL")]
    if any(r.evaluation.get("tstr_gap_closed") for r in rows):
        metrics.append(("tstr_gap_closed", "TSTR: gap closed"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 2.8), dpi=80)
    groups: dict[tuple, list[SweepPoint]] = {}
    for r in private:
        key = (r.params["batch_size"], r.params["top_k"], r.params["temperature"], r.params["max_new_tokens"])
        groups.setdefault(key, []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: str(kv[0]))
    for ax, (key, label) in zip(axes, metrics):
        _draw_utility_panel(ax, key, label, groups, ordered, private, refs)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    save_not_private_figure(fig, utility)
    plt.close(fig)
    return utility


def _draw_utility_panel(ax, key: str, label: str, groups: Mapping[tuple, list[SweepPoint]], ordered: Sequence[tuple],
                        private: Sequence[SweepPoint], refs: Mapping[str, SweepPoint]) -> None:  # fmt: skip
    """One panel of ``sweep_utility.png``: metric ``key`` against ε, with the floor and ceiling lines."""
    estimates, intervals = [], []
    for index, ((b, k, t, n), members) in enumerate(ordered):
        members = sorted(members, key=lambda r: r.params["epsilon"])
        pts = [(r.params["epsilon"], r.evaluation.get(key)) for r in members if r.evaluation.get(key)]
        if not pts:
            continue
        shift = _SWEEP_SHIFT ** (index - (len(ordered) - 1) / 2)  # an offset along a log ε axis
        xs = [x * shift for x, _ in pts]
        ys = [m["estimate"] for _, m in pts]
        err = [[m["estimate"] - m["lower"] for _, m in pts], [m["upper"] - m["estimate"] for _, m in pts]]
        suffix = "" if len(groups) == len({g[0] for g in groups}) else f", k={k}, τ={t:g}, T={n}"
        drawn = ax.errorbar(xs, ys, yerr=err, marker=_SWEEP_MARKERS[index % len(_SWEEP_MARKERS)], capsize=3,
                            alpha=0.75, label=f"B={b}{suffix}")  # fmt: skip
        colour = drawn.lines[0].get_color()
        estimates += ys
        intervals += [(x, m["lower"], m["upper"], colour) for x, (_, m) in zip(xs, pts)]
    for kind, style in (("floor", ":"), ("ceiling", "--")):
        metric = refs.get(kind) and refs[kind].evaluation.get(key)
        if metric:
            ax.axhline(metric["estimate"], linestyle=style, color="grey", label=kind)
            estimates.append(metric["estimate"])
    ax.set_xscale("log")
    epsilons = sorted({r.params["epsilon"] for r in private})
    ax.minorticks_off()
    ax.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
    ax.set_xlabel("ε")
    cut = _clip_to_estimates(ax, estimates, intervals)
    ax.set_title(label + (f"\n({cut} interval end(s) cut: arrows)" if cut else ""), fontsize=9)


def _write_cost_plot(plt, private: Sequence[SweepPoint], cost: Path) -> Path:
    """``sweep_cost.png``: MAUVE (paper setting) against forward rows per text, one colour per B."""
    fig, ax = plt.subplots(figsize=(3.6, 2.8), dpi=80)
    sizes = sorted({p.params["batch_size"] for p in private})
    estimates, intervals, labelled = [], [], set()
    for r in private:
        m = r.evaluation.get("mauve")
        if m and r.forward_rows_per_text:
            index = sizes.index(r.params["batch_size"])
            b = r.params["batch_size"]
            ax.errorbar(r.forward_rows_per_text, m["estimate"], yerr=[[m["estimate"] - m["lower"]], [m["upper"] - m["estimate"]]],
                        marker=_SWEEP_MARKERS[index % len(_SWEEP_MARKERS)], capsize=3, alpha=0.75, color=f"C{index}",
                        label=None if b in labelled else f"B={b}")  # fmt: skip
            labelled.add(b)
            ax.annotate(f"ε={r.params['epsilon']:g},B={b}", (r.forward_rows_per_text, m["estimate"]), fontsize=6)
            estimates.append(m["estimate"])
            intervals.append((r.forward_rows_per_text, m["lower"], m["upper"], f"C{index}"))
    cut = _clip_to_estimates(ax, estimates, intervals)
    if cut:
        ax.set_title(f"({cut} interval end(s) cut: arrows)", fontsize=8)
    if labelled:
        ax.legend(fontsize=7)
    ax.set_xlabel("forward rows per text")
    ax.set_ylabel("MAUVE (paper)")
    fig.tight_layout()
    save_not_private_figure(fig, cost)
    plt.close(fig)
    return cost


#: one marker per group of a sweep plot, and the factor between neighbouring groups' ε offsets
_SWEEP_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
_SWEEP_SHIFT = 1.08


def _clip_to_estimates(ax, estimates: Sequence[float], intervals: Sequence[tuple]) -> int:
    """Limit ``ax``'s y axis to the ``estimates`` and the ``intervals`` (``(x, lower, upper, colour)``)
    up to one span of the estimates beyond them, with a 5% pad; mark every interval end the axis cuts
    with an arrow at the edge and its value. Returns the number of ends cut (0: nothing is hidden)."""
    finite = [float(e) for e in estimates if math.isfinite(e)]
    if not finite:
        return 0
    low, high = min(finite), max(finite)
    span = high - low or max(abs(high), 1e-3)
    ends = [float(v) for _, lo, hi, _ in intervals for v in (lo, hi) if math.isfinite(v)]
    bottom = max(min([low, *ends]), low - span)
    top = min(max([high, *ends]), high + span)
    if not top > bottom:  # one value and no interval: a span around it
        bottom, top = low - span, high + span
    pad = 0.05 * (top - bottom)
    bottom, top = bottom - pad, top + pad
    ax.set_ylim(bottom, top)
    arrow = 0.1 * (top - bottom)
    cut = 0
    for x, lower, upper, colour in intervals:
        below, above = (lower, bottom, bottom + arrow, "bottom", lower < bottom), (upper, top, top - arrow, "top", upper > top)
        for end, edge, inside, va, beyond in (below, above):
            if beyond:
                cut += 1
                ax.annotate("", xy=(x, edge), xytext=(x, inside), arrowprops={"arrowstyle": "->", "color": colour})
                ax.annotate(f"{end:.3g}", (x, inside), fontsize=6, color=colour, ha="left", va=va)
    return cut
