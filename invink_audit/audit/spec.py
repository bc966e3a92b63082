"""Audit specifications (TOML) and running them.

A spec names what to audit and how; ``run_spec`` returns typed reports and ``invink-audit audit
SPEC.toml --output DIR`` writes them (report.json, report.md, PNG plots). Kinds:

``selftest``
    the auditor against the correct mechanism and four planted bugs on synthetic logits
    (section ``[selftest]``: any field of :class:`~invink_audit.audit.selftest.SelfTestSettings`).
``white-box``
    a model audit (:func:`~invink_audit.audit.model_audit.audit_model`). Sections: ``[model]``
    (``name``: ``"embedded"``, a directory or hub id; ``gguf_file``, ``device``, ``dtype``,
    ``max_batch_rows``),
    ``[prompt]`` (``preset``, ``fields``), ``[data]`` (``inline``: a list of references; ``yelp = "dev"|"test"`` reads
    ``$INVINK_YELP_DIR`` or ``../shared/data/yelp`` next to the repository; or ``path`` relative to the
    spec file; ``column``; ``offset``: index of the first reference used), ``[mechanism]``
    (``batch_size``, ``max_new_tokens``, ``temperature``, ``top_k``, ``epsilon`` or ``clip_norm``,
    ``delta``, ``accountant``; ``kind = "amin"`` audits Amin et al. 2024 instead, with ``epsilon`` (planned
    by :func:`~invink_audit.mechanisms.plan_amin`) or ``clip_norm``, ``max_private_tokens``,
    ``sensitivity`` (``"replace-by-null"`` or ``"paper"``), ``svt_threshold``, ``svt_noise``,
    ``public_temperature``, ``posterior_grid``; ``kind = "adapmixed"`` audits AdaPMixED with ``epsilon``
    (its data-dependent budget) and any field of :class:`~invink_audit.mechanisms.AdaPMixEDConfig`),
    ``[canaries]`` (``secret``/``repeat``: slot of the default text
    canaries; ``hardest_case``: slot of the logit-level hardest-case canary; ``custom``: a list of
    ``{slot, text, label}``), ``[audit]`` (``alphas``, ``num_samples``, ``num_is_samples``,
    ``neighbours`` (list or ``"all"``), ``directions``, ``significance``, ``delta_grid``,
    ``min_samples``).
``black-box``
    a canary audit of a generator (``[target] kind = "engine"`` for our engine, or ``"invink"`` for
    the reference package with ``model_path``: a directory, ``"embedded"`` or ``"tiny"``; and
    ``spare_references``: extra references after the batch, which the package's ``drop_empty``
    pulls in when the canary slot is emptied); sections ``[mechanism]``, ``[data]``, ``[prompt]`` as
    above and ``[blackbox]`` (``canary``, ``num_trials``, ``scores`` (names; ``"tokens"`` counts
    output tokens with the invink target's tokenizer), ``significance``,
    ``invink_kwargs``: keywords for ``invink.generate``; ``random_seed = "fresh"`` draws a new seed
    per call). ``num_batches`` instead of ``num_trials`` runs the batched audit
    (:mod:`invink_audit.audit.batched`: one trial per batch, a recorded coin each; the engine target
    adds the exact ``log-likelihood-ratio`` score), ``sequential`` (default true) stopping at the first
    look that decides, false running every batch for the highest bound they allow.
``augpe-histogram``
    a black-box audit of AugPE's DP core, its T noisy nearest-neighbour histograms on fixed public candidate
    embeddings (:func:`~invink_audit.augpe.audit.histogram_canary_audit`), with the exact white-box check of the
    same embeddings (:func:`~invink_audit.augpe.audit.exact_histogram_check`) and the canary's exact true ε in the
    report's notes. Sections: ``[mechanism]`` (``kind = "augpe"``, optional; ``iterations`` T; ``noise_std`` σ or
    ``epsilon``, σ then planned by :func:`accounting.plan_augpe_noise_std` on the exact μ-GDP curve under the
    claimed sensitivity; ``delta``; ``sensitivity``: ``"replace-by-null"`` (Δ = √2) or ``"paper"`` (Δ = 1 under
    replace-by-null, not a valid guarantee); ``threshold`` H), ``[canary]`` (``kind = "worst-case"``:
    :func:`~invink_audit.augpe.audit.worst_case_canary` with ``others_per_candidate`` and ``num_candidates``) and
    ``[blackbox]`` (``num_batches``, ``significance``, ``sequential``). The top-level ``seed`` fixes the noise
    (``seed``) and the coins (``seed + 1``).

Canary and data slots: the B references are the canaries in their slots and data references (in
file order from ``offset``, a data-independent choice) everywhere else.

Checks: :func:`load_spec` checks every key when the spec is read, before any model loads: the
numbers against the ranges the command line applies (:mod:`accounting.limits`: ε, δ, C, τ, T, B and
the counts), the types (``max_new_tokens = 4.7`` or ``batch_size = true`` are refused, never
truncated), and the names (an unknown key is refused with the allowed ones). An error is one
``ValueError`` line naming the spec's file, the section and the key (``invink-audit audit`` prints it
and exits with status 2). A temporary model directory (``model_path = "tiny"``) is removed on every
path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import shutil
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Union

from accounting import Accountant, AugPEEvent, as_accountant, plan_augpe_noise_std
from accounting.augpe import NOISE_STD_RANGE
from accounting.limits import (
    COUNT_RANGE, MAX_COUNT, RANGES, ParameterRange, check_nonnegative, check_order, check_positive,
)
from invink_audit.audit.whitebox import Direction, WhiteBoxConfig

if TYPE_CHECKING:
    from invink_audit.audit.records import BlackBoxReport, WhiteBoxReport
    from invink_audit.audit.selftest import SelfTestResult

__all__ = [
    "AuditSpec", "AugPEHistogramSpec", "BlackBoxSpec", "MechanismSpec", "ModelSpec", "PromptSpec", "SpecResult", "load_spec",
    "mechanism_from_section", "run_spec", "yelp_dir",
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


# -- field checks ---------------------------------------------------------------------------------
# Each takes (key, value) and returns the checked value or raises a one-line ValueError naming the key;
# _Section.get adds the section and _naming the spec file. The numeric ranges are accounting.limits'
# (the ones the command line's flags go through), never a second copy.

_count = COUNT_RANGE.check
_NON_NEGATIVE_COUNT = ParameterRange(0, MAX_COUNT, integer=True)
_NUM_TRIALS_RANGE = ParameterRange(8, MAX_COUNT, integer=True)  # blackbox_audit's smallest num_trials
_NUM_BATCHES_RANGE = ParameterRange(16, MAX_COUNT, integer=True)  # batched_canary_audit's smallest num_batches
_SEED_RANGE = ParameterRange(0, 2**63 - 1, integer=True)  # any TOML integer >= 0 (make_generator's seeds)
_UNIT_INTERVAL = ParameterRange(0.0, 1.0)


def _string(key: str, value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string; got {value!r}")
    return value


def _boolean(key: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false; got {value!r}")
    return value


def _number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{key} must be a finite number; got {value!r}")
    return float(value)


def _significance(key: str, value) -> float:
    from invink_audit.audit.stats import check_significance

    return check_significance(_number(key, value))


def _top_k(key: str, value) -> int | None:
    """An integer k, or ``"full"`` for the full vocabulary (as ``--top-k`` takes it)."""
    if isinstance(value, str) and value.strip().lower() == "full":
        return None
    try:
        return _count(key, value)
    except ValueError as err:
        raise ValueError(f"{key} must be {COUNT_RANGE.describe()} or 'full'; got {value!r}") from err


def _accountant(key: str, value) -> Accountant:
    return as_accountant(value)


def _choice(*options: str) -> Callable:
    def check(key: str, value):
        if not isinstance(value, str) or value not in options:
            raise ValueError(f"{key} must be one of {list(options)}; got {value!r}")
        return value

    return check


def _list_of(check: Callable, *, empty: bool = False) -> Callable:
    def checked(key: str, value) -> tuple:
        if not isinstance(value, list) or not (value or empty):
            raise ValueError(f"{key} must be a {'' if empty else 'non-empty '}list; got {value!r}")
        return tuple(check(f"{key}[{i}]", v) for i, v in enumerate(value))

    return checked


def _table(key: str, value) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a table; got {value!r}")
    return dict(value)


def _string_table(key: str, value) -> dict:
    return {name: _string(f"{key}.{name}", v) for name, v in _table(key, value).items()}


def _device(key: str, value) -> str:
    from invink_audit.models import resolve_device

    resolve_device(_string(key, value))
    return value


def _dtype(key: str, value) -> str:
    import torch

    from invink_audit.models import resolve_dtype

    resolve_dtype(_string(key, value), torch.device("cpu"))
    return value


def _direction(key: str, value) -> Direction:
    return Direction(_choice(*(d.value for d in Direction))(key, value))


def _neighbours(key: str, value) -> tuple[int, ...] | None:
    """``"all"`` (``None``) or a list of indices."""
    if value == "all":
        return None
    try:
        return _list_of(_NON_NEGATIVE_COUNT.check)(key, value)
    except ValueError as err:
        raise ValueError(f"{key} must be 'all' or a non-empty list of indices >= 0; got {value!r}") from err


def _custom_canary(key: str, value) -> dict:
    item = _Section(key, _table(key, value), ("slot", "text", "label"), prefix=False)
    item.require("slot", _NON_NEGATIVE_COUNT.check)
    item.require("text", _string)
    item.get("label", _string)
    return item.values


class _Section:
    """One ``[section]`` of a spec: unknown keys are refused with the allowed names, and every read is
    checked, its error naming the section and the key."""

    def __init__(self, name: str, table, allowed, *, prefix: bool = True) -> None:
        self.name, self.where = name, f"[{name}]" if prefix else name
        if not isinstance(table, dict):
            raise ValueError(f"{self.where} must be a table; got {table!r}")
        unknown = set(table) - set(allowed)
        if unknown:
            raise ValueError(f"unknown keys in {self.where}: {sorted(unknown)}; allowed: {sorted(allowed)}")
        self.values = table

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str, check: Callable, default=None):
        """``check(key, value)`` of the key's value, or ``default`` when the key is absent."""
        if key not in self.values:
            return default
        try:
            return check(key, self.values[key])
        except ValueError as err:
            raise ValueError(f"{self.where} {err}") from err

    def require(self, key: str, check: Callable, why: str = ""):
        if key not in self.values:
            raise ValueError(f"{self.where} {key} is required{why}")
        return self.get(key, check)


