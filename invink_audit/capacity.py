r"""Capacity planning: an upper bound on the peak memory of a release, from the model's shape and the workload.

Each term, the engine code that allocates it, the KV bound's rules (numbered 1–4 and 3'–4' below) and what the
bound leaves out: docs/guide/capacity.md. ``Engine.kv_bytes`` reports what a run holds.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from accounting.limits import check_count
from invink_audit.model_sizes import cached_hub_config, check_config_file, looks_like_path, read_config_file
from invink_audit.rows import KV_LAYOUTS, MIN_BUCKET_ROWS, bucket_length, pool_capacity, pool_width

__all__ = [
    "DTYPE_BYTES",
    "FORMULA",
    "GIB",
    "MemoryEstimate",
    "ModelShape",
    "Workload",
    "activation_bytes",
    "bucket_rows",
    "dtype_name",
    "estimate_memory",
    "format_bytes",
    "kv_bound_bytes",
    "kv_bytes_per_token",
    "max_batch_rows_for_budget",
    "prefix_slots",
    "read_model_shape",
    "sampling_bytes",
    "shape_of",
    "text_kv_tokens",
]

#: Bytes per element of the dtypes a model can be loaded in (``models.py: load_model``'s names).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
#: Tokens per prefill forward pass (``engine.py: _DEFAULT_PREFILL_TOKENS``).
PREFILL_CHUNK = 512
GIB = 1024**3


def dtype_name(dtype) -> str:
    """The canonical name (``"float32"``, ``"bfloat16"``, ...) of a dtype name or ``torch.dtype``."""
    text = str(dtype).removeprefix("torch.").lower()
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}; got {dtype!r}")
    return text


# --------------------------------------------------------------------------------------------
# the model's shape


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What memory depends on in a model: read from its ``config`` (its text config for a multimodal
    one) and its parameter count, in the dtype it will run in."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_parameters: int
    dtype: str

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_attention_heads", "num_kv_heads", "head_dim", "hidden_size",
                      "intermediate_size", "vocab_size", "num_parameters"):
            check_count(field, getattr(self, field))
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weights_bytes(self) -> int:
        """``num_parameters × s``."""
        return self.num_parameters * self.dtype_bytes

    @classmethod
    def from_config(cls, config, *, num_parameters: int, dtype, name: str, vocab_size: int | None = None) -> ModelShape:
        """From a transformers config: ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` (default: the attention heads), ``head_dim`` (default: hidden / heads),
        ``hidden_size``, ``intermediate_size`` (default 4 × hidden), ``vocab_size``; each an integer >= 1 (a
        float or a string is refused, not rounded)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        hidden, heads = _config_count(text, "hidden_size"), _config_count(text, "num_attention_heads")
        return cls(
            name=name, num_layers=_config_count(text, "num_hidden_layers"), num_attention_heads=heads,
            num_kv_heads=_config_count(text, "num_key_value_heads", heads),
            head_dim=_config_count(text, "head_dim", hidden // heads), hidden_size=hidden,
            intermediate_size=_config_count(text, "intermediate_size", 4 * hidden),
            vocab_size=int(vocab_size) if vocab_size is not None else _config_count(text, "vocab_size"),
            num_parameters=int(num_parameters), dtype=dtype,
        )

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "dtype_bytes": self.dtype_bytes, "weights_bytes": self.weights_bytes,
                "kv_bytes_per_token": kv_bytes_per_token(self)}


def _config_count(config, attribute: str, default: int | None = None) -> int:
    """``config.attribute`` (``default`` when it is absent or ``None``), an integer >= 1."""
    value = getattr(config, attribute, None)
    return check_count(attribute, default if value is None else value)


def shape_of(loaded) -> ModelShape:
    """The :class:`ModelShape` of a :class:`~invink_audit.models.LoadedModel` (its dtype, its logits' width)."""
    network = loaded.model
    return ModelShape.from_config(
        network.config, num_parameters=sum(p.numel() for p in network.parameters()), dtype=loaded.dtype,
        name=loaded.name, vocab_size=loaded.vocab_size,
    )


def _resolve_dtype(dtype: str, device: str) -> str:
    """``"auto"``: bfloat16 on CUDA, float32 on CPU (``models.py: resolve_dtype``; on a CPU with native
    bfloat16 ``load_model``'s probe may then pick bfloat16: plan with ``dtype="bfloat16"`` there)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda'; got {device!r}")
    if dtype is None or dtype == "auto":
        return "bfloat16" if device == "cuda" else "float32"
    return dtype_name(dtype)


def read_model_shape(
    model: str | os.PathLike | None = None, *, dtype: str = "auto", device: str = "cuda"
) -> ModelShape:
    """The :class:`ModelShape` of ``model`` (as :func:`~invink_audit.models.load_model` names it) without
    loading its weights: its config is read, and its parameters are counted on the ``meta`` device.
    A ``.gguf`` file is converted (cached) by :func:`~invink_audit.models.load_model`, which loads it.

    A missing folder, a folder without ``config.json``, a ``config.json`` that is not a JSON object, and a
    configuration no model can be built from (an unknown ``model_type``, a size that is not an integer >= 1,
    hidden size not a multiple of the heads, a size beyond :data:`~invink_audit.model_sizes.SIZE_BOUNDS`,
    checked before a layer is built) are refused in one ``ValueError`` naming the file. Absent keys take the
    architecture's defaults, as in transformers: the shape planned for names every size it used."""
    from invink_audit.models import EMBEDDED_ALIASES, EMBEDDED_MODEL, GEMMA3_MODEL, load_model, named_model_dir

    resolved = _resolve_dtype(dtype, device)
    if model is not None and str(model).lower().endswith(".gguf"):
        loaded = load_model(model, device="cpu", dtype="float32")
        return dataclasses.replace(shape_of(loaded), dtype=resolved)
    key = None if model is None else str(model).lower()
    if key is None or key in EMBEDDED_ALIASES or key in (GEMMA3_MODEL, "gemma-3-270m"):
        source = named_model_dir(key or EMBEDDED_MODEL)
        name, where = str(model or EMBEDDED_MODEL), f"model {str(model or EMBEDDED_MODEL)!r}"
    else:
        if not str(model).strip():
            raise ValueError(f"model must be a non-empty path or hub id, or None for the default; got {model!r}")
        source, name = str(model), str(model)
        config_file = _checked_config_file(name)
        where = f"model {name!r}" if config_file is None else repr(str(config_file))
        config_file = config_file or cached_hub_config(name)
        if config_file is not None:  # sizes no model has, refused before a layer is built (even on meta)
            check_config_file(config_file, dtype_bytes=None)
    return _shape_from_config(source, name, where, resolved)


def _shape_from_config(source, name: str, where: str, dtype: str) -> ModelShape:
    """The shape of the model whose config ``source`` holds, built on the ``meta`` device; an error names ``where``."""
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source)
        with torch.device("meta"):
            network = AutoModelForCausalLM.from_config(config)
        vocab = network.get_output_embeddings().weight.shape[0]
        count = sum(p.numel() for p in network.parameters())
        return ModelShape.from_config(config, num_parameters=count, dtype=dtype, name=name, vocab_size=int(vocab))
    except OSError as err:
        if Path(str(source)).expanduser().exists():
            raise ValueError(f"{where} cannot be read: {_one_line(err)}") from err
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise ValueError(
            f"{where}: no local folder of that name exists, and it could not be read as a Hugging Face hub id"
            f"{' (HF_HUB_OFFLINE is set: only cached hub models are read)' if offline else ''}"
        ) from err
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError, StrictDataclassError) as err:
        raise ValueError(f"{where} is not a model configuration this tool can plan for: {_one_line(err)}") from err


def _one_line(err: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most ``limit`` characters (transformers' can list every architecture)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _checked_config_file(model: str) -> Path | None:
    """The ``config.json`` of the local model folder ``model``, checked to hold a JSON object
    (:func:`~invink_audit.model_sizes.read_config_file`); ``None`` for a string that names nothing local and
    may be a hub id. A missing folder, a file, a missing or unreadable ``config.json`` are refused."""
    path = Path(model).expanduser()
    if not path.exists():
        if looks_like_path(model):
            raise ValueError(f"model folder {model!r} does not exist")
        return None
    if not path.is_dir():
        raise ValueError(
            f"model {model!r} is a file: give a model folder (holding config.json), a .gguf file or a hub id"
        )
    config = path / "config.json"
    if not config.is_file():
        raise ValueError(f"model folder {model!r} has no config.json (the model's configuration)")
    read_config_file(config)
    return config


# --------------------------------------------------------------------------------------------
# the workload


@dataclasses.dataclass(frozen=True)
class Workload:
    """A release's shape: ``batch_size`` B references per text, ``max_new_tokens`` T, prompts of
    ``prompt_tokens`` P tokens (template and reference: the private rows) and ``public_prompt_tokens``
    (the public row: the template alone; default P, an upper bound), ``max_batch_rows`` rows per
    decoding pass, ``num_texts`` texts to generate (``None``: at least ``G``), ``top_k``, and the engine's
    ``kv_layout`` (:data:`~invink_audit.rows.KV_LAYOUTS`; the engine's default: ``"pool"`` on CUDA, ``"buckets"``
    on the CPU)."""

    batch_size: int
    max_new_tokens: int
    prompt_tokens: int
    max_batch_rows: int
    public_prompt_tokens: int | None = None
    num_texts: int | None = None
    top_k: int | None = 100
    kv_layout: str = "buckets"

    def __post_init__(self) -> None:
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}; got {self.kv_layout!r}")
        for name in ("batch_size", "max_new_tokens", "prompt_tokens", "max_batch_rows"):
            check_count(name, getattr(self, name))
        for name in ("public_prompt_tokens", "num_texts", "top_k"):
            check_count(name, getattr(self, name), allow_none=True)
        if self.public_prompt_tokens is None:
            object.__setattr__(self, "public_prompt_tokens", self.prompt_tokens)

    @property
    def rows_per_text(self) -> int:
        return self.batch_size + 1

    @property
    def texts_in_flight(self) -> int:
        """``G = max(1, max_batch_rows // (B + 1))`` (``engine.py: Engine.max_texts``), at most ``num_texts``."""
        texts = max(1, self.max_batch_rows // self.rows_per_text)
        return texts if self.num_texts is None else min(texts, self.num_texts)

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "texts_in_flight": self.texts_in_flight,
                "rows_in_flight": self.texts_in_flight * self.rows_per_text}


# --------------------------------------------------------------------------------------------
# the terms


def kv_bytes_per_token(shape: ModelShape) -> int:
    r""":math:`\kappa = 2 \cdot L \cdot H_{kv} \cdot d \cdot s`: keys and values of every layer, per row and
    token (``rows.py: RowKV.append``, buffers ``(1, kv_heads, capacity, head_dim)`` per layer, keys and
    values; ``_Bucket``: ``(rows, kv_heads, width, head_dim)``)."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * shape.dtype_bytes


def bucket_rows(rows: int) -> int:
    """Rows a bucket holding ``rows`` rows is allocated for: ``max(4, 2**ceil(log2 rows))`` (``rows.py:
    _Bucket._room``: 4 at first, doubled when full); 0 for none."""
    check_count("rows", rows, minimum=0)
    return 0 if rows == 0 else max(MIN_BUCKET_ROWS, 1 << (rows - 1).bit_length())


def sampling_bytes(shape: ModelShape, workload: Workload) -> int:
    """One step's mechanism buffers, per text in flight, summed (``engine.py: _StepMath.draw``,
    ``_draw_support``, ``_support_report``; ``mechanism.py: topk_plus_support``, ``support_log_probs``):
    ``V·(s + 4·8 + 1)`` (public logits, two float64 copies, the uniforms and their copy, the support
    mask) + ``m·(hidden·s + B·(s + 3·8) + 5·8)`` on the ``m = min(V, max(4·top_k, 256))`` gathered
    columns (the output layer's rows, the private logits and their float64 arithmetic, top-k values and
    indices); ``m = V`` without Top-k (``top_k=None``)."""
    s, vocab = shape.dtype_bytes, shape.vocab_size
    width = vocab if workload.top_k is None else min(vocab, max(4 * workload.top_k, 256))
    per_text = vocab * (s + 4 * 8 + 1) + width * (shape.hidden_size * s + workload.batch_size * (s + 3 * 8) + 5 * 8)
    return workload.texts_in_flight * per_text


def activation_bytes(shape: ModelShape, workload: Workload) -> int:
    """The larger of one decoding pass and one prefill chunk (approximate; one layer's intermediates
    at a time, inference mode). Per token: ``s·(2·hidden + (H + 2·H_kv)·d + 3·intermediate)`` (residual and
    normed input, queries/keys/values, the MLP's gate, up and product). Attention: a decoding pass
    scores each row against its bucket (``rows.py: _decode_attention``: ``N·H·W`` scores in the model's
    dtype and their float32 softmax, ``W`` the widest bucket); a prefill chunk of ``c = min(P, 512)``
    tokens (``engine.py: _DEFAULT_PREFILL_TOKENS``) may materialise ``H·c·P`` float32 scores and
    weights (``rows.py: rows_attention``, masked ``scaled_dot_product_attention``)."""
    s = shape.dtype_bytes
    per_token = s * (2 * shape.hidden_size + (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim
                     + 3 * shape.intermediate_size)
    longest = max(workload.prompt_tokens, workload.public_prompt_tokens)
    tokens = workload.texts_in_flight * workload.rows_per_text
    width = bucket_length(longest + workload.max_new_tokens)
    if workload.kv_layout == "pool":  # every slot of the pool, at the pool's width
        tokens, width = pool_capacity(tokens), pool_width(longest + workload.max_new_tokens)
    decode = tokens * per_token + tokens * shape.num_attention_heads * width * (s + 4)
    chunk = min(longest, PREFILL_CHUNK)
    prefill = chunk * per_token + 2 * shape.num_attention_heads * chunk * longest * 4
    return max(decode, prefill)


# --------------------------------------------------------------------------------------------
# the KV cache's upper bound


def prefix_slots(tokens: int) -> int:
    """Tokens a cached template prefix of ``tokens`` is allocated for (rule 2): prefilled in chunks of
    :data:`PREFILL_CHUNK` into a row with no reserve, whose buffer doubles when a chunk does not fit
    (``rows.py: RowKV.append``): ``tokens`` up to one chunk, less than ``2·tokens`` beyond."""
    check_count("tokens", tokens, minimum=0)
    return tokens if tokens <= PREFILL_CHUNK else 2 * tokens


def text_kv_tokens(lengths: Sequence[int | None], max_new_tokens: int) -> tuple[int, int]:
    """(prefill, stores) of one text whose rows' prompts have ``lengths`` tokens (public row first;
    ``None``: a null reference, which has no row): the tokens its rows are allocated while it is
    prefilled, ``Σ (p + T)`` (rule 1), and the slots they may take while it decodes, ``Σ 4·W(p + T − 1)``
    (rule 3; 0 when ``T = 1``: a text of one token never decodes)."""
    check_count("max_new_tokens", max_new_tokens)
    if not lengths or lengths[0] is None:
        raise ValueError(f"a text's lengths must start with the public prompt's; got {lengths!r}")
    rows = [check_count("prompt lengths", p) for p in lengths if p is not None]
    prefill = sum(p + max_new_tokens for p in rows)
    stores = 0 if max_new_tokens == 1 else sum(MIN_BUCKET_ROWS * bucket_length(p + max_new_tokens - 1) for p in rows)
    return prefill, stores


def kv_bound_bytes(
    shape: ModelShape, texts: Sequence[Sequence[int | None]], max_new_tokens: int, texts_in_flight: int, *,
    prefix_tokens: int = 0, kv_layout: str = "buckets",
) -> int:  # fmt: skip
    r"""An upper bound on the KV cache's peak bytes of a run of ``texts`` (each its rows' prompt lengths,
    public row first, ``None`` for a null reference; :func:`text_kv_tokens` gives each text's prefill size
    :math:`R_i` and store allowance :math:`S_i`), ``T = max_new_tokens``, at most ``G = texts_in_flight``
    in progress, ``prefix_tokens`` the cached template prefix (rules 1–4 of docs/guide/capacity.md):

    .. math:: \kappa \Big(\sum_{\text{the } G \text{ largest}} \max(R_i, S_i) + \max_i \min(R_i, S_i)
       + \mathrm{prefix} + 4 W_{\max}\Big) + \tfrac{1}{2} A(G B) \, W_{\max} \, \min(2, L) \, \kappa / L

    (``W_max = W(p_max + T − 1)``; the last two terms: one moving row's second bucket and a doubling
    bucket's old layers, none when ``T = 1``; ``A`` = :func:`bucket_rows`, no doubling under 5 rows).
    Texts that end early only lower it; the one case it leaves out is in docs/guide/capacity.md.

    ``kv_layout="pool"`` (rules 1, 2, 3'–4'): every text in flight may hold its prefill rows while the pool is
    allocated,

    .. math:: \kappa \Big(\sum_{\text{the } G \text{ largest}} R_i + \mathrm{prefix} + C \, W_{\max}\Big)
       + 3 \, C \, W_{\max} \, \kappa / L

    (``C = pool_capacity(min(G, texts)·(B + 1))``, ``W_max = pool_width(p_max + T − 1)``; no pool when ``T = 1``)."""
    check_count("texts_in_flight", texts_in_flight)
    if not texts:
        raise ValueError("texts must hold at least one text")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}; got {kv_layout!r}")
    sizes = [text_kv_tokens(text, max_new_tokens) for text in texts]
    if kv_layout == "pool":
        return _pool_bound_bytes(shape, texts, sizes, max_new_tokens, texts_in_flight, prefix_tokens)
    largest = sorted(max(size) for size in sizes)[-texts_in_flight:]
    tokens = sum(largest) + max(min(size) for size in sizes) + prefix_slots(prefix_tokens)
    kappa, grown = kv_bytes_per_token(shape), 0
    if max_new_tokens > 1:
        widest = bucket_length(max(p for text in texts for p in text if p is not None) + max_new_tokens - 1)
        tokens += MIN_BUCKET_ROWS * widest
        private = min(texts_in_flight, len(texts)) * max(sum(p is not None for p in text[1:]) for text in texts)
        old = bucket_rows(private) // 2 if private > MIN_BUCKET_ROWS else 0
        grown = old * widest * min(2, shape.num_layers) * (kappa // shape.num_layers)
    return tokens * kappa + grown


def _pool_bound_bytes(shape: ModelShape, texts, sizes, max_new_tokens: int, texts_in_flight: int,
                      prefix_tokens: int) -> int:
    """:func:`kv_bound_bytes` for ``kv_layout="pool"`` (``sizes``: each text's :func:`text_kv_tokens`)."""
    kappa = kv_bytes_per_token(shape)
    tokens = sum(sorted(prefill for prefill, _ in sizes)[-texts_in_flight:]) + prefix_slots(prefix_tokens)
    if max_new_tokens == 1:  # no decoding pass: no pool
        return tokens * kappa
    slots = pool_capacity(min(texts_in_flight, len(texts)) * max(len(text) for text in texts))
    width = pool_width(max(p for text in texts for p in text if p is not None) + max_new_tokens - 1)
    return (tokens + slots * width) * kappa + 3 * slots * width * (kappa // shape.num_layers)


# --------------------------------------------------------------------------------------------
# the estimate


FORMULA = (
    "peak = weights + KV + sampling + activations, where weights = parameters x s; "
    "KV per row and token kappa = 2 x layers x kv_heads x head_dim x s; "
    "texts in flight G = max(1, max_batch_rows // (B+1)); "
    "KV while a text is prefilled = R = ((P0+T) + B x (P+T)) x kappa (every row sized for its prompt and T tokens); "
    "while it decodes at most S = 4 x (W(P0+T-1) + B x W(P+T-1)) x kappa (length buckets of width W(length), "
    "length rounded up by at most 1/8, to a multiple of 16 at least, of 4 slots per public row and at most 4 per "
    "private row); KV upper bound = G x max(R, S) + min(R, S) (one text copied into the buckets at a time) "
    "+ the cached template prefix + one moving row's second bucket + a doubling bucket's old layers; "
    "in a pool (kv_layout pool, CUDA's default): C = max(8, 2^ceil(log2 G(B+1))) slots, each W' = "
    "(max(P0, P)+T-1) rounded up to whole tiles of 512 wide (one long row widens every slot), KV upper bound = "
    "G x R + the prefix + C x W' x kappa + 3 layers of the pool (reallocation and the tile invariance probe); "
    "sampling = G x (V x (s + 33) + m x (hidden x s + B x (s + 24) + 40)), m = min(V, max(4 top_k, 256)); "
    "activations = the larger of a decoding pass over G(B+1) tokens and a 512-token prefill chunk"
)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of a release (:func:`estimate_memory`), in bytes.

    * ``kv_bytes_per_token``: κ (:func:`kv_bytes_per_token`); ``kv_text_bytes``: one text's rows sized
      for prompt and T tokens, ``((P0 + T) + B·(P + T))·κ``, what a text holds while it is prefilled;
      ``kv_decoding_bytes``: the most its rows take in the length buckets (or the pool's slots) while it decodes;
    * ``kv_peak_bytes``: the KV cache's upper bound (:func:`kv_bound_bytes`, prompts of at most P tokens);
    * ``sampling_bytes`` (:func:`sampling_bytes`), ``activation_bytes`` (:func:`activation_bytes`).

    ``peak_bytes`` = weights + KV bound + sampling + activations.
    """

    shape: ModelShape
    workload: Workload
    kv_bytes_per_token: int
    kv_text_bytes: int
    kv_decoding_bytes: int
    kv_peak_bytes: int
    sampling_bytes: int
    activation_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ModelShape) or not isinstance(self.workload, Workload):
            raise ValueError("shape must be a ModelShape and workload a Workload")
        for name in ("kv_bytes_per_token", "kv_text_bytes", "kv_decoding_bytes", "kv_peak_bytes", "sampling_bytes",
                     "activation_bytes"):
            check_count(name, getattr(self, name), minimum=0)

    @property
    def weights_bytes(self) -> int:
        return self.shape.weights_bytes

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.kv_peak_bytes + self.sampling_bytes + self.activation_bytes

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("shape", "workload")}
        return {
            "model": self.shape.to_json(),
            "workload": self.workload.to_json(),
            **fields,
            "weights_bytes": self.weights_bytes,
            "peak_bytes": self.peak_bytes,
            "formula": FORMULA,
        }


def estimate_memory(shape: ModelShape, workload: Workload) -> MemoryEstimate:
    """The peak memory of ``workload`` on a model of ``shape`` (docs/guide/capacity.md for each term); the
    template prefix is counted at its largest, ``P − 1`` tokens."""
    if not isinstance(shape, ModelShape):
        raise ValueError(f"shape must be a ModelShape; got {type(shape).__name__}")
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload; got {type(workload).__name__}")
    kappa, g = kv_bytes_per_token(shape), workload.texts_in_flight
    text = [workload.public_prompt_tokens] + [workload.prompt_tokens] * workload.batch_size  # each of the G in flight
    prefill, stores = text_kv_tokens(text, workload.max_new_tokens)
    if workload.kv_layout == "pool":  # its rows' slots, each the pool's widest
        stores = 0 if workload.max_new_tokens == 1 else len(text) * pool_width(max(text) + workload.max_new_tokens - 1)
    bound = kv_bound_bytes(shape, [text] * g, workload.max_new_tokens, g, prefix_tokens=workload.prompt_tokens - 1,
                           kv_layout=workload.kv_layout)
    return MemoryEstimate(
        shape=shape, workload=workload, kv_bytes_per_token=kappa, kv_text_bytes=prefill * kappa,
        kv_decoding_bytes=stores * kappa, kv_peak_bytes=bound, sampling_bytes=sampling_bytes(shape, workload),
        activation_bytes=activation_bytes(shape, workload),
    )


def max_batch_rows_for_budget(shape: ModelShape, workload: Workload, budget_bytes: int) -> int:
    """The largest ``max_batch_rows`` (a multiple of ``B + 1``: rows beyond one are never used) whose
    :attr:`MemoryEstimate.peak_bytes` fits ``budget_bytes``; ``workload.max_batch_rows`` is ignored. 0 when
    even one text does not fit. With ``num_texts`` set, at most ``num_texts × (B + 1)``."""
    check_count("budget_bytes", budget_bytes)

    def fits(texts: int) -> bool:
        trial = dataclasses.replace(workload, max_batch_rows=texts * workload.rows_per_text)
        return estimate_memory(shape, trial).peak_bytes <= budget_bytes

    if not fits(1):
        return 0
    ceiling = workload.num_texts or (1 << 40)
    low, high = 1, 2
    while high <= ceiling and fits(high):
        low, high = high, 2 * high
    high = min(high, ceiling + 1)
    while high - low > 1:  # fits(low), not fits(high) (or high past the ceiling)
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low * workload.rows_per_text


def format_bytes(count: int) -> str:
    """``1536`` → ``"1.5 KiB"``; binary units."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover
