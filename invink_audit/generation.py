r"""Private synthetic text generation: references in, DP texts and their a-priori guarantee out.

:func:`generate` runs paper Algorithm 1 over a partition (Corollary 11, coro:parallel-batches) for any
:class:`~invink_audit.mechanisms.Mechanism` (:class:`ReleaseConfig`; InvisibleInk's by :func:`GenerationConfig`):
one text per disjoint batch of ``B`` references, texts of at most ``T`` tokens composing in parallel, so the run
costs one text's guarantee. The steps (check, charge once, generate keyed by batch, resume), the files next to the
output, the master key and its per-batch streams, torchrun and Ray: docs/design/release-protocol.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import secrets
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from accounting import Accountant, BudgetExceededError, BudgetLedger, LedgerError, as_accountant, epsilon_for_clip_norm
from accounting.accountants import DEFAULT_ACCOUNTANT
from accounting.ledger import unit_phrase
from accounting.limits import RANGES, check_count
from invink_audit.data import (
    LabelledReferences,
    Partition,
    PrivacyUnit,
    ReferencesFile,
    UnitReferences,
    as_references,
    labelled_partition,
    partition_references,
    unit_partition,
)
from invink_audit.distributed import (
    Cluster,
    RankFailure,
    ReleaseIncompleteError,
    assign_batches,
    current_cluster,
    request_cost,
)
from invink_audit.engine import Engine, GeneratedText
from invink_audit.mechanism import (
    DEFAULT_TOP_K,
    MechanismConfig,
    SeededGeneratorWarning,
    check_seed,
    derive_key,
    make_generator,
)
from invink_audit.mechanisms import InvisibleInk, Mechanism, MechanismGuarantee
from invink_audit.outputs import (
    Journal,
    OutputInUseError,
    OutputState,
    RecordSink,
    check_run,
    clear_pending,
    pending_release_id,
    inspect_output,
    merge_shards,
    output_lock,
    read_generation_output,
    release_texts,
    shard_path,
    start_output,
)
from invink_audit.model_sizes import looks_like_path
from invink_audit.models import (
    DEFAULT_GENERATOR,
    EMBEDDED_ALIASES,
    DtypeChoice,
    LoadedModel,
    follow_dtype,
    load_model,
    model_fingerprint,
    resolve_device,
    resolve_dtype,
)
from invink_audit.prompts import (
    PromptTemplate,
    TextRequest,
    encode_prompt,
    encode_request,
    get_preset,
    label_fields_for,
    refuse_private_in_public,
    require_label_fields,
    template_for_batch,
    template_for_labels,
    template_for_model,
)

__all__ = [
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_K",
    "GeneratedText",
    "GenerationConfig",
    "GenerationHooks",
    "GenerationResult",
    "ModelSpec",
    "PromptSpec",
    "OutputInUseError",
    "ExternalRelease",
    "ProcessStats",
    "ReleaseConfig",
    "ReleaseIncompleteError",
    "SEEDED_VOID_REASON",
    "charge_release",
    "generate",
    "input_fingerprint",
    "prepare_release",
    "read_generation_output",
]

_LOG = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0
_RECORD_VERSION = 1
#: Why a seeded run's guarantee is void; written as ``guarantee_void_reason`` next to ``guarantee: null``.
SEEDED_VOID_REASON = "seeded: a fixed seed makes the texts reproducible, so they carry no privacy guarantee"


# --------------------------------------------------------------------------------------------
# configuration and results


def _check_options(num_texts, num_texts_per_group, allow_all_null) -> None:
    """Check the options every release takes, whatever its mechanism."""
    for name, value in (("num_texts", num_texts), ("num_texts_per_group", num_texts_per_group)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None; got {value!r}")
    if not isinstance(allow_all_null, bool):
        raise ValueError(f"allow_all_null must be a bool; got {allow_all_null!r}")


@dataclasses.dataclass(frozen=True)
class ReleaseConfig:
    """The public parameters of a release through :func:`generate`: one text per disjoint batch of
    ``mechanism.batch_size`` references (paper Corollary 11), from any :class:`~invink_audit.mechanisms.Mechanism`:
    InvisibleInk (:func:`GenerationConfig`), the paper's baselines (Amin et al. 2024, AdaPMixED) or yours.

    ``max_new_tokens`` (T) and ``delta`` fix the release's guarantee (:meth:`guarantee`, the mechanism's). An
    a-priori guarantee is charged to a ledger (:meth:`event`); a data-dependent one (AdaPMixED's stop rule) is
    refused with a ledger: its spend is not a guarantee a ledger can compose. ``num_texts=None`` generates one text
    per full batch; with labelled references give ``num_texts_per_group`` instead. ``allow_all_null``: generate
    even when every reference to be used is empty (public-only texts that still charge the ledger).

    Valid ranges: ``max_new_tokens``, ``num_texts``, ``num_texts_per_group``: integers >= 1 (the last two also
    ``None``; ``num_texts`` at most the number of full batches); ``delta`` in (0, 1).
    """

    mechanism: Mechanism
    max_new_tokens: int
    delta: float
    num_texts: int | None = None
    num_texts_per_group: int | None = None
    allow_all_null: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mechanism, Mechanism):
            raise ValueError(f"mechanism must be an invink_audit.mechanisms.Mechanism; got {type(self.mechanism).__name__}")
        object.__setattr__(self, "max_new_tokens", check_count("max_new_tokens", self.max_new_tokens))
        object.__setattr__(self, "delta", RANGES["delta"].check("delta", self.delta))
        _check_options(self.num_texts, self.num_texts_per_group, self.allow_all_null)
        guarantee = self.mechanism.release_guarantee(self.max_new_tokens, self.delta)
        object.__setattr__(self, "_guarantee", guarantee)

    @property
    def batch_size(self) -> int:
        return self.mechanism.batch_size

    def guarantee(self) -> MechanismGuarantee:
        """The mechanism's guarantee for texts of at most T tokens at δ (one per disjoint batch: the release's)."""
        return self._guarantee

    def event(self, unit: PrivacyUnit | None = None):
        """The privacy event a ledger is charged, once, before anything is generated (the mechanism's
        :meth:`~invink_audit.mechanisms.Mechanism.ledger_event`: InvisibleInk's :class:`accounting.GenerationEvent`,
        another's a-priori zCDP; a data-dependent guarantee has none, ``ValueError``). Per privacy ``unit``: the
        event of its ``unit_contributions`` texts (:mod:`accounting.events`)."""
        event = self.mechanism.ledger_event(self._guarantee)
        return event if unit is None else dataclasses.replace(event, unit_contributions=unit.unit_contributions)

    def unit_guarantee(self, unit: PrivacyUnit | None) -> MechanismGuarantee:
        """The release's guarantee for one privacy ``unit``: :meth:`guarantee` when each unit has one slot (rules
        combine and first: replacing the unit by null is replacing one slot by null); under rule spread, the k
        texts one unit may touch composed (:meth:`event`'s ε at δ by the mechanism's accountant; zCDP k·ρ). A
        data-dependent guarantee cannot be composed so: ``ValueError``."""
        if unit is None or unit.unit_contributions == 1:
            return self._guarantee
        if not self._guarantee.a_priori:
            raise ValueError(f"{self.mechanism.name}'s guarantee is data-dependent: it cannot be composed over the "
                             f"{unit.unit_contributions} texts one unit touches under rule 'spread'; use 'combine' or 'first'")
        event = self.event(unit)
        epsilon = event.epsilon(self.delta, self._guarantee.details.get("accountant", DEFAULT_ACCOUNTANT))
        return dataclasses.replace(
            self._guarantee, epsilon=epsilon, rho_sequence=event.rho_sequence,
            description=f"{self._guarantee.description}; per unit: {unit.unit_contributions} texts composed".lstrip("; "),
        )  # fmt: skip

    def run_parameters(self) -> dict:
        """The mechanism's public parameters as the records' ``run`` holds them (compared on resume;
        :meth:`~invink_audit.mechanisms.Mechanism.release_settings`)."""
        return self.mechanism.release_settings(self._guarantee)


def GenerationConfig(  # noqa: N802 - a constructor of the one release config, under the name InvisibleInk's had
    batch_size: int,
    max_new_tokens: int,
    delta: float,
    epsilon: float | None = None,
    clip_norm: float | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int | None = DEFAULT_TOP_K,
    accountant: Accountant | str = Accountant.BR_ADAPTIVE,
    num_texts: int | None = None,
    num_texts_per_group: int | None = None,
    allow_all_null: bool = False,
    unit_contributions: int = 1,
) -> ReleaseConfig:
    """InvisibleInk's :class:`ReleaseConfig`: B, T and δ, the budget as ``epsilon`` (the clip norm is planned,
    :meth:`~invink_audit.mechanisms.InvisibleInk.planned`) or as ``clip_norm`` (its ε is what the accountant
    certifies), τ, ``top_k`` (``None``: the full vocabulary), the accountant, and the release options of
    :class:`ReleaseConfig`. ``unit_contributions`` k > 1 (a privacy unit under rule spread touches k texts):
    ``epsilon`` is the unit's, the clip norm planned for k·T composed steps.

    Valid ranges: ``batch_size``, ``max_new_tokens``, ``top_k``: integers >= 1; ``epsilon``, ``clip_norm``,
    ``temperature``: finite and > 0; the rest as :class:`ReleaseConfig`'s.
    """
    for name, value in (("batch_size", batch_size), ("max_new_tokens", max_new_tokens)):
        check_count(name, value)  # the planner's message would name another range
    if (epsilon is None) == (clip_norm is None):
        raise ValueError(
            f"give exactly one of epsilon (plan the clip norm) and clip_norm (report epsilon); got "
            f"epsilon={epsilon!r}, clip_norm={clip_norm!r}"
        )
    common = dict(delta=delta, max_new_tokens=max_new_tokens, batch_size=batch_size, temperature=temperature,
                  accountant=as_accountant(accountant))  # fmt: skip
    if epsilon is not None:
        mechanism = InvisibleInk.planned(epsilon=epsilon, top_k=top_k, unit_contributions=unit_contributions, **common)
    else:  # the planner's checks of C, B, T, δ and τ, and its event
        plan = epsilon_for_clip_norm(clip_norm=clip_norm, **common)
        mechanism = InvisibleInk(MechanismConfig.from_event(plan.event, top_k=top_k), accountant=plan.accountant)
    return ReleaseConfig(mechanism, max_new_tokens, delta, num_texts, num_texts_per_group, allow_all_null)


@dataclasses.dataclass(frozen=True)
class ProcessStats:
    """What one process of a run generated: ``texts`` and ``tokens`` in ``seconds`` on ``device``."""

    rank: int
    device: str
    texts: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else math.nan


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """The texts of a run (sorted by batch), its guarantee (the mechanism's), and what was measured.

    ``num_resumed`` texts were read back from an earlier output; ``tokens_generated`` and ``seconds`` measure
    this call only (the slowest process). ``seeded`` runs carry no privacy (``guarantee.void_reason``). On
    rank 0 ``texts`` is the whole release, elsewhere that rank's texts; ``processes``: per-rank figures (rank 0).
    """

    texts: tuple[GeneratedText, ...]
    guarantee: MechanismGuarantee
    release_id: str
    model: str
    prompt: str
    num_references: int
    num_batches: int
    num_unused_references: int
    num_resumed: int
    tokens_generated: int
    seconds: float
    seeded: bool
    output: str | None = None
    rank: int = 0
    processes: tuple[ProcessStats, ...] = ()
    #: what the release was, so that an audit of it derives nothing: the mechanism, the prompt template
    #: (each batch's, with its labels placed by ``label_fields``) and the partition
    mechanism: Mechanism | None = None
    template: PromptTemplate | None = None
    partition: Partition | None = None
    labels: tuple[Mapping[str, str], ...] | None = None
    label_fields: Mapping[str, str] | None = None
    #: the dtype the model ran in and why (:class:`~invink_audit.models.DtypeChoice`; each record has it
    #: too, as ``model_dtype``)
    dtype_choice: DtypeChoice | None = None
    #: the unit the guarantee protects (``None``: one reference); ``partition.units`` holds each slot's unit
    privacy_unit: PrivacyUnit | None = None

    def batch_template(self, index: int) -> PromptTemplate:
        """The prompt batch ``index`` was generated with (its labels filled in, when label-conditioned)."""
        if self.template is None:
            raise ValueError("this result records no prompt template")
        return template_for_batch(self.template, self.labels, self.label_fields, index)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else math.nan


# --------------------------------------------------------------------------------------------
# records


def input_fingerprint(partition: Partition, labels: Sequence[Mapping[str, str]] | None = None) -> str:
    """The fingerprint of a release's input as its state file records it (``input_sha256``): the batches'
    references in order (length-prefixed UTF-8), B, the number of references, and each batch's labels."""
    digest = hashlib.sha256()
    digest.update(json.dumps([partition.batch_size, partition.num_references]).encode())
    for batch in partition.batches:
        for reference in batch:
            encoded = reference.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
    if labels is not None:  # a label-conditioned release: each batch's labels are part of its input
        digest.update(json.dumps([dict(sorted(m.items())) for m in labels], ensure_ascii=False).encode())
    return digest.hexdigest()


def _record(
    text: GeneratedText, guarantee: MechanismGuarantee, release_id: str, run: dict, template: PromptTemplate, *, model_dtype: dict
) -> dict:
    """One output record. ``run``: the release-wide settings (compared on resume; ``run["prompt"]`` is the
    template before any batch's labels fill it); ``template``: this batch's prompt, its public fields written
    as ``prompt_fields`` (older records lack them and still resume); ``model_dtype``: the dtype this process's
    model ran in and why (outside ``run``: a release may resume in another dtype)."""
    return {
        "batch_index": text.batch_index,
        "text": text.text,
        "num_tokens": text.num_tokens,
        "finish_reason": text.finish_reason,
        "topk_plus_size_mean": text.topk_plus_size_mean,
        "topk_plus_size_std": text.topk_plus_size_std,
        "expansion_tokens": text.expansion_tokens,
        "token_ids": list(text.token_ids),
        **({"modes": list(text.modes)} if text.modes else {}),  # a mechanism with several modes (Amin et al.)
        **({} if text.labels is None else {"labels": dict(text.labels)}),
        "prompt_fields": dict(template.fields),
        "model_dtype": model_dtype,
        **guarantee.record_fields(),
        **({"guarantee_protects": unit_phrase(run["privacy_unit"]["column"])} if "privacy_unit" in run else {}),
        "release_id": release_id,
        "run": run,
        "version": _RECORD_VERSION,
    }


def _from_record(record: dict) -> GeneratedText:
    return GeneratedText(
        key=int(record["batch_index"]),
        text=record["text"],
        token_ids=tuple(record["token_ids"]),
        finish_reason=record["finish_reason"],
        topk_plus_size_mean=float(record["topk_plus_size_mean"]),
        topk_plus_size_std=float(record["topk_plus_size_std"]),
        expansion_tokens=int(record["expansion_tokens"]),
        labels=record.get("labels"),
        modes=tuple(int(m) for m in record.get("modes", ())),
    )


# --------------------------------------------------------------------------------------------
# validation before anything is loaded or charged


def _check_output_path(output) -> Path | None:
    if output is None:
        return None
    if not isinstance(output, (str, os.PathLike)) or not isinstance(os.fspath(output), str):
        raise ValueError(f"output must be a file path (str or os.PathLike) or None; got {type(output).__name__}")
    text = os.fspath(output)
    if not text.strip():
        raise ValueError("output must name a .jsonl file; got an empty path")
    path = Path(text)
    if path.name in ("", ".", "..") or text.endswith(("/", os.sep)):
        raise ValueError(f"output must name a file, not a directory; got {text!r}")
    if path.is_dir():
        raise ValueError(f"output {text!r} is a directory; give a file path inside it, e.g. {str(path / 'texts.jsonl')!r}")
    if path.exists() and not path.is_file():
        raise ValueError(f"output {text!r} exists and is not a regular file")
    for parent in path.resolve().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"output {text!r}: {str(parent)!r} is not a directory")
            break
    return path