@contextlib.contextmanager
def _naming(path: Path | None) -> Iterator[None]:
    """A ``ValueError`` raised while a spec is read becomes one line that starts with the spec's file."""
    try:
        yield
    except ValueError as err:
        where = "audit spec" if path is None else f"audit spec {str(path)!r}"
        raise ValueError(f"{where}: {err}") from err


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``[model]``: ``name`` (``"embedded"``, a directory or hub id), ``gguf_file``, ``device``, ``dtype``,
    ``max_batch_rows``."""

    name: str = "embedded"
    gguf_file: str | None = None
    device: str | None = None
    dtype: str | None = None
    max_batch_rows: int | None = None

    @classmethod
    def from_section(cls, section: dict) -> ModelSpec:
        s = _Section("model", section, ("name", "gguf_file", "device", "dtype", "max_batch_rows"))
        return cls(s.get("name", _string, "embedded"), s.get("gguf_file", _string), s.get("device", _device),
                   s.get("dtype", _dtype), s.get("max_batch_rows", _count))

    @property
    def model(self) -> str | None:
        """What :func:`~invink_audit.models.load_model` takes (``None``: the embedded model)."""
        return None if self.name == "embedded" else self.name


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """``[prompt]``: ``preset`` and its ``fields``."""

    preset: str = "generic"
    fields: dict | None = None

    @classmethod
    def from_section(cls, section: dict) -> PromptSpec:
        from invink_audit.prompts import get_preset

        def preset_name(key: str, value) -> str:
            try:
                get_preset(_string(key, value))
            except ValueError as err:
                raise ValueError(f"{key}: {err}") from err
            return value

        s = _Section("prompt", section, ("preset", "fields"))
        preset, fields = s.get("preset", preset_name, "generic"), s.get("fields", _string_table)
        try:
            get_preset(preset, **(fields or {}))
        except ValueError as err:
            raise ValueError(f"[prompt] fields: {err}") from err
        return cls(preset, fields)


_MECHANISM_KINDS = ("invisibleink", "amin", "adapmixed")
_COMMON_MECHANISM_KEYS = ("kind", "batch_size", "max_new_tokens", "delta")
_AMIN_KEYS = ("epsilon", "clip_norm", "temperature", "public_temperature", "svt_threshold", "svt_noise",
              "max_private_tokens", "sensitivity", "posterior_grid")
#: the check of every [mechanism] key, whichever kind reads it
_MECHANISM_CHECKS = {
    "kind": _choice(*_MECHANISM_KINDS),
    "batch_size": _count,
    "max_new_tokens": _count,
    "delta": RANGES["delta"].check,
    "epsilon": RANGES["epsilon"].check,
    "clip_norm": RANGES["clip_norm"].check,
    "temperature": RANGES["temperature"].check,
    "top_k": _top_k,
    "accountant": _accountant,
    # Amin et al. 2024
    "public_temperature": RANGES["temperature"].check,
    "svt_threshold": _number,
    "svt_noise": check_positive,
    "max_private_tokens": _count,
    "sensitivity": _choice("replace-by-null", "paper"),
    "posterior_grid": _count,
    # AdaPMixED
    "renyi_order": check_order,
    "beta": check_positive,
    "screen_top_k": _count,
    "screen_threshold": check_positive,
    "screen_noise": check_positive,
    "screen_mixing": _UNIT_INTERVAL.check,
    "screen_samples": _count,
}


def _mechanism_keys(kind: str) -> tuple[str, ...]:
    """The keys ``[mechanism]`` takes for ``kind``."""
    if kind == "invisibleink":
        return (*_COMMON_MECHANISM_KEYS, "temperature", "top_k", "clip_norm", "epsilon", "accountant")
    if kind == "amin":
        return (*_COMMON_MECHANISM_KEYS, *_AMIN_KEYS)
    from invink_audit.mechanisms import AdaPMixEDConfig

    own = (f.name for f in dataclasses.fields(AdaPMixEDConfig) if f.name not in ("batch_size", "delta"))
    return (*_COMMON_MECHANISM_KEYS, *own)


def _mechanism_values(mech: dict) -> dict:
    """Every key of a ``[mechanism]`` table, checked (unknown keys for its kind refused)."""
    if not isinstance(mech, dict):
        raise ValueError(f"[mechanism] must be a table; got {mech!r}")
    try:
        kind = _MECHANISM_CHECKS["kind"]("kind", mech.get("kind", "invisibleink"))
    except ValueError as err:
        raise ValueError(f"[mechanism] {err}") from err
    s = _Section("mechanism", mech, _mechanism_keys(kind))
    values = {key: s.get(key, _MECHANISM_CHECKS[key]) for key in mech}
    values["kind"] = kind
    return values


@dataclasses.dataclass(frozen=True)
class MechanismSpec:
    """``[mechanism]``, every value checked against its range (:mod:`accounting.limits`); ``section`` is
    the table itself, for :func:`mechanism_from_section`."""

    kind: str
    batch_size: int
    max_new_tokens: int | None
    delta: float
    temperature: float
    top_k: int | None
    clip_norm: float | None
    epsilon: float | None
    accountant: Accountant
    section: dict

    @classmethod
    def from_section(cls, mech: dict) -> MechanismSpec:
        v = _mechanism_values(mech)
        if "batch_size" not in v:
            raise ValueError(f"[mechanism] batch_size is required ({COUNT_RANGE.describe()})")
        if v["kind"] == "invisibleink" and v.get("epsilon") is not None and v.get("clip_norm") is not None:
            raise ValueError("[mechanism] give one of epsilon (the clip norm is planned) and clip_norm; got both")
        return cls(
            v["kind"], v["batch_size"], v.get("max_new_tokens"), v.get("delta", 1e-6), v.get("temperature", 1.0),
            v.get("top_k"), v.get("clip_norm"), v.get("epsilon"), v.get("accountant", Accountant.BR_ADAPTIVE), mech,
        )

    @property
    def tokens(self) -> int:
        """``max_new_tokens`` (T), which a model audit needs."""
        if self.max_new_tokens is None:
            raise ValueError("[mechanism] max_new_tokens is required")
        return int(self.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class BlackBoxSpec:
    """``[target]`` and ``[blackbox]`` of a black-box spec."""

    target: str
    model_path: str | None
    dataset_desc: str
    spare_references: int
    canary: str
    num_trials: int
    significance: float
    scores: tuple
    invink_kwargs: dict
    #: batched mode (:mod:`invink_audit.audit.batched`): this many batches, one independent trial each
    num_batches: int | None = None
    #: batched mode: stop at the first look that decides (True), or run every batch for the highest bound
    sequential: bool = True

    @classmethod
    def from_sections(cls, target: dict, bb: dict) -> BlackBoxSpec:
        from invink_audit.audit.batched import LLR_SCORE
        from invink_audit.audit.blackbox import DEFAULT_SCORES, SCORES

        t = _Section("target", target, ("kind", "model_path", "dataset_desc", "spare_references"))
        kind = t.get("kind", _choice("engine", "invink"), "engine")
        model_path = t.get("model_path", _string)
        if kind == "invink":
            if model_path is None:
                raise ValueError(
                    "[target] model_path is required for kind = 'invink' (a directory, 'embedded' or 'tiny')"
                )
            if model_path not in ("embedded", "tiny") and not Path(model_path).is_dir():
                raise ValueError(f"[target] model_path must be a directory, 'embedded' or 'tiny'; got {model_path!r}")
        elif model_path is not None:
            raise ValueError("[target] model_path is for kind = 'invink'; the engine's model is [model] name")
        b = _Section("blackbox", bb, ("canary", "num_trials", "num_batches", "sequential", "scores", "significance",
                                      "invink_kwargs"))
        names = (*SCORES, "tokens") if kind == "invink" else tuple(SCORES)  # "tokens": the invink target's tokenizer
        if "num_batches" in bb:
            if "num_trials" in bb:
                raise ValueError("[blackbox] give num_trials (alternating trials of one batch) or num_batches (batched), not both")
            names += (LLR_SCORE,) if kind == "engine" else ()
        default_scores = ((LLR_SCORE,) if kind == "engine" and "num_batches" in bb else ()) + tuple(DEFAULT_SCORES)
        return cls(
            kind, model_path, t.get("dataset_desc", _string, "short texts"),
            t.get("spare_references", _NON_NEGATIVE_COUNT.check, 0),
            b.get("canary", _string, "My name is Zelphine Quorrick and my card number is 4929 7310 5528 1746."),
            b.get("num_trials", _NUM_TRIALS_RANGE.check, 200), b.get("significance", _significance, 0.05),
            b.get("scores", _list_of(_choice(*names)), default_scores), b.get("invink_kwargs", _table, {}),
            b.get("num_batches", _NUM_BATCHES_RANGE.check), b.get("sequential", _boolean, True),
        )


def _check_blackbox_mechanism(m: MechanismSpec, bb: BlackBoxSpec) -> None:
    """What a black-box target needs from ``[mechanism]``."""
    if m.kind != "invisibleink":
        raise ValueError(
            f"[mechanism] kind {m.kind!r} is audited white-box only; a black-box spec audits InvisibleInk "
            "([target] kind = 'engine') or the reference package ('invink')"
        )
    if bb.target == "invink":
        if m.epsilon is None:
            raise ValueError("[mechanism] epsilon is required for [target] kind = 'invink'")
        if m.clip_norm is not None:
            raise ValueError("[mechanism] clip_norm: the reference package plans its clip norm from epsilon; remove it")
        return
    m.tokens  # noqa: B018 - raises when max_new_tokens is missing
    if m.epsilon is None and m.clip_norm is None:
        raise ValueError("[mechanism] give epsilon (the clip norm is planned) or clip_norm")


def _check_data(section: dict) -> None:
    s = _Section("data", section, ("yelp", "path", "inline", "column", "offset"))
    sources = [key for key in ("yelp", "path", "inline") if key in s]
    if len(sources) > 1:
        raise ValueError(f"[data] give one of 'yelp', 'path' and 'inline'; got {sources}")
    s.get("yelp", _choice("dev", "test"))
    s.get("path", _string)
    s.get("inline", _list_of(_string, empty=True))
    s.get("column", _string)
    s.get("offset", _NON_NEGATIVE_COUNT.check)


def _check_canaries(section: dict) -> None:
    s = _Section("canaries", section, ("secret", "repeat", "custom", "hardest_case"))
    for key in ("secret", "repeat", "hardest_case"):
        s.get(key, _NON_NEGATIVE_COUNT.check)
    s.get("custom", _list_of(_custom_canary, empty=True))


#: the check of every [selftest] key (a field of SelfTestSettings)
_SELFTEST_CHECKS = {
    "clip_norm": RANGES["clip_norm"].check,
    "temperature": RANGES["temperature"].check,
    "top_k": _count,
    "batch_size": _count,
    "max_new_tokens": _count,
    "num_samples": _count,
    "num_is_samples": _NON_NEGATIVE_COUNT.check,
    "alphas": _list_of(check_order),
    "significance": _significance,
    "baselines": _boolean,
    "amin_svt_threshold": _number,
    "amin_svt_noise": check_positive,
    "amin_max_private_tokens": _count,
    "amin_posterior_grid": _count,
    "adapmixed_stop_epsilon": RANGES["epsilon"].check,
    "adapmixed_within_epsilon": RANGES["epsilon"].check,
    "adapmixed_screen_samples": _count,
}


def _selftest_settings(section: dict):
    from invink_audit.audit.selftest import SelfTestSettings

    s = _Section("selftest", section, _SELFTEST_CHECKS)
    return SelfTestSettings(**{key: s.get(key, _SELFTEST_CHECKS[key]) for key in section})


#: the check of every [mechanism] key of an augpe-histogram spec
_AUGPE_MECHANISM_CHECKS = {
    "kind": _choice("augpe"),
    "iterations": ParameterRange(1, 100, integer=True).check,  # the paper's T is 1-10; the target keeps every release
    "noise_std": NOISE_STD_RANGE.check,
    "epsilon": RANGES["epsilon"].check,
    "delta": RANGES["delta"].check,
    "sensitivity": _choice("replace-by-null", "paper"),  # add-or-remove is not a claim about replace-by-null data
    "threshold": check_nonnegative,
}
#: the worst-case canary's sizes: the exact check recomputes the histogram for each of its 1 + k·m references
_OTHERS_PER_CANDIDATE_RANGE = ParameterRange(1, 500, integer=True)
_NUM_CANDIDATES_RANGE = ParameterRange(2, 16, integer=True)


@dataclasses.dataclass(frozen=True)
class AugPEHistogramSpec:
    """The sections of an ``augpe-histogram`` spec. ``event`` is the claim audited (σ given or planned, T, the
    claimed sensitivity), ``delta`` the δ it is quoted at, ``epsilon`` the ε σ was planned for (``None``: σ given);
    the mechanism run adds the ``threshold`` H. ``others_per_candidate`` and ``num_candidates`` shape
    :func:`~invink_audit.augpe.audit.worst_case_canary`; ``num_batches``, ``significance`` and ``sequential`` are the
    batched audit's (as in a black-box spec's ``[blackbox]``)."""

    event: AugPEEvent
    delta: float
    epsilon: float | None
    threshold: float
    others_per_candidate: int
    num_candidates: int
    num_batches: int
    significance: float
    sequential: bool

    @classmethod
    def from_sections(cls, mechanism: dict, canary: dict, blackbox: dict) -> AugPEHistogramSpec:
        m = _Section("mechanism", mechanism, _AUGPE_MECHANISM_CHECKS)
        values = {key: m.get(key, _AUGPE_MECHANISM_CHECKS[key]) for key in mechanism}
        iterations = m.require("iterations", _AUGPE_MECHANISM_CHECKS["iterations"], " (T: the histograms released)")
        delta, sensitivity = values.get("delta", 1e-6), values.get("sensitivity", "replace-by-null")
        if ("noise_std" in values) == ("epsilon" in values):
            raise ValueError("[mechanism] give one of noise_std (σ) and epsilon (σ is planned)")
        try:
            if "noise_std" in values:
                sigma = values["noise_std"]
            else:  # planned on the exact μ-GDP curve, the curve the audit tests (the safe, larger σ)
                sigma = plan_augpe_noise_std(values["epsilon"], delta, iterations, sensitivity, exact_gaussian=True)
            event = AugPEEvent(sigma, iterations, sensitivity)
        except ValueError as err:
            raise ValueError(f"[mechanism] {err}") from err
        c = _Section("canary", canary, ("kind", "others_per_candidate", "num_candidates"))
        c.get("kind", _choice("worst-case"))
        b = _Section("blackbox", blackbox, ("num_batches", "significance", "sequential"))
        return cls(
            event, delta, values.get("epsilon"), values.get("threshold", 0.0),
            c.get("others_per_candidate", _OTHERS_PER_CANDIDATE_RANGE.check, 50),
            c.get("num_candidates", _NUM_CANDIDATES_RANGE.check, 4),
            b.get("num_batches", _NUM_BATCHES_RANGE.check, 10_000), b.get("significance", _significance, 0.05),
            b.get("sequential", _boolean, True),
        )

    def embeddings(self):
        """The audit's public data: :func:`~invink_audit.augpe.audit.worst_case_canary` of this spec's sizes."""
        from invink_audit.augpe.audit import worst_case_canary

        return worst_case_canary(others_per_candidate=self.others_per_candidate, num_candidates=self.num_candidates)


@dataclasses.dataclass(frozen=True)
class AuditSpec:
    """A parsed, validated audit specification: ``raw`` is the TOML table; the typed sections are parsed
    from it at construction (``selftest``: the self-test's settings; ``model``, ``prompt``,
    ``mechanism``, and ``audit`` (white-box) or ``blackbox`` (black-box) for a model audit; ``augpe`` for an
    ``augpe-histogram`` audit). Every value
    is checked here, before any model loads; an error is one ``ValueError`` line naming the spec's file,
    the section and the key."""

    name: str
    kind: str
    raw: dict
    path: Path | None = None
    model: ModelSpec | None = dataclasses.field(default=None, init=False)
    prompt: PromptSpec | None = dataclasses.field(default=None, init=False)
    mechanism: MechanismSpec | None = dataclasses.field(default=None, init=False)
    audit: WhiteBoxConfig | None = dataclasses.field(default=None, init=False)
    blackbox: BlackBoxSpec | None = dataclasses.field(default=None, init=False)
    selftest: object | None = dataclasses.field(default=None, init=False)  # SelfTestSettings
    augpe: AugPEHistogramSpec | None = dataclasses.field(default=None, init=False)
    seed: int | None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        with _naming(self.path):
            self._parse()

    def _parse(self) -> None:
        _check_top_level(self.raw)
        seed = self.raw.get("seed")
        object.__setattr__(self, "seed", None if seed is None else _SEED_RANGE.check("seed", seed))
        if self.kind == "selftest":
            object.__setattr__(self, "selftest", _selftest_settings(self.section("selftest")))
            return
        if self.kind == "augpe-histogram":
            sections = (self.section(name) for name in ("mechanism", "canary", "blackbox"))
            object.__setattr__(self, "augpe", AugPEHistogramSpec.from_sections(*sections))
            return
        mechanism = MechanismSpec.from_section(self.section("mechanism"))
        object.__setattr__(self, "model", ModelSpec.from_section(self.section("model")))
        object.__setattr__(self, "prompt", PromptSpec.from_section(self.section("prompt")))
        object.__setattr__(self, "mechanism", mechanism)
        _check_data(self.section("data"))
        _check_canaries(self.section("canaries"))
        if self.kind == "white-box":
            object.__setattr__(self, "audit", _whitebox_config(self.section("audit"), mechanism.batch_size))
            mechanism_from_section(mechanism.section, mechanism.batch_size)  # Amin et al., AdaPMixED: built to check
        else:
            blackbox = BlackBoxSpec.from_sections(self.section("target"), self.section("blackbox"))
            _check_blackbox_mechanism(mechanism, blackbox)
            object.__setattr__(self, "blackbox", blackbox)

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
            _string(key, raw[key])


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
    with _naming(path):
        _check_top_level(raw)
    name = raw.get("name") or (path.stem if path else raw["kind"])
    return AuditSpec(str(name), raw["kind"], raw, path)


#: the check of every [audit] key
_AUDIT_CHECKS = {
    "alphas": _list_of(check_order),
    "num_samples": _count,
    "num_is_samples": _NON_NEGATIVE_COUNT.check,
    "neighbours": _neighbours,
    "directions": _list_of(_direction),
    "significance": _significance,
    "delta_grid": _list_of(RANGES["delta"].check),
    "min_samples": _count,
}


def _whitebox_config(section: dict, batch_size: int) -> WhiteBoxConfig:
    s = _Section("audit", section, _AUDIT_CHECKS)
    kwargs = {key: s.get(key, _AUDIT_CHECKS[key]) for key in section}
    kwargs["neighbours"] = kwargs.get("neighbours")  # absent or "all": every neighbour
    try:
        config = WhiteBoxConfig(**kwargs)
        config.audited_neighbours(batch_size)
    except ValueError as err:
        raise ValueError(f"[audit] {err}") from err
    return config


def _data_references(spec: AuditSpec, needed: int) -> list[str]:
    from invink_audit.data import read_references

    data = spec.section("data")
    if needed == 0:
        return []
    if "yelp" in data:
        split = data["yelp"]
        if split not in ("dev", "test"):
            raise ValueError(f"[data] yelp must be 'dev' or 'test'; got {split!r}")
        file = yelp_dir() / f"{split}.csv"
        if not file.is_file():
            raise ValueError(f"[data] yelp: Yelp data not found at {str(file)!r}; set INVINK_YELP_DIR")
    elif "inline" in data:
        refs = [str(r) for r in data["inline"]]
        offset = int(data.get("offset", 0))
        if offset < 0 or offset + needed > len(refs):
            raise ValueError(f"[data] inline holds {len(refs)} references; {needed} needed from offset {offset}")
        return refs[offset : offset + needed]
    elif "path" in data:
        file = Path(data["path"])
        if not file.is_absolute() and spec.path is not None:
            file = spec.path.parent / file
    else:
        raise ValueError("[data] needs 'yelp', 'path' or 'inline' to fill the non-canary slots")
    refs = read_references(file, column=data.get("column"))
    offset = int(data.get("offset", 0))
    if offset < 0 or offset + needed > len(refs):
        raise ValueError(f"[data] offset={offset} with {needed} references needed exceeds the {len(refs)} in {str(file)!r}")
    return refs[offset : offset + needed]


def _batch(spec: AuditSpec, batch_size: int) -> tuple[list[str | None], dict, int | None]:
    from invink_audit.audit.model_audit import DEFAULT_CANARIES

    canaries = spec.section("canaries")
    slots: dict[int, tuple[str | None, str]] = {}

    def claim_slot(slot, text, label):
        slot = int(slot)
        if not 0 <= slot < batch_size:
            raise ValueError(f"[canaries] slot {slot} out of range for batch_size={batch_size}")
        if slot in slots:
            raise ValueError(f"[canaries] two canaries in slot {slot}")
        slots[slot] = (text, label)

    for key in ("secret", "repeat"):
        if key in canaries:
            claim_slot(canaries[key], DEFAULT_CANARIES[key], f"{key} canary: {DEFAULT_CANARIES[key]!r}")
    for item in canaries.get("custom", []):
        claim_slot(item["slot"], str(item["text"]), str(item.get("label", f"canary {item['text']!r}")))
    hardest = canaries.get("hardest_case")
    if hardest is not None:
        claim_slot(hardest, None, "hardest-case logit canary")
    unknown = set(canaries) - {"secret", "repeat", "custom", "hardest_case"}
    if unknown:
        raise ValueError(f"unknown keys in [canaries]: {sorted(unknown)}")
    data = iter(_data_references(spec, batch_size - len(slots)))
    refs = [slots[j][0] if j in slots else next(data) for j in range(batch_size)]
    labels = {j: lab for j, (_, lab) in slots.items() if j != hardest}
    return refs, labels, (int(hardest) if hardest is not None else None)


def mechanism_from_section(mech: dict, batch_size: int):
    """The :class:`~invink_audit.mechanisms.Mechanism` a ``[mechanism]`` section names (``None``: InvisibleInk,
    audited on the engine's own path from ``clip_norm``/``epsilon``). Every key is checked first."""
    values = _mechanism_values(mech)
    kind = values["kind"]
    if kind == "invisibleink":
        return None
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism, plan_amin

    delta = values.get("delta", 1e-6)
    try:
        if kind == "amin":
            kwargs = {k: values[k] for k in _AMIN_KEYS if k in values and k not in ("epsilon", "clip_norm")}
            if (values.get("epsilon") is None) == (values.get("clip_norm") is None):
                raise ValueError("kind 'amin' needs exactly one of epsilon and clip_norm")
            if values.get("clip_norm") is None:
                acc = plan_amin(
                    epsilon=values["epsilon"], delta=delta, max_private_tokens=values.get("max_private_tokens", 100),
                    batch_size=batch_size, temperature=values.get("temperature", 1.0),
                    svt_noise=values.get("svt_noise", 0.3), sensitivity=values.get("sensitivity", "replace-by-null"),
                )
                kwargs["clip_norm"] = acc.clip_norm
            else:
                kwargs["clip_norm"] = values["clip_norm"]
            return AminMechanism(AminConfig(batch_size=batch_size, **kwargs))
        if values.get("epsilon") is None:
            raise ValueError("kind 'adapmixed' needs epsilon (the budget of its stop rule)")
        kwargs = {k: values[k] for k in _mechanism_keys("adapmixed") if k not in _COMMON_MECHANISM_KEYS and k in values}
        return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=batch_size, delta=delta, **kwargs))
    except ValueError as err:
        raise ValueError(f"[mechanism] {err}") from err


