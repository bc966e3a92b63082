"""Bounds on the sizes a model's configuration gives, checked before any model is built from it.

A ``config.json`` is input like any other file: ``"num_hidden_layers": 1000000000000`` makes transformers
build layer after layer (even on the ``meta`` device) until the machine runs out of memory, and a
``hidden_size`` of ``10**9`` makes it allocate terabytes. :func:`check_config_file` reads it as plain JSON,
strictly (:func:`read_config_file`), and refuses a size larger than any model has (:data:`SIZE_BOUNDS`), a size
that is not an integer >= 1 (``null`` is left to the architecture's default; an expert count may be 0) and
weights beyond all of this machine's memory (:func:`machine_memory_bytes`), each in one ``ValueError`` naming
the file, before transformers builds anything (its own checks would end in a traceback).
"""

from __future__ import annotations

import json
import os
import resource
from collections.abc import Mapping
from pathlib import Path

from accounting.strict_json import DuplicateKeyError, loads_strict

__all__ = [
    "FALLBACK_MEMORY_BYTES",
    "MAX_CONFIG_BYTES",
    "SIZE_BOUNDS",
    "cached_hub_config",
    "check_config_file",
    "estimated_parameters",
    "looks_like_path",
    "machine_memory_bytes",
    "read_config_file",
]

#: The largest value each size may take, far above any published model (the deepest have ~130 layers, the
#: widest a hidden size of ~25k, the largest vocabularies ~260k tokens, the longest contexts ~10M tokens),
#: and each name under which a configuration may give it (transformers' ``attribute_map`` aliases).
SIZE_BOUNDS: dict[str, tuple[int, tuple[str, ...]]] = {
    "num_hidden_layers": (2**11, ("num_hidden_layers", "n_layer", "n_layers", "num_layers")),
    "hidden_size": (2**17, ("hidden_size", "n_embd", "d_model")),
    "intermediate_size": (2**20, ("intermediate_size", "n_inner", "ffn_dim", "d_ff")),
    "moe_intermediate_size": (2**20, ("moe_intermediate_size",)),
    "num_experts": (2**16, ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")),
    "vocab_size": (2**24, ("vocab_size",)),
    "num_attention_heads": (2**12, ("num_attention_heads", "n_head", "num_heads")),
    "num_key_value_heads": (2**12, ("num_key_value_heads", "num_kv_heads")),
    "head_dim": (2**14, ("head_dim",)),
    "max_position_embeddings": (2**30, ("max_position_embeddings", "n_positions")),
}
#: The largest ``config.json`` read (real ones are a few kB; the largest, with per-layer lists, well under 1 MiB):
#: a larger file is refused before it is read.
MAX_CONFIG_BYTES = 16 * 2**20
#: The sizes that may be 0 (a model without experts); every other size is an integer >= 1.
_MAY_BE_ZERO = frozenset({"num_experts", "moe_intermediate_size"})
#: The machine's memory when the operating system does not say (not Linux): generous, so that only a
#: configuration beyond any machine is refused.
FALLBACK_MEMORY_BYTES = 2**40
# keys whose presence means rotary or ALiBi positions (no learned position table among the parameters)
_NO_POSITION_TABLE = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_pct",
                      "partial_rotary_factor", "alibi")  # fmt: skip


def read_config_file(config: Path) -> dict:
    """The JSON object in the file ``config``; a file larger than :data:`MAX_CONFIG_BYTES` (refused before it is
    read), invalid JSON, an object repeating a key, text that is not UTF-8, an unreadable file or anything but an
    object is refused in one ``ValueError`` naming the file."""
    try:
        with open(config, "rb") as handle:
            text = handle.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ValueError(
                f"{str(config)!r} is larger than {MAX_CONFIG_BYTES:,} bytes: not a model configuration "
                "(real ones are a few kB); refused unread"
            )
        data = loads_strict(text)
    except RecursionError:
        raise ValueError(f"{str(config)!r} nests its JSON too deeply to be a model configuration") from None
    except DuplicateKeyError as err:
        raise ValueError(f"{str(config)!r} repeats the key {err.key_shown()} in one object: refused") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{str(config)!r} is not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(f"{str(config)!r} is not UTF-8 text") from None
    except OSError as err:
        raise ValueError(f"{str(config)!r} cannot be read: {err.strerror or err}") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{str(config)!r} must hold a JSON object (the model's configuration); got {type(data).__name__}"
        )
    return data


def _sizes(config: Mapping, where: str) -> dict[str, int]:
    """The sizes ``config`` gives (the largest entry of a per-layer list), each checked to be an integer >= 1
    (0 allowed for an expert count; ``null`` is skipped: the architecture's default) and against
    :data:`SIZE_BOUNDS`."""
    sizes = {}
    for size, (bound, names) in SIZE_BOUNDS.items():
        least = 0 if size in _MAY_BE_ZERO else 1
        for name in names:
            values = config.get(name)
            values = values if isinstance(values, list) else [values]
            given = [v for v in values if v is not None]
            for value in given:
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if number and not value <= bound:  # NaN and inf too
                    raise ValueError(
                        f"{where}: {name} is {value!r}, larger than any model's (at most {bound}): "
                        "not a configuration a model can be built from"
                    )
                if not number or not isinstance(value, int) or value < least:
                    shown = json.dumps(value)[:40] if isinstance(value, (str, int, float, bool)) else "a JSON " + (
                        "object" if isinstance(value, Mapping) else "array" if isinstance(value, list) else "value")
                    raise ValueError(
                        f"{where}: {name} is {shown}, not an integer >= {least}: "
                        "not a configuration a model can be built from"
                    )
            if given:
                sizes.setdefault(size, max(0, int(max(given))))
    return sizes