def _check_model_source(model, gguf_file, device, dtype) -> None:
    """Check the model argument, device and dtype without loading anything."""
    if isinstance(model, LoadedModel):
        return
    resolve_dtype(dtype, resolve_device(device))
    if gguf_file is not None and (not isinstance(gguf_file, str) or not gguf_file.strip()):
        raise ValueError(f"gguf_file must be a non-empty file name or None; got {gguf_file!r}")
    if model is None:
        return
    if not isinstance(model, (str, os.PathLike)) or not str(os.fspath(model)).strip():
        raise ValueError(f"model must be a non-empty path or hub id, a LoadedModel, or None for the default; got {model!r}")
    text = str(os.fspath(model))
    if isinstance(model, str) and text.lower() in EMBEDDED_ALIASES:
        return
    path = Path(text).expanduser()
    if gguf_file is not None:
        if not path.is_dir():
            raise ValueError(f"model directory {text!r} does not exist (gguf_file needs a local directory)")
        if not (path / gguf_file).is_file():
            raise ValueError(f"GGUF file {gguf_file!r} not found in model directory {text!r}")
        return
    if path.exists():
        return
    if isinstance(model, os.PathLike) or looks_like_path(text):
        kind = "GGUF file" if text.lower().endswith(".gguf") else "model directory"
        raise ValueError(f"{kind} {text!r} does not exist")


