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

Resuming: the output file is append-only, one record per finished text, and two small files next to
it hold the resume state: ``<output>.state.json`` (the release id and a fingerprint of the input,
written only once the ledger charge has succeeded) and ``<output>.sampled`` (an append-only, fsynced
journal with one line per batch whose text has been drawn, written *before* that text is written to
the output or handed to ``on_text``). Re-running with the same output file, input and configuration
keeps the finished texts and generates only the batches that were never sampled; a batch that the
journal records as sampled but whose record is missing from the output (deleted, or torn by a crash
in mid-write) is refused, because its text may have been released and drawing it again would be a
second, uncharged release. The ledger charge is idempotent on the release id, so a resumed run is
not charged twice. ``<output>.lock`` is held for the whole run: a second run on the same output is
refused (:class:`OutputInUseError`). The state file contains a hash of the private input: it is
bookkeeping, not part of the release.

Everything is validated before the ledger is charged: arguments, the input file, the output's resume
state, and (after the model is loaded, before any decoding) that every prompt fits the model's
context. Arguments and files are checked before the model is loaded.
"""

from __future__ import annotations

import contextlib
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
from invink_audit.models import LoadedModel, load_model, resolve_device, resolve_dtype
from invink_audit.prompts import PromptTemplate, TextRequest, encode_messages, encode_request, get_preset

__all__ = [
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_K",
    "GeneratedText",
    "GenerationConfig",
    "GenerationResult",
    "Guarantee",
    "OutputInUseError",
    "SEEDED_VOID_REASON",
    "generate",
    "read_generation_output",
]

_LOG = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0
#: Top-k of the Top-k+ set; the paper's best setting (§5, Appendix E: k = 100 with τ ≈ 1.1).
DEFAULT_TOP_K = 100
_RECORD_VERSION = 1
#: Version of ``<output>.state.json``; version 2 added the ``<output>.sampled`` journal.
_STATE_VERSION = 2
#: Why a seeded run's guarantee is void; written as ``guarantee_void_reason`` next to ``guarantee: null``.
SEEDED_VOID_REASON = "seeded: a fixed seed makes the texts reproducible, so they carry no privacy guarantee"


class OutputInUseError(ValueError):
    """Another run holds the lock on this output file (two runs must never write one output)."""


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
    void_reason: str | None = None

    @property
    def holds(self) -> bool:
        """Whether the run carries this guarantee (``False`` for a seeded run)."""
        return self.void_reason is None

    @classmethod
    def from_plan(cls, plan, top_k: int | None, void_reason: str | None = None) -> Guarantee:
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
            void_reason=void_reason,
        )

    def to_json(self) -> dict:
        """The figures as a dict (``void_reason`` only when the guarantee is void)."""
        data = dataclasses.asdict(self)
        if data["void_reason"] is None:
            del data["void_reason"]
        return data

    def record_fields(self) -> dict:
        """What an output record or summary writes: ``{"guarantee": {...}}``, or for a void guarantee
        ``{"guarantee": None, "guarantee_void_reason": ...}`` (no ε that a reader could take at face value)."""
        if self.void_reason is not None:
            return {"guarantee": None, "guarantee_void_reason": self.void_reason}
        return {"guarantee": self.to_json()}


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
    ``seconds`` measure this call only. ``seeded`` runs are reproducible and carry no privacy: their
    ``guarantee.void_reason`` says so.
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


def _journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".sampled")


def _lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


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
    """The text records of an output file.

    A torn last line from an interrupted run is ignored; a last line that lacks only its newline but
    parses as a record is kept. Records of seeded runs carry ``guarantee: None`` and a
    ``guarantee_void_reason``; records written before that change carry the planned figures.
    """
    return _read_records(Path(path)).records


@dataclasses.dataclass(frozen=True)
class _Lines:
    """Complete JSON lines of an append-only file: the parsed objects, the byte length to keep (a torn
    last line is cut off), and whether the kept part ends without a newline (a complete last record)."""

    records: list
    keep: int
    needs_newline: bool


def _split_lines(data: bytes):
    """``(line_number, line, complete)`` for each ``\\n``-terminated line, then an unterminated tail."""
    position, number = 0, 0
    while position < len(data):
        end = data.find(b"\n", position)
        number += 1
        if end < 0:
            yield number, data[position:], False
            return
        yield number, data[position : end + 1], True
        position = end + 1


def _read_records(path: Path) -> _Lines:
    """Records of the output ``path``; a last line without newline is kept when it parses as a record."""
    if not path.exists():
        return _Lines([], 0, False)
    data = path.read_bytes()
    records, keep, needs_newline = [], 0, False
    for number, line, complete in _split_lines(data):
        if line.strip():
            record, problem = None, None
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                problem = f"line {number} is not JSON ({getattr(err, 'msg', type(err).__name__)})"
            if problem is None and (not isinstance(record, dict) or "batch_index" not in record):
                problem = f"line {number} is not a text record (no batch_index)"
            if problem is not None:
                if not complete:
                    _LOG.warning("ignoring an incomplete last line in %s (interrupted run)", path)
                    break
                raise ValueError(f"{str(path)!r} is not a generation output file: {problem}")
            records.append(record)
            needs_newline = not complete
        keep += len(line)
    return _Lines(records, keep, needs_newline)


def _read_journal(path: Path, release_id: str, num_batches: int) -> _Lines:
    """Batch indices recorded as sampled in the journal ``path`` (a torn last line is ignored: the journal
    line is fsynced before the text is written anywhere, so that text never left the process)."""
    data = path.read_bytes()
    entries, keep = [], 0
    for number, line, complete in _split_lines(data):
        if not complete:
            break
        try:
            entry = json.loads(line)
            index, recorded_release = entry["batch_index"], entry["release_id"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"sampled-batch journal {str(path)!r} is corrupt at line {number}: {err}") from None
        if recorded_release != release_id:
            raise ValueError(f"sampled-batch journal {str(path)!r} line {number} belongs to another release")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_batches:
            raise ValueError(f"sampled-batch journal {str(path)!r} line {number} holds an invalid batch_index")
        entries.append(index)
        keep += len(line)
    return _Lines(entries, keep, False)


def _append_line(handle, data: dict) -> None:
    """Append one JSON line and make it durable before returning."""
    handle.write((json.dumps(data, ensure_ascii=False) + "\n").encode("utf-8"))
    handle.flush()
    os.fsync(handle.fileno())


def _short_list(indices: Sequence[int], limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", … ({len(indices)} in all)" if len(indices) > limit else "")


@dataclasses.dataclass(frozen=True)
class _OutputState:
    """What :func:`_inspect_output` found (nothing is written until the ledger charge succeeds)."""

    release_id: str
    is_new: bool
    run: dict | None  # the settings recorded in the state file (None for a new output)
    records: list
    keep: int
    needs_newline: bool
    journal_keep: int


def _inspect_output(output: Path, fingerprint: str, num_batches: int) -> _OutputState:
    """Read the output's resume state and refuse what cannot be resumed safely (read-only)."""
    state_path, journal_path = _state_path(output), _journal_path(output)
    if not state_path.exists():
        if output.exists() and output.stat().st_size > 0:
            raise ValueError(
                f"{str(output)!r} exists and is not empty, but its resume state {state_path.name!r} is missing: "
                "refusing to overwrite or append to a file this tool did not start (use a new --output file)"
            )
        if journal_path.exists() and journal_path.stat().st_size > 0:
            raise ValueError(
                f"{journal_path.name!r} records sampled batches but {state_path.name!r} is missing: the release "
                f"of {str(output)!r} cannot be resumed (use a new --output file)"
            )
        return _OutputState(uuid.uuid4().hex, True, None, [], 0, False, 0)
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        old_run, old_fingerprint, release_id = state["run"], state["input_sha256"], state["release_id"]
        version = state.get("version", 1)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"resume state {str(state_path)!r} is corrupt: {err}") from None
    if not isinstance(release_id, str) or not isinstance(old_run, dict):
        raise ValueError(f"resume state {str(state_path)!r} is corrupt")
    if old_fingerprint != fingerprint:
        raise ValueError(f"{str(output)!r} was written from a different input; use a new --output file")
    lines = _read_records(output)
    seen = set()
    for record in lines.records:
        index = record["batch_index"]
        if record.get("release_id") != release_id:
            raise ValueError(f"{str(output)!r} holds a record of another run (batch {index!r}); use a new --output file")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_batches or index in seen:
            raise ValueError(f"{str(output)!r} holds an invalid or duplicate batch_index {index!r}")
        seen.add(index)
    if version == 1:
        # written before the journal existed: which batches were sampled is unknown, so all were
        missing = sorted(set(range(num_batches)) - seen)
        journal_keep = 0
        if missing:
            raise ValueError(
                f"{str(output)!r} lacks batch(es) {_short_list(missing)}, and its resume state predates the "
                "sampled-batch journal, so they may have been sampled and released already: drawing them again "
                "would be an uncharged second release. Use a new --output file (a new release, charged again)."
            )
    elif version == _STATE_VERSION:
        if not journal_path.exists():
            raise ValueError(
                f"the sampled-batch journal {journal_path.name!r} of {str(output)!r} is missing, so which batches "
                "were already sampled is unknown; refusing to resume (use a new --output file: a new release, "
                "charged again)"
            )
        journal = _read_journal(journal_path, release_id, num_batches)
        journal_keep = journal.keep
        missing = sorted(set(journal.records) - seen)
        if missing:
            raise ValueError(
                f"batch(es) {_short_list(missing)} of {str(output)!r} were already sampled (recorded in "
                f"{journal_path.name!r}) but their records are missing from the output (deleted, or torn by an "
                "interrupted write): their texts may have been released, and drawing them again would be a second "
                "release that the ledger was not charged for. Restore the missing lines, or use a new --output "
                "file (a new release, charged again)."
            )
    else:
        raise ValueError(f"resume state {str(state_path)!r} has an unknown version {version!r}")
    return _OutputState(release_id, False, old_run, lines.records, lines.keep, lines.needs_newline, journal_keep)


