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
    per call).

Canary and data slots: the B references are the canaries in their slots and data references (in
file order from ``offset``, a data-independent choice) everywhere else.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Union

from accounting import Accountant, as_accountant
from invink_audit.audit.whitebox import Direction, WhiteBoxConfig

if TYPE_CHECKING:
    from invink_audit.audit.report import BlackBoxReport, WhiteBoxReport
    from invink_audit.audit.selftest import SelfTestResult

__all__ = [
    "AuditSpec", "BlackBoxSpec", "MechanismSpec", "ModelSpec", "PromptSpec", "SpecResult", "load_spec",
    "mechanism_from_section", "run_spec", "yelp_dir",
]

KINDS = ("selftest", "white-box", "black-box")
_SECTIONS = {"name", "kind", "description", "model", "prompt", "data", "mechanism", "canaries", "audit", "selftest", "target", "blackbox", "seed"}


def yelp_dir() -> Path:
    """The Yelp data directory: ``$INVINK_YELP_DIR`` or ``../shared/data/yelp`` beside the repository."""
    env = os.environ.get("INVINK_YELP_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data" / "yelp"


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
        return cls(section.get("name", "embedded"), section.get("gguf_file"), section.get("device"), section.get("dtype"),
                   section.get("max_batch_rows"))

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
        return cls(section.get("preset", "generic"), section.get("fields"))


@dataclasses.dataclass(frozen=True)
class MechanismSpec:
    """``[mechanism]``, as written (values are converted where they are used); ``section`` is the table
    itself, for :func:`mechanism_from_section`."""

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
        batch_size = int(mech.get("batch_size", 0))
        if batch_size < 1:
            raise ValueError(f"[mechanism] batch_size must be an integer >= 1; got {mech.get('batch_size')!r}")
        return cls(
            str(mech.get("kind", "invisibleink")), batch_size, mech.get("max_new_tokens"), float(mech.get("delta", 1e-6)),
            float(mech.get("temperature", 1.0)), mech.get("top_k"), mech.get("clip_norm"), mech.get("epsilon"),
            as_accountant(mech.get("accountant", Accountant.BR_ADAPTIVE.value)), mech,
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

    @classmethod
    def from_sections(cls, target: dict, bb: dict) -> BlackBoxSpec:
        from invink_audit.audit.blackbox import DEFAULT_SCORES

        return cls(
            target.get("kind", "engine"), target.get("model_path"), str(target.get("dataset_desc", "short texts")),
            int(target.get("spare_references", 0)),
            str(bb.get("canary", "My name is Zelphine Quorrick and my card number is 4929 7310 5528 1746.")),
            int(bb.get("num_trials", 200)), float(bb.get("significance", 0.05)), tuple(bb.get("scores", DEFAULT_SCORES)),
            dict(bb.get("invink_kwargs", {})),
        )


@dataclasses.dataclass(frozen=True)
class AuditSpec:
    """A parsed, validated audit specification: ``raw`` is the TOML table; the typed sections are parsed
    from it at construction (``selftest``: the self-test's settings; ``model``, ``prompt``,
    ``mechanism``, and ``audit`` (white-box) or ``blackbox`` (black-box) for a model audit)."""

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
    seed: int | None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        object.__setattr__(self, "seed", self.raw.get("seed"))
        if self.kind == "selftest":
            from invink_audit.audit.selftest import SelfTestSettings

            section = self.section("selftest")
            if "alphas" in section:
                section = {**section, "alphas": tuple(float(a) for a in section["alphas"])}
            object.__setattr__(self, "selftest", SelfTestSettings(**section))
            return
        mechanism = MechanismSpec.from_section(self.section("mechanism"))
        object.__setattr__(self, "model", ModelSpec.from_section(self.section("model")))
        object.__setattr__(self, "prompt", PromptSpec.from_section(self.section("prompt")))
        object.__setattr__(self, "mechanism", mechanism)
        if self.kind == "white-box":
            object.__setattr__(self, "audit", _whitebox_config(self.section("audit"), mechanism.batch_size))
        else:
            object.__setattr__(self, "blackbox", BlackBoxSpec.from_sections(self.section("target"), self.section("blackbox")))

    def section(self, name: str) -> dict:
        value = self.raw.get(name, {})
        if not isinstance(value, dict):
            raise ValueError(f"[{name}] must be a table; got {value!r}")
        return value


def load_spec(path: str | os.PathLike) -> AuditSpec:
    """Read and validate a TOML audit spec."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"audit spec not found: {str(p)!r}")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{str(p)!r} is not valid TOML: {err}") from err
    return parse_spec(raw, path=p)


def parse_spec(raw: dict, *, path: Path | None = None) -> AuditSpec:
    unknown = set(raw) - _SECTIONS
    if unknown:
        raise ValueError(f"unknown keys in audit spec: {sorted(unknown)}; allowed: {sorted(_SECTIONS)}")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}; got {kind!r}")
    name = raw.get("name") or (path.stem if path else kind)
    return AuditSpec(str(name), kind, raw, path)


def _whitebox_config(section: dict, batch_size: int) -> WhiteBoxConfig:
    allowed = {"alphas", "num_samples", "num_is_samples", "neighbours", "directions", "significance", "delta_grid", "min_samples"}
    unknown = set(section) - allowed
    if unknown:
        raise ValueError(f"unknown keys in [audit]: {sorted(unknown)}; allowed: {sorted(allowed)}")
    kwargs = dict(section)
    nb = kwargs.get("neighbours", "all")
    kwargs["neighbours"] = None if nb == "all" else tuple(int(j) for j in nb)
    if "directions" in kwargs:
        kwargs["directions"] = tuple(Direction(d) for d in kwargs["directions"])
    for key in ("alphas", "delta_grid"):
        if key in kwargs:
            kwargs[key] = tuple(float(x) for x in kwargs[key])
    config = WhiteBoxConfig(**kwargs)
    config.audited_neighbours(batch_size)
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
            raise ValueError(f"Yelp data not found at {str(file)!r}; set INVINK_YELP_DIR")
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
            raise ValueError(f"canary slot {slot} out of range for batch_size={batch_size}")
        if slot in slots:
            raise ValueError(f"two canaries in slot {slot}")
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


_MECHANISM_KINDS = ("invisibleink", "amin", "adapmixed")


def mechanism_from_section(mech: dict, batch_size: int):
    """The :class:`~invink_audit.mechanisms.Mechanism` a ``[mechanism]`` section names (``None``: InvisibleInk,
    audited on the engine's own path from ``clip_norm``/``epsilon``)."""
    kind = str(mech.get("kind", "invisibleink"))
    if kind not in _MECHANISM_KINDS:
        raise ValueError(f"[mechanism] kind must be one of {_MECHANISM_KINDS}; got {kind!r}")
    if kind == "invisibleink":
        return None
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism, plan_amin

    common = {"kind", "batch_size", "max_new_tokens", "delta"}
    if kind == "amin":
        fields = {"epsilon", "clip_norm", "temperature", "public_temperature", "svt_threshold", "svt_noise",
                  "max_private_tokens", "sensitivity", "posterior_grid"}
        unknown = set(mech) - common - fields
        if unknown:
            raise ValueError(f"unknown keys in [mechanism] for kind 'amin': {sorted(unknown)}")
        kwargs = {k: mech[k] for k in fields - {"epsilon", "clip_norm"} if k in mech}
        for k in ("temperature", "public_temperature", "svt_threshold", "svt_noise"):
            if k in kwargs:
                kwargs[k] = float(kwargs[k])
        if (mech.get("epsilon") is None) == (mech.get("clip_norm") is None):
            raise ValueError("[mechanism] kind 'amin' needs exactly one of epsilon and clip_norm")
        if mech.get("clip_norm") is None:
            acc = plan_amin(
                epsilon=float(mech["epsilon"]), delta=float(mech.get("delta", 1e-6)),
                max_private_tokens=int(mech.get("max_private_tokens", 100)), batch_size=batch_size,
                temperature=float(mech.get("temperature", 1.0)), svt_noise=float(mech.get("svt_noise", 0.3)),
                sensitivity=mech.get("sensitivity", "replace-by-null"),
            )
            kwargs["clip_norm"] = acc.clip_norm
        else:
            kwargs["clip_norm"] = float(mech["clip_norm"])
        return AminMechanism(AminConfig(batch_size=batch_size, **kwargs))
    fields = {f.name for f in dataclasses.fields(AdaPMixEDConfig)} - {"batch_size", "delta"}
    unknown = set(mech) - common - fields
    if unknown:
        raise ValueError(f"unknown keys in [mechanism] for kind 'adapmixed': {sorted(unknown)}")
    kwargs = {k: mech[k] for k in fields if k in mech}
    return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size=batch_size, delta=float(mech.get("delta", 1e-6)), **kwargs))


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


def _invink_model_dir(path) -> str:
    """A local model directory for the reference package: a path, ``"embedded"`` (the cached
    safetensors conversion of the embedded SmolLM2) or ``"tiny"`` (the random tiny test model,
    saved once to a temporary directory)."""
    if not path:
        raise ValueError("[target] kind = 'invink' needs model_path (a directory, 'embedded' or 'tiny')")
    if path == "embedded":
        from invink_audit.models import _cached_gguf_conversion, embedded_gguf_path

        return str(_cached_gguf_conversion(embedded_gguf_path()))
    if path == "tiny":
        import tempfile

        from invink_audit.models import build_tiny_model

        folder = Path(tempfile.mkdtemp(prefix="invink-audit-tiny-"))
        tiny = build_tiny_model()
        tiny.model.save_pretrained(folder)
        tiny.tokenizer.save_pretrained(folder)
        return str(folder)
    if not Path(path).is_dir():
        raise ValueError(f"[target] model_path must be a directory, 'embedded' or 'tiny'; got {path!r}")
    return str(path)


#: what :func:`run_spec` returns, by the spec's kind
SpecResult = Union["WhiteBoxReport", "BlackBoxReport", "SelfTestResult"]


def run_spec(
    spec: AuditSpec,
    *,
    seed: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    status: Callable[[str], None] | None = None,
) -> SpecResult:
    """Run a spec; returns a :class:`~invink_audit.audit.report.WhiteBoxReport` (white-box), a
    :class:`~invink_audit.audit.report.BlackBoxReport` (black-box) or a
    :class:`~invink_audit.audit.selftest.SelfTestResult` (selftest)."""
    if spec.kind == "selftest":
        from invink_audit.audit.selftest import run_selftest

        return run_selftest(spec.selftest, generator=_generator(spec, seed), progress=status)
    if spec.kind == "white-box":
        return _run_whitebox(spec, seed, progress)
    return _run_blackbox(spec, seed, progress)


def _model_audit_settings(spec: AuditSpec):
    """The :class:`~invink_audit.audit.model_audit.ModelAuditSettings` of a white-box spec's ``[mechanism]``."""
    from invink_audit.audit.model_audit import ModelAuditSettings

    m = spec.mechanism
    generic = mechanism_from_section(m.section, m.batch_size)
    if generic is not None:
        return ModelAuditSettings(max_new_tokens=m.tokens, delta=m.delta, mechanism=generic)
    return ModelAuditSettings(
        max_new_tokens=m.tokens,
        temperature=m.temperature,
        top_k=m.top_k,
        clip_norm=m.clip_norm,
        epsilon=m.epsilon,
        delta=m.delta,
        accountant=m.accountant,
    )


def _run_whitebox(spec: AuditSpec, seed, progress):
    from invink_audit.audit.model_audit import audit_model
    from invink_audit.models import load_model

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
    refs, _, _ = _batch(spec, spec.mechanism.batch_size + bb.spare_references)
    if bb.target == "engine":
        return _run_engine_target(spec, refs, seed, progress)
    if bb.target == "invink":
        return _run_invink_target(spec, refs, progress)
    raise ValueError(f"[target] kind must be 'engine' or 'invink'; got {bb.target!r}")


def _run_engine_target(spec: AuditSpec, refs, seed, progress):
    """Black-box audit of our engine: the clip norm given (its ε reported) or planned for ε."""
    from accounting import epsilon_for_clip_norm, plan_clip_norm
    from invink_audit.audit.blackbox import blackbox_audit, engine_generator

    m, bb = spec.mechanism, spec.blackbox
    T, tau, epsilon = m.tokens, m.temperature, m.epsilon
    if m.clip_norm is not None:
        clip_norm = float(m.clip_norm)
        epsilon = epsilon_for_clip_norm(
            clip_norm=clip_norm, max_new_tokens=T, batch_size=m.batch_size, temperature=tau, delta=m.delta
        ).epsilon
    else:
        clip_norm = plan_clip_norm(epsilon=epsilon, delta=m.delta, max_new_tokens=T, batch_size=m.batch_size, temperature=tau).clip_norm
    many = engine_generator(
        model=spec.model.model,
        clip_norm=clip_norm, temperature=tau, top_k=m.top_k, batch_size=m.batch_size, max_new_tokens=T,
        prompt=spec.prompt.preset, prompt_fields=spec.prompt.fields,
        generator=_generator(spec, seed, device=_device_of(spec.section("model"))),
    )
    return blackbox_audit(
        None, refs, bb.canary, claimed_epsilon=float(epsilon), claimed_delta=m.delta, generate_many=many,
        num_trials=bb.num_trials, significance=bb.significance, scores=bb.scores,
        mechanism=f"InvisibleInk engine ({spec.model.name})", progress=progress,
    )


def _run_invink_target(spec: AuditSpec, refs, progress):
    """Black-box audit of the reference package ``invink`` (the audited model's tokenizer counts tokens)."""
    from invink_audit.audit.blackbox import blackbox_audit, invink_generator

    m, bb = spec.mechanism, spec.blackbox
    path = _invink_model_dir(bb.model_path)
    scores = list(bb.scores)
    if "tokens" in scores:  # the public tokenizer of the audited model counts output tokens
        from transformers import AutoTokenizer

        from invink_audit.audit.blackbox import token_count

        scores[scores.index("tokens")] = token_count(AutoTokenizer.from_pretrained(path))
    gen = invink_generator(
        str(path), batch_size=m.batch_size, dataset_desc=bb.dataset_desc, epsilon=float(m.epsilon), delta=m.delta,
        **bb.invink_kwargs,
    )
    return blackbox_audit(
        gen, refs, bb.canary, claimed_epsilon=float(m.epsilon), claimed_delta=m.delta,
        num_trials=bb.num_trials, significance=bb.significance, scores=tuple(scores),
        mechanism="reference package invink 0.1.0", progress=progress,
    )
