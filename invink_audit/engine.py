r"""The batched decoding engine: many texts × (B+1) rows, one forward per token, the mechanism on the device.

For each text (paper Algorithm 1) the engine keeps ``B + 1`` rows in the model's KV cache: the public
prompt and one private prompt per reference. A null reference has no row of its own: it *is* the
public row, so its logits equal the public logits exactly (replace-by-null adjacency, paper §3).
Every step runs one forward pass over the rows of all live texts (left-padded, each row with its own
position ids), gathers each text's public row ``(G, V)`` and private rows ``(G, B, V)``, applies
:func:`invink_audit.mechanism.token_log_probs` to all texts at once, draws one token per text with
:func:`invink_audit.mechanism.sample_tokens` and the injected generator, and appends that token to
every row of its text. Everything stays in torch on the model's device; the only host transfers per
step are one boolean (whether some text finished) and, for finished texts, their token ids.

Texts that finish (end-of-sequence token, or ``max_new_tokens``) leave the batch at once, and waiting
texts are prefilled and join it (continuous batching), so the batch stays full. Rows are split into
shards of at most ``max_batch_rows`` rows, each with its own KV cache; normally all rows fit in one
shard and a step is exactly one forward pass.

Private logits on the Top-k+ set only. Outside :math:`V_k^+` a token's probability is exactly zero
whatever the private logits are, and :math:`V_k^+` depends on the public row alone (paper §4,
Algorithm 1), so when no hook needs full private logits the engine runs the model up to its last
hidden states, applies the output layer to the public rows (G × V), and computes the private rows'
logits on each text's Top-k+ columns only (G × B × |V_k^+| instead of G × B × V: the output layer is
a fifth of SmolLM2-135M's forward pass). The mechanism then runs on those columns. This is enabled per
model only after a probe shows that the model's logits are exactly its output layer applied to its
last hidden state (no logit scaling or soft-capping); otherwise, and whenever a hook is set, every
row's full logits are computed.

Hooks, both optional and free when unused:

* ``observer(step)``: called once per step with a :class:`DecodeStep` holding the public and private
  logits, the mechanism's log-probabilities, the distribution actually sampled from and the sampled
  tokens of every live text; :meth:`DecodeStep.neighbour_log_probs` gives the log-probabilities under
  every replace-by-null neighbour ``R'_j`` (computed once, on demand).
* ``sampling_rule(step)``: returns the log-weights ``(G, V)`` to sample from instead of the
  mechanism's (e.g. neighbour ``j``'s distribution for an audit, or a one-hot for teacher forcing);
  the engine still computes every row, so the observer sees the mechanism's distribution as well.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Sequence

import torch

from invink_audit.mechanism import MechanismConfig, NeighbourLogProbs, sample_tokens, topk_plus_columns
from invink_audit.models import LoadedModel
from invink_audit.prompts import TextRequest

__all__ = ["DecodeStep", "Engine", "FinishedText", "default_max_batch_rows"]

FINISH_EOS = "eos"
FINISH_LENGTH = "length"


def default_max_batch_rows(device: torch.device) -> int:
    """Rows per forward pass when the caller gives none: 64 on CPU, 256 on CUDA."""
    return 256 if device.type == "cuda" else 64


@dataclasses.dataclass(frozen=True)
class FinishedText:
    """One generated text and its after-the-fact measurements.

    * ``token_ids``: the sampled tokens, the end-of-sequence token included when one was drawn;
    * ``finish_reason``: ``"eos"`` or ``"length"`` (``max_new_tokens`` reached);
    * ``topk_plus_size_mean`` / ``_std``: mean and (population) standard deviation of :math:`|V_k^+|`
      over the steps of this text;
    * ``expansion_tokens``: tokens drawn from :math:`V_k^+ \\setminus V_k`, i.e. whose public logit is
      below :math:`\\ell_k` (0 for the full-vocabulary variant).
    """

    request_index: int
    key: object
    token_ids: tuple[int, ...]
    finish_reason: str
    topk_plus_size_mean: float
    topk_plus_size_std: float
    expansion_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DecodeStep:
    """What the engine saw and did at one step, for the live texts (``G`` of them, in a fixed order).

    Attributes (all on the model's device; read-only by convention, never modify them):

    * ``request_indices`` (G,) int64: position of each live text in the ``requests`` given to
      :meth:`Engine.generate`;
    * ``positions`` (G,) int64: index ``t`` (0-based) of the token being drawn for each text;
    * ``public_logits`` (G, V) and ``private_logits`` (G, B, V), in the model's dtype (a null
      reference's row is the public row);
    * ``log_probs`` (G, V) float64: the mechanism's distribution (``token_log_probs``);
    * ``sampling_log_probs`` (G, V): what was sampled from (``log_probs`` unless a sampling rule
      replaced it); ``tokens`` (G,) int64: the drawn tokens. Both are ``None`` inside a sampling rule.
    """

    def __init__(self, *, mechanism, request_indices, positions, public_logits, private_logits, log_probs, neighbours):
        self.mechanism: MechanismConfig = mechanism
        self.request_indices: torch.Tensor = request_indices
        self.positions: torch.Tensor = positions
        self.public_logits: torch.Tensor = public_logits
        self.private_logits: torch.Tensor = private_logits
        self.log_probs: torch.Tensor = log_probs
        self.sampling_log_probs: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        self._neighbours: NeighbourLogProbs | None = neighbours

    @property
    def num_texts(self) -> int:
        return int(self.request_indices.shape[0])

    def neighbour_log_probs(self) -> NeighbourLogProbs:
        """Log-probabilities under ``R`` (``.actual``) and every neighbour ``R'_j`` (``.neighbours``,
        (G, B, V)), from this step's logits (:func:`invink_audit.mechanism.neighbour_log_probs`)."""
        if self._neighbours is None:
            self._neighbours = self.mechanism.neighbour_log_probs(self.private_logits, self.public_logits)
        return self._neighbours