def _load(model, gguf_file, device, dtype) -> LoadedModel:
    try:
        return load_model(model, gguf_file=gguf_file, device=device, dtype=dtype)
    except OSError as err:
        if isinstance(model, str) and not Path(model).expanduser().exists():
            offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
            raise ValueError(
                f"model {model!r}: no local directory or file of that name exists, and it could not be loaded as a "
                f"Hugging Face hub id{' (HF_HUB_OFFLINE is set: only cached hub models load)' if offline else ''}"
            ) from err
        raise


def _check_context(
    loaded: LoadedModel,
    template: PromptTemplate,
    requests: Sequence[TextRequest],
    batch_size: int,
    max_new_tokens: int,
    position: Callable[[int, int], int] | None = None,
) -> None:
    """Refuse, before any decoding, prompts that do not fit the model's positions with T new tokens; names
    the reference's position in the input (``position(batch, slot)``; default ``batch·B + slot``), never its text."""
    positions = loaded.context_length
    if positions is None or not requests:
        return
    room = positions - max_new_tokens
    public = max(len(request.public_ids) for request in requests)
    if room < public:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} does not fit the model: it has {positions} positions and the public "
            f"prompt alone takes {public} tokens"
        )
    position = position or (lambda batch, slot: batch * batch_size + slot)
    too_long = [
        (position(int(request.key), slot), int(request.key), len(ids))
        for request in requests
        for slot, ids in enumerate(request.private_ids)
        if ids is not None and len(ids) > room
    ]
    if too_long:
        index, batch, length = too_long[0]
        overhead = len(encode_prompt(loaded.tokenizer, template, "x")) - 1
        raise ValueError(
            f"reference {index} (0-based, in input order; batch {batch}) is too long for the model: "
            f"its prompt is {length} tokens, but the model has {positions} positions, so with max_new_tokens="
            f"{max_new_tokens} a prompt may take at most {room} tokens (the prompt template takes about {overhead}, "
            f"leaving about {room - overhead} for a reference); {len(too_long)} reference(s) are too long in all. "
            "Nothing was charged. Truncate every reference to one fixed token count before generating (a rule "
            "that does not depend on the data), or lower max_new_tokens."
        )


# --------------------------------------------------------------------------------------------
# the run


