"""Audit specifications (TOML): :func:`load_spec` reads one into the library's own records (each section validated
by its record's constructor, :func:`read_table`; an error is one line naming file, section and key), :func:`run_spec`
runs it. Format: docs/guide/auditing.md ("The spec format").
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import enum
import importlib
import math
import numbers
import os
import shutil
import tempfile
import time
import tomllib
import types
import typing
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Union

from accounting import Accountant, AugPEEvent, as_accountant, plan_augpe_noise_std, plan_clip_norm
from accounting.augpe import NOISE_STD_RANGE
from accounting.limits import (
    COUNT_RANGE, EPSILON_RANGE, MAX_COUNT, RANGES, TEMPERATURE_RANGE, ParameterRange, check_nonnegative, check_order,
    check_positive,
)
from invink_audit.audit.stats import check_significance
from invink_audit.audit.whitebox import WhiteBoxConfig
from invink_audit.generation import ModelSpec, PromptSpec

if TYPE_CHECKING:
    from invink_audit.audit.records import BlackBoxReport, WhiteBoxReport
    from invink_audit.audit.selftest import SelfTestResult, SelfTestSettings
    from invink_audit.mechanisms import Mechanism

__all__ = [
    "AuditSpec", "AugPEHistogramSpec", "BlackBoxSpec", "SpecResult", "TargetSpec", "load_spec", "mechanism_from_section",
    "parse_spec", "read_table", "run_spec", "yelp_dir",
]

KINDS = ("selftest", "white-box", "black-box", "augpe-histogram")
_TOP_LEVEL = ("name", "kind", "description", "seed")
#: the sections each kind reads; any other key of a spec is refused
_KIND_SECTIONS = {
    "selftest": ("selftest",),
    "white-box": ("model", "prompt", "data", "mechanism", "canaries", "audit"),
    "black-box": ("model", "prompt", "data", "mechanism", "canaries", "target", "blackbox"),
    "augpe-histogram": ("mechanism", "canary", "blackbox"),
}


def yelp_dir() -> Path:
    """The Yelp data directory: ``$INVINK_YELP_DIR`` or ``../shared/data/yelp`` beside the repository."""
    env = os.environ.get("INVINK_YELP_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "yelp"


# -- reading a TOML table into a record ------------------------------------------------------------
# A key is read by its own check when it has one (below: the ranges the command line's flags go through,
# accounting.limits, never a second copy), else by its field's type; the record's constructor checks the rest.

_NON_NEGATIVE = ParameterRange(0, MAX_COUNT, integer=True)
_KEY_RANGES = {
    **RANGES,
    "public_temperature": TEMPERATURE_RANGE,
    "adapmixed_stop_epsilon": EPSILON_RANGE,
    "adapmixed_within_epsilon": EPSILON_RANGE,
    **dict.fromkeys(("num_is_samples", "offset", "slot", "secret", "repeat", "hardest_case", "spare_references"),
                    _NON_NEGATIVE),
    "num_trials": ParameterRange(8, MAX_COUNT, integer=True),  # blackbox_audit's smallest num_trials
    "num_batches": ParameterRange(16, MAX_COUNT, integer=True),  # batched_canary_audit's smallest num_batches
    "seed": ParameterRange(0, 2**63 - 1, integer=True),  # any TOML integer >= 0 (make_generator's seeds)
    "iterations": ParameterRange(1, 100, integer=True),  # AugPE: the paper's T is 1-10; the target keeps every release
    "noise_std": NOISE_STD_RANGE,
    # the worst-case canary's sizes: the exact check recomputes the histogram for each of its 1 + k·m references
    "others_per_candidate": ParameterRange(1, 500, integer=True),
    "num_candidates": ParameterRange(2, 16, integer=True),
}


def _top_k(key: str, value) -> int | None:
    """An integer k, or ``"full"`` for the full vocabulary (as ``--top-k`` takes it)."""
    if isinstance(value, str) and value.strip().lower() == "full":
        return None
    try:
        return COUNT_RANGE.check(key, value)
    except ValueError as err:
        raise ValueError(f"{key} must be {COUNT_RANGE.describe()} or 'full'; got {value!r}") from err


def _significance(key: str, value) -> float:
    return check_significance(_by_type(key, value, float))


def _neighbours(key: str, value) -> tuple[int, ...] | None:
    """``"all"`` (``None``) or a list of indices."""
    if value == "all":
        return None
    try:
        return tuple(_NON_NEGATIVE.check(f"{key}[{i}]", v) for i, v in enumerate(_by_type(key, value, tuple[object, ...])))
    except ValueError as err:
        raise ValueError(f"{key} must be 'all' or a non-empty list of indices >= 0; got {value!r}") from err


def _preset(key: str, value) -> str:
    from invink_audit.prompts import get_preset

    try:
        get_preset(_by_type(key, value, str))
    except ValueError as err:
        raise ValueError(f"{key}: {err}") from err
    return value


def _custom_canaries(key: str, value) -> tuple[dict, ...]:
    fields = {"slot": int, "text": str, "label": str}
    return tuple(table_values(item, f"{key}[{i}]", fields, required=("slot", "text"))
                 for i, item in enumerate(_by_type(key, value, list[object])))


_KEY_CHECKS: dict[str, Callable] = {
    **{key: r.check for key, r in _KEY_RANGES.items()},
    "top_k": _top_k,
    "accountant": lambda key, value: as_accountant(value),
    "significance": _significance,
    "alphas": lambda key, value: tuple(check_order(f"{key}[{i}]", a)
                                       for i, a in enumerate(_by_type(key, value, tuple[object, ...]))),
    "neighbours": _neighbours,
    "preset": _preset,
    "custom": _custom_canaries,
    "threshold": check_nonnegative,
    "amin_svt_noise": check_positive,
}


def _typed(key: str, value, hint):
    """``value`` of ``key`` read as ``hint`` (a record field's type): by the key's own check when it has one
    (``_KEY_CHECKS``), else by the type (:func:`_by_type`)."""
    return _KEY_CHECKS[key](key, value) if key in _KEY_CHECKS else _by_type(key, value, hint)


def _by_type(key: str, value, hint):
    """``value`` of ``key`` read as ``hint``; a ``tuple`` is a non-empty list, a ``list`` may be empty."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):  # X | None: TOML has no null, so the value is an X
        return _by_type(key, value, next(a for a in args if a is not type(None)))
    if origin is Literal or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        options = list(args) if origin is Literal else [m.value for m in hint]
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"{key} must be one of {options}; got {value!r}")
        return value if origin is Literal else hint(value)
    if origin in (tuple, list):
        if not isinstance(value, list) or not (value or origin is list):
            raise ValueError(f"{key} must be a {'' if origin is list else 'non-empty '}list; got {value!r}")
        return tuple(value if args[0] is object else (_typed(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value)))
    if hint is dict or origin in (dict, Mapping, collections.abc.Mapping):
        if not isinstance(value, dict):
            raise ValueError(f"{key} must be a table; got {value!r}")
        return {k: _typed(f"{key}.{k}", v, args[1]) for k, v in value.items()} if args else dict(value)
    if hint is int:
        return COUNT_RANGE.check(key, value)
    if hint is float and not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value):
        return float(value)
    if (hint is bool and isinstance(value, bool)) or (hint is str and isinstance(value, str)) or hint is object:
        return value
    what = {float: "a finite number", bool: "true or false", str: "a string"}.get(hint)
    if what is None:
        raise TypeError(f"{key}: a field of type {hint!r} cannot be read from TOML")
    raise ValueError(f"{key} must be {what}; got {value!r}")