Observer = Callable[[DecodeStep], None]
SamplingRule = Callable[[DecodeStep], torch.Tensor]


# --------------------------------------------------------------------------------------------
# KV-cache shards


def _cache_classes():
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return DynamicCache, DynamicLayer


def _check_cache(cache) -> None:
    _, dynamic_layer = _cache_classes()
    layers = getattr(cache, "layers", None)
    if layers is None or not layers or any(type(layer) is not dynamic_layer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers or []})
        raise ValueError(
            "the engine supports models whose KV cache is a plain DynamicCache (full attention in every "
            f"layer); this model's cache has layers {kinds}"
        )


_LAYER_CLASS = None


def _preallocated_layer_class():
    """A ``DynamicLayer`` whose keys/values live in buffers with room for the tokens still to come.

    transformers' ``DynamicLayer.update`` concatenates the whole cache with the new token at every
    step (a copy of the full KV cache per token: about a quarter of a decoding step on CPU for a few
    hundred cached tokens). This layer writes the new token into spare capacity in place and exposes
    views of the filled part, so a step copies nothing; capacity doubles if it ever runs out.
    """
    global _LAYER_CLASS
    if _LAYER_CLASS is None:
        _, dynamic_layer = _cache_classes()

        class _PreallocatedLayer(dynamic_layer):
            def __init__(self, keys: torch.Tensor, values: torch.Tensor, reserve: int):
                super().__init__()
                self.dtype, self.device = keys.dtype, keys.device
                self.is_initialized = True
                self._length = keys.shape[2]
                self._key_buffer = self._allocate(keys, self._length + reserve)
                self._value_buffer = self._allocate(values, self._length + reserve)
                self._expose()

            @staticmethod
            def _allocate(filled: torch.Tensor, capacity: int) -> torch.Tensor:
                rows, heads, length, dim = filled.shape
                buffer = filled.new_empty((rows, heads, max(capacity, length), dim))
                buffer[:, :, :length].copy_(filled)
                return buffer

            def _expose(self) -> None:
                self.keys = self._key_buffer[:, :, : self._length]
                self.values = self._value_buffer[:, :, : self._length]

            def update(self, key_states, value_states, *args, **kwargs):
                new = key_states.shape[2]
                end = self._length + new
                if end > self._key_buffer.shape[2]:
                    capacity = max(end, 2 * self._key_buffer.shape[2])
                    self._key_buffer = self._allocate(self.keys, capacity)
                    self._value_buffer = self._allocate(self.values, capacity)
                self._key_buffer[:, :, self._length : end].copy_(key_states)
                self._value_buffer[:, :, self._length : end].copy_(value_states)
                self._length = end
                self._expose()
                return self.keys, self.values

            def batch_select_indices(self, indices: torch.Tensor) -> None:  # pragma: no cover - unused
                raise NotImplementedError("the engine selects rows with _Shard.select")

        _LAYER_CLASS = _PreallocatedLayer
    return _LAYER_CLASS