def generate(
    references: Sequence[str | None] | str | os.PathLike | ReferencesFile | LabelledReferences,
    config: ReleaseConfig,
    *,
    model: str | os.PathLike | LoadedModel | ModelSpec | None = None,
    prompt: str | PromptTemplate | PromptSpec = "generic",
    output: str | os.PathLike | None = None,
    ledger=None,
    seed: int | None = None,
    hooks: GenerationHooks | None = None,
) -> GenerationResult:
    """Generate one DP synthetic text per disjoint batch of ``config.batch_size`` references.

    ``references``: a list of strings (``""``/``None`` are nulls), a ``.csv`` / ``.jsonl`` path (field ``text``),
    a :class:`~invink_audit.data.ReferencesFile` (another column, ``label_columns``, a privacy unit) or
    :class:`~invink_audit.data.LabelledReferences` (batched within their label group; their labels, public
    attributes of each slot, fill the prompt's fields). ``config``: :class:`ReleaseConfig` (InvisibleInk's:
    :func:`GenerationConfig`). ``model``: a path or name, a loaded model or a :class:`ModelSpec` (default
    :data:`~invink_audit.models.DEFAULT_GENERATOR`). ``prompt``: a preset name, a
    :class:`~invink_audit.prompts.PromptTemplate` or a :class:`PromptSpec`; a preset's label-describing fields
    left at their example values are refused (:func:`~invink_audit.prompts.defaulted_label_fields`). ``output``:
    JSON Lines, written as texts finish and resumed when it exists. ``ledger``: an :class:`accounting.BudgetLedger`
    or its path, charged once, after every check and before any decoding (a data-dependent guarantee is refused,
    :meth:`ReleaseConfig.event`). ``seed``: ``None`` (OS entropy, the private default) or a
    fixed seed, which warns and voids the guarantee (:data:`SEEDED_VOID_REASON`). ``hooks``: :class:`GenerationHooks`.

    Anything invalid raises ``ValueError`` before the model is loaded (the context check: after loading, before
    the ledger is charged). Labels, prompts, the output's files and resuming: docs/guide/generating.md.
    """
    return prepare_release(references, config, model=model, prompt=prompt, output=output, ledger=ledger, seed=seed,
                           hooks=hooks).run()


