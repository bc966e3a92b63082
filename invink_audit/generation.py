r"""Private synthetic text generation: references in, DP texts and their a-priori guarantee out.

One call (:func:`generate`) does what the paper's experiments do (Algorithm 1 over a partition,
Corollary 1): read the references, partition them into disjoint batches of ``B`` in input order
(:func:`invink_audit.data.partition_references`), plan the clip norm for the budget
(:func:`accounting.plan_clip_norm`) or report the budget of a given clip norm
(:func:`accounting.epsilon_for_clip_norm`), charge the ledger, and generate one text per batch with
the batched engine, streaming JSON Lines as texts finish.

The guarantee is a-priori: (ε, δ) for texts of at most ``T = max_new_tokens`` tokens, whatever their
realised lengths (a length-dependent "ε spent" would depend on the data). ``T`` is always given by
the caller. Texts from disjoint batches compose in parallel, so the whole run costs one sequence.

Resuming: the output file is append-only, one record per finished text, and a small state file next
to it (``<output>.state.json``) holds the release id and a fingerprint of the input. Re-running with the
same output file, input and configuration keeps the finished texts and generates only the missing
batches; the ledger charge is idempotent on the release id, so a resumed run is not charged twice.
The state file contains a hash of the private input: it is bookkeeping, not part of the release.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from invink_audit.data import Partition, partition_references, read_references
from invink_audit.engine import Engine, FinishedText
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.models import LoadedModel, load_model
from invink_audit.prompts import PromptTemplate, encode_request, get_preset

__all__ = [
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_K",
    "GeneratedText",
    "GenerationConfig",
    "GenerationResult",
    "Guarantee",
    "generate",
    "read_generation_output",
]

_LOG = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0
#: Top-k of the Top-k+ set; the paper's best setting (§5, Appendix E: k = 100 with τ ≈ 1.1).
DEFAULT_TOP_K = 100
_RECORD_VERSION = 1


# --------------------------------------------------------------------------------------------
# configuration and results


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """The public parameters of a generation run, validated at construction.

    Give the budget either as ``epsilon`` (the clip norm is planned) or as ``clip_norm`` (ε is
    reported); ``delta`` is always needed. ``top_k=None`` samples from the full vocabulary.
    ``num_texts=None`` generates one text per full batch.
    """

    batch_size: int
    max_new_tokens: int
    delta: float
    epsilon: float | None = None
    clip_norm: float | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int | None = DEFAULT_TOP_K
    accountant: str = "br-adaptive"
    num_texts: int | None = None

    def __post_init__(self) -> None:
        from accounting import Accountant

        for name in ("batch_size", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.num_texts is not None and (
            isinstance(self.num_texts, bool) or not isinstance(self.num_texts, int) or self.num_texts < 1
        ):
            raise ValueError(f"num_texts must be an integer >= 1 or None; got {self.num_texts!r}")
        if (self.epsilon is None) == (self.clip_norm is None):
            raise ValueError(
                f"give exactly one of epsilon (plan the clip norm) and clip_norm (report epsilon); got "
                f"epsilon={self.epsilon!r}, clip_norm={self.clip_norm!r}"
            )
        top_k = self.top_k
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"top_k must be an integer >= 1 or None (full vocabulary); got {self.top_k!r}")
        try:
            object.__setattr__(self, "accountant", Accountant(self.accountant).value)
        except ValueError as err:
            choices = ", ".join(a.value for a in Accountant)
            raise ValueError(f"accountant must be one of {choices}; got {self.accountant!r}") from err
        # validates epsilon/clip_norm, delta and temperature through the planner, once
        object.__setattr__(self, "_plan", self._make_plan())

    def plan(self):
        """The a-priori :class:`accounting.Plan` of this configuration."""
        return self._plan

    def _make_plan(self):
        from accounting import epsilon_for_clip_norm, plan_clip_norm

        common = dict(
            delta=self.delta,
            max_new_tokens=self.max_new_tokens,
            batch_size=self.batch_size,
            temperature=self.temperature,
            accountant=self.accountant,
        )
        if self.epsilon is not None:
            return plan_clip_norm(epsilon=self.epsilon, **common)
        return epsilon_for_clip_norm(clip_norm=self.clip_norm, **common)


@dataclasses.dataclass(frozen=True)
class Guarantee:
    r"""The run's a-priori guarantee: (ε, δ)-DP under replace-by-null adjacency for texts of ≤ T tokens.

    ``rho_sequence`` = T·ρ_tok zCDP (paper Theorem 1); ``epsilon0`` = 2C/(Bτ) per-token bounded range;
    ``epsilon`` is what ``accountant`` certifies at ``delta``. Independent of the number of texts
    (disjoint batches, paper Corollary 1) and of their realised lengths.
    """

    epsilon: float
    delta: float
    rho_sequence: float
    rho_token: float
    epsilon0: float
    accountant: str
    clip_norm: float
    batch_size: int
    temperature: float
    top_k: int | None
    max_new_tokens: int

    @classmethod
    def from_plan(cls, plan, top_k: int | None) -> Guarantee:
        return cls(
            epsilon=plan.epsilon,
            delta=plan.delta,
            rho_sequence=plan.rho_sequence,
            rho_token=plan.rho_token,
            epsilon0=plan.epsilon0,
            accountant=plan.accountant,
            clip_norm=plan.clip_norm,
            batch_size=plan.batch_size,
            temperature=plan.temperature,
            top_k=top_k,
            max_new_tokens=plan.max_new_tokens,
        )

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class GeneratedText:
    """One synthetic text (from batch ``batch_index``) and its after-the-fact measurements."""

    batch_index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    topk_plus_size_mean: float
    topk_plus_size_std: float
    expansion_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """The texts of a run (sorted by batch), its a-priori guarantee, and what was measured.

    ``num_resumed`` texts were read back from an earlier run's output; ``tokens_generated`` and
    ``seconds`` measure this call only. ``seeded`` runs are reproducible and carry no privacy.
    """

    texts: tuple[GeneratedText, ...]
    guarantee: Guarantee
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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_generated / self.seconds if self.seconds > 0 else math.nan


# --------------------------------------------------------------------------------------------
# output file and resume state


def _state_path(output: Path) -> Path:
    return output.with_name(output.name + ".state.json")


def _atomic_write_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _input_fingerprint(partition: Partition) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps([partition.batch_size, partition.num_references]).encode())
    for batch in partition.batches:
        for reference in batch:
            encoded = reference.encode("utf-8")
            digest.update(len(encoded).to_bytes(8, "little"))
            digest.update(encoded)
    return digest.hexdigest()


def read_generation_output(path: str | os.PathLike) -> list[dict]:
    """The text records of an output file (a torn last line from an interrupted run is ignored)."""
    records, _ = _read_records(Path(path))
    return records


def _read_records(path: Path) -> tuple[list[dict], int]:
    """Records of ``path`` and the byte length of its complete lines."""
    if not path.exists():
        return [], 0
    data = path.read_bytes()
    records, good = [], 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            _LOG.warning("ignoring an incomplete last line in %s (interrupted run)", path)
            break
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{str(path)!r} is not a generation output file: {err}") from err
            if not isinstance(record, dict) or "batch_index" not in record:
                raise ValueError(f"{str(path)!r} is not a generation output file (record without batch_index)")
            records.append(record)
        good += len(line)
    return records, good


def _record(text: GeneratedText, guarantee: Guarantee, release_id: str, run: dict) -> dict:
    return {
        "batch_index": text.batch_index,
        "text": text.text,
        "num_tokens": text.num_tokens,
        "finish_reason": text.finish_reason,
        "topk_plus_size_mean": text.topk_plus_size_mean,
        "topk_plus_size_std": text.topk_plus_size_std,
        "expansion_tokens": text.expansion_tokens,
        "token_ids": list(text.token_ids),
        "guarantee": guarantee.to_json(),
        "release_id": release_id,
        "run": run,
        "version": _RECORD_VERSION,
    }


def _from_record(record: dict) -> GeneratedText:
    return GeneratedText(
        batch_index=int(record["batch_index"]),
        text=record["text"],
        token_ids=tuple(record["token_ids"]),
        finish_reason=record["finish_reason"],
        topk_plus_size_mean=float(record["topk_plus_size_mean"]),
        topk_plus_size_std=float(record["topk_plus_size_std"]),
        expansion_tokens=int(record["expansion_tokens"]),
    )


def _diff(old: Mapping, new: Mapping) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _prepare_output(output: Path, run: dict, fingerprint: str, num_batches: int):
    """Read or create the resume state; returns (release_id, finished records, byte length to keep)."""
    state_path = _state_path(output)
    records, keep = _read_records(output)
    if state_path.exists():
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
            old_run, old_fingerprint, release_id = state["run"], state["input_sha256"], state["release_id"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"resume state {str(state_path)!r} is corrupt: {err}") from err
        if old_run != run:
            raise ValueError(
                f"{str(output)!r} was written by a run with different settings ({', '.join(_diff(old_run, run))}); "
                "use a new --output file"
            )
        if old_fingerprint != fingerprint:
            raise ValueError(f"{str(output)!r} was written from a different input; use a new --output file")
    elif records:
        raise ValueError(
            f"{str(output)!r} already holds texts but its resume state {state_path.name!r} is missing; "
            "refusing to append to it (use a new --output file)"
        )
    else:
        release_id = uuid.uuid4().hex
        output.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write_json(state_path, {"release_id": release_id, "input_sha256": fingerprint, "run": run})
    seen = set()
    for record in records:
        index = record["batch_index"]
        if record.get("release_id") != release_id or record.get("run") != run:
            raise ValueError(f"{str(output)!r} holds a record of another run (batch {index}); use a new --output file")
        if not isinstance(index, int) or not 0 <= index < num_batches or index in seen:
            raise ValueError(f"{str(output)!r} holds an invalid or duplicate batch_index {index!r}")
        seen.add(index)
    return release_id, records, keep


# --------------------------------------------------------------------------------------------
# the run


def _template_json(template: PromptTemplate) -> dict:
    return {
        "name": template.name,
        "system": template.system,
        "private": template.private,
        "public": template.public,
        "fields": dict(template.fields),
    }


def generate(
    references: Sequence[str | None] | str | os.PathLike,
    *,
    batch_size: int,
    max_new_tokens: int,
    delta: float,
    epsilon: float | None = None,
    clip_norm: float | None = None,
    temperature: float = DEFAULT_TEMPERATURE,
    top_k: int | None = DEFAULT_TOP_K,
    num_texts: int | None = None,
    accountant: str = "br-adaptive",
    model: str | os.PathLike | LoadedModel | None = None,
    prompt: str | PromptTemplate = "generic",
    prompt_fields: Mapping[str, str] | None = None,
    column: str | None = None,
    output: str | os.PathLike | None = None,
    ledger=None,
    seed: int | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    max_batch_rows: int | None = None,
    on_tokens: Callable[[int], None] | None = None,
    on_text: Callable[[GeneratedText], None] | None = None,
) -> GenerationResult:
    """Generate one DP synthetic text per disjoint batch of ``batch_size`` references.

    ``references``: a list of strings (``""``/``None`` are nulls) or a path to a ``.csv`` / ``.jsonl``
    file (``column``, default ``text``). Budget: ``epsilon`` and ``delta`` (the clip norm is planned
    with ``accountant``) or ``clip_norm`` and ``delta`` (ε is reported). ``max_new_tokens`` is T.
    ``model``: see :func:`invink_audit.models.load_model` (default: the embedded SmolLM2-135M).
    ``prompt``: a preset name (``generic``, ``yelp``, ``tab``, ``mimic``) or a
    :class:`~invink_audit.prompts.PromptTemplate`, with ``prompt_fields`` values.
    ``output``: JSON Lines file, written as texts finish and resumed when it exists.
    ``ledger``: an :class:`accounting.BudgetLedger` or its path, charged before any generation.
    ``device``/``dtype``: see :func:`~invink_audit.models.load_model` (ignored for a loaded model).
    ``seed``: ``None`` (OS entropy, the private default) or a fixed seed, which warns: seeded output
    is reproducible and therefore not private. ``on_tokens(n)`` / ``on_text(text)``: progress hooks.
    """
    config = GenerationConfig(
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        delta=delta,
        epsilon=epsilon,
        clip_norm=clip_norm,
        temperature=temperature,
        top_k=top_k,
        accountant=accountant,
        num_texts=num_texts,
    )
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer or None; got {seed!r}")
        warnings.warn(
            f"generating with a fixed seed ({seed}): the output is reproducible and carries no privacy guarantee",
            SeededGeneratorWarning,
            stacklevel=2,
        )
    if isinstance(references, (str, os.PathLike)):
        references = read_references(references, column=column)
    elif column is not None:
        raise ValueError(f"column is only used when references is a file path; got column={column!r}")
    partition = partition_references(references, config.batch_size, num_texts=config.num_texts)
    template = get_preset(prompt, **dict(prompt_fields or {}))
    plan = config.plan()
    guarantee = Guarantee.from_plan(plan, config.top_k)
    mechanism = MechanismConfig(
        clip_norm=plan.clip_norm, temperature=config.temperature, top_k=config.top_k, batch_size=config.batch_size
    )
    if not math.isclose(mechanism.epsilon0, plan.epsilon0, rel_tol=1e-12):
        raise RuntimeError(
            f"internal inconsistency: mechanism epsilon0={mechanism.epsilon0!r} but plan epsilon0={plan.epsilon0!r}"
        )
    loaded = load_model(model, device=device, dtype=dtype)
    num_batches = len(partition.batches)
    run = {
        "model": loaded.name,
        "prompt": _template_json(template),
        "batch_size": config.batch_size,
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "top_k": config.top_k,
        "clip_norm": plan.clip_norm,
        "delta": plan.delta,
        "accountant": plan.accountant,
        "num_batches": num_batches,
        "seeded": seed is not None,
    }

    # resume state first (so the release id is persisted before the ledger is charged)
    output_path = Path(output) if output is not None else None
    done: dict[int, GeneratedText] = {}
    if output_path is not None:
        release_id, records, keep = _prepare_output(output_path, run, _input_fingerprint(partition), num_batches)
        done = {int(r["batch_index"]): _from_record(r) for r in records}
    else:
        release_id, keep = uuid.uuid4().hex, 0

    if ledger is not None:
        _charge(ledger, plan, config, num_batches, release_id, output_path)

    todo = [i for i in range(num_batches) if i not in done]
    started = time.perf_counter()
    tokens_generated = 0
    fresh: list[GeneratedText] = []
    if todo:
        requests = [encode_request(loaded.tokenizer, template, partition.batches[i], key=i) for i in todo]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SeededGeneratorWarning)  # warned above, at the caller
            generator = make_generator(seed, device=loaded.device)
        engine = Engine(loaded, mechanism, max_batch_rows=max_batch_rows)
        handle = None
        if output_path is not None:
            handle = output_path.open("r+b" if output_path.exists() else "wb")
            handle.truncate(keep)  # drop a torn last line
            handle.seek(keep)
        try:
            for finished in engine.generate(
                requests, max_new_tokens=config.max_new_tokens, generator=generator, progress=on_tokens
            ):
                text = _to_text(finished, loaded)
                tokens_generated += text.num_tokens
                fresh.append(text)
                if handle is not None:
                    line = json.dumps(_record(text, guarantee, release_id, run), ensure_ascii=False) + "\n"
                    handle.write(line.encode("utf-8"))
                    handle.flush()
                    os.fsync(handle.fileno())
                if on_text is not None:
                    on_text(text)
        finally:
            if handle is not None:
                handle.close()
    seconds = time.perf_counter() - started
    texts = sorted([*done.values(), *fresh], key=lambda t: t.batch_index)
    return GenerationResult(
        texts=tuple(texts),
        guarantee=guarantee,
        release_id=release_id,
        model=loaded.name,
        prompt=template.name,
        num_references=partition.num_references,
        num_batches=num_batches,
        num_unused_references=partition.num_unused,
        num_resumed=len(done),
        tokens_generated=tokens_generated,
        seconds=seconds,
        seeded=seed is not None,
        output=str(output_path) if output_path is not None else None,
    )


def _to_text(finished: FinishedText, loaded: LoadedModel) -> GeneratedText:
    text = loaded.tokenizer.decode(list(finished.token_ids), skip_special_tokens=True).strip()
    return GeneratedText(
        batch_index=int(finished.key),
        text=text,
        token_ids=finished.token_ids,
        finish_reason=finished.finish_reason,
        topk_plus_size_mean=finished.topk_plus_size_mean,
        topk_plus_size_std=finished.topk_plus_size_std,
        expansion_tokens=finished.expansion_tokens,
    )


def _charge(ledger, plan, config: GenerationConfig, num_batches: int, release_id: str, output: Path | None) -> None:
    """Charge the release to the ledger before anything is generated (idempotent on ``release_id``)."""
    from accounting import BudgetLedger, Release

    if not isinstance(ledger, BudgetLedger):
        ledger = BudgetLedger(ledger)
    release = Release(
        clip_norm=plan.clip_norm,
        batch_size=config.batch_size,
        temperature=config.temperature,
        max_new_tokens=config.max_new_tokens,
        texts_per_batch=1,
        num_batches=num_batches,
        label=f"generate -> {output.name}" if output is not None else "generate",
        release_id=release_id,
    )
    ledger.charge(release)