def fields_of(cls, *exclude: str) -> dict:
    """The type of every field of the dataclass ``cls`` a spec may give (``exclude``: those it may not)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init and f.name not in exclude}


def table_values(table, where: str, fields: dict, *, required=()) -> dict:
    """Every key of ``table`` read as its field's type (:func:`fields_of`); an unknown key is refused with the
    allowed ones, a missing ``required`` one named. Errors start with ``where`` (e.g. ``[mechanism]``)."""
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table; got {table!r}")
    unknown = set(table) - set(fields)
    if unknown:
        raise ValueError(f"unknown keys in {where}: {sorted(unknown)}; allowed: {sorted(fields)}")
    for key in required:
        if key not in table:
            raise ValueError(f"{where} {key} is required")
    values = {}
    for key, value in table.items():
        try:
            values[key] = _typed(key, value, fields[key])
        except ValueError as err:
            raise ValueError(f"{where} {err}") from err
    return values


def _built(where: str, cls, **values):
    """``cls(**values)``, its constructor's error starting with ``where``."""
    try:
        return cls(**values)
    except ValueError as err:
        raise ValueError(f"{where} {err}") from err


def read_table(cls, table, where: str):
    """The dataclass ``cls`` from a TOML table of its fields (:func:`table_values`), validated by its constructor."""
    return _built(where, cls, **table_values(table, where, fields_of(cls)))


@contextlib.contextmanager
def _naming(path: Path | None) -> Iterator[None]:
    """A ``ValueError`` raised while a spec is read becomes one line that starts with the spec's file."""
    try:
        yield
    except ValueError as err:
        where = "audit spec" if path is None else f"audit spec {str(path)!r}"
        raise ValueError(f"{where}: {err}") from err


# -- the sections -----------------------------------------------------------------------------------


def _model(table) -> ModelSpec:
    """``[model]``: ``name`` (``"embedded"``, a directory or hub id) and the other fields of :class:`ModelSpec`."""
    values = table_values(table, "[model]", {"name": str, **fields_of(ModelSpec, "model")})
    return _built("[model]", ModelSpec, model=values.pop("name", "embedded"), **values)