def prepare_release(
    references,
    config: ReleaseConfig,
    *,
    model=None,
    prompt="generic",
    output=None,
    ledger=None,
    seed: int | None = None,
    hooks: GenerationHooks | None = None,
) -> _Release:
    """Every check that needs no model, then the release to run; the arguments are :func:`generate`'s."""
    if not isinstance(config, ReleaseConfig):
        raise ValueError(f"config must be a ReleaseConfig (GenerationConfig builds InvisibleInk's); got {type(config).__name__}")
    check_seed(seed)
    hooks = GenerationHooks() if hooks is None else hooks
    if not isinstance(hooks, GenerationHooks):
        raise ValueError(f"hooks must be GenerationHooks or None; got {type(hooks).__name__}")
    load = model if isinstance(model, ModelSpec) else ModelSpec(model)
    prompt = prompt if isinstance(prompt, PromptSpec) else PromptSpec(prompt)
    output_path = _check_output_path(output)
    ledger = BudgetLedger.of(ledger)
    template = prompt.resolved()
    partition, labels, positions, filled, unit = _partition(references, config, template, prompt.label_fields)
    require_label_fields(template, given=tuple(prompt.fields or ()), filled=filled)
    if not config.allow_all_null:
        _refuse_all_null(partition, config.batch_size)
    if ledger is not None:
        config.event(unit)  # a guarantee no ledger can compose (data-dependent) is refused now
    guarantee = config.unit_guarantee(unit)
    fingerprint = input_fingerprint(partition, labels)
    if seed is not None:
        guarantee = dataclasses.replace(guarantee, void_reason=SEEDED_VOID_REASON)
        warnings.warn(
            f"generating with a fixed seed ({seed}): the output is reproducible and carries no privacy guarantee",
            SeededGeneratorWarning,
            stacklevel=3,
        )
    return _Release(
        config=config, guarantee=guarantee, partition=partition, template=template,
        fingerprint=fingerprint, seed=seed, output=output_path, ledger=ledger, cluster=current_cluster(), load=load,
        hooks=hooks, labels=labels, label_fields=None if prompt.label_fields is None else dict(prompt.label_fields),
        positions=positions, privacy_unit=unit,
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GenerationHooks:
    """Progress hooks of a release: ``on_tokens(n)`` after every step with the tokens drawn, ``on_text(text)``
    for each released :class:`GeneratedText`, ``on_start(num_texts)`` once per process before decoding, with
    the number of texts it will generate, each of at most T tokens (what a progress bar's total needs)."""

    on_tokens: Callable[[int], None] | None = None
    on_text: Callable[[GeneratedText], None] | None = None
    on_start: Callable[[int], None] | None = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            hook = getattr(self, field.name)
            if hook is not None and not callable(hook):
                raise ValueError(f"{field.name} must be callable or None; got {type(hook).__name__}")


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """The prompts of a release: ``template`` (a preset name or a :class:`~invink_audit.prompts.PromptTemplate`),
    ``fields`` (values of its public fields) and ``label_fields`` ({label column: prompt field}, for labels
    whose column is not named by the preset's rule or after a field)."""

    template: str | PromptTemplate = "generic"
    fields: Mapping[str, str] | None = None
    label_fields: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        for name in ("fields", "label_fields"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Mapping):
                raise ValueError(f"{name} must be a mapping of names to strings; got {type(value).__name__}")
        self.resolved()  # an unknown preset or field fails here

    def resolved(self) -> PromptTemplate:
        """The template with its field values."""
        return get_preset(self.template, **dict(self.fields or {}))


def _refuse_all_null(partition, batch_size: int) -> None:
    """Refuse a release whose references to be used are all empty (without ``allow_all_null``)."""
    num_batches = len(partition.batches)
    if not any(reference for batch in partition.batches for reference in batch):
        raise ValueError(
            f"all {num_batches * batch_size} references in the {num_batches} batch(es) to generate are empty "
            "(nulls): every text would come from the public prompt alone, and the ledger would still be charged. "
            "Check the input column; pass GenerationConfig(allow_all_null=True) (--allow-all-null) to generate public-only texts anyway"
        )


def _partition(references, config: ReleaseConfig, template: PromptTemplate, label_fields):
    """The batches, each batch's labels (``None`` for unlabelled references), each batch's reference
    positions in the input (``None``: batch ``i`` holds positions ``i·B ..``), the prompt fields the
    labels fill, and the privacy unit (``None``: one reference; else :func:`invink_audit.data.unit_partition`)."""
    references = as_references(references)
    unit = references.privacy_unit if isinstance(references, UnitReferences) else None
    labelled = references.labels if unit is not None else references
    labelled = labelled if isinstance(labelled, LabelledReferences) else None
    refuse_private_in_public(template, references.texts if isinstance(references, (UnitReferences, LabelledReferences))
                             else references)
    if labelled is None:
        for name, value in (("num_texts_per_group", config.num_texts_per_group), ("label_fields", label_fields)):
            if value is not None:
                raise ValueError(f"{name} is only used with labelled references (ReferencesFile with label_columns)")
    elif config.num_texts is not None:
        raise ValueError("with labelled references, give num_texts_per_group (texts per label group), not num_texts")
    # every label reaches the prompt
    rules = () if labelled is None else label_fields_for(template, list(labelled.label_columns), label_fields)
    if unit is not None:
        partition, labels, positions = unit_partition(references, config.batch_size, num_texts=config.num_texts,
                                                      num_texts_per_group=config.num_texts_per_group)  # fmt: skip
    elif labelled is not None:
        partition, labels, positions = labelled_partition(references, config.batch_size,
                                                          num_texts_per_group=config.num_texts_per_group)
    else:
        partition = partition_references(references, config.batch_size, num_texts=config.num_texts)
        labels = positions = None
    for batch_labels in labels or ():  # every group's labels fill the prompt (an empty label is refused here)
        template_for_labels(template, batch_labels, label_fields)
    return partition, labels, positions, tuple(rule.field for rule in rules), unit


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model a release loads and how; every process (and every Ray actor) builds its engine from it.
    ``model``: a path or hub-cache name (default: :data:`~invink_audit.models.DEFAULT_GENERATOR`, Gemma-3-270M,
    prompted with the completion twin of a chat preset: :func:`~invink_audit.prompts.template_for_model`) or a
    loaded model; ``gguf_file``: a GGUF file inside a model directory; ``device`` / ``dtype``: see
    :func:`~invink_audit.models.load_model`; ``max_batch_rows``: forward rows per pass, an integer >= 1 (``None``:
    no limit). Checked without loading anything."""

    model: str | os.PathLike | LoadedModel | None = None
    gguf_file: str | None = None
    device: str | torch.device | None = None
    dtype: str | torch.dtype | None = None
    max_batch_rows: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch_rows is not None and (
            isinstance(self.max_batch_rows, bool) or not isinstance(self.max_batch_rows, int) or self.max_batch_rows < 1
        ):
            raise ValueError(f"max_batch_rows must be an integer >= 1 or None; got {self.max_batch_rows!r}")
        # a DtypeChoice is a decision already made (an external release's workers follow the driver's)
        _check_model_source(self.model, self.gguf_file, self.device, None if isinstance(self.dtype, DtypeChoice) else self.dtype)

    def build(self, mechanism: MechanismConfig, device) -> tuple[LoadedModel, Engine]:
        loaded = _load(DEFAULT_GENERATOR if self.model is None else self.model, self.gguf_file, device, self.dtype)
        return loaded, Engine(loaded, mechanism, max_batch_rows=self.max_batch_rows)


@dataclasses.dataclass(frozen=True)
class _Admission:
    """Rank 0's decision, followed by every process: made after every check passed and the charge.

    ``stream_keys[i]``: the 128-bit key of batch ``i``'s random stream, ``derive_key(master, i)`` for the
    release's master key. Rank 0 holds every batch's; each process receives only its own batches' keys
    (:meth:`for_rank`, :meth:`_Release._hand_out`). The master key never leaves rank 0's ``_admit``, and
    no key is ever written to disk. ``assignment[r]``: the batch indices process ``r`` generates;
    ``attempt`` names this run's shards.
    """

    release_id: str
    run: dict
    attempt: str
    assignment: tuple[tuple[int, ...], ...]
    num_resumed: int
    stream_keys: Mapping[int, int]

    def for_rank(self, rank: int) -> _Admission:
        """What process ``rank`` receives: this decision with the stream keys of its own batches only."""
        return dataclasses.replace(self, stream_keys={i: self.stream_keys[i] for i in self.assignment[rank]})


@dataclasses.dataclass(frozen=True)
class _RankReport:
    """What one process sends rank 0 when its batches are done."""

    stats: ProcessStats
    texts: tuple[GeneratedText, ...]
    dropped: tuple[int, ...]
    failure: RankFailure | None


class _StepReleaser:
    """Releases the texts that finish in one decoding step together: one journal append and one fsync
    for all of them (:func:`invink_audit.outputs.release_texts`), then ``on_text`` for each that won its
    claim. The engine calls ``progress`` after each step and before yielding that step's texts, so a
    call means the previous step's texts are all in."""

    def __init__(self, journal, sink, on_text, on_tokens) -> None:
        self.journal, self.sink, self.on_text, self.on_tokens = journal, sink, on_text, on_tokens
        self.pending: list = []
        self.fresh: list[GeneratedText] = []
        self.dropped: list[int] = []

    def progress(self, drawn: int) -> None:
        self.flush()
        if self.on_tokens is not None:
            self.on_tokens(drawn)

    def release(self, engine: Engine, requests, stream_keys, *, seed, max_new_tokens: int, released) -> None:
        """Generate ``requests`` (each from its batch's stream key) and release the texts of each step together;
        ``released(finished)``: the released text and its output record. A fixed ``seed`` was warned of already."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SeededGeneratorWarning)
            generator = make_generator(seed, device=engine.model.device)
        for finished in () if not requests else engine.generate(
            requests, max_new_tokens=max_new_tokens, generator=generator, progress=self.progress,
            stream_keys=list(stream_keys),
        ):  # fmt: skip
            self.pending.append(released(finished))
        self.flush()

    def flush(self) -> None:
        items, self.pending = self.pending, []
        if not items:
            return
        won = release_texts(self.journal, self.sink, [(text.batch_index, record) for text, record in items])
        for (text, _), ok in zip(items, won):
            if not ok:
                self.dropped.append(text.batch_index)  # another process released this batch first
                continue
            self.fresh.append(text)
            if self.on_text is not None:
                self.on_text(text)


def release_key(seed: int | None) -> int:
    """The master key: 128 bits from the OS, or derived from a fixed ``seed`` (then not private)."""
    return secrets.randbits(128) if seed is None else derive_key(seed, 0)


@dataclasses.dataclass
class _Release:
    """One release, run by one or several processes (:mod:`invink_audit.distributed`); its phases (lock,
    load, rank 0's checks and charge, generate and claim, merge): docs/design/release-protocol.md."""

    config: ReleaseConfig
    guarantee: MechanismGuarantee  # the config's, void for a seeded run
    partition: Partition
    template: PromptTemplate
    fingerprint: str
    seed: int | None
    output: Path | None
    ledger: object
    cluster: Cluster
    load: ModelSpec
    hooks: GenerationHooks = dataclasses.field(default_factory=GenerationHooks)
    labels: tuple[Mapping[str, str], ...] | None = None
    label_fields: Mapping[str, str] | None = None
    positions: tuple[tuple[int, ...], ...] | None = None
    privacy_unit: PrivacyUnit | None = None
    state: OutputState | None = None
    done: dict = dataclasses.field(default_factory=dict)
    requests: dict = dataclasses.field(default_factory=dict)

    @property
    def mechanism(self) -> Mechanism:
        return self.config.mechanism

    @property
    def io_path(self) -> Path | None:
        return None if self.output is None else self.output.resolve()

    @property
    def num_batches(self) -> int:
        return len(self.partition.batches)

    def run(self) -> GenerationResult:
        with contextlib.ExitStack() as stack:
            # the output's lock and resume state (read-only) before any model loads
            self.cluster.lead(lambda: self._open_output(stack))
            loaded, engine = self._load()
            admission = self._hand_out(self.cluster.lead(lambda: self._admit(loaded)))
            report = self._work(loaded, engine, admission)
            return self._finish(loaded, admission, report)

    def _open_output(self, stack: contextlib.ExitStack) -> None:
        if self.io_path is None:
            return
        self.io_path.parent.mkdir(parents=True, exist_ok=True)
        stack.enter_context(output_lock(self.io_path))
        self.state = inspect_output(self.io_path, self.fingerprint, self.num_batches)

    def _load(self):
        """The model and its engine on every process (the engine's probes refuse unsupported models
        here, before the charge)."""
        loaded = engine = ledger = error = None
        try:
            ledger = self._ledger_identity()
            loaded, engine = self.load.build(self.mechanism, self.cluster.device(self.load.device))
        except Exception as err:  # noqa: BLE001 - re-raised on every process by agree()
            if not self.cluster.distributed:
                raise
            error = err
        self.cluster.agree(error)
        loaded, engine = self._follow_dtype(loaded, engine)
        self.template = template_for_model(self.template, loaded.tokenizer)  # a base model: the completion twin
        # every process must run the release rank 0 admits: same input, settings, prompt, seed and model
        self.cluster.check_same(self._identity_digest(loaded), "settings, input, prompt, seed, model or output")
        # ... and charge the ledger rank 0 charges: a process with no ledger, or another one, would run a
        # release that its own command line says is charged nowhere, or elsewhere
        self.cluster.check_same(ledger, "ledger (--ledger: its resolved file, or none, and its current head)")
        return loaded, engine

    def _follow_dtype(self, loaded: LoadedModel, engine: Engine) -> tuple[LoadedModel, Engine]:
        """Every process runs in the dtype process 0 chose, with process 0's record of why: ``dtype="auto"``
        on a CPU decides by a probe on each process (float rounding may differ with the thread count), and
        process 0's decision is the one all follow (another dtype is loaded again)."""
        if not self.cluster.distributed:
            return loaded, engine
        decided = self.cluster.broadcast(loaded.dtype_choice)
        error = None
        try:
            reload = functools.partial(_load, self.load.model, self.load.gguf_file, loaded.device)
            followed = follow_dtype(loaded, decided, reload)
            if followed is not loaded:
                loaded, engine = followed, Engine(followed, self.mechanism, max_batch_rows=self.load.max_batch_rows)
        except Exception as err:  # noqa: BLE001 - re-raised on every process by agree()
            error = err
        self.cluster.agree(error)
        return loaded, engine

    def _ledger_identity(self) -> dict | None:
        """The ledger this process would charge, as every process must see it: its resolved file and its
        state (hash-chain head, number of releases, budget), or ``None`` without a ledger."""
        if self.ledger is None:
            return None
        status = self.ledger.status()
        return {
            "path": str(self.ledger.path),
            "head": status.head,
            "releases": len(status.releases),
            "budget": [status.epsilon_budget, status.delta, str(status.accountant)],
        }

    def _hand_out(self, admission: _Admission | None) -> _Admission:
        """This process's part of rank 0's ``admission`` (``None`` on the other ranks): rank 0 sends each
        process the shared decision with the stream keys of that process's batches, to it alone
        (:meth:`Cluster.scatter`); no process receives the master key or another process's keys."""
        parts = None
        if self.cluster.is_main:
            parts = [admission.for_rank(rank) for rank in range(self.cluster.world_size)]
        return self.cluster.scatter(parts)

    def _identity_digest(self, loaded: LoadedModel) -> str:
        """A digest of everything that makes this process's texts and records what they are."""
        identity = {
            "input": self.fingerprint,
            "config": [self.config.run_parameters(), self.config.num_texts, self.config.num_texts_per_group,
                       self.config.allow_all_null],
            "guarantee": self.guarantee.record_fields(),
            "seed": self.seed,
            "prompt": self.template.as_json(),
            "label_fields": None if self.label_fields is None else dict(self.label_fields),
            "privacy_unit": None if self.privacy_unit is None else self.privacy_unit.to_json(),
            "model": loaded.name,
            "dtype": loaded.dtype_choice.dtype,
            "output": None if self.io_path is None else str(self.io_path),
        }
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()

    def _admit(self, loaded: LoadedModel) -> _Admission:
        """Rank 0: check the settings and every prompt, charge, persist the resume state, assign batches."""
        config = self.config
        run = {"model": loaded.name, "prompt": self.template.as_json(), **config.run_parameters(),
               "num_batches": self.num_batches, "seeded": self.seed is not None,
               "model_fingerprint": model_fingerprint(loaded)}  # fmt: skip
        if self.state is not None and self.state.run is not None and "model_fingerprint" not in self.state.run:
            del run["model_fingerprint"]  # a release begun before fingerprints were recorded resumes with its settings
        if self.privacy_unit is not None:  # the column and the rule, never a unit's value
            run["privacy_unit"] = self.privacy_unit.to_json()
        if self.labels is not None:
            run["label_columns"] = sorted(self.labels[0])
            run["label_fields"] = None if self.label_fields is None else dict(sorted(self.label_fields.items()))
        if self.state is not None and not self.state.is_new:
            check_run(self.output, self.state, run)
            self.done = {int(r["batch_index"]): _from_record(r) for r in self.state.records}
            release_id = self.state.release_id
        else:
            release_id = uuid.uuid4().hex
        todo = [i for i in range(self.num_batches) if i not in self.done]
        self.requests = {i: self._request(loaded, i) for i in todo}
        position = None if self.positions is None else (lambda batch, slot: self.positions[batch][slot])
        _check_context(
            loaded, self.batch_template(0), list(self.requests.values()), config.batch_size, config.max_new_tokens, position
        )
        key = release_key(self.seed)
        # every check passed: charge, then persist the resume state
        new_output = self.state is not None and self.state.is_new
        if new_output:  # the id is on disk before the charge (a stop right after it charges nothing twice)
            release_id = pending_release_id(self.io_path, self.state, run, self.fingerprint)
        if self.ledger is not None:
            try:
                label = f"generate -> {self.output.name}" if self.output is not None else "generate"
                unit = self.privacy_unit
                charge_release(self.ledger, config.event(unit), self.num_batches, release_id, label,
                               privacy_unit=None if unit is None else unit.column)
            except (ValueError, BudgetExceededError, LedgerError):
                if new_output:
                    clear_pending(self.io_path)  # refused: nothing was charged, nothing is left behind
                raise
        if new_output:
            start_output(self.io_path, self.state, self.fingerprint, run, release_id)
        costs = {i: request_cost(r, config.max_new_tokens) for i, r in self.requests.items()}
        assignment = tuple(tuple(part) for part in assign_batches(costs, self.cluster.world_size))
        stream_keys = {i: derive_key(key, i) for i in self.requests}  # batch i's stream: (key, i), as ever
        return _Admission(release_id, run, uuid.uuid4().hex[:12], assignment, len(self.done), stream_keys)

    def _request(self, loaded: LoadedModel, index: int) -> TextRequest:
        return encode_request(loaded.tokenizer, self.batch_template(index), self.partition.batches[index], key=index)

    def batch_template(self, index: int) -> PromptTemplate:
        return template_for_batch(self.template, self.labels, self.label_fields, index)

    def _sink(self, admission: _Admission) -> RecordSink:
        if self.cluster.distributed:
            return RecordSink(shard_path(self.io_path, admission.attempt, self.cluster.rank), lock=True)
        return RecordSink(self.io_path, keep=self.state.keep, needs_newline=self.state.needs_newline)

    def _work(self, loaded, engine, admission: _Admission) -> _RankReport:
        """This process's batches: each text claimed in the journal, then written, then handed out."""
        mine = admission.assignment[self.cluster.rank]
        failure, releaser = None, None
        started = time.perf_counter()
        with contextlib.ExitStack() as files:
            try:
                journal = sink = None
                if mine and self.io_path is not None:
                    journal = Journal(self.io_path, admission.release_id, self.num_batches)
                    sink = files.enter_context(self._sink(admission))
                requests = [self.requests.get(i) or self._request(loaded, i) for i in mine]
                releaser = _StepReleaser(journal, sink, self.hooks.on_text, self.hooks.on_tokens)
                if self.hooks.on_start is not None:
                    self.hooks.on_start(len(requests))
                released = functools.partial(_released, labels=self.labels, guarantee=self.guarantee,
                                             release_id=admission.release_id, run=admission.run,
                                             template=self.batch_template, model_dtype=loaded.dtype_choice.to_json())
                releaser.release(engine, requests, [admission.stream_keys[i] for i in mine], seed=self.seed,
                                 max_new_tokens=self.config.max_new_tokens, released=released)  # fmt: skip
            except Exception as err:  # noqa: BLE001 - reported to rank 0, re-raised below
                if not self.cluster.distributed:
                    raise
                failure = RankFailure.of(self.cluster.rank, err)
        fresh = [] if releaser is None else releaser.fresh
        tokens = sum(t.num_tokens for t in fresh)
        stats = ProcessStats(self.cluster.rank, str(loaded.device), len(fresh), tokens, time.perf_counter() - started)
        dropped = () if releaser is None else tuple(releaser.dropped)
        return _RankReport(stats, tuple(fresh), dropped, failure)

    def _collect(self, report: _RankReport) -> list[_RankReport]:
        try:
            reports = self.cluster.gather(report)
        except RuntimeError as err:  # a process died: its connections closed
            raise ReleaseIncompleteError(self._incomplete(f"a process stopped before reporting ({err})")) from err
        failed = report.failure if not self.cluster.is_main else next((r.failure for r in reports if r.failure), None)
        if failed is not None:
            error = failed.error
            reason = f"process {failed.rank} of {self.cluster.world_size} failed: {type(error).__name__}: {error}"
            raise ReleaseIncompleteError(self._incomplete(reason)) from error
        return reports if self.cluster.is_main else [report]

    def _incomplete(self, reason: str) -> str:
        where = f"{str(self.output)!r} and its shard files" if self.output is not None else "nowhere (no output file)"
        return (
            f"{reason}. The texts finished so far are kept in {where}; the ledger was charged once for the whole "
            "release. Run the same command again (on any number of processes) to generate only the missing batches."
        )

    def _finish(self, loaded: LoadedModel, admission: _Admission, report: _RankReport) -> GenerationResult:
        reports = self._collect(report)
        seconds = report.stats.seconds
        if self.cluster.is_main:
            seconds = max(r.stats.seconds for r in reports)
            if self.io_path is not None:  # shards, recovered records, and one process's finishing order: batch order
                merge_shards(self.io_path, admission.release_id, self.num_batches)
            dropped = sorted(i for r in reports for i in r.dropped)
            if dropped:
                _LOG.warning("batch(es) %s had already been released by another process: their new texts were dropped", dropped)
        fresh = [text for r in reports for text in r.texts]
        texts = sorted([*self.done.values(), *fresh], key=lambda t: t.batch_index)
        return self.result(
            loaded.name, admission, texts, sum(r.stats.tokens for r in reports), seconds, tuple(r.stats for r in reports),
            dtype_choice=loaded.dtype_choice,
        )

    def result(
        self, model: str, admission: _Admission, texts, tokens: int, seconds: float, processes, *,
        dtype_choice: DtypeChoice | None = None,
    ) -> GenerationResult:  # fmt: skip
        """The :class:`GenerationResult` of this release: ``texts``, what this run generated, what the release was."""
        return GenerationResult(
            texts=tuple(texts),
            guarantee=self.guarantee,
            release_id=admission.release_id,
            model=model,
            prompt=self.template.name,
            num_references=self.partition.num_references,
            num_batches=self.num_batches,
            num_unused_references=self.partition.num_unused,
            num_resumed=admission.num_resumed,
            tokens_generated=tokens,
            seconds=seconds,
            seeded=self.seed is not None,
            output=str(self.output) if self.output is not None else None,
            rank=self.cluster.rank,
            processes=tuple(processes),
            mechanism=self.mechanism,
            template=self.template,
            partition=self.partition,
            labels=self.labels,
            label_fields=None if self.label_fields is None else dict(self.label_fields),
            dtype_choice=dtype_choice,
            privacy_unit=self.privacy_unit,
        )


class ExternalRelease:
    """A release whose batches an external executor generates (Ray Data: :mod:`invink_audit.ray_release`).

    The driver keeps rank 0's part (:meth:`admit`: lock, resume state, prompt checks, the charge); workers
    generate from :meth:`worker_state` and their batches' stream keys, releasing texts first-claim-wins
    (:func:`generate_texts`); :meth:`finish` merges their shards and reads the release back.
    """

    def __init__(self, release: _Release) -> None:
        if release.output is None:
            raise ValueError(
                "an external executor needs an output file: its sampled-batch journal is what keeps at most one "
                "text per batch when the executor retries a task"
            )
        if isinstance(release.load.model, LoadedModel):
            raise ValueError("give the model as a path or name (each worker loads its own copy), not a LoadedModel")
        if release.hooks.on_tokens is not None:
            raise ValueError("on_tokens is not available when workers generate (the executor reports progress)")
        release.cluster = Cluster()  # the driver is one process, even inside a torchrun job
        self.release = release
        self.stack = contextlib.ExitStack()
        self.loaded = self.admission = None

    def admit(self, device="cpu") -> tuple[int, ...]:
        """Everything before decoding; returns the batch indices to generate."""
        release = self.release
        release._open_output(self.stack)
        self.loaded, _ = release.load.build(release.mechanism, device)
        release.template = template_for_model(release.template, self.loaded.tokenizer)  # the workers prompt with it
        # the workers follow the driver's dtype decision (on a device of its kind; on another, they decide)
        release.load = dataclasses.replace(release.load, dtype=self.loaded.dtype_choice)
        self.admission = release._admit(self.loaded)
        if release.hooks.on_start is not None:
            release.hooks.on_start(len(self.admission.assignment[0]))
        return self.admission.assignment[0]

    def references(self, index: int) -> tuple[str | None, ...]:
        return tuple(self.release.partition.batches[index])

    def worker_state(self) -> dict:
        """What a worker needs (picklable): how to load and how to prompt. No key: the executor brings
        each call's batches' stream keys to the worker its own way (:func:`generate_texts`'s
        ``stream_keys``), never the release's master key and never through data it may spill to disk
        (:mod:`invink_audit.ray_release`)."""
        release, admission = self.release, self.admission
        return {
            "load": release.load,
            "mechanism": release.mechanism,
            "template": release.template,
            "labels": release.labels,
            "label_fields": release.label_fields,
            "max_new_tokens": release.config.max_new_tokens,
            "guarantee": release.guarantee,
            "seed": release.seed,
            "output": release.io_path,
            "num_batches": release.num_batches,
            "release_id": admission.release_id,
            "run": admission.run,
            "attempt": admission.attempt,
        }

    def finish(self, seconds: float, released: Sequence[int] | None = None) -> GenerationResult:
        """Merge the workers' shards, check that every admitted batch has its record, and read them back.
        ``released``: the batches this run's workers released (default: every admitted batch)."""
        release, admission = self.release, self.admission
        try:
            merge_shards(release.io_path, admission.release_id, release.num_batches)
            records = inspect_output(release.io_path, release.fingerprint, release.num_batches).records
        finally:
            self.stack.close()
        texts = {int(r["batch_index"]): _from_record(r) for r in records}
        missing = [i for i in admission.assignment[0] if i not in texts]
        if missing:
            raise ReleaseIncompleteError(release._incomplete(f"{len(missing)} batch(es) have no text (first: {missing[0]})"))
        fresh = [texts[i] for i in (admission.assignment[0] if released is None else sorted(released))]
        if release.hooks.on_text is not None:
            for text in fresh:
                release.hooks.on_text(text)
        tokens = sum(t.num_tokens for t in fresh)
        ordered = [texts[i] for i in sorted(texts)]
        stats = ProcessStats(0, "ray", len(fresh), tokens, seconds)
        return release.result(
            self.loaded.name, admission, ordered, tokens, seconds, (stats,), dtype_choice=self.loaded.dtype_choice
        )

    def close(self) -> None:
        self.stack.close()


def generate_texts(state: dict, loaded: LoadedModel, engine: Engine, items, shard: Path, stream_keys: Mapping[int, int]):
    """A worker's part of an external release: generate ``items`` (``(batch_index, references)``), claim
    each text in the journal and write it to ``shard``; yields ``(batch_index, released, num_tokens)``
    (``released`` is ``False`` when another attempt had released that batch first: the text is dropped).
    ``stream_keys``: each item's batch's stream key, ``derive_key(master, batch_index)``: the worker never
    holds the master key, from which every other batch's stream follows."""
    items = list(items)
    indices = [int(index) for index, _ in items]
    missing = [i for i in indices if i not in stream_keys]
    if missing:
        raise ValueError(f"no stream key for batch(es) {missing[:3]}")
    template = functools.partial(template_for_batch, state["template"], state["labels"], state["label_fields"])
    requests = [encode_request(loaded.tokenizer, template(index), list(refs), key=index) for index, refs in items]
    journal = Journal(state["output"], state["release_id"], state["num_batches"])
    released = functools.partial(_released, labels=state["labels"], guarantee=state["guarantee"],
                                 release_id=state["release_id"], run=state["run"], template=template,
                                 model_dtype=loaded.dtype_choice.to_json())
    with RecordSink(shard, lock=True) as sink:
        releaser = _StepReleaser(journal, sink, None, None)
        releaser.release(engine, requests, [int(stream_keys[i]) for i in indices], seed=state["seed"],
                         max_new_tokens=state["max_new_tokens"], released=released)  # fmt: skip
    for text in releaser.fresh:
        yield text.batch_index, True, text.num_tokens
    for index in releaser.dropped:
        yield index, False, 0


def _released(finished: GeneratedText, *, labels, guarantee, release_id, run, template, model_dtype):
    """The engine's text as a release keeps it (its key the batch index, its batch's labels, and never a
    data-dependent spend: a function of the references) and its output record (``template(i)``: batch i's prompt)."""
    text = dataclasses.replace(finished, key=int(finished.key), spend=None,
                               labels=None if labels is None else dict(labels[int(finished.key)]))
    return text, _record(text, guarantee, release_id, run, template(text.batch_index), model_dtype=model_dtype)


def charge_release(ledger, event, num_batches: int, release_id: str, label: str, *, privacy_unit: str | None = None) -> None:
    """Charge a release to the ledger, once, after every check and before anything is generated (idempotent on
    ``release_id``): its ``event`` (one text per batch, :meth:`ReleaseConfig.event`; AugPE's ρ), drawn from
    ``num_batches`` batches, protecting ``privacy_unit`` (the unit column; ``None``: one reference). Over budget, or
    a ledger of another unit: :class:`accounting.LedgerError`, and nothing was charged."""
    from accounting import Release

    ledger.charge(Release(event, num_batches, release_id, label, privacy_unit))
