r"""The model's forward passes over rows: chunked prefill of one row, one decoding pass over many.

:class:`RowForward` runs a loaded model over rows whose new tokens are packed into one sequence
(:mod:`invink_audit.rows`: no padding, each row attends to its own cache). It is the engine's only way
to the model and the public extension point for code that needs the same forward passes without the
mechanism (the benchmark's bare rows). :func:`output_layer_split` is the probe that decides whether a
model's logits are exactly its output layer applied to its last hidden state (then the engine computes
private logits on the Top-k+ columns only).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

import torch

from invink_audit.models import LoadedModel
from invink_audit.rows import (
    DecodePlan,
    KVPool,
    KVStore,
    PoolPlan,
    PrefillChunk,
    RowKV,
    StoredRow,
    pack_kwargs,
    packed_attention,
)

__all__ = [
    "ForwardStats",
    "OutputLayerSplit",
    "RowForward",
    "UnsupportedModelError",
    "check_packed_attention",
    "output_layer_split",
    "to_device",
]


class UnsupportedModelError(ValueError):
    """The model's attention is not what the packed rows reproduce (e.g. attention sinks, ALiBi)."""


def to_device(values, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """A host list as a tensor on ``device``; on CUDA through pinned memory, without waiting for the device
    (a copy from pageable memory would synchronise: the decoding loop keeps one sync per step)."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


@dataclasses.dataclass(frozen=True)
class OutputLayerSplit:
    decoder: torch.nn.Module  # input ids → last hidden states (with the cache)
    head: torch.nn.Module  # hidden states → logits: the output layer without autograd (_InferenceHead)


class _InferenceHead(torch.nn.Module):
    """The model's output layer (a ``torch.nn.Linear``) with its ``weight`` and ``bias`` detached (views,
    no copy) and applied without autograd, bitwise as the layer itself. The decoder runs under
    ``torch.inference_mode`` in :class:`RowForward`; the engine applies the head outside it, in its step
    arithmetic, which writes into its own buffers (``out=``): on a model whose parameters still require
    gradients (a user's own model, not frozen) the layer itself would make every result require them."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight.detach()

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.linear.bias is None else self.linear.bias.detach()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight, self.bias)


# config attributes of models whose logits are not just the output layer (scaled or soft-capped)
_LOGIT_TRANSFORMS = (
    "final_logit_softcapping",
    "logit_scale",
    "logits_scaling",
    "output_multiplier_scale",
    "output_multiplier",
    "lm_head_multiplier",
)


def output_layer_split(model: LoadedModel) -> OutputLayerSplit | None:
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
            last = to_device([ids.shape[1] - 1], model.device)  # an index, not 1: see RowForward._run
            full = network(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=last).logits[:, -1, :]
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
    return OutputLayerSplit(decoder=decoder, head=_InferenceHead(head))


@dataclasses.dataclass
class ForwardStats:
    """What the forward passes processed, and their wall-clock time (with :attr:`RowForward.stats` set).

    ``*_tokens``/``*_rows`` count real work; ``placeholder_rows`` the rows that only kept a decoding
    pass's shape; ``kv_tokens`` the cached keys that decoding rows attended to, ``kv_processed`` the
    key positions their attention processed (each row is padded to its own length bucket only).
    """

    prefill_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_calls: int = 0
    decode_seconds: float = 0.0
    decode_rows: int = 0
    placeholder_rows: int = 0
    kv_tokens: int = 0
    kv_processed: int = 0