def _one_model_parameters(config: Mapping, sizes: dict[str, int]) -> int:
    r"""An estimate of one (sub-)model's parameters: per layer :math:`h \cdot d \cdot (2 n_q + 2 n_{kv})`
    (attention) and :math:`3 h \cdot (i + E \cdot i_{moe})` (a gated MLP, every expert counted), the token
    embedding and the output layer (:math:`V h` each, once when tied), and a learned position table
    (:math:`P h`) unless the configuration names rotary or ALiBi positions. 0 without layers or a hidden size."""
    layers, hidden = sizes.get("num_hidden_layers", 0), sizes.get("hidden_size", 0)
    heads = sizes.get("num_attention_heads") or 1
    head_dim = sizes.get("head_dim") or max(1, hidden // heads)
    kv_heads = sizes.get("num_key_value_heads") or heads
    intermediate = sizes.get("intermediate_size") or 4 * hidden
    experts = sizes.get("num_experts", 0)
    if experts > 1:
        moe = sizes.get("moe_intermediate_size")
        intermediate = intermediate + experts * moe if moe else experts * intermediate
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * intermediate
    embeddings = sizes.get("vocab_size", 0) * hidden * (1 if config.get("tie_word_embeddings") is True else 2)
    positions = 0 if any(k in config for k in _NO_POSITION_TABLE) else sizes.get("max_position_embeddings", 0)
    return layers * per_layer + embeddings + positions * hidden


def estimated_parameters(config: Mapping, where: str) -> int:
    """The parameter count a configuration implies (its own and every sub-configuration's, e.g. a
    multimodal model's ``text_config`` and ``vision_config``), an estimate; a size beyond
    :data:`SIZE_BOUNDS` is refused in one ``ValueError`` naming ``where``."""
    total = _one_model_parameters(config, _sizes(config, where))
    for key, value in config.items():
        if key.endswith("_config") and isinstance(value, Mapping):
            total += estimated_parameters(value, f"{where} ({key})")
    return total


def machine_memory_bytes() -> int:
    """The memory a process here can use at most: the physical memory (``sysconf``), or less where a
    cgroup (v2 ``memory.max``) or the address-space limit (``ulimit -v``) says so;
    :data:`FALLBACK_MEMORY_BYTES` where the system does not say."""
    try:
        limits = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    except (ValueError, OSError, AttributeError):
        limits = [FALLBACK_MEMORY_BYTES]
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft > 0:
        limits.append(soft)
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        text = "max"
    if text.isdigit() and int(text) > 0:
        limits.append(int(text))
    return min(limits)


def cached_hub_config(repo_id: str) -> Path | None:
    """The ``config.json`` of the hub model ``repo_id`` in the local Hugging Face cache (its ``main``
    revision), or ``None`` when it is not cached or ``repo_id`` is not a valid hub id. Nothing is downloaded:
    a model that is not cached is read by transformers, from the cache only when ``HF_HUB_OFFLINE`` is set."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except HFValidationError:
        return None
    return Path(found) if isinstance(found, str) else None


def looks_like_path(model: str) -> bool:
    """Whether a model string can only be a local path (hub ids are ``name`` or ``owner/name``)."""
    return (model.startswith(("/", "./", "../", "~", "\\")) or model in (".", "..") or model.lower().endswith(".gguf")
            or model.count("/") > 1 or "\\" in model)


def _gib(count: int) -> str:
    return f"{count / 2**30:,.1f} GiB"


def check_config_file(config, *, dtype_bytes: int | None, where: str | None = None) -> int:
    """Read the configuration ``config`` (a ``config.json`` path, or its parsed object with ``where`` naming
    it) and refuse sizes beyond :data:`SIZE_BOUNDS`; with ``dtype_bytes`` (bytes per parameter of the dtype
    the model is loaded in) also a model whose weights alone exceed :func:`machine_memory_bytes`. Returns
    the estimated parameter count. Nothing is allocated: call it before transformers builds the model."""
    if not isinstance(config, Mapping):
        where, config = where or repr(str(config)), read_config_file(Path(config))
    where = where or "the model's configuration"
    parameters = estimated_parameters(config, where)
    if dtype_bytes is not None:
        needed, memory = parameters * dtype_bytes, machine_memory_bytes()
        if needed > memory:
            raise ValueError(
                f"{where} describes a model of about {parameters:.3g} parameters ({_gib(needed)} of weights at "
                f"{dtype_bytes} bytes each), more than this machine's memory ({_gib(memory)}): refused before "
                "loading it"
            )
    return parameters