def _prompt(table) -> PromptSpec:
    """``[prompt]``: ``preset`` and its ``fields`` (:class:`PromptSpec`)."""
    values = table_values(table, "[prompt]", {"preset": str, "fields": fields_of(PromptSpec)["fields"]})
    return _built("[prompt] fields:", PromptSpec, template=values.get("preset", "generic"), fields=values.get("fields"))


def _check_data(table) -> None:
    fields = {"yelp": Literal["dev", "test"], "path": str, "inline": list[str], "column": str, "offset": int}
    sources = [key for key in ("yelp", "path", "inline") if key in table_values(table, "[data]", fields)]
    if len(sources) > 1:
        raise ValueError(f"[data] give one of 'yelp', 'path' and 'inline'; got {sources}")


def _whitebox_config(table, batch_size: int) -> WhiteBoxConfig:
    """``[audit]``: :class:`WhiteBoxConfig`, its neighbours within ``batch_size``."""
    config = _built("[audit]", WhiteBoxConfig, **table_values(table, "[audit]", fields_of(WhiteBoxConfig, "accountants")))
    _built("[audit]", config.audited_neighbours, batch_size=batch_size)
    return config


_MECHANISM_KINDS = Literal["invisibleink", "amin", "adapmixed"]


def _mechanism_values(table, batch_size: int | None = None) -> dict:
    """Every key of a ``[mechanism]`` table read as a field of its kind's config (InvisibleInk's
    :class:`~invink_audit.mechanism.MechanismConfig` with its ``accountant``, :class:`~invink_audit.mechanisms.AminConfig`,
    :class:`~invink_audit.mechanisms.AdaPMixEDConfig`; ``epsilon`` to plan for), or ``max_new_tokens``, ``delta``."""
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import AdaPMixEDConfig, AminConfig

    if not isinstance(table, dict):
        raise ValueError(f"[mechanism] must be a table; got {table!r}")
    kind = table_values({"kind": table.get("kind", "invisibleink")}, "[mechanism]", {"kind": _MECHANISM_KINDS})["kind"]
    own = {"invisibleink": {**fields_of(MechanismConfig, "clipping"), "accountant": Accountant},
           "amin": fields_of(AminConfig), "adapmixed": fields_of(AdaPMixEDConfig)}[kind]
    fields = {"kind": _MECHANISM_KINDS, "max_new_tokens": int, "delta": float, "epsilon": float, **own}
    values = table_values(table, "[mechanism]", fields, required=() if batch_size else ("batch_size",))
    return {"kind": kind, "delta": 1e-6, **values, **({"batch_size": batch_size} if batch_size else {})}


def mechanism_from_section(table, batch_size: int | None = None) -> Mechanism:
    """The :class:`~invink_audit.mechanisms.Mechanism` a ``[mechanism]`` section names (``batch_size``: B, in place
    of the section's): InvisibleInk (its clip norm given, or planned for ``epsilon`` over ``max_new_tokens`` tokens
    by its ``accountant``), Amin et al. (given or planned: :meth:`~invink_audit.mechanisms.AminConfig.planned`) or
    AdaPMixED (``epsilon``: its budget). Every key is checked, then the config's constructor."""
    from invink_audit.mechanism import MechanismConfig
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism, InvisibleInk

    values = _mechanism_values(table, batch_size)
    kind, epsilon, delta = values.pop("kind"), values.pop("epsilon", None), values.pop("delta")
    steps, accountant = values.pop("max_new_tokens", None), values.pop("accountant", Accountant.BR_ADAPTIVE)
    try:
        if kind == "adapmixed":
            if epsilon is None:
                raise ValueError("kind 'adapmixed' needs epsilon (the budget of its stop rule)")
            return AdaPMixEDMechanism(AdaPMixEDConfig(epsilon=epsilon, delta=delta, **values))
        if (epsilon is None) == ("clip_norm" not in values):
            raise ValueError("kind 'amin' needs exactly one of epsilon and clip_norm" if kind == "amin" else
                             "give one of epsilon (the clip norm is planned) and clip_norm; got "
                             + ("both" if epsilon is not None else "neither"))
        if kind == "amin":
            planned = epsilon is not None
            return AminMechanism(AminConfig.planned(epsilon=epsilon, delta=delta, **{"max_private_tokens": 100, **values})
                                 if planned else AminConfig(**values))
        if epsilon is not None:
            if steps is None:
                raise ValueError("max_new_tokens is required (the clip norm is planned for it)")
            values["clip_norm"] = plan_clip_norm(
                epsilon=epsilon, delta=delta, max_new_tokens=steps, batch_size=values["batch_size"],
                temperature=values.get("temperature", 1.0), accountant=accountant).clip_norm
        return InvisibleInk(MechanismConfig(**{"temperature": 1.0, "top_k": None, **values}), accountant=accountant)
    except ValueError as err:
        raise ValueError(f"[mechanism] {err}") from err


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    """``[target]`` of a black-box spec (docs/guide/auditing.md, "The spec format"): what is audited."""

    kind: Literal["engine", "invink", "callable"] = "engine"
    model_path: str | None = None
    dataset_desc: str = "short texts"
    spare_references: int = 0
    function: str | None = None
    batched: bool = False

    def __post_init__(self) -> None:
        if self.kind == "invink" and self.model_path is None:
            raise ValueError("model_path is required for kind = 'invink' (a directory, 'embedded' or 'tiny')")
        if self.kind != "invink" and self.model_path is not None:
            raise ValueError("model_path is for kind = 'invink'; the engine's model is [model] name")
        if self.model_path not in (None, "embedded", "tiny") and not Path(self.model_path).is_dir():
            raise ValueError(f"model_path must be a directory, 'embedded' or 'tiny'; got {self.model_path!r}")
        if (self.kind == "callable") != (self.function is not None) or self.batched and self.kind != "callable":
            raise ValueError("function ('module:function') and batched are for kind = 'callable', which needs function")
        module, _, name = (self.function or "m:f").partition(":")
        if not (module and name):
            raise ValueError(f"function must be 'module:function'; got {self.function!r}")