def _make_cache(keys: list[torch.Tensor], values: list[torch.Tensor], reserve: int):
    """A DynamicCache holding copies of the given per-layer tensors with room for ``reserve`` more tokens."""
    dynamic_cache, _ = _cache_classes()
    layer_class = _preallocated_layer_class()
    cache = dynamic_cache()
    cache.layers = [layer_class(k, v, reserve) for k, v in zip(keys, values)]
    return cache


class _Shard:
    """A contiguous range of rows with its own KV cache, left-padded attention mask and positions.

    The cache's layers keep spare capacity for ``reserve`` further tokens, which the forward passes
    fill in place; its tensors are only rebuilt when rows join or leave (``select``, ``split``,
    ``concat``).
    """

    __slots__ = ("cache", "mask", "positions")

    def __init__(self, cache, mask: torch.Tensor, positions: torch.Tensor):
        self.cache = cache
        self.mask = mask  # (rows, length) int64, 0 on left padding
        self.positions = positions  # (rows,) int64: position id of the next input token

    @classmethod
    def from_prefill(cls, cache, mask: torch.Tensor, positions: torch.Tensor, reserve: int) -> _Shard:
        _check_cache(cache)
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        return cls(_make_cache(keys, values, reserve), mask, positions)

    @property
    def num_rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def _tensors(self):
        return [layer.keys for layer in self.cache.layers], [layer.values for layer in self.cache.layers]

    def select(self, rows: torch.Tensor, reserve: int) -> _Shard:
        """Keep ``rows`` (local indices, in order) and drop left columns that are padding for all of them."""
        mask = self.mask.index_select(0, rows)
        live_columns = mask.any(dim=0)
        start = int(live_columns.int().argmax()) if bool(live_columns.any()) else 0
        keys, values = self._tensors()
        return _Shard(
            _make_cache(
                [k.index_select(0, rows)[:, :, start:] for k in keys],
                [v.index_select(0, rows)[:, :, start:] for v in values],
                reserve,
            ),
            mask[:, start:],
            self.positions.index_select(0, rows),
        )

    def split(self, count: int, reserve: int) -> tuple[_Shard, _Shard]:
        """The first ``count`` rows and the rest."""
        keys, values = self._tensors()
        head = _Shard(
            _make_cache([k[:count] for k in keys], [v[:count] for v in values], reserve),
            self.mask[:count],
            self.positions[:count],
        )
        tail = _Shard(
            _make_cache([k[count:] for k in keys], [v[count:] for v in values], reserve),
            self.mask[count:],
            self.positions[count:],
        )
        return head, tail

    @staticmethod
    def concat(first: _Shard, second: _Shard, reserve: int) -> _Shard:
        """Rows of ``first`` then ``second``; the shorter one is left-padded (masked columns)."""
        length = max(first.length, second.length)

        def padded(shard: _Shard):
            keys, values = shard._tensors()
            extra = length - shard.length
            if extra == 0:
                return keys, values, shard.mask

            def grow(t):
                return torch.cat([t.new_zeros(t.shape[0], t.shape[1], extra, t.shape[3]), t], dim=2)

            mask = torch.cat([shard.mask.new_zeros(shard.num_rows, extra), shard.mask], dim=1)
            return [grow(k) for k in keys], [grow(v) for v in values], mask

        k1, v1, m1 = padded(first)
        k2, v2, m2 = padded(second)
        return _Shard(
            _make_cache(
                [torch.cat([a, b], dim=0) for a, b in zip(k1, k2)],
                [torch.cat([a, b], dim=0) for a, b in zip(v1, v2)],
                reserve,
            ),
            torch.cat([m1, m2], dim=0),
            torch.cat([first.positions, second.positions], dim=0),
        )


