r"""Capacity planning: the peak memory of a release, from the model's shape and the workload.

What the engine allocates (read from the code, each term cited where it is computed):

* **Weights**: ``num_parameters × s`` bytes (``s``: bytes per element of the model's dtype; tied
  embeddings counted once).
* **KV cache** (:mod:`invink_audit.rows`). One row stores, per layer, keys and values
  ``(kv_heads, tokens, head_dim)``: :math:`\kappa = 2 \cdot L \cdot H_{kv} \cdot d \cdot s` bytes per
  token (:func:`kv_bytes_per_token`). Every layer keeps every token, sliding-window layers included.
  A row lives in two places in turn:

  - while its text is prefilled and draws its first token, in a :class:`~invink_audit.rows.RowKV`
    sized for its prompt **and** the ``T`` tokens to come (``engine.py: _Text.__init__``,
    ``capacity=len(p) + reserve`` with ``reserve = max_new_tokens`` from ``_Run._admit``);
  - from its first decoding pass on, in a :class:`~invink_audit.rows.KVStore` bucket of width
    :func:`~invink_audit.rows.bucket_length` ``(length + 1)`` (``rows.py: KVStore.insert``,
    ``KVStore.ready``); a bucket is allocated for ``max(4, 2·rows)`` rows and doubles when full
    (``rows.py: _Bucket._room``: at least :data:`MIN_BUCKET_ROWS` slots). Public rows are each in a
    bucket of their own (``engine.py: _Run.__init__``, ``new_store(solo=True)``), so a public row
    always takes 4 slots; private rows of equal length share one bucket. When a row outgrows its
    bucket it is copied into the next one, and the old bucket is freed once empty
    (``rows.py: KVStore.ready``, ``KVStore._take_out``): both exist during that pass.

* **Texts in flight**: ``G = max(1, max_batch_rows // (B + 1))`` (``engine.py: Engine.max_texts``),
  each with ``B + 1`` rows (a null reference has none). All ``G`` are admitted and prefilled in the
  first step (``engine.py: _Run._admit``, ``_Run._prefill``).
* **Sampling buffers** of one step, per text in flight (``engine.py: _StepMath.draw``,
  ``_draw_support``, ``_support_report``; ``mechanism.py: topk_plus_support``): the public row's full
  logits (``V × s``), two float64 copies of them, the support mask (``V`` bools), the uniforms and
  their copy (``2 × V × 8``), and on the ``m = min(V, max(4·top_k, 256))`` gathered columns the output
  layer's rows (``m × hidden × s``) and the private logits and their float64 arithmetic.
* **Activations** of one forward pass (transient, one layer at a time): a decoding pass over
  ``N = G·(B+1)`` packed tokens, or a prefill chunk of at most 512 tokens of one row
  (``engine.py: _DEFAULT_PREFILL_TOKENS``); an approximation (:func:`activation_bytes`).

:func:`estimate_memory` puts them together for prompts of equal length (the closed form of
:func:`simulate_kv`, which replays the engine's KV allocations for any prompt lengths). Left out:
the allocator's own overhead (CPU malloc fragmentation; the CUDA caching allocator's reserve and the
CUDA context), Python objects, the tokenizer, a bucket's per-layer copy while it doubles (at most
``1/L`` of it), and texts that end early (EOS) and let new ones in while others decode (then rows of
different lengths share buckets: :func:`estimate_memory` reports the case where every row has a
bucket of its own as ``kv_unshared_bytes``). Measured against the real engine in
``docs/results/capacity.md``; the guide is ``docs/guide/capacity.md``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

from accounting.limits import check_count
from invink_audit.model_sizes import cached_hub_config, check_config_file, read_config_file
from invink_audit.rows import MIN_BUCKET_ROWS, bucket_length

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
    "growth_layers",
    "kv_bytes_per_token",
    "kv_growth_bytes",
    "kv_peak_tokens",
    "kv_unshared_tokens",
    "max_batch_rows_for_budget",
    "read_model_shape",
    "sampling_bytes",
    "shape_of",
    "simulate_kv",
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
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute} must be an integer >= 1; got {value!r}")
    return value


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
    hidden size not a multiple of the heads, a size larger than any model's:
    :data:`~invink_audit.model_sizes.SIZE_BOUNDS`, checked before a layer is built) are refused in one
    ``ValueError`` naming the file. Keys that are
    absent take the architecture's defaults, as in transformers (``save_pretrained`` omits the values equal to
    them): the shape planned for names every size it used."""
    from invink_audit.models import EMBEDDED_MODEL, GEMMA3_MODEL, load_model, named_model_dir

    resolved = _resolve_dtype(dtype, device)
    if model is not None and str(model).lower().endswith(".gguf"):
        loaded = load_model(model, device="cpu", dtype="float32")
        return dataclasses.replace(shape_of(loaded), dtype=resolved)
    key = None if model is None else str(model).lower()
    if key is None or key in (EMBEDDED_MODEL, "embedded", "default", GEMMA3_MODEL, "gemma-3-270m"):
        source = named_model_dir(GEMMA3_MODEL if key in (GEMMA3_MODEL, "gemma-3-270m") else EMBEDDED_MODEL)
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