@dataclasses.dataclass(frozen=True)
class BlackBoxSpec:
    """``[blackbox]`` of a black-box spec: the canary, the trials (``num_trials`` alternating ones, or with
    ``num_batches`` the batched audit, ``sequential`` looks or not), the scores to choose from, the significance
    and the reference package's ``invink_kwargs``."""

    canary: str = "My name is Zelphine Quorrick and my card number is 4929 7310 5528 1746."
    num_trials: int = 200
    num_batches: int | None = None
    sequential: bool = True
    scores: tuple[str, ...] = ()
    significance: float = 0.05
    invink_kwargs: dict = dataclasses.field(default_factory=dict)


def _blackbox(table, target: TargetSpec) -> BlackBoxSpec:
    """``[blackbox]``, its scores checked for ``target`` (default: the exact ratio where the engine is batched, and
    the text scores)."""
    from invink_audit.audit.batched import LLR_SCORE
    from invink_audit.audit.blackbox import DEFAULT_SCORES, SCORES

    values = table_values(table, "[blackbox]", fields_of(BlackBoxSpec))
    if "num_batches" in values and "num_trials" in values:
        raise ValueError("[blackbox] give num_trials (alternating trials of one batch) or num_batches (batched), not both")
    llr = (LLR_SCORE,) if target.kind == "engine" and "num_batches" in values else ()
    names = (*SCORES, *llr, *(("tokens",) if target.kind == "invink" else ()))  # "tokens": the package's tokenizer
    for i, score in enumerate(values.get("scores", ())):
        if score not in names:
            raise ValueError(f"[blackbox] scores[{i}] must be one of {list(names)}; got {score!r}")
    return BlackBoxSpec(**{"scores": (*llr, *DEFAULT_SCORES), **values})


def _mechanism_for(table, target: TargetSpec | None) -> dict:
    """``[mechanism]`` of a white-box spec or a black-box one auditing ``target``: the mechanism built (the engine
    and a white-box audit run it), B, T, δ and the ε given (the reference package's and a callable's claim)."""
    values = _mechanism_values(table)
    fields = {"batch_size": values["batch_size"], "max_new_tokens": values.get("max_new_tokens"),
              "delta": values["delta"], "epsilon": values.get("epsilon")}
    if target is not None and target.kind != "engine":
        if values["kind"] != "invisibleink":
            raise ValueError(f"[mechanism] kind {values['kind']!r} is audited white-box only or on the engine "
                             "([target] kind = 'engine')")
        if fields["epsilon"] is None:
            raise ValueError(f"[mechanism] epsilon is required for [target] kind = {target.kind!r}")
        if "clip_norm" in values:
            raise ValueError(f"[mechanism] clip_norm: [target] kind = {target.kind!r} is audited against epsilon "
                             "(the reference package plans its clip norm from it); remove it")
        return {**fields, "mechanism": None}
    if fields["max_new_tokens"] is None:
        raise ValueError("[mechanism] max_new_tokens is required")
    return {**fields, "mechanism": mechanism_from_section(table)}


@dataclasses.dataclass(frozen=True)
class AugPEHistogramSpec:
    """The sections of an ``augpe-histogram`` spec. ``event`` is the claim audited (σ given or planned, T, the
    claimed sensitivity), ``delta`` the δ it is quoted at, ``epsilon`` the ε σ was planned for (``None``: σ given);
    the mechanism run adds the ``threshold`` H. ``others_per_candidate`` and ``num_candidates`` shape
    :func:`~invink_audit.audit.augpe.worst_case_canary`; ``num_batches``, ``significance`` and ``sequential`` are the
    batched audit's (as in a black-box spec's ``[blackbox]``)."""

    event: AugPEEvent
    delta: float = 1e-6
    epsilon: float | None = None
    threshold: float = 0.0
    others_per_candidate: int = 50
    num_candidates: int = 4
    num_batches: int = 10_000
    significance: float = 0.05
    sequential: bool = True

    @classmethod
    def from_sections(cls, mechanism, canary, blackbox) -> AugPEHistogramSpec:
        fields = {"kind": Literal["augpe"], "iterations": int, "noise_std": float, "epsilon": float, "delta": float,
                  "sensitivity": Literal["replace-by-null", "paper"],  # add-or-remove is no claim about replace-by-null
                  "threshold": float}
        m = table_values(mechanism, "[mechanism]", fields, required=("iterations",))
        delta = m.get("delta", 1e-6)
        if ("noise_std" in m) == ("epsilon" in m):
            raise ValueError("[mechanism] give one of noise_std (σ) and epsilon (σ is planned)")
        # σ planned on the exact μ-GDP curve, the curve the audit tests (the safe, larger σ)
        event = _built("[mechanism]", lambda: AugPEEvent(m["noise_std"] if "noise_std" in m else plan_augpe_noise_std(
            m["epsilon"], delta, m["iterations"], m.get("sensitivity", "replace-by-null"), exact_gaussian=True),
            m["iterations"], m.get("sensitivity", "replace-by-null")))
        c = table_values(canary, "[canary]", {"kind": Literal["worst-case"], "others_per_candidate": int, "num_candidates": int})
        b = table_values(blackbox, "[blackbox]", {"num_batches": int, "significance": float, "sequential": bool})
        c.pop("kind", None)
        return cls(event, delta, m.get("epsilon"), m.get("threshold", 0.0), **c, **b)

    def embeddings(self):
        """The audit's public data: :func:`~invink_audit.audit.augpe.worst_case_canary` of this spec's sizes."""
        from invink_audit.audit.augpe import worst_case_canary

        return worst_case_canary(others_per_candidate=self.others_per_candidate, num_candidates=self.num_candidates)


@dataclasses.dataclass(frozen=True)
class AuditSpec:
    """A parsed, validated audit specification (:func:`parse_spec`): ``raw`` is the TOML table; the sections
    read into their records (``selftest``; ``model``, ``prompt``, the ``mechanism`` built with its B, T, δ and the
    ε given, and ``audit`` (white-box) or ``target`` and ``blackbox`` (black-box); ``augpe``). Every value is
    checked before any model loads; an error is one ``ValueError`` line naming the spec's file, the section and
    the key."""

    name: str
    kind: str
    raw: dict
    path: Path | None = None
    seed: int | None = None
    selftest: SelfTestSettings | None = None
    model: ModelSpec | None = None
    prompt: PromptSpec | None = None
    mechanism: Mechanism | None = None
    batch_size: int | None = None
    max_new_tokens: int | None = None
    delta: float = 1e-6
    epsilon: float | None = None
    audit: WhiteBoxConfig | None = None
    target: TargetSpec | None = None
    blackbox: BlackBoxSpec | None = None
    augpe: AugPEHistogramSpec | None = None

    def section(self, name: str) -> dict:
        value = self.raw.get(name, {})
        if not isinstance(value, dict):
            raise ValueError(f"[{name}] must be a table; got {value!r}")
        return value


def _check_top_level(raw) -> None:
    """The spec's kind and top-level keys (a kind's sections, ``name``, ``description``, ``seed``)."""
    if not isinstance(raw, dict):
        raise ValueError(f"an audit spec must be a table; got {type(raw).__name__}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    allowed = {*_TOP_LEVEL, *_KIND_SECTIONS[kind]}
    unknown = set(raw) - allowed
    if unknown:
        raise ValueError(f"unknown keys in a {kind} spec: {sorted(unknown)}; allowed: {sorted(allowed)}")
    for key in ("name", "description"):
        if key in raw:
            _typed(key, raw[key], str)


def _sections(raw: dict) -> dict:
    """The records of a spec's sections (:class:`AuditSpec`'s fields), every key checked."""
    kind, section = raw["kind"], (lambda name: raw.get(name, {}))
    seed = {"seed": _typed("seed", raw["seed"], int)} if "seed" in raw else {}
    if kind == "selftest":
        from invink_audit.audit.selftest import SelfTestSettings

        return {**seed, "selftest": read_table(SelfTestSettings, section("selftest"), "[selftest]")}
    if kind == "augpe-histogram":
        return {**seed, "augpe": AugPEHistogramSpec.from_sections(*(section(s) for s in ("mechanism", "canary", "blackbox")))}
    target = read_table(TargetSpec, section("target"), "[target]") if kind == "black-box" else None
    out = {**seed, "model": _model(section("model")), "prompt": _prompt(section("prompt"))}
    _check_data(section("data"))
    canaries = {"secret": int, "repeat": int, "hardest_case": int, "custom": list[object]}
    table_values(section("canaries"), "[canaries]", canaries)  # checked here, read when the spec runs
    if kind == "white-box":
        out["audit"] = _whitebox_config(section("audit"), _mechanism_values(section("mechanism"))["batch_size"])
    else:
        out.update(target=target, blackbox=_blackbox(section("blackbox"), target))
    return {**out, **_mechanism_for(section("mechanism"), target)}


def load_spec(path: str | os.PathLike) -> AuditSpec:
    """Read and validate a TOML audit spec (UTF-8); every error names the file."""
    from invink_audit.data import read_text

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"audit spec not found: {str(p)!r}")
    text = read_text(p)  # a byte that is not UTF-8: the file and its line
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{str(p)!r} is not valid TOML: {err}") from err
    return parse_spec(raw, path=p)