# --------------------------------------------------------------------------------------------
# live texts


@dataclasses.dataclass(eq=False)
class _Live:
    """Host-side bookkeeping for one live text: its rows (public first) and where its references point."""

    request_index: int
    request: TextRequest
    prompts: list[tuple[int, ...]]  # distinct rows: [public, non-null private ...]
    reference_rows: list[int]  # for each reference, index into ``prompts`` (0 = public row for a null)

    @classmethod
    def from_request(cls, index: int, request: TextRequest) -> _Live:
        prompts = [request.public_ids]
        reference_rows = []
        for ids in request.private_ids:
            if ids is None:
                reference_rows.append(0)
            else:
                reference_rows.append(len(prompts))
                prompts.append(ids)
        return cls(index, request, prompts, reference_rows)

    @property
    def num_rows(self) -> int:
        return len(self.prompts)


@dataclasses.dataclass(frozen=True)
class _OutputLayerSplit:
    decoder: torch.nn.Module  # input ids → last hidden states (with the cache)
    head: torch.nn.Linear  # hidden states → logits


# config attributes of models whose logits are not just the output layer (scaled or soft-capped)
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
    "output_multiplier",
    "lm_head_multiplier",
)


def _output_layer_split(model: LoadedModel) -> _OutputLayerSplit | None:
    """The model as (decoder, output layer) when its logits are exactly ``head(decoder(x))``, else None.

    Checked on the model itself: its config (and its text config) has no known logit transform, its
    output layer is a ``torch.nn.Linear``, and on a probe of two rows the two routes agree, logit by
    logit, to two units in the last place of the model's dtype (they run the same operations).
    """
    network = model.model
    try:
        head, decoder = network.get_output_embeddings(), network.get_decoder()
    except (AttributeError, NotImplementedError):
        return None
    if not isinstance(head, torch.nn.Linear) or not isinstance(decoder, torch.nn.Module) or decoder is network:
        return None
    config = network.config
    configs = [config]
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_config is not config:
        configs.append(text_config)
    for part in configs:
        for name in _LOGIT_TRANSFORMS:
            value = getattr(part, name, None)
            if value not in (None, 1, 1.0):
                return None
    vocab = head.weight.shape[0]
    ids = (torch.arange(10, dtype=torch.long).view(2, 5) * 7919 + 3) % vocab
    ids = ids.to(model.device)
    mask = torch.ones_like(ids)
    try:
        with torch.inference_mode():
            full = network(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1).logits[:, -1, :]
            split = head(decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state[:, -1, :])
    except Exception:  # noqa: BLE001 - any failure of the probe means: do not use the split
        return None
    if split.shape != full.shape or split.dtype != full.dtype:
        return None
    # element by element: two units in the last place of the model's dtype, plus float32 accumulation
    # noise (a scaling or soft-capping after the output layer moves every logit by far more)
    floor = 16 * torch.finfo(torch.float32).eps * (float(full.abs().max()) + 1.0)
    if not bool(((split - full).abs() <= 2 * torch.finfo(full.dtype).eps * full.abs() + floor).all()):
        return None
    return _OutputLayerSplit(decoder=decoder, head=head)