def _could_only_be_a_path(model: str) -> bool:
    """A model string that names no hub id (hub ids are ``name`` or ``owner/name``)."""
    return (model.startswith(("/", "./", "../", "~", "\\")) or model in (".", "..") or model.count("/") > 1
            or "\\" in model)  # fmt: skip


def _checked_config_file(model: str) -> Path | None:
    """The ``config.json`` of the local model folder ``model``, checked to hold a JSON object
    (:func:`~invink_audit.model_sizes.read_config_file`); ``None`` for a string that names nothing local and
    may be a hub id. A missing folder, a file, a missing or unreadable
    ``config.json`` are refused in one line naming the path."""
    path = Path(model).expanduser()
    if not path.exists():
        if _could_only_be_a_path(model):
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
    decoding pass, ``num_texts`` texts to generate (``None``: at least ``G``), ``top_k``."""

    batch_size: int
    max_new_tokens: int
    prompt_tokens: int
    max_batch_rows: int
    public_prompt_tokens: int | None = None
    num_texts: int | None = None
    top_k: int | None = 100

    def __post_init__(self) -> None:
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
    decode = tokens * per_token + tokens * shape.num_attention_heads * width * (s + 4)
    chunk = min(longest, PREFILL_CHUNK)
    prefill = chunk * per_token + 2 * shape.num_attention_heads * chunk * longest * 4
    return max(decode, prefill)


# --------------------------------------------------------------------------------------------
# the KV cache over a run


class _KVReplay:
    """The engine's KV allocations, counted in layer-token slots (one token of one row in one layer; ``κ/L``
    bytes): prefill buffers (``rows.py: RowKV``), public rows' solo buckets (``MIN_BUCKET_ROWS × width``
    each) and private buckets by width (``rows.py: KVStore``, ``_Bucket._room``). ``growth``: count a
    bucket's old and new buffers of one layer together while it doubles (``_Bucket._room`` grows layer
    by layer)."""

    def __init__(self, layers: int, growth: bool, held: int = 0) -> None:
        self.layers, self.growth = layers, growth
        self.loose = held * layers
        self.public = 0
        self.private: dict[int, tuple[int, int]] = {}  # width -> (rows, rows allocated)
        self.peak, self.phase = 0, ""

    def note(self, phase: str, extra: int = 0) -> None:
        stores = sum(width * slots for width, (_, slots) in self.private.items())
        total = self.loose + self.public + self.layers * stores
        if total + extra > self.peak:
            self.peak, self.phase = total + extra, phase

    def add(self, public: bool, width: int, phase: str) -> None:
        if public:  # KVStore(solo=True): a bucket of its own, allocated for MIN_BUCKET_ROWS rows
            self.public += self.layers * MIN_BUCKET_ROWS * width
            return
        rows, slots = self.private.get(width, (0, 0))
        if rows >= slots:  # _Bucket._room: max(4, 2·count) when full, copied layer by layer
            self.private[width] = (rows, max(MIN_BUCKET_ROWS, 2 * rows))
            if self.growth and slots:  # old buffers of the layer being copied are still held
                self.note(phase, extra=growth_layers(self.layers) * slots * width)
            slots = self.private[width][1]
        self.private[width] = (rows + 1, slots)

    def remove(self, public: bool, width: int) -> None:
        if public:
            self.public -= self.layers * MIN_BUCKET_ROWS * width
            return
        rows, slots = self.private[width]
        if rows == 1:  # KVStore._take_out: an empty bucket is freed
            del self.private[width]
        else:
            self.private[width] = (rows - 1, slots)

    def run(self, texts: list[list[tuple[bool, int]]], drawn: list[int], max_new_tokens: int, in_flight: int) -> None:
        """The engine's schedule (``engine.py: _Run.step``): admit texts in order while fewer than
        ``in_flight`` are in progress and prefill them (rows sized for prompt + T); in the decoding pass,
        move the rows of texts that drew their first token into the stores (then drop their prefill
        buffers), and move every row whose bucket width changes; each text draws one token per step and
        leaves after ``drawn[i]`` tokens."""
        pending, live = list(range(len(texts)))[::-1], []  # live: [text, stored, tokens drawn]
        reserve = [self.layers * sum(n + max_new_tokens for _, n in rows) for rows in texts]
        while pending or live:
            while pending and len(live) < in_flight:  # _Run._admit, _Run._prefill
                live.append([pending.pop(), False, 0])
                self.loose += reserve[live[-1][0]]
            self.note("prefill")
            for entry in live:  # _Run._forward: rows of a text that drew its first token move into the stores
                if entry[2] and not entry[1]:
                    for public, n in texts[entry[0]]:
                        self.add(public, bucket_length(n + 1), "first decoding pass")
                    self.note("first decoding pass")
                    self.loose -= reserve[entry[0]]
                    entry[1] = True
            for index, stored, tokens in live:  # RowForward.decode: KVStore.ready before the pass
                for public, n in texts[index] if stored and tokens >= 2 else ():
                    old, new = bucket_length(n + tokens - 1), bucket_length(n + tokens)
                    if new != old:
                        self.add(public, new, "decoding")
                        self.note("decoding")
                        self.remove(public, old)
            for entry in live:  # every text in progress draws a token; _Run._record drops finished texts
                entry[2] += 1
                if entry[2] >= drawn[entry[0]]:
                    self._finish(texts[entry[0]], entry, reserve[entry[0]])
            live = [entry for entry in live if entry[2] < drawn[entry[0]]]

    def _finish(self, rows: list[tuple[bool, int]], entry: list, reserved: int) -> None:
        if not entry[1]:  # ended on its first token: only its prefill buffers existed
            self.loose -= reserved
            return
        for public, n in rows:
            self.remove(public, bucket_length(n + entry[2] - 1))


def growth_layers(num_layers: int) -> int:
    """Layers whose old buffers are still held, at the worst moment, while a bucket doubles
    (``rows.py: _Bucket._room`` replaces them layer by layer in a ``for ... in enumerate(zip(keys, values))``
    loop): one, the layer being copied; two in a two-layer model, where the iteration's reused tuple keeps
    the first layer's old buffers until the loop ends (measured on the engine: ``tests/test_capacity.py``)."""
    check_count("num_layers", num_layers)
    return 2 if num_layers == 2 else 1