def parse_spec(raw: dict, *, path: Path | None = None) -> AuditSpec:
    """An :class:`AuditSpec` from a TOML table (``path``: the file it came from, named in every error)."""
    with _naming(path):
        _check_top_level(raw)
        sections = _sections(raw)
    name = raw.get("name") or (path.stem if path else raw["kind"])
    return AuditSpec(str(name), raw["kind"], raw, path, **sections)


# -- running a spec ---------------------------------------------------------------------------------


def _data_references(spec: AuditSpec, needed: int) -> list[str]:
    from invink_audit.data import read_references

    data = spec.section("data")
    if needed == 0:
        return []
    if "inline" in data:
        refs, where = [str(r) for r in data["inline"]], "[data] inline"
    elif "yelp" in data or "path" in data:
        file = yelp_dir() / f"{data['yelp']}.csv" if "yelp" in data else Path(data["path"])
        if "yelp" in data and not file.is_file():
            raise ValueError(f"[data] yelp: Yelp data not found at {str(file)!r}; set INVINK_YELP_DIR")
        if not file.is_absolute() and spec.path is not None:
            file = spec.path.parent / file
        refs, where = read_references(file, column=data.get("column")), f"[data] {str(file)!r}"
    else:
        raise ValueError("[data] needs 'yelp', 'path' or 'inline' to fill the non-canary slots")
    offset = int(data.get("offset", 0))
    if offset + needed > len(refs):
        raise ValueError(f"{where} holds {len(refs)} references; {needed} needed from offset {offset}")
    return refs[offset : offset + needed]


def _batch(spec: AuditSpec, batch_size: int) -> tuple[list[str | None], dict, int | None]:
    """The audited batch (the canaries in their slots, data references elsewhere), the canaries' labels by slot and
    the hardest-case canary's slot."""
    from invink_audit.audit.model_audit import DEFAULT_CANARIES

    canaries = spec.section("canaries")
    slots: dict[int, tuple[str | None, str]] = {}
    hardest = canaries.get("hardest_case")
    named = [(canaries[k], DEFAULT_CANARIES[k], f"{k} canary: {DEFAULT_CANARIES[k]!r}") for k in ("secret", "repeat")
             if k in canaries]
    custom = [(c["slot"], str(c["text"]), str(c.get("label", f"canary {c['text']!r}"))) for c in canaries.get("custom", [])]
    for slot, text, label in named + custom + ([(hardest, None, "hardest-case logit canary")] if hardest is not None else []):
        if not 0 <= slot < batch_size:
            raise ValueError(f"[canaries] slot {slot} out of range for batch_size={batch_size}")
        if slot in slots:
            raise ValueError(f"[canaries] two canaries in slot {slot}")
        slots[slot] = (text, label)
    data = iter(_data_references(spec, batch_size - len(slots)))
    refs = [slots[j][0] if j in slots else next(data) for j in range(batch_size)]
    labels = {j: lab for j, (_, lab) in slots.items() if j != hardest}
    return refs, labels, hardest


def _generator(spec: AuditSpec, seed: int | None, device="cpu"):
    from invink_audit.mechanism import SeededGeneratorWarning, make_generator

    seed = seed if seed is not None else spec.seed
    if seed is None:
        return make_generator(device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)  # an audit may be reproducible
        return make_generator(int(seed), device=device)


@contextlib.contextmanager
def _invink_model_dir(path) -> Iterator[str]:
    """A local model directory for the reference package: a path, ``"embedded"`` (the cached
    safetensors conversion of the embedded SmolLM2) or ``"tiny"`` (the random tiny test model, saved to
    a temporary directory that is removed when the audit ends, on every path: success, error or
    interruption)."""
    if path == "embedded":
        from invink_audit.models import EMBEDDED_MODEL, named_model_dir

        yield str(named_model_dir(EMBEDDED_MODEL))
        return
    if path != "tiny":
        yield str(path)
        return
    from invink_audit.models import build_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="invink-audit-tiny-"))
    try:
        tiny = build_tiny_model()
        tiny.model.save_pretrained(folder)
        tiny.tokenizer.save_pretrained(folder)
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _require_invink() -> None:
    """The reference package must be importable (an optional dependency): a one-line error otherwise."""
    try:
        importlib.import_module("invink")
    except ImportError as err:
        raise ValueError(
            f"[target] kind = 'invink' audits the reference package invink, which cannot be imported ({err}); "
            "install it (pip install invink==0.1.0, with pandas) or put it on PYTHONPATH"
        ) from err