def _check_run(output: Path, state: _OutputState, run: dict) -> None:
    """Refuse to resume with settings other than the recorded ones."""
    if state.run is not None and state.run != run:
        raise ValueError(
            f"{str(output)!r} was written by a run with different settings ({', '.join(_diff(state.run, run))}); "
            "use a new --output file"
        )
    for record in state.records:
        if record.get("run") != run:
            raise ValueError(
                f"{str(output)!r} holds a record of another run (batch {record['batch_index']!r}); use a new --output file"
            )


def _start_output(output: Path, state: _OutputState, fingerprint: str, run: dict) -> None:
    """Create the journal (empty), then the state file: only after the ledger charge succeeded.

    In this order a crash in between leaves an empty journal without state, which is harmless.
    """
    with _journal_path(output).open("wb") as handle:
        handle.flush()
        os.fsync(handle.fileno())
    _atomic_write_json(
        _state_path(output),
        {"version": _STATE_VERSION, "release_id": state.release_id, "input_sha256": fingerprint, "run": run},
    )


@contextlib.contextmanager
def _output_lock(output: Path):
    """Hold ``<output>.lock`` exclusively for the whole run; a second run is refused at once."""
    from filelock import FileLock, Timeout

    path = _lock_path(output)
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise OutputInUseError(
            f"another run is writing {str(output)!r} (it holds {path.name!r}); two runs must not write one "
            "output: wait for it to finish, or use another --output file"
        ) from None
    try:
        yield
    finally:
        lock.release()


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
        **guarantee.record_fields(),
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