def _device_of(model_section: dict):
    from invink_audit.models import resolve_device

    return resolve_device(model_section.get("device"))


def _generator(spec: AuditSpec, seed: int | None, device="cpu"):
    import warnings

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
    if not path:
        raise ValueError("[target] kind = 'invink' needs model_path (a directory, 'embedded' or 'tiny')")
    if path == "embedded":
        from invink_audit.models import EMBEDDED_MODEL, named_model_dir

        yield str(named_model_dir(EMBEDDED_MODEL))
        return
    if path == "tiny":
        import tempfile

        from invink_audit.models import build_tiny_model

        folder = Path(tempfile.mkdtemp(prefix="invink-audit-tiny-"))
        try:
            tiny = build_tiny_model()
            tiny.model.save_pretrained(folder)
            tiny.tokenizer.save_pretrained(folder)
            yield str(folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    if not Path(path).is_dir():
        raise ValueError(f"[target] model_path must be a directory, 'embedded' or 'tiny'; got {path!r}")
    yield str(path)


def _require_invink() -> None:
    """The reference package must be importable (an optional dependency): a one-line error otherwise."""
    try:
        import invink  # noqa: F401
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
    """The :class:`~invink_audit.audit.model_audit.ModelAuditSettings` of a white-box spec's ``[mechanism]``."""
    from invink_audit.audit.model_audit import ModelAuditSettings

    m = spec.mechanism
    generic = mechanism_from_section(m.section, m.batch_size)
    tokens = m.tokens
    try:
        if generic is not None:
            return ModelAuditSettings(max_new_tokens=tokens, delta=m.delta, mechanism=generic)
        return ModelAuditSettings(
            max_new_tokens=tokens,
            temperature=m.temperature,
            top_k=m.top_k,
            clip_norm=m.clip_norm,
            epsilon=m.epsilon,
            delta=m.delta,
            accountant=m.accountant,
        )
    except ValueError as err:
        raise ValueError(f"[mechanism] {err}") from err


def _run_whitebox(spec: AuditSpec, seed, progress):
    from invink_audit.audit.model_audit import audit_model
    from invink_audit.models import load_model

    with _naming(spec.path):  # everything the spec decides, before the model loads
        refs, labels, hardest = _batch(spec, spec.mechanism.batch_size)
        settings = _model_audit_settings(spec)
    model = spec.model
    loaded = load_model(model.model, gguf_file=model.gguf_file, device=model.device, dtype=model.dtype)
    return audit_model(
        refs,
        settings,
        spec.audit,
        model=loaded,
        prompt=spec.prompt.preset,
        prompt_fields=spec.prompt.fields,
        canaries=labels,
        hardest_case_slot=hardest,
        generator=_generator(spec, seed, loaded.device),
        max_batch_rows=model.max_batch_rows,
        progress=progress,
        label=spec.name,
    )


def _run_blackbox(spec: AuditSpec, seed, progress):
    bb = spec.blackbox
    with _naming(spec.path):  # before any model loads
        refs, _, _ = _batch(spec, spec.mechanism.batch_size + bb.spare_references)
        if bb.target == "invink":
            _require_invink()
    if bb.target == "engine":
        return _run_engine_target(spec, refs, seed, progress)
    if bb.target == "invink":
        return _run_invink_target(spec, refs, progress)
    raise ValueError(f"[target] kind must be 'engine' or 'invink'; got {bb.target!r}")


def _run_engine_target(spec: AuditSpec, refs, seed, progress):
    """Black-box audit of our engine: the clip norm given (its ε reported) or planned for ε."""
    from accounting import epsilon_for_clip_norm, plan_clip_norm
    from invink_audit.audit.batched import EngineTarget
    from invink_audit.audit.blackbox import blackbox_audit, engine_generator

    m, bb = spec.mechanism, spec.blackbox
    with _naming(spec.path):
        T, tau, epsilon = m.tokens, m.temperature, m.epsilon
        try:
            if m.clip_norm is not None:
                clip_norm = float(m.clip_norm)
                epsilon = epsilon_for_clip_norm(
                    clip_norm=clip_norm, max_new_tokens=T, batch_size=m.batch_size, temperature=tau, delta=m.delta
                ).epsilon
            else:
                clip_norm = plan_clip_norm(
                    epsilon=epsilon, delta=m.delta, max_new_tokens=T, batch_size=m.batch_size, temperature=tau
                ).clip_norm
        except ValueError as err:
            raise ValueError(f"[mechanism] {err}") from err
    if bb.num_batches is not None:
        def curve(d: float) -> float:  # the release's accountant at every δ': the claim tested is its curve
            return epsilon_for_clip_norm(clip_norm=clip_norm, max_new_tokens=T, batch_size=m.batch_size, temperature=tau,
                                         delta=d).epsilon

        return _run_batched(spec, refs, curve(m.delta), EngineTarget(
            model=spec.model.model, clip_norm=clip_norm, temperature=tau, top_k=m.top_k, batch_size=m.batch_size,
            max_new_tokens=T, prompt=spec.prompt.preset, prompt_fields=spec.prompt.fields,
            generator=_generator(spec, seed, device=_device_of(spec.section("model"))),
        ), seed, f"InvisibleInk engine ({spec.model.name})", claimed_profile=curve)
    many = engine_generator(
        model=spec.model.model,
        clip_norm=clip_norm, temperature=tau, top_k=m.top_k, batch_size=m.batch_size, max_new_tokens=T,
        prompt=spec.prompt.preset, prompt_fields=spec.prompt.fields,
        generator=_generator(spec, seed, device=_device_of(spec.section("model"))),
    )
    return blackbox_audit(
        None, refs, bb.canary, claimed_epsilon=float(epsilon), claimed_delta=m.delta, generate_many=many,
        num_trials=bb.num_trials, significance=bb.significance, scores=bb.scores,
        mechanism=f"InvisibleInk engine ({spec.model.name}, {many.dtype_choice.dtype})", progress=progress,
        notes=(f"model dtype {many.dtype_choice.dtype}: {many.dtype_choice.reason}",),
    )


def _run_batched(spec: AuditSpec, refs, epsilon: float, target, seed, mechanism: str, scores=None, claimed_profile=None):
    """A batched canary audit (:func:`invink_audit.audit.batched.batched_canary_audit`): the spec's references
    after the canary slot are every batch's others (with its spare references), cycled. ``claimed_profile``:
    the claim's ε at every δ' (our engine's accountant); the reference package's claim is its quoted point."""
    from invink_audit.audit.batched import batched_canary_audit

    bb, m = spec.blackbox, spec.mechanism
    return batched_canary_audit(
        target, [r for r in refs[1:] if r], bb.canary, batch_size=m.batch_size, num_batches=bb.num_batches,
        claimed_epsilon=epsilon, claimed_delta=m.delta, scores=scores or bb.scores, significance=bb.significance,
        spare_references=bb.spare_references, seed=seed, mechanism=mechanism, num_looks=4 if bb.sequential else 1,
        claimed_profile=claimed_profile,
    )


def _run_invink_target(spec: AuditSpec, refs, progress):
    """Black-box audit of the reference package ``invink`` (the audited model's tokenizer counts tokens)."""
    from invink_audit.audit.blackbox import blackbox_audit, invink_generator

    m, bb = spec.mechanism, spec.blackbox
    with _invink_model_dir(bb.model_path) as path:  # a temporary "tiny" model is removed on every path
        scores = list(bb.scores)
        if "tokens" in scores:  # the public tokenizer of the audited model counts output tokens
            from transformers import AutoTokenizer

            from invink_audit.audit.blackbox import token_count

            scores[scores.index("tokens")] = token_count(AutoTokenizer.from_pretrained(path))
        gen = invink_generator(
            str(path), batch_size=m.batch_size, dataset_desc=bb.dataset_desc, epsilon=float(m.epsilon), delta=m.delta,
            **bb.invink_kwargs,
        )
        if bb.num_batches is not None:
            return _run_batched(spec, refs, float(m.epsilon), lambda batches: [gen(b) for b in batches], None,
                                "reference package invink 0.1.0", scores=tuple(scores))
        return blackbox_audit(
            gen, refs, bb.canary, claimed_epsilon=float(m.epsilon), claimed_delta=m.delta,
            num_trials=bb.num_trials, significance=bb.significance, scores=tuple(scores),
            mechanism="reference package invink 0.1.0", progress=progress,
        )


def _run_augpe_histogram(a: AugPEHistogramSpec, seed: int | None):
    """The batched canary audit of AugPE's histogram releases on the worst-case canary, the noise seeded by ``seed``
    and the coins by ``seed + 1`` (OS entropy for both when ``None``); the exact check of the same embeddings, the
    canary's exact true ε and the claim go into the report's notes, beside (not into) its black-box verdict."""
    import time

    import numpy as np

    from invink_audit.augpe.audit import HistogramTarget, exact_histogram_check, histogram_canary_audit

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
    from invink_audit.augpe.audit import true_epsilon

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