#: what :func:`run_spec` returns, by the spec's kind
SpecResult = Union["WhiteBoxReport", "BlackBoxReport", "SelfTestResult"]


def run_spec(
    spec: AuditSpec,
    *,
    seed: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    status: Callable[[str], None] | None = None,
) -> SpecResult:
    """Run a spec; returns a :class:`~invink_audit.audit.records.WhiteBoxReport` (white-box), a
    :class:`~invink_audit.audit.records.BlackBoxReport` (black-box, augpe-histogram) or a
    :class:`~invink_audit.audit.selftest.SelfTestResult` (selftest)."""
    if spec.kind == "selftest":
        from invink_audit.audit.selftest import run_selftest

        return run_selftest(spec.selftest, generator=_generator(spec, seed), progress=status)
    if spec.kind == "augpe-histogram":
        return _run_augpe_histogram(spec.augpe, seed if seed is not None else spec.seed)
    if spec.kind == "white-box":
        return _run_whitebox(spec, seed, progress)
    return _run_blackbox(spec, seed, progress)


def _model_audit_settings(spec: AuditSpec):
    """The :class:`~invink_audit.audit.model_audit.ModelAuditSettings` of a white-box spec's mechanism (InvisibleInk
    by its parameters, its clip norm planned for the spec's ε when one is given)."""
    from invink_audit.audit.model_audit import ModelAuditSettings
    from invink_audit.mechanisms import InvisibleInk

    m, steps = spec.mechanism, spec.max_new_tokens
    if not isinstance(m, InvisibleInk):
        return ModelAuditSettings(max_new_tokens=steps, delta=spec.delta, mechanism=m)
    size = {"epsilon": spec.epsilon} if spec.epsilon is not None else {"clip_norm": m.config.clip_norm}
    return ModelAuditSettings(max_new_tokens=steps, temperature=m.config.temperature, top_k=m.config.top_k,
                              delta=spec.delta, accountant=m.accountant, **size)


def _run_whitebox(spec: AuditSpec, seed, progress):
    from invink_audit.audit.model_audit import audit_model
    from invink_audit.models import load_model

    with _naming(spec.path):  # everything the spec decides, before the model loads
        refs, labels, hardest = _batch(spec, spec.batch_size)
    model = spec.model
    loaded = load_model(model.model, gguf_file=model.gguf_file, device=model.device, dtype=model.dtype)
    return audit_model(
        refs, _model_audit_settings(spec), spec.audit, model=loaded, prompt=spec.prompt.template,
        prompt_fields=spec.prompt.fields, canaries=labels, hardest_case_slot=hardest,
        generator=_generator(spec, seed, loaded.device), max_batch_rows=model.max_batch_rows, progress=progress,
        label=spec.name,
    )  # fmt: skip


@contextlib.contextmanager
def _target(spec: AuditSpec, seed) -> Iterator[tuple]:
    """The target a black-box spec names and the scores it is audited with (the reference package's ``tokens``
    counted by its model's tokenizer), for the audit's duration."""
    from invink_audit.audit.targets import CallableTarget, EngineTarget, ReferencePackageTarget

    t, bb = spec.target, spec.blackbox
    if t.kind == "callable":
        with _naming(spec.path):
            target = CallableTarget.named(t.function, batched=t.batched)
        yield target, bb.scores
    elif t.kind == "invink":
        with _invink_model_dir(t.model_path) as path:  # a temporary "tiny" model is removed on every path
            scores = list(bb.scores)
            if "tokens" in scores:
                from transformers import AutoTokenizer

                from invink_audit.audit.blackbox import token_count

                scores[scores.index("tokens")] = token_count(AutoTokenizer.from_pretrained(path))
            yield ReferencePackageTarget(path, batch_size=spec.batch_size, dataset_desc=t.dataset_desc,
                                         epsilon=spec.epsilon, delta=spec.delta, **bb.invink_kwargs), tuple(scores)
    else:
        from invink_audit.models import resolve_device

        target = EngineTarget(spec.mechanism, model=spec.model, max_new_tokens=spec.max_new_tokens,
                              prompt=spec.prompt.template, prompt_fields=spec.prompt.fields,
                              generator=_generator(spec, seed, device=resolve_device(spec.model.device)))
        yield target, bb.scores


def _claim(spec: AuditSpec) -> tuple[float, Callable[[float], float] | None]:
    """The claim a black-box spec tests: the engine's mechanism's guarantee (ε at the spec's δ, and at every δ'
    when it is a-priori), or the ε given for the reference package or a callable (its quoted point)."""
    if spec.mechanism is None:
        return spec.epsilon, None
    mechanism, steps = spec.mechanism, spec.max_new_tokens

    def curve(delta: float) -> float:
        return mechanism.guarantee(steps, delta).epsilon

    return curve(spec.delta), curve if mechanism.guarantee(steps, spec.delta).a_priori else None