def _open_ledger(ledger):
    if ledger is None:
        return None
    from accounting import BudgetLedger

    if isinstance(ledger, BudgetLedger):
        return ledger
    if not isinstance(ledger, (str, os.PathLike)) or not str(os.fspath(ledger)).strip():
        raise ValueError(f"ledger must be a BudgetLedger, a path to one, or None; got {ledger!r}")
    return BudgetLedger(ledger)


def _looks_like_path(model: str) -> bool:
    """A model string that can only be a local path (hub ids are ``name`` or ``owner/name``)."""
    return (
        model.startswith(("/", "./", "../", "~", "\\"))
        or model in (".", "..")
        or model.lower().endswith(".gguf")
        or model.count("/") > 1
        or "\\" in model
    )


def _check_model_source(model, gguf_file, device, dtype) -> None:
    """Check the model argument, device and dtype without loading anything."""
    from invink_audit.models import _EMBEDDED_ALIASES

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
    if isinstance(model, str) and text.lower() in _EMBEDDED_ALIASES:
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
    if isinstance(model, os.PathLike) or _looks_like_path(text):
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


def _max_positions(loaded: LoadedModel) -> int | None:
    """The model's context length from its config (``None`` when the config does not say)."""
    config = getattr(loaded.model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _check_context(
    loaded: LoadedModel, template: PromptTemplate, requests: Sequence[TextRequest], batch_size: int, max_new_tokens: int
) -> None:
    """Refuse, before any decoding, prompts that do not fit the model's positions with T new tokens.

    Names the reference's position in the input, never its text.
    """
    positions = _max_positions(loaded)
    if positions is None or not requests:
        return
    room = positions - max_new_tokens
    if room < len(requests[0].public_ids):
        raise ValueError(
            f"max_new_tokens={max_new_tokens} does not fit the model: it has {positions} positions and the public "
            f"prompt alone takes {len(requests[0].public_ids)} tokens"
        )
    too_long = [
        (int(request.key) * batch_size + slot, len(ids))
        for request in requests
        for slot, ids in enumerate(request.private_ids)
        if ids is not None and len(ids) > room
    ]
    if too_long:
        index, length = too_long[0]
        overhead = len(encode_messages(loaded.tokenizer, template.messages("x"))) - 1
        raise ValueError(
            f"reference {index} (0-based, in input order; batch {index // batch_size}) is too long for the model: "
            f"its prompt is {length} tokens, but the model has {positions} positions, so with max_new_tokens="
            f"{max_new_tokens} a prompt may take at most {room} tokens (the prompt template takes about {overhead}, "
            f"leaving about {room - overhead} for a reference); {len(too_long)} reference(s) are too long in all. "
            "Nothing was charged. Truncate every reference to one fixed token count before generating (a rule "
            "that does not depend on the data), or lower max_new_tokens."
        )


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
    gguf_file: str | None = None,
    prompt: str | PromptTemplate = "generic",
    prompt_fields: Mapping[str, str] | None = None,
    column: str | None = None,
    output: str | os.PathLike | None = None,
    ledger=None,
    seed: int | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    max_batch_rows: int | None = None,
    allow_all_null: bool = False,
    on_tokens: Callable[[int], None] | None = None,
    on_text: Callable[[GeneratedText], None] | None = None,
) -> GenerationResult:
    """Generate one DP synthetic text per disjoint batch of ``batch_size`` references.

    ``references``: a list of strings (``""``/``None`` are nulls) or a path to a ``.csv`` / ``.jsonl``
    file (``column``, default ``text``; UTF-8, with or without a byte-order mark). Budget: ``epsilon``
    and ``delta`` (the clip norm is planned with ``accountant``) or ``clip_norm`` and ``delta`` (ε is
    reported). ``max_new_tokens`` is T.
    ``model``: see :func:`invink_audit.models.load_model` (default: the embedded SmolLM2-135M), with
    ``gguf_file`` for a GGUF file inside a model directory.
    ``prompt``: a preset name (``generic``, ``yelp``, ``tab``, ``mimic``) or a
    :class:`~invink_audit.prompts.PromptTemplate`, with ``prompt_fields`` values.
    ``output``: JSON Lines file, written as texts finish and resumed when it exists (see the module
    docstring: its lock, state file and sampled-batch journal).
    ``ledger``: an :class:`accounting.BudgetLedger` or its path, charged after every check passed and
    before any decoding.
    ``device``/``dtype``: see :func:`~invink_audit.models.load_model` (ignored for a loaded model).
    ``seed``: ``None`` (OS entropy, the private default) or a fixed seed, which warns: seeded output
    is reproducible and therefore not private (``guarantee.void_reason`` is set; records write
    ``guarantee: null``). ``allow_all_null``: generate even when every reference to be used is empty
    (public-only texts that still charge the ledger); refused by default.
    ``on_tokens(n)`` / ``on_text(text)``: progress hooks.

    Valid ranges: ``batch_size``, ``max_new_tokens``, ``num_texts``, ``top_k``, ``max_batch_rows``:
    integers ≥ 1 (``num_texts`` at most the number of full batches; ``top_k``/``max_batch_rows``
    also ``None``); ``delta`` in (0, 1); ``epsilon``, ``clip_norm``, ``temperature``: finite and > 0;
    ``seed``: an integer ≥ 0 or ``None``; every prompt must fit the model's context with T new
    tokens. Anything else raises ``ValueError`` before the model is loaded (the context check: after
    loading, before the ledger is charged).
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
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be a non-negative integer or None; got {seed!r}")
    if max_batch_rows is not None and (
        isinstance(max_batch_rows, bool) or not isinstance(max_batch_rows, int) or max_batch_rows < 1
    ):
        raise ValueError(f"max_batch_rows must be an integer >= 1 or None; got {max_batch_rows!r}")
    if not isinstance(allow_all_null, bool):
        raise ValueError(f"allow_all_null must be a bool; got {allow_all_null!r}")
    for name, hook in (("on_tokens", on_tokens), ("on_text", on_text)):
        if hook is not None and not callable(hook):
            raise ValueError(f"{name} must be callable or None; got {type(hook).__name__}")
    if prompt_fields is not None and not isinstance(prompt_fields, Mapping):
        raise ValueError(f"prompt_fields must be a mapping of field names to strings; got {type(prompt_fields).__name__}")
    output_path = _check_output_path(output)
    ledger = _open_ledger(ledger)
    _check_model_source(model, gguf_file, device, dtype)
    if isinstance(references, (str, os.PathLike)):
        references = read_references(references, column=column)
    elif column is not None:
        raise ValueError(f"column is only used when references is a file path; got column={column!r}")
    partition = partition_references(references, config.batch_size, num_texts=config.num_texts)
    num_batches = len(partition.batches)
    if not allow_all_null and not any(reference for batch in partition.batches for reference in batch):
        raise ValueError(
            f"all {num_batches * config.batch_size} references in the {num_batches} batch(es) to generate are empty "
            "(nulls): every text would come from the public prompt alone, and the ledger would still be charged. "
            "Check the input column; pass allow_all_null=True (--allow-all-null) to generate public-only texts anyway"
        )
    template = get_preset(prompt, **dict(prompt_fields or {}))
    plan = config.plan()
    guarantee = Guarantee.from_plan(plan, config.top_k, void_reason=None if seed is None else SEEDED_VOID_REASON)
    mechanism = MechanismConfig(
        clip_norm=plan.clip_norm, temperature=config.temperature, top_k=config.top_k, batch_size=config.batch_size
    )
    if not math.isclose(mechanism.epsilon0, plan.epsilon0, rel_tol=1e-12):
        raise RuntimeError(
            f"internal inconsistency: mechanism epsilon0={mechanism.epsilon0!r} but plan epsilon0={plan.epsilon0!r}"
        )
    fingerprint = _input_fingerprint(partition)
    if seed is not None:
        warnings.warn(
            f"generating with a fixed seed ({seed}): the output is reproducible and carries no privacy guarantee",
            SeededGeneratorWarning,
            stacklevel=2,
        )

    with contextlib.ExitStack() as stack:
        # lock the output and read its resume state (read-only) before the model loads
        io_path = state = None
        if output_path is not None:
            io_path = output_path.resolve()
            io_path.parent.mkdir(parents=True, exist_ok=True)
            stack.enter_context(_output_lock(io_path))
            state = _inspect_output(io_path, fingerprint, num_batches)
        loaded = _load(model, gguf_file, device, dtype)
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
        done: dict[int, GeneratedText] = {}
        if state is not None:
            _check_run(output_path, state, run)
            done = {int(r["batch_index"]): _from_record(r) for r in state.records}
            release_id = state.release_id
        else:
            release_id = uuid.uuid4().hex
        todo = [i for i in range(num_batches) if i not in done]
        requests = [encode_request(loaded.tokenizer, template, partition.batches[i], key=i) for i in todo]
        _check_context(loaded, template, requests, config.batch_size, config.max_new_tokens)
        engine = Engine(loaded, mechanism, max_batch_rows=max_batch_rows) if todo else None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SeededGeneratorWarning)  # warned above, at the caller
            generator = make_generator(seed, device=loaded.device)

        # every check passed: charge, then persist the resume state
        if ledger is not None:
            _charge(ledger, plan, config, num_batches, release_id, output_path)
        if state is not None and state.is_new:
            _start_output(io_path, state, fingerprint, run)

        started = time.perf_counter()
        tokens_generated = 0
        fresh: list[GeneratedText] = []
        if todo:
            handle = journal = None
            if io_path is not None:
                handle = stack.enter_context(io_path.open("r+b" if io_path.exists() else "wb"))
                handle.truncate(state.keep)  # drop a torn last line
                handle.seek(state.keep)
                if state.needs_newline:  # a complete last record that only lacked its newline
                    handle.write(b"\n")
                journal = stack.enter_context(_journal_path(io_path).open("r+b"))
                journal.truncate(state.journal_keep)
                journal.seek(state.journal_keep)
            for finished in engine.generate(
                requests, max_new_tokens=config.max_new_tokens, generator=generator, progress=on_tokens
            ):
                text = _to_text(finished, loaded)
                tokens_generated += text.num_tokens
                if journal is not None:
                    # recorded as sampled before the text can leave the process (output file, on_text)
                    _append_line(journal, {"batch_index": text.batch_index, "release_id": release_id})
                fresh.append(text)
                if handle is not None:
                    _append_line(handle, _record(text, guarantee, release_id, run))
                if on_text is not None:
                    on_text(text)
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
    from accounting import Release

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