class Engine:
    """Private decoding of many texts at once with one model and one mechanism configuration.

    ``max_batch_rows``: rows per forward pass (memory bound; default :func:`default_max_batch_rows`).
    ``max_prefill_tokens``: bound on rows × prompt length per prefill forward (default
    ``max_batch_rows * 512``).
    ``support_only``: compute private logits on the Top-k+ columns only when nothing needs the full
    rows and the model passes the output-layer probe (see the module docstring); ``False`` always
    computes full logits.
    """

    def __init__(
        self,
        model: LoadedModel,
        mechanism: MechanismConfig,
        *,
        max_batch_rows: int | None = None,
        max_prefill_tokens: int | None = None,
        support_only: bool = True,
    ):
        if not isinstance(model, LoadedModel):
            raise ValueError(f"model must be a LoadedModel (see invink_audit.load_model); got {type(model).__name__}")
        if not isinstance(mechanism, MechanismConfig):
            raise ValueError(f"mechanism must be a MechanismConfig; got {type(mechanism).__name__}")
        rows = default_max_batch_rows(model.device) if max_batch_rows is None else max_batch_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"max_batch_rows must be an integer >= 1; got {max_batch_rows!r}")
        prefill = rows * 512 if max_prefill_tokens is None else max_prefill_tokens
        if isinstance(prefill, bool) or not isinstance(prefill, int) or prefill < 1:
            raise ValueError(f"max_prefill_tokens must be an integer >= 1; got {max_prefill_tokens!r}")
        if "logits_to_keep" not in inspect.signature(model.model.forward).parameters:
            raise ValueError(
                f"model {model.name!r} does not accept logits_to_keep; use a recent transformers causal LM"
            )
        if not isinstance(support_only, bool):
            raise ValueError(f"support_only must be a bool; got {support_only!r}")
        self.model = model
        self.mechanism = mechanism
        self.max_batch_rows = rows
        self.max_prefill_tokens = prefill
        self._split = _output_layer_split(model) if support_only else None

    @property
    def support_only(self) -> bool:
        """Whether runs without hooks compute private logits on the Top-k+ columns only."""
        return self._split is not None

    # ---------------------------------------------------------------- forward passes

    def _forward(self, input_ids, mask, positions, cache, hidden: bool = False):
        """The rows' next-token logits (or, with ``hidden``, their last hidden states) and the cache."""
        arguments = dict(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        )
        if hidden:
            out = self._split.decoder(**arguments)
            return out.last_hidden_state[:, -1, :], out.past_key_values
        out = self.model.model(**arguments, logits_to_keep=1)
        return out.logits[:, -1, :], out.past_key_values

    def _prefill(
        self, prompts: list[tuple[int, ...]], reserve: int, hidden: bool = False
    ) -> tuple[list[_Shard], torch.Tensor]:
        """Left-padded prefill of ``prompts`` in row chunks; returns shards (with room for ``reserve``
        more tokens) and the rows' next-token logits (their last hidden states with ``hidden``)."""
        device = self.model.device
        length = max(len(p) for p in prompts)
        rows_per_chunk = max(1, min(self.max_batch_rows, self.max_prefill_tokens // length))
        ids = torch.full((len(prompts), length), self.model.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, length - len(prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        shards, logits = [], []
        for start in range(0, len(prompts), rows_per_chunk):
            part = slice(start, start + rows_per_chunk)
            row_logits, cache = self._forward(ids[part], mask[part], positions[part], None, hidden)
            shards.append(_Shard.from_prefill(cache, mask[part], positions[part, -1] + 1, reserve))
            logits.append(row_logits)
        return shards, torch.cat(logits, dim=0)

    def _decode(self, shard: _Shard, input_ids: torch.Tensor, hidden: bool = False) -> tuple[_Shard, torch.Tensor]:
        mask = torch.cat([shard.mask, shard.mask.new_ones(shard.num_rows, 1)], dim=1)
        logits, cache = self._forward(input_ids[:, None], mask, shard.positions[:, None], shard.cache, hidden)
        return _Shard(cache, mask, shard.positions + 1), logits

    # ---------------------------------------------------------------- generation

    def generate(
        self,
        requests: Sequence[TextRequest],
        *,
        max_new_tokens: int,
        generator: torch.Generator,
        observer: Observer | None = None,
        sampling_rule: SamplingRule | None = None,
        neighbours: bool = False,
        stop_at_eos: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> Iterator[FinishedText]:
        """Generate one text per request; yields texts as they finish (not in request order).

        ``max_new_tokens`` (T) is given by the caller, never derived from the data. ``generator`` is a
        ``torch.Generator`` on the model's device (:func:`invink_audit.mechanism.make_generator`).
        ``neighbours=True`` computes the neighbour log-probabilities every step (use it when the
        observer or the sampling rule needs them: the mechanism's distribution is then taken from the
        same computation instead of a second one). ``stop_at_eos=False`` ignores end-of-sequence
        tokens (benchmarks). ``progress(n)`` is called after each step with the number of tokens drawn.
        """
        requests = list(requests)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1; got {max_new_tokens!r}")
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator; got {type(generator).__name__}")
        if generator.device.type != self.model.device.type:
            raise ValueError(f"generator is on {generator.device} but the model is on {self.model.device}")
        for i, request in enumerate(requests):
            if not isinstance(request, TextRequest):
                raise ValueError(f"requests[{i}] must be a TextRequest; got {type(request).__name__}")
            if request.batch_size != self.mechanism.batch_size:
                raise ValueError(
                    f"requests[{i}] has {request.batch_size} references but the mechanism is configured for "
                    f"batch_size={self.mechanism.batch_size}"
                )
        if not requests:
            return
        run = _Run(self, requests, max_new_tokens, generator, observer, sampling_rule, neighbours, stop_at_eos)
        while not run.done:
            finished = run.step()
            if progress is not None:
                progress(run.last_step_tokens)
            yield from finished


class _Run:
    """State of one :meth:`Engine.generate` call."""

    def __init__(self, engine, requests, max_new_tokens, generator, observer, sampling_rule, neighbours, stop_at_eos):
        self.engine = engine
        self.model = engine.model
        self.mechanism = engine.mechanism
        self.requests = requests
        self.max_new_tokens = max_new_tokens
        self.generator = generator
        self.observer = observer
        self.sampling_rule = sampling_rule
        self.neighbours = neighbours
        self.stop_at_eos = stop_at_eos
        self.pending = collections.deque(range(len(requests)))
        self.live: list[_Live] = []
        self.shards: list[_Shard] = []
        self.last_step_tokens = 0
        device = self.model.device
        self.device = device
        self.eos = torch.tensor(self.model.eos_token_ids, dtype=torch.long, device=device)
        top_k = self.mechanism.top_k
        self.top_k = top_k if top_k is not None and top_k < self.model.vocab_size else None
        # private logits on the Top-k+ columns only: nothing may need the full rows
        self.hidden = (
            engine.support_only and self.top_k is not None and observer is None and sampling_rule is None
            and not neighbours
        )
        # per live text (slot) state, on the device
        self.tokens = torch.empty((0, max_new_tokens), dtype=torch.long, device=device)
        self.count = torch.empty(0, dtype=torch.long, device=device)
        self.size_sum = torch.empty(0, dtype=torch.float64, device=device)
        self.size_sq_sum = torch.empty(0, dtype=torch.float64, device=device)
        self.expansion = torch.empty(0, dtype=torch.long, device=device)
        self.last = torch.empty(0, dtype=torch.long, device=device)  # last sampled token per text
        self._index()

    @property
    def done(self) -> bool:
        return not self.pending and not self.live

    # ---------------------------------------------------------------- structure

    def _index(self) -> None:
        """Rebuild the row ↔ text index tensors after texts joined or left."""
        row_text, public_row, reference_rows = [], [], []
        offset = 0
        for slot, live in enumerate(self.live):
            row_text.extend([slot] * live.num_rows)
            public_row.append(offset)
            reference_rows.append([offset + r for r in live.reference_rows])
            offset += live.num_rows
        device = self.device
        self.row_text = torch.tensor(row_text, dtype=torch.long, device=device)
        self.public_row = torch.tensor(public_row, dtype=torch.long, device=device)
        self.reference_rows = torch.tensor(reference_rows, dtype=torch.long, device=device).reshape(
            len(self.live), self.mechanism.batch_size
        )
        self.request_indices = torch.tensor([lv.request_index for lv in self.live], dtype=torch.long, device=device)

    def _live_rows(self) -> int:
        return sum(live.num_rows for live in self.live)

    def _admit(self) -> torch.Tensor | None:
        """Prefill waiting texts that fit next to the live ones; returns their rows' logits."""
        capacity = self.engine.max_batch_rows
        rows = self._live_rows()
        admitted: list[_Live] = []
        while self.pending:
            live = _Live.from_request(self.pending[0], self.requests[self.pending[0]])
            if (self.live or admitted) and rows + live.num_rows > capacity:
                break
            self.pending.popleft()
            admitted.append(live)
            rows += live.num_rows
        if not admitted:
            return None
        prompts = [p for live in admitted for p in live.prompts]
        new_shards, logits = self.engine._prefill(prompts, self.max_new_tokens, self.hidden)
        self._attach(new_shards)
        count = len(admitted)
        device = self.device
        self.live.extend(admitted)
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(count, self.max_new_tokens)])
        self.count = torch.cat([self.count, self.count.new_zeros(count)])
        self.size_sum = torch.cat([self.size_sum, self.size_sum.new_zeros(count)])
        self.size_sq_sum = torch.cat([self.size_sq_sum, self.size_sq_sum.new_zeros(count)])
        self.expansion = torch.cat([self.expansion, self.expansion.new_zeros(count)])
        self.last = torch.cat([self.last, torch.zeros(count, dtype=torch.long, device=device)])
        self._index()
        return logits

    def _attach(self, new_shards: list[_Shard]) -> None:
        """Append shards, merging into the last shard while it has room (rows stay in order)."""
        capacity = self.engine.max_batch_rows
        for shard in new_shards:
            while shard is not None and shard.num_rows:
                if self.shards and self.shards[-1].num_rows < capacity:
                    room = capacity - self.shards[-1].num_rows
                    if shard.num_rows <= room:
                        head, shard = shard, None
                    else:
                        head, shard = shard.split(room, self.max_new_tokens)
                    self.shards[-1] = _Shard.concat(self.shards[-1], head, self.max_new_tokens)
                else:
                    if shard.num_rows <= capacity:
                        self.shards.append(shard)
                        shard = None
                    else:
                        head, shard = shard.split(capacity, self.max_new_tokens)
                        self.shards.append(head)

    def _evict(self, finished_slots: list[int]) -> None:
        gone = set(finished_slots)
        keep_slots = [s for s in range(len(self.live)) if s not in gone]
        keep_rows_mask = torch.ones(self._live_rows(), dtype=torch.bool)
        offset = 0
        for slot, live in enumerate(self.live):
            if slot in gone:
                keep_rows_mask[offset : offset + live.num_rows] = False
            offset += live.num_rows
        shards, start = [], 0
        for shard in self.shards:
            local = keep_rows_mask[start : start + shard.num_rows].nonzero().flatten()
            start += shard.num_rows
            if local.numel():
                shards.append(shard.select(local.to(self.device), self.max_new_tokens))
        self.shards = []
        self._attach(shards)  # also compacts shards that fit together again
        keep = torch.tensor(keep_slots, dtype=torch.long, device=self.device)
        self.live = [self.live[s] for s in keep_slots]
        for name in ("tokens", "count", "size_sum", "size_sq_sum", "expansion", "last"):
            setattr(self, name, getattr(self, name).index_select(0, keep))
        self._index()

    # ---------------------------------------------------------------- one step

    @torch.inference_mode()
    def _compute(self) -> list[FinishedText]:
        # 1. logits of the live rows: one forward per shard with each text's last token ...
        parts = []
        if self.shards:
            input_ids = self.last.index_select(0, self.row_text)
            start, shards = 0, []
            for shard in self.shards:
                shard, logits = self.engine._decode(shard, input_ids[start : start + shard.num_rows], self.hidden)
                start += shard.num_rows
                shards.append(shard)
                parts.append(logits)
            self.shards = shards
        # ... then the prefill of texts that join now (their rows come last)
        joined = self._admit()
        if joined is not None:
            parts.append(joined)
        row_logits = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

        # 2. the mechanism for every live text at once
        neighbour_result = None
        if self.hidden:
            public, log_probs = self._support_log_probs(row_logits)
        else:
            public, private = row_logits.index_select(0, self.public_row), row_logits[self.reference_rows]
            if self.neighbours:
                neighbour_result = self.mechanism.neighbour_log_probs(private, public)
                log_probs = neighbour_result.actual
            else:
                log_probs = self.mechanism.token_log_probs(private, public)
        step = None
        if self.observer is not None or self.sampling_rule is not None:
            step = DecodeStep(
                mechanism=self.mechanism,
                request_indices=self.request_indices,
                positions=self.count,
                public_logits=public,
                private_logits=private,
                log_probs=log_probs,
                neighbours=neighbour_result,
            )
        sampling = log_probs
        if self.sampling_rule is not None:
            sampling = self.sampling_rule(step)
            if not isinstance(sampling, torch.Tensor) or sampling.shape != log_probs.shape:
                raise ValueError(
                    f"sampling_rule must return a tensor of shape {tuple(log_probs.shape)}; got "
                    f"{getattr(sampling, 'shape', type(sampling).__name__)}"
                )
        tokens = sample_tokens(sampling, self.generator)
        if step is not None:
            step.sampling_log_probs = sampling
            step.tokens = tokens
            if self.observer is not None:
                self.observer(step)

        # 3. bookkeeping on the device
        slots = torch.arange(tokens.shape[0], device=self.device)
        self.tokens[slots, self.count] = tokens
        self.count = self.count + 1
        size = torch.isfinite(log_probs).sum(dim=-1).to(torch.float64)
        self.size_sum = self.size_sum + size
        self.size_sq_sum = self.size_sq_sum + size * size
        if self.top_k is not None:
            kth = torch.topk(public, self.top_k, dim=-1).values[:, -1]
            outside = public.gather(1, tokens[:, None])[:, 0] < kth
            self.expansion = self.expansion + outside.long()
        self.last = tokens
        self.last_step_tokens = int(tokens.shape[0])
        finished = self.count >= self.max_new_tokens
        if self.stop_at_eos:
            finished = finished | torch.isin(tokens, self.eos)
        if not bool(finished.any()):
            return []
        return self._finish(finished)

    def _support_log_probs(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mechanism from the rows' last hidden states, private logits on the Top-k+ columns only.

        Public logits (G, V) come from the output layer; the columns holding every text's ``V_k+``
        come from :func:`~invink_audit.mechanism.topk_plus_columns`, and the private logits are the
        output layer's rows for those columns only (when the sets take the whole vocabulary, the full
        private logits are computed instead). Every other token has probability exactly zero.
        Returns (public logits, log-probs (G, V)).
        """
        split, mechanism = self.engine._split, self.mechanism
        public = split.head(states.index_select(0, self.public_row))
        index = topk_plus_columns(public, mechanism.top_k, mechanism.clip_norm, mechanism.batch_size)
        if index is None:
            private, compact_public = split.head(states[self.reference_rows]), public
        else:
            texts, width, hidden_size = index.shape[0], index.shape[1], states.shape[-1]
            weight = split.head.weight.index_select(0, index.reshape(-1)).view(texts, width, hidden_size)
            private = torch.bmm(states[self.reference_rows], weight.transpose(1, 2))  # (G, B, m)
            if split.head.bias is not None:
                private = private + split.head.bias[index].unsqueeze(-2)
            compact_public = public.gather(-1, index)
        # a null reference has no row of its own: its row IS the public row, so its logits must be the
        # public logits exactly (clipped difference exactly 0, sensitivity C/B), not a second GEMM's
        # rounding of them
        null = (self.reference_rows == self.public_row.unsqueeze(-1)).unsqueeze(-1)
        private = torch.where(null, compact_public.unsqueeze(-2), private)
        compact = mechanism.token_log_probs(private, compact_public)
        if index is None:
            return public, compact
        log_probs = torch.full(public.shape, -math.inf, dtype=compact.dtype, device=compact.device)
        return public, log_probs.scatter_(-1, index, compact)

    def _finish(self, finished: torch.Tensor) -> list[FinishedText]:
        slots = finished.nonzero().flatten()
        counts = self.count[slots].tolist()
        tokens = self.tokens[slots].tolist()
        size_sum = self.size_sum[slots].tolist()
        size_sq = self.size_sq_sum[slots].tolist()
        expansion = self.expansion[slots].tolist()
        results = []
        for i, slot in enumerate(slots.tolist()):
            live = self.live[slot]
            n = counts[i]
            ids = tuple(tokens[i][:n])
            mean = size_sum[i] / n
            variance = max(size_sq[i] / n - mean * mean, 0.0)
            eos = self.stop_at_eos and ids[-1] in self.model.eos_token_ids
            results.append(
                FinishedText(
                    request_index=live.request_index,
                    key=live.request.key,
                    token_ids=ids,
                    finish_reason=FINISH_EOS if eos else FINISH_LENGTH,
                    topk_plus_size_mean=mean,
                    topk_plus_size_std=math.sqrt(variance),
                    expansion_tokens=int(expansion[i]),
                )
            )
        self._evict(slots.tolist())
        return results

    def step(self) -> list[FinishedText]:
        return self._compute()