def _run_blackbox(spec: AuditSpec, seed, progress):
    """The alternating canary audit (``num_trials``) or the batched one (``num_batches``: the spec's references after
    the canary slot are every batch's others, with its spare references, cycled; the coins from the seed)."""
    from invink_audit.audit.batched import batched_canary_audit
    from invink_audit.audit.blackbox import blackbox_audit

    bb, t = spec.blackbox, spec.target
    with _naming(spec.path):  # before any model loads
        refs, _, _ = _batch(spec, spec.batch_size + t.spare_references)
        if t.kind == "invink":
            _require_invink()
    epsilon, curve = _claim(spec)
    with _target(spec, seed) as (target, scores):
        if bb.num_batches is None:
            dtype = getattr(target, "loaded", None)
            notes = () if dtype is None else (f"model dtype {dtype.dtype_choice.dtype}: {dtype.dtype_choice.reason}",)
            return blackbox_audit(target, refs, bb.canary, claimed_epsilon=epsilon, claimed_delta=spec.delta,
                                  num_trials=bb.num_trials, significance=bb.significance, scores=scores,
                                  progress=progress, notes=notes)
        return batched_canary_audit(
            target, [r for r in refs[1:] if r], bb.canary, batch_size=spec.batch_size, num_batches=bb.num_batches,
            claimed_epsilon=epsilon, claimed_delta=spec.delta, scores=scores, significance=bb.significance,
            spare_references=t.spare_references, seed=seed if seed is not None else spec.seed,
            num_looks=4 if bb.sequential else 1, claimed_profile=curve,
        )  # fmt: skip


def _run_augpe_histogram(a: AugPEHistogramSpec, seed: int | None):
    """The batched canary audit of AugPE's histogram releases on the worst-case canary, the noise seeded by ``seed``
    and the coins by ``seed + 1`` (OS entropy for both when ``None``); the exact check of the same embeddings, the
    canary's exact true ε and the claim go into the report's notes, beside (not into) its black-box verdict."""
    import numpy as np

    from invink_audit.audit.augpe import exact_histogram_check, histogram_canary_audit
    from invink_audit.audit.targets import HistogramTarget

    data, event, start = a.embeddings(), a.event, time.perf_counter()
    check = exact_histogram_check(np.vstack([data.canary, data.others]), data.candidates, data.null, event)
    exact_seconds = time.perf_counter() - start
    target = HistogramTarget(data, noise_std=event.noise_std, iterations=event.iterations, threshold=a.threshold,
                             seed=seed)
    report = histogram_canary_audit(
        target, event, claimed_delta=a.delta, num_batches=a.num_batches, significance=a.significance,
        num_looks=4 if a.sequential else 1, seed=None if seed is None else seed + 1,
    )
    notes = (*report.notes, *_augpe_notes(a, target, check, seed))
    return dataclasses.replace(report, notes=notes, timings={**report.timings, "exact_check_seconds": exact_seconds})


def _augpe_notes(a: AugPEHistogramSpec, target, check, seed: int | None) -> tuple[str, ...]:
    """What an augpe-histogram report says beside its verdict: the claim, the exact check, the true ε, the seed."""
    from invink_audit.audit.augpe import true_epsilon

    event, n = a.event, 1 + a.num_candidates * a.others_per_candidate
    planned = (f"σ planned for ε = {a.epsilon:g} at δ = {a.delta:g} on the exact μ-GDP curve" if a.epsilon is not None
               else "σ given")
    notes = [
        f"claim: {event.describe()}; {planned}; claimed ε(δ = {a.delta:g}) = {event.gaussian_epsilon(a.delta):.4g}, "
        f"μ = {event.mu:.4g}; threshold H = {a.threshold:g}",
        f"audited release: the T = {event.iterations} thresholded noisy histograms on fixed public candidate embeddings "
        f"(worst-case canary: {a.num_candidates} basis candidates, the canary on e_0, the empty text on e_1, "
        f"{a.others_per_candidate} other references on each candidate); generation, paraphrasing and selection are "
        "post-processing of the released counts",
        f"exact check on the same embeddings (exact_histogram_check: all {n} replace-by-null neighbours, no sampling): "
        f"{check.verdict.value}, realised/claimed ρ = {check.ratio:.4g}: {check.reason}",
        f"true ε of this canary at δ = {a.delta:g}: {true_epsilon(target, a.delta):.4g} (exact μ-GDP of the realised "
        f"shift, μ = {target.true_mu:.4g})",
    ]
    if seed is not None:
        notes.append(f"seed {seed} (noise) and {seed + 1} (coins): a reproducible audit; seeded output carries no privacy")
    return tuple(notes)