def _text_rows(texts: Sequence[Sequence[int | None]]) -> list[list[tuple[bool, int]]]:
    """Each text's rows as (public?, prompt length), a null reference's row left out."""
    rows_of = []
    for i, text in enumerate(texts):
        lengths = list(text)
        if not lengths or lengths[0] is None:
            raise ValueError(f"texts[{i}] must start with the public prompt's length; got {text!r}")
        for n in lengths:
            check_count(f"texts[{i}] lengths", n, allow_none=True)
        rows_of.append([(r == 0, n) for r, n in enumerate(lengths) if n is not None])
    return rows_of


def _drawn_counts(drawn: Sequence[int] | None, texts: int, max_new_tokens: int) -> list[int]:
    counts = [max_new_tokens] * texts if drawn is None else list(drawn)
    if len(counts) != texts:
        raise ValueError(f"drawn must give one count per text ({texts}); got {len(counts)}")
    for count in counts:
        check_count("drawn", count)
        if count > max_new_tokens:
            raise ValueError(f"drawn counts must be at most max_new_tokens ({max_new_tokens}); got {count}")
    return counts


def simulate_kv(
    texts: Sequence[Sequence[int | None]],
    max_new_tokens: int,
    texts_in_flight: int,
    *,
    kv_bytes_per_token: int = 1,
    num_layers: int | None = None,
    prefix_tokens: int = 0,
    drawn: Sequence[int] | None = None,
) -> tuple[int, str]:
    """Replay the engine's KV allocations (:class:`_KVReplay`, ``engine.py: _Run.step``) for texts whose
    rows' prompts have the given lengths (public row first; ``None``: a null reference, no row), each
    drawing ``drawn[i]`` tokens (default ``max_new_tokens``: no early EOS), at most ``texts_in_flight``
    at once, admitted in order; ``prefix_tokens``: the template prefix cached for the run
    (``engine.py: _Run._prefix_row``).

    Returns (peak KV bytes, with ``kv_bytes_per_token`` κ per row and token; the phase it is reached in:
    ``"prefill"``, ``"first decoding pass"`` or ``"decoding"``). ``num_layers`` (L, dividing κ): also
    count the old buffers of :func:`growth_layers` layers a bucket keeps while it doubles (``rows.py:
    _Bucket._room``, ``κ/L`` per slot); ``None``: not (as the closed form :func:`kv_peak_tokens`)."""
    check_count("max_new_tokens", max_new_tokens)
    check_count("texts_in_flight", texts_in_flight)
    check_count("kv_bytes_per_token", kv_bytes_per_token)
    check_count("num_layers", num_layers, allow_none=True)
    check_count("prefix_tokens", prefix_tokens, minimum=0)
    layers = num_layers or 1
    if kv_bytes_per_token % layers:
        raise ValueError(f"kv_bytes_per_token ({kv_bytes_per_token}) must be a multiple of num_layers ({layers})")
    rows_of = _text_rows(texts)
    counts = _drawn_counts(drawn, len(rows_of), max_new_tokens)
    replay = _KVReplay(layers, num_layers is not None, prefix_tokens)
    replay.run(rows_of, counts, max_new_tokens, texts_in_flight)
    return replay.peak * (kv_bytes_per_token // layers), replay.phase


def _crossings(prompt: int, last: int) -> list[int]:
    """Decoding passes ``j`` in ``2..last`` at which a row of ``prompt`` tokens changes bucket
    (``bucket_length(prompt + j) != bucket_length(prompt + j - 1)``), jumping from width to width."""
    passes, j = [], 1
    while True:
        j = bucket_length(prompt + j) + 1 - prompt  # first pass past the current bucket's width
        if j > last:
            return passes
        passes.append(j)


def _conversion_candidates(texts: int, batch_size: int) -> set[int]:
    """``k`` at which the first decoding pass's total can peak: the ends of the ranges where the
    private bucket's allocation :func:`bucket_rows` (``k·B``) is constant (linear in ``k`` between)."""
    ks = {1, texts}
    m = 2
    while (1 << m) + 1 <= texts * batch_size:
        k = -(-((1 << m) + 1) // batch_size)  # first k with k·B > 2**m: the allocation doubles
        ks.update(x for x in (k - 1, k) if 1 <= x <= texts)
        m += 1
    return ks


def kv_peak_tokens(workload: Workload) -> tuple[int, str]:
    """:func:`simulate_kv` in closed form for prompts of equal length (``P0`` public, ``P`` private),
    ``G`` texts in flight, ``n = G·B`` private rows sharing one bucket, ``W(x) = bucket_length(x)``,
    ``A(r) = bucket_rows(r)``; the largest of

    * prefill: ``G·((P0 + T) + B·(P + T))``;
    * first decoding pass, text ``k`` moved into the stores before its prefill buffers are dropped:
      ``(G − k + 1)·((P0 + T) + B·(P + T)) + 4k·W(P0 + 1) + A(k·B)·W(P + 1)``;
    * decoding pass ``j`` (row length ``P + j − 1`` before it, ``j ≤ T − 1``): ``4G·W(P0 + j) + A(n)·W(P + j)``,
      and at a pass where the private rows change bucket, the old bucket too, ``+ A(n)·W(P + j − 1)``
      (freed once its last row left); at one where the public rows do, the last public row's old
      bucket ``+ 4·W(P0 + j − 1)`` (with the private rows of the other ``G − 1`` texts moved already).

    Widths grow with ``j``, so only the passes where a width changes are evaluated."""
    g, b, t = workload.texts_in_flight, workload.batch_size, workload.max_new_tokens
    p0, p = workload.public_prompt_tokens, workload.prompt_tokens
    per_text = (p0 + t) + b * (p + t)
    best = (g * per_text, "prefill")
    if t == 1:
        return best
    n, w = g * b, bucket_length
    for k in sorted(_conversion_candidates(g, b)):
        value = (g - k + 1) * per_text + MIN_BUCKET_ROWS * k * w(p0 + 1) + bucket_rows(k * b) * w(p + 1)
        best = max(best, (value, "first decoding pass"), key=lambda pair: pair[0])
    last = t - 1
    private_moves, public_moves = set(_crossings(p, last)), set(_crossings(p0, last))
    for j in sorted(private_moves | public_moves | {last}):
        if j < 2:
            continue
        public = MIN_BUCKET_ROWS * g * w(p0 + j)
        if j in public_moves:  # the last text's public row is copied before its old bucket is freed
            private = bucket_rows(n) * w(p + j)
            if j in private_moves:  # the other texts' private rows have moved already, the last text's not
                private = bucket_rows(n) * w(p + j - 1) + bucket_rows(n - b) * w(p + j)
            best = max(best, (public + MIN_BUCKET_ROWS * w(p0 + j - 1) + private, "decoding"), key=lambda pair: pair[0])
        private = bucket_rows(n) * (w(p + j) + (w(p + j - 1) if j in private_moves else 0))
        best = max(best, (public + private, "decoding"), key=lambda pair: pair[0])
    return best


# --------------------------------------------------------------------------------------------
# the estimate


def kv_growth_bytes(shape: ModelShape, workload: Workload) -> int:
    """What :func:`kv_peak_tokens` leaves out: the shared private bucket's old buffers of
    :func:`growth_layers` layers while it doubles (``rows.py: _Bucket._room``), at most
    ``A(n)/2 · W(P + T − 1) · growth_layers(L) · κ/L`` (0 when the ``n = G·B`` rows fit 4 slots)."""
    rows = workload.texts_in_flight * workload.batch_size
    if rows <= MIN_BUCKET_ROWS or workload.max_new_tokens == 1:  # no bucket ever doubles (or none exists)
        return 0
    width = bucket_length(workload.prompt_tokens + workload.max_new_tokens - 1)
    layer_bytes = kv_bytes_per_token(shape) // shape.num_layers
    return bucket_rows(rows) // 2 * width * growth_layers(shape.num_layers) * layer_bytes


def kv_unshared_tokens(workload: Workload) -> int:
    """KV token slots when every row has a bucket of its own at the last pass (prompts of many lengths):
    ``G·4·(W(P0 + T − 1) + B·W(P + T − 1))``, or the prefill buffers if larger."""
    g, b, t = workload.texts_in_flight, workload.batch_size, workload.max_new_tokens
    p0, p = workload.public_prompt_tokens, workload.prompt_tokens
    prefill = g * ((p0 + t) + b * (p + t))
    if t == 1:
        return prefill
    stores = g * MIN_BUCKET_ROWS * (bucket_length(p0 + t - 1) + b * bucket_length(p + t - 1))
    return max(prefill, stores)


FORMULA = (
    "peak = weights + KV + sampling + activations, where weights = parameters x s; "
    "KV per row and token kappa = 2 x layers x kv_heads x head_dim x s; "
    "texts in flight G = max(1, max_batch_rows // (B+1)); "
    "KV while a text is prefilled = ((P0+T) + B x (P+T)) x kappa per text "
    "(every row sized for its prompt and T tokens); "
    "KV while it decodes = buckets of width W(length) (length rounded up by at most 1/8, to a multiple of 16 at least) "
    "allocated for max(4, 2^ceil(log2 rows)) rows: 4 slots per public row, and for the G x B private rows of equal "
    "length one shared bucket, doubled while rows move to the next width; "
    "sampling = G x (V x (s + 33) + m x (hidden x s + B x (s + 24) + 40)), m = min(V, max(4 top_k, 256)); "
    "activations = the larger of a decoding pass over G(B+1) tokens and a 512-token prefill chunk"
)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Peak memory of a release (:func:`estimate_memory`), in bytes.

    * ``kv_bytes_per_token``: κ (:func:`kv_bytes_per_token`); ``kv_text_bytes``: one text's rows sized
      for prompt and T tokens, ``((P0 + T) + B·(P + T))·κ``, what a text holds while it is prefilled;
    * ``kv_peak_bytes``: the KV cache's peak for prompts of equal length (:func:`kv_peak_tokens`, reached
      in ``kv_peak_phase``) and ``kv_growth_bytes`` (:func:`kv_growth_bytes`) on top;
    * ``kv_unshared_bytes``: the KV cache when every row has a bucket of its own
      (:func:`kv_unshared_tokens`): the figure to plan with when prompts vary widely;
    * ``sampling_bytes`` (:func:`sampling_bytes`), ``activation_bytes`` (:func:`activation_bytes`).

    ``peak_bytes`` = weights + KV peak + growth + sampling + activations; ``peak_unshared_bytes`` the same
    with the larger of the KV peak and ``kv_unshared_bytes``.
    """

    shape: ModelShape
    workload: Workload
    kv_bytes_per_token: int
    kv_text_bytes: int
    kv_peak_bytes: int
    kv_peak_phase: str
    kv_growth_bytes: int
    kv_unshared_bytes: int
    sampling_bytes: int
    activation_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ModelShape) or not isinstance(self.workload, Workload):
            raise ValueError("shape must be a ModelShape and workload a Workload")
        for name in ("kv_bytes_per_token", "kv_text_bytes", "kv_peak_bytes", "kv_growth_bytes", "kv_unshared_bytes",
                     "sampling_bytes", "activation_bytes"):
            check_count(name, getattr(self, name), minimum=0)
        if self.kv_peak_phase not in _PHASES:
            raise ValueError(f"kv_peak_phase must be one of {_PHASES}; got {self.kv_peak_phase!r}")

    @property
    def weights_bytes(self) -> int:
        return self.shape.weights_bytes

    @property
    def working_bytes(self) -> int:
        """Everything but the KV cache and the weights: sampling buffers and activations."""
        return self.sampling_bytes + self.activation_bytes

    @property
    def peak_bytes(self) -> int:
        return self.weights_bytes + self.kv_peak_bytes + self.kv_growth_bytes + self.working_bytes

    @property
    def peak_unshared_bytes(self) -> int:
        kv = max(self.kv_peak_bytes + self.kv_growth_bytes, self.kv_unshared_bytes)
        return self.weights_bytes + kv + self.working_bytes

    def to_json(self) -> dict:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("shape", "workload")}
        return {
            "model": self.shape.to_json(),
            "workload": self.workload.to_json(),
            **fields,
            "weights_bytes": self.weights_bytes,
            "peak_bytes": self.peak_bytes,
            "peak_unshared_bytes": self.peak_unshared_bytes,
            "formula": FORMULA,
        }


_PHASES = ("prefill", "first decoding pass", "decoding")


def estimate_memory(shape: ModelShape, workload: Workload) -> MemoryEstimate:
    """The peak memory of ``workload`` on a model of ``shape`` (module docstring for each term)."""
    if not isinstance(shape, ModelShape):
        raise ValueError(f"shape must be a ModelShape; got {type(shape).__name__}")
    if not isinstance(workload, Workload):
        raise ValueError(f"workload must be a Workload; got {type(workload).__name__}")
    kappa = kv_bytes_per_token(shape)
    tokens, phase = kv_peak_tokens(workload)
    t = workload.max_new_tokens
    per_text = (workload.public_prompt_tokens + t) + workload.batch_size * (workload.prompt_tokens + t)
    return MemoryEstimate(
        shape=shape, workload=workload, kv_bytes_per_token=kappa, kv_text_bytes=per_text * kappa,
        kv_peak_bytes=tokens * kappa, kv_peak_phase=phase, kv_growth_bytes=kv_growth_bytes(shape, workload),
        kv_unshared_bytes=kv_unshared_tokens(workload) * kappa, sampling_bytes=sampling_bytes(shape, workload),
        activation_bytes=activation_bytes(shape, workload),
    )


def max_batch_rows_for_budget(
    shape: ModelShape, workload: Workload, budget_bytes: int, *, unshared: bool = True
) -> int:
    """The largest ``max_batch_rows`` (a multiple of ``B + 1``: rows beyond one are never used) whose peak
    fits ``budget_bytes`` (``unshared``: :attr:`MemoryEstimate.peak_unshared_bytes`, else ``peak_bytes``);
    ``workload.max_batch_rows`` is ignored. 0 when even one text does not fit. With ``num_texts`` set,
    at most ``num_texts × (B + 1)``."""
    check_count("budget_bytes", budget_bytes)

    def fits(texts: int) -> bool:
        trial = estimate_memory(shape, dataclasses.replace(workload, max_batch_rows=texts * workload.rows_per_text))
        return (trial.peak_unshared_bytes if unshared else trial.peak_bytes) <= budget_bytes

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