class RowForward:
    """The model's forward pass over packed rows (see :mod:`invink_audit.rows`): the extension point
    for code that needs the engine's forward passes without its mechanism (the benchmark's bare rows).

    ``prefill(row, ids)`` appends a prompt (or a chunk of one) to a :class:`~invink_audit.rows.RowKV`
    (``new_row``) and returns the output at its last token; ``new_store().insert(row, public=...)`` moves a
    prefilled row into a :class:`~invink_audit.rows.KVStore` (or ``new_pool(rows)``, a
    :class:`~invink_audit.rows.KVPool`); ``decode(rows, ids)`` appends one token to every row of the stores involved (``None``: a
    placeholder row) and returns one output per row. Outputs are last hidden states with ``hidden=True`` (requires
    :attr:`decoder`), else logits. Set ``stats`` to a :class:`ForwardStats` to count and time the
    passes (on CUDA each timed pass synchronises: benchmarks only).
    """

    def __init__(self, model: LoadedModel):
        self.model = model
        self.network = model.model
        self.decoder: torch.nn.Module | None = None
        self.stats: ForwardStats | None = None
        #: decoding passes over pools captured as CUDA graphs and replayed (CUDA only; else eager)
        self.graphs = _DecodeGraphs(self)
        config = self.network.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.num_layers = int(text.num_hidden_layers)
        self.heads = int(text.num_attention_heads)
        #: the scales the model's attention modules pass to the attention (what a pool's probe calls with)
        self.scales = tuple({m.scaling: None for m in self.network.modules() if hasattr(m, "scaling")
                             and hasattr(m, "layer_idx")}) or (None,)
        positions = getattr(text, "max_position_embeddings", None)
        self.max_positions = int(positions) if isinstance(positions, int) and positions > 0 else None

    def new_row(self, reserve: int) -> RowKV:
        return RowKV(self.num_layers, reserve)

    def new_store(self) -> KVStore:
        """A store for decoding rows in length buckets (see :class:`KVStore`)."""
        return KVStore(self.num_layers)

    def new_pool(self, rows: int) -> KVPool:
        """A pool for decoding rows (one attention call per layer for all of them; see :class:`KVPool`), sized
        for ``rows`` rows (public information: it fixes the pass's shape)."""
        return KVPool(self.num_layers, rows, heads=self.heads, scales=self.scales)

    @torch.inference_mode()
    def pool_pass(self, plan: PoolPlan, *, hidden: bool) -> torch.Tensor:
        """The model over every slot of ``plan``'s pools (bound to its token ids and positions): (slots, features)."""
        with packed_attention(self.network):
            kwargs = pack_kwargs(plan, self.model.device)
            if hidden:
                return self.decoder(input_ids=plan.ids, position_ids=plan.positions, **kwargs).last_hidden_state[0]
            return self.network(input_ids=plan.ids, position_ids=plan.positions, logits_to_keep=0, **kwargs).logits[0]

    @torch.inference_mode()
    def _run(self, layout: PrefillChunk | DecodePlan, flat_ids: list[int], positions: list[int], *, hidden: bool,
             last_only: bool) -> torch.Tensor:
        device = self.model.device
        input_ids = to_device([flat_ids], device)
        position_ids = to_device([positions], device)
        with packed_attention(self.network):
            if hidden:
                out = self.decoder(input_ids=input_ids, position_ids=position_ids, **pack_kwargs(layout, device))
                return out.last_hidden_state[0]
            # the last position as an index, not ``logits_to_keep=1``, whose slice (batch stride: the packed length)
            # torch's bfloat16 CPU linear multiplies through a copy of the whole output layer (1.5 s a prefill on
            # Gemma 3's 262k vocabulary); the index gives a fresh (1, 1, features) and the same logits
            keep = to_device([len(flat_ids) - 1], device) if last_only else 0
            out = self.network(
                input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep, **pack_kwargs(layout, device)
            )
            return out.logits[0]

    def _clock(self) -> float | None:
        if self.stats is None:
            return None
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter()

    def prefill(self, row: RowKV, ids: Sequence[int], *, hidden: bool) -> torch.Tensor:
        """Append ``ids`` (a prompt or a chunk of one) to ``row``; the output at the last token (1-D)."""
        started = self._clock()
        pack = PrefillChunk(row, len(ids))
        features = self._run(pack, list(ids), list(range(row.length, row.length + len(ids))), hidden=hidden,
                             last_only=True)
        pack.commit()
        if self.stats is not None:
            self.stats.prefill_seconds += self._clock() - started
            self.stats.prefill_calls += 1
            self.stats.prefill_tokens += len(ids)
        return features[-1]

    def decode(self, rows: Sequence[StoredRow | None], ids: Sequence[int], *, hidden: bool) -> torch.Tensor:
        """Append ``ids[i]`` to ``rows[i]`` (rows of :class:`~invink_audit.rows.KVStore` s, every row of
        which must take part; ``None``: a placeholder); outputs (rows, features)."""
        started = self._clock()
        for row in rows:
            if row is not None:
                row.ready()
        stores = list({id(r.store): r.store for r in rows if r is not None}.values())
        if stores and isinstance(stores[0], KVPool):
            plan = PoolPlan(stores, rows, ids)
            flat_ids, positions, order = plan.host
            device = self.model.device
            features = self.graphs.run(plan, to_device([flat_ids], device), to_device([positions], device), hidden)
            features = features.index_select(0, to_device(order, device))
            processed = sum(pool.capacity * pool.width for pool in stores)
        else:
            plan = DecodePlan(rows, self.model.device, to_device)
            features = self._run(plan, list(ids), plan.positions(), hidden=hidden, last_only=False)
            processed = sum(group.bucket.width * (group.stop - group.start) for group in plan.groups)
        if self.stats is not None:
            stats = self.stats
            stats.decode_seconds += self._clock() - started
            real = [row for row in rows if row is not None]
            stats.decode_rows += len(real)
            stats.placeholder_rows += len(rows) - len(real)
            stats.kv_tokens += sum(row.length + 1 for row in real)
            stats.kv_processed += processed
        plan.commit()
        return features


@dataclasses.dataclass(frozen=True)
class _Captured:
    graph: object  # torch.cuda.CUDAGraph
    ids: torch.Tensor  # the static inputs the replay reads
    positions: torch.Tensor
    output: torch.Tensor  # the static output it writes


class _DecodeGraphs:
    """Decoding passes over pools as CUDA graphs: captured once per layout of the pools (:meth:`PoolPlan.signature`:
    which pools, their buffers' version and shape) and output kind, then replayed with the step's token ids and
    positions copied into the captured inputs; the pools' keys and values are written inside the graph, as in an
    eager pass. Elsewhere than on CUDA, with ``enabled`` False, or after a capture failed (warned once), the pass
    runs eagerly: the same function, the same arithmetic. ``captures`` counts the captures (each synchronises)."""

    def __init__(self, forward: RowForward):
        self.forward = forward
        self.enabled = True
        self.captures = 0
        self._graphs: dict = {}
        self._memory = None

    def run(self, plan: PoolPlan, ids: torch.Tensor, positions: torch.Tensor, hidden: bool) -> torch.Tensor:
        if not self.enabled or ids.device.type != "cuda":
            plan.bind(ids, positions)
            return self.forward.pool_pass(plan, hidden=hidden)
        key = (plan.signature(), hidden)
        if key not in self._graphs:
            self._graphs.clear()  # a new layout: the pools were reallocated, older graphs read freed buffers
            try:
                self._graphs[key] = self._capture(plan, ids, positions, hidden)
            except RuntimeError as err:
                self.enabled = False
                warnings.warn(f"CUDA graph capture of the decoding pass failed ({err}); decoding eagerly", stacklevel=2)
                return self.run(plan, ids, positions, hidden)
        captured = self._graphs[key]
        captured.ids.copy_(ids, non_blocking=True)
        captured.positions.copy_(positions, non_blocking=True)
        captured.graph.replay()
        return captured.output

    def _capture(self, plan: PoolPlan, ids: torch.Tensor, positions: torch.Tensor, hidden: bool) -> _Captured:
        """Warm up on a side stream (it writes this step's keys and values, as the replay then does again), then
        capture the pass reading static copies of the inputs."""
        device = ids.device
        static_ids, static_positions = ids.clone(), positions.clone()
        plan.bind(static_ids, static_positions)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.forward.pool_pass(plan, hidden=hidden)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._memory is None:
            self._memory = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        plan.bind(static_ids, static_positions)  # masks computed inside the graph
        with torch.cuda.graph(graph, pool=self._memory):
            output = self.forward.pool_pass(plan, hidden=hidden)
        self.captures += 1
        return _Captured(graph, static_ids, static_positions, output)


def check_packed_attention(model: LoadedModel, *, pool: bool = False) -> None:
    """Refuse a model whose own forward pass the packed rows do not reproduce.

    The rows' attention (:mod:`invink_audit.rows`) is plain scaled dot-product attention, causal, with an
    optional sliding window; an architecture with more (attention sinks, ALiBi or other position
    biases, soft-capping, a layer that bypasses transformers' attention interface) would be computed
    wrongly, or would attend across rows. Probe: two rows of different lengths, prefilled in two chunks
    and decoded for two steps next to a placeholder (in a :class:`~invink_audit.rows.KVPool` with ``pool``, else
    in length buckets), against the model's own uncached forward pass of each row, logit by logit (16 units in
    the last place of the model's dtype, relative to the largest logit, plus float32 accumulation noise). Raises
    :class:`UnsupportedModelError`.
    """
    vocab = model.vocab_size
    prompts = [[(7919 * i + 3) % vocab for i in range(1, 12)], [(104729 * i + 5) % vocab for i in range(1, 7)]]
    steps = [[(31 * i + 11) % vocab, (37 * i + 13) % vocab] for i in range(2)]
    forward = RowForward(model)
    forward.graphs.enabled = False  # the probe checks the arithmetic; a capture would only cost time
    try:
        with torch.inference_mode():
            store, got = (forward.new_pool(2) if pool else forward.new_store()), []
            stored = []
            for prompt in prompts:
                row = forward.new_row(2)
                forward.prefill(row, prompt[:4], hidden=False)
                got.append([forward.prefill(row, prompt[4:], hidden=False)])
                stored.append(store.insert(row))
            for t in range(2):
                out = forward.decode([stored[0], None, stored[1]], [steps[0][t], 0, steps[1][t]], hidden=False)
                got[0].append(out[0])
                got[1].append(out[2])
            worst = 0.0
            for prompt, tokens, outs in zip(prompts, steps, got):
                ids = torch.tensor([prompt + tokens], device=model.device)
                expected = model.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : len(prompt) + 2]
                actual = torch.stack(outs).to(expected.dtype)
                scale = float(expected.abs().max()) + 1.0
                tolerance = 16 * torch.finfo(expected.dtype).eps * scale + 64 * torch.finfo(torch.float32).eps * scale
                if not bool(torch.isfinite(actual).all()):
                    worst = float("inf")
                else:
                    worst = max(worst, float((actual - expected).abs().max()) / tolerance)
    except UnsupportedModelError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of the probe means: not supported
        raise UnsupportedModelError(
            f"model {model.name!r}: the engine's packed rows cannot run this architecture ({type(err).__name__}: "
            f"{err}); supported: plain scaled dot-product attention, full or sliding-window"
        ) from err
    if worst > 1.0:
        raise UnsupportedModelError(
            f"model {model.name!r}: the engine's packed rows do not reproduce this model's attention (probe off "
            f"by {worst:.1f}x its tolerance); supported: plain scaled dot-product attention, full or "
            "sliding-window (not attention sinks, ALiBi or other position biases)"
        )
