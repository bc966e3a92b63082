"""Rows and their key/value caches, without padding: each row attends to its own tokens only.

:class:`RowKV` and :class:`PrefillChunk` (one row's cache and prefill); decoding rows either in length
buckets (:class:`KVStore` with :func:`bucket_length`: little padding, one attention call per bucket, the CPU's
layout) or in one pool (:class:`KVPool`: static shapes, one attention call per layer for every row, the GPU's
layout); and the packed attention registered with transformers under :data:`ATTENTION_NAME`
(:func:`packed_attention`).

Design: docs/design/engine.md (§"Inside the code", and "No padding between rows").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_NAME",
    "MIN_BUCKET_ROWS",
    "DecodePlan",
    "KVPool",
    "KVStore",
    "KV_LAYOUTS",
    "KV_TILE",
    "PoolPlan",
    "PoolShape",
    "PrefillChunk",
    "RowKV",
    "StoredRow",
    "bucket_length",
    "default_kv_layout",
    "default_max_batch_rows",
    "packed_attention",
    "pool_capacity",
    "pool_width",
    "tile_invariant_attention",
]

#: Where decoding rows' caches live (``Engine(kv_layout=...)``): ``"buckets"``, length buckets with little padding
#: and one attention call per bucket (:class:`KVStore`; compute-bound devices: the CPU's default); ``"pool"``, one
#: pool with static shapes and one attention call per layer (:class:`KVPool`), captured as a CUDA graph on CUDA
#: (launch-bound devices: CUDA's default).
KV_LAYOUTS = ("buckets", "pool")
#: Name of the attention implementation registered with transformers.
ATTENTION_NAME = "invink_rows"
#: Rows a decoding bucket is allocated for at first; it doubles when full (:meth:`_Bucket._room`).
MIN_BUCKET_ROWS = 4
_PACK_KWARG = "invink_pack"


def default_kv_layout(device: torch.device | str) -> str:
    """The engine's layout when the caller gives none: ``"pool"`` on CUDA, ``"buckets"`` elsewhere."""
    return "pool" if torch.device(device).type == "cuda" else "buckets"


def default_max_batch_rows(device: torch.device | str) -> int:
    """Rows per forward pass when the caller gives none: 64 on CPU, 256 on CUDA."""
    return 256 if torch.device(device).type == "cuda" else 64


class RowKV:
    """The key/value cache of one row: per layer, buffers ``(1, kv_heads, capacity, head_dim)``.

    ``length`` is the number of cached tokens (the same in every layer between forward passes).
    Buffers are allocated at the first write, for ``capacity`` tokens (the prompt and the tokens to
    come, when the caller knows them) or the written tokens plus ``reserve``, whichever is larger, and
    double when full.
    """

    __slots__ = ("keys", "values", "length", "reserve", "capacity")

    def __init__(self, num_layers: int, reserve: int, capacity: int = 0):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.length = 0
        self.reserve = reserve
        self.capacity = capacity

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` (1, kv_heads, n, head_dim) after the cached tokens of ``layer``;
        returns views of the whole cache of that layer (the new tokens included)."""
        start, count = self.length, keys.shape[2]
        end = start + count
        buffer = self.keys[layer]
        if buffer is None or end > buffer.shape[2]:
            capacity = max(end + self.reserve, self.capacity) if buffer is None else max(end, 2 * buffer.shape[2])
            self.keys[layer] = self._grow(buffer, keys, start, capacity)
            self.values[layer] = self._grow(self.values[layer], values, start, capacity)
        self.keys[layer][:, :, start:end].copy_(keys)
        self.values[layer][:, :, start:end].copy_(values)
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    @staticmethod
    def _grow(buffer: torch.Tensor | None, like: torch.Tensor, filled: int, capacity: int) -> torch.Tensor:
        grown = like.new_zeros((1, like.shape[1], capacity, like.shape[3]))
        if buffer is not None and filled:
            grown[:, :, :filled].copy_(buffer[:, :, :filled])
        return grown

    def allocated_bytes(self) -> int:
        """Bytes of the key/value buffers this row has allocated (a read-only report)."""
        return sum(t.nbytes for t in (*self.keys, *self.values) if t is not None)

    def copy(self, reserve: int, capacity: int = 0) -> RowKV:
        """An independent copy of the filled part (bitwise), with room for ``reserve`` more tokens (or
        ``capacity`` tokens in all, if more)."""
        twin = RowKV(len(self.keys), reserve)
        twin.length = self.length
        size = max(self.length + reserve, capacity)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None:
                twin.keys[layer] = self._grow(k, k, self.length, size)
                twin.values[layer] = self._grow(v, v, self.length, size)
        return twin


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """The layout of one prefill forward pass: the next ``count`` prompt tokens of one row (rows are
    prefilled alone, so no row's prefill ever shares a pass with another row)."""

    row: RowKV
    count: int

    def commit(self) -> None:
        """After the forward pass: the row's cache now holds the chunk."""
        self.row.length += self.count


# --------------------------------------------------------------------------------------------
# decoding: rows in length buckets, one batched attention per bucket


def bucket_length(length: int) -> int:
    """The attention length of a row with ``length`` cached tokens: ``length`` rounded up to a multiple of
    ``max(16, 2**(floor(log2 length) - 3))`` (at most 1/8 more, about 6% on average).

    A function of the row's own length only: which other rows share its bucket cannot change the
    shapes of its arithmetic.
    """
    step = max(16, 1 << max(0, length.bit_length() - 4))
    return -(-length // step) * step


class StoredRow:
    """A decoding row's place in a :class:`KVStore` or :class:`KVPool`: its bucket, its slot there, its cached
    length, and whether it is ``public`` (its attention's result must depend on nothing but its own keys)."""

    __slots__ = ("store", "bucket", "slot", "length", "public")

    def __init__(self, store: KVStore | KVPool | None, bucket: _Bucket | None, slot: int, length: int,
                 public: bool = False):
        self.store, self.bucket, self.slot, self.length, self.public = store, bucket, slot, length, public

    def ready(self) -> None:
        """Before a decoding pass: move to the bucket of the next length if that changed."""
        self.store.ready(self)


class _Bucket:
    """Rows of one attention length ``width``: per layer, keys and values ``(capacity, kv_heads, width,
    head_dim)``; rows in use occupy slots ``0..len(rows)`` (compact), unused positions hold zeros or
    another row's old (finite) values, always masked."""

    def __init__(self, width: int, num_layers: int):
        self.key: object = width
        self.width = width
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.rows: list[StoredRow] = []

    def _room(self, like: torch.Tensor) -> None:
        """Make room for one more row (capacity doubles; zero-filled)."""
        count = len(self.rows)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is None or count >= k.shape[0]:
                capacity = max(MIN_BUCKET_ROWS, 2 * count)
                shape = (capacity, like.shape[1], self.width, like.shape[3])
                grown_k, grown_v = like.new_zeros(shape), like.new_zeros(shape)
                if k is not None and count:
                    grown_k[:count].copy_(k[:count])
                    grown_v[:count].copy_(v[:count])
                self.keys[layer], self.values[layer] = grown_k, grown_v

    def add(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], length: int, public: bool) -> StoredRow:
        """A new row holding ``keys[layer][..., :length, :]`` (any leading shape ``(1, kv_heads)``)."""
        self._room(keys[0])
        row = StoredRow(None, self, len(self.rows), length, public)
        self.rows.append(row)
        for layer in range(len(self.keys)):
            self.keys[layer][row.slot, :, :length].copy_(keys[layer][0, :, :length])
            self.values[layer][row.slot, :, :length].copy_(values[layer][0, :, :length])
        return row

    def remove(self, row: StoredRow) -> None:
        """Take ``row`` out; the last row moves into its slot (slots stay compact)."""
        last = self.rows.pop()
        if last is not row:
            for layer in range(len(self.keys)):
                self.keys[layer][row.slot, :, : last.length].copy_(self.keys[layer][last.slot, :, : last.length])
                self.values[layer][row.slot, :, : last.length].copy_(self.values[layer][last.slot, :, : last.length])
            last.slot = row.slot
            self.rows[row.slot] = last
        row.bucket = None


class KVStore:
    """The caches of decoding rows, grouped by :func:`bucket_length` so that one attention call serves
    every row of a bucket: each row's arithmetic has the shapes of its own bucket, and the matrix
    products and softmax of a batch compute each row independently of the others (bitwise on CPU,
    checked in ``tests/test_engine_rows.py``). A public row (``insert(row, public=True)``) gets a bucket of
    its own (one call per row: its shapes depend on nothing but itself, on any device). Buckets that empty are
    dropped (their memory freed)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.buckets: dict[object, _Bucket] = {}
        self._made = 0

    def _bucket(self, width: int, solo: bool) -> _Bucket:
        key = (width, self._made) if solo else width
        self._made += 1
        if key not in self.buckets:
            self.buckets[key] = _Bucket(width, self.num_layers)
            self.buckets[key].key = key
        return self.buckets[key]

    def _take_out(self, row: StoredRow) -> None:
        bucket = row.bucket
        bucket.remove(row)
        if not bucket.rows:  # an empty bucket frees its memory
            del self.buckets[bucket.key]

    def allocated_bytes(self) -> int:
        """Bytes of the key/value buffers of this store's buckets, every slot allocated (a read-only report)."""
        return sum(t.nbytes for b in self.buckets.values() for t in (*b.keys, *b.values) if t is not None)

    def insert(self, row: RowKV, *, public: bool = False) -> StoredRow:
        """Move a prefilled row in (its cache is copied; the :class:`RowKV` can be dropped)."""
        stored = self._bucket(bucket_length(row.length + 1), public).add(row.keys, row.values, row.length, public)
        stored.store = self
        return stored

    def remove(self, row: StoredRow) -> None:
        if row.bucket is not None:
            self._take_out(row)

    def reserve(self) -> None:
        """A null reference's place: none (a decoding pass keeps its placeholder row in the caller's order)."""

    def ready(self, row: StoredRow) -> None:
        """Before a decoding pass: move ``row`` to the bucket of its next length if that changed."""
        width = bucket_length(row.length + 1)
        old = row.bucket
        if old.width == width:
            return
        keys = [k[row.slot : row.slot + 1] for k in old.keys]
        values = [v[row.slot : row.slot + 1] for v in old.values]
        moved = self._bucket(width, row.public).add(keys, values, row.length, row.public)
        self._take_out(row)
        row.bucket, row.slot = moved.bucket, moved.slot
        moved.bucket.rows[moved.slot] = row


@dataclasses.dataclass(frozen=True)
class _Group:
    """The rows of one bucket in a decoding pass: ``start:stop`` in the plan's bucket order, their
    cached lengths (where each new token goes), and their masks."""

    bucket: _Bucket
    start: int
    stop: int
    positions: torch.Tensor  # (n,) int64

    def visible(self, window: int | None, cache: dict) -> torch.Tensor:
        """(n, 1, 1, width) bool: key j is visible to the new token at ``positions`` (and in the window)."""
        key = (self.start, window)
        if key not in cache:
            j = torch.arange(self.bucket.width, device=self.positions.device)
            mask = j <= self.positions[:, None]
            if window is not None:
                mask &= j > self.positions[:, None] - window
            cache[key] = mask[:, None, None, :]
        return cache[key]


class DecodePlan:
    """The layout of one decoding pass: one token per row, rows of :class:`KVStore` s or placeholders.

    ``order`` lists the pack positions of the stored rows bucket by bucket (slot order within a
    bucket), so that each bucket's queries, keys and outputs are one slice of a single gathered tensor.
    """

    def __init__(self, rows: Sequence[StoredRow | None], device: torch.device, to_device):
        self.rows = list(rows)
        self.placeholders = to_device([i for i, r in enumerate(self.rows) if r is None], device)
        where = {id(r): i for i, r in enumerate(self.rows) if r is not None}
        buckets = {id(r.bucket): r.bucket for r in self.rows if r is not None}
        order, lengths, self.groups = [], [], []
        for bucket in buckets.values():
            start = len(order)
            order += [where[id(r)] for r in bucket.rows]
            lengths += [r.length for r in bucket.rows]
            self.groups.append((bucket, start, len(order)))
        self.order = to_device(order, device)
        positions = to_device(lengths, device)
        self.groups = [_Group(b, a, z, positions[a:z]) for b, a, z in self.groups]
        self.masks: dict = {}

    def positions(self) -> list[int]:
        return [0 if r is None else r.length for r in self.rows]

    def commit(self) -> None:
        for row in self.rows:
            if row is not None:
                row.length += 1


def _decode_attention(plan: DecodePlan, layer, query, key, value, scaling, window) -> torch.Tensor:
    """One new token per row: for each bucket, write the rows' new keys/values at their lengths, then
    one batched attention over the bucket's width (positions beyond a row's length masked)."""
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    groups, count = heads // kv_heads, query.shape[2]
    scale = head_dim**-0.5 if scaling is None else scaling
    # the stored rows' queries, keys and values gathered once, bucket by bucket
    queries = query[0].transpose(0, 1).index_select(0, plan.order).view(-1, kv_heads, groups, head_dim)
    new_keys = key[0].transpose(0, 1).index_select(0, plan.order)  # (rows, kv_heads, head_dim)
    new_values = value[0].transpose(0, 1).index_select(0, plan.order)
    outputs = torch.empty_like(queries)
    for group in plan.groups:
        n, bucket, part = group.stop - group.start, group.bucket, slice(group.start, group.stop)
        keys, values = bucket.keys[layer], bucket.values[layer]
        slots = torch.arange(n, device=query.device)
        keys[slots, :, group.positions] = new_keys[part]
        values[slots, :, group.positions] = new_values[part]
        scores = torch.matmul(queries[part], keys[:n].transpose(-1, -2)).mul_(scale)
        scores.masked_fill_(~group.visible(window, plan.masks), -math.inf)
        # softmax in float32 at least (as transformers' eager attention does for half precision)
        weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
        torch.matmul(weights.to(values.dtype), values[:n], out=outputs[part])
    output = query.new_empty((count, heads, head_dim))
    output.index_copy_(0, plan.order, outputs.view(-1, heads, head_dim))
    if plan.placeholders.numel():  # one token attending to itself: its value
        own = value[0].transpose(0, 1).index_select(0, plan.placeholders).repeat_interleave(groups, dim=1)
        output.index_copy_(0, plan.placeholders, own)
    return output[None]


# --------------------------------------------------------------------------------------------
# decoding: every row in one pool, one attention call per layer

#: Keys per tile of the pool's attention; a pool's width is a multiple of it. An attention kernel that runs over
#: a row's keys tile by tile with an online softmax (PyTorch's CPU flash attention takes tiles of 512 keys from
#: 512 keys on) adds exact zeros for the tiles of masked keys after a row's own and scales by exactly one: the
#: row's result does not depend on the width, nor on the other rows of the call. That is a property of the
#: kernel at a given shape, checked for every shape a pool takes by :func:`tile_invariant_attention`, not an
#: assumption.
KV_TILE = 512
#: Rows a pool holds at least (its capacity is a power of two).
MIN_POOL_ROWS = 8


def pool_capacity(rows: int) -> int:
    """The slots of a pool made for ``rows`` rows: ``max(MIN_POOL_ROWS, 2**ceil(log2 rows))``."""
    return max(MIN_POOL_ROWS, 1 << max(0, rows - 1).bit_length())


def pool_width(length: int) -> int:
    """The pool width that holds ``length`` keys: ``length`` rounded up to a multiple of :data:`KV_TILE`."""
    return -(-max(length, 1) // KV_TILE) * KV_TILE


@dataclasses.dataclass(frozen=True)
class PoolShape:
    """The shapes and arguments of a pool's attention call (one per layer of a pass): queries ``(capacity,
    kv_heads, groups, head_dim)`` (a key/value head's query heads as its query positions), keys and values
    ``(capacity, kv_heads, width, head_dim)``, in ``dtype`` on ``device``, with the ``scale`` the model's
    attention passes (``None``: 1/sqrt(head_dim))."""

    capacity: int
    kv_heads: int
    groups: int
    head_dim: int
    width: int
    dtype: torch.dtype
    device: torch.device
    scale: float | None


def _attend(queries, keys, values, visible, scale) -> torch.Tensor:
    """The pool's attention call, the one :func:`tile_invariant_attention` probes: ``visible`` (rows, 1, 1, keys)."""
    return F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=scale)


def _attend_alone(queries, keys, values, visible, scale, slot: int, width: int) -> torch.Tensor:
    """Row ``slot`` of a pool's call computed alone over its first ``width`` keys: a function of that row's query,
    keys and ``width`` only (what the probe compares the shared call with, and what a public row gets where the
    probe fails)."""
    part = slice(slot, slot + 1)
    return _attend(queries[part], keys[part, :, :width], values[part, :, :width], visible[part, ..., :width], scale)


@functools.cache
def tile_invariant_attention(shape: PoolShape) -> bool:
    """Whether every row of a pool's attention call of ``shape`` is bitwise the row computed alone at the
    narrowest width of whole tiles that holds its keys (:func:`pool_width`), whatever the other rows hold:
    what lets public rows share the call with private ones. Probed once per shape (cached; each reallocation
    of a pool asks), on random queries, keys and values of exactly that shape, with the call the pass makes
    (:func:`_attend`; :func:`_attend_alone` for the row alone), covering every tile count a row can have at this
    width at its first key, its last key and a random one, a third behind a masked prefix, in ⌈3·tiles /
    capacity⌉ calls. Why that suffices: docs/design/engine.md ("In the pool")."""
    device, tiles, capacity = torch.device(shape.device), shape.width // KV_TILE, shape.capacity
    gen = torch.Generator(device=device).manual_seed(0)

    def draw(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=gen, device=device, dtype=shape.dtype)

    queries = draw(capacity, shape.kv_heads, shape.groups, shape.head_dim)
    keys, values = (draw(capacity, shape.kv_heads, shape.width, shape.head_dim) for _ in range(2))
    rounds = -(-3 * tiles // capacity)
    picks = torch.randint(KV_TILE, (rounds * capacity, 2), generator=torch.Generator().manual_seed(0)).tolist()
    j = torch.arange(shape.width, device=device)
    for r in range(rounds):
        cases = range(r * capacity, (r + 1) * capacity)
        ends = [c % tiles * KV_TILE + (1, KV_TILE, 1 + picks[c][0])[c // tiles % 3] for c in cases]
        starts = [picks[c][1] % end if c % 3 == 2 else 0 for c, end in zip(cases, ends)]
        ends_t, starts_t = torch.tensor(ends, device=device), torch.tensor(starts, device=device)
        visible = ((j < ends_t[:, None]) & (j >= starts_t[:, None]))[:, None, None, :]
        shared = _attend(queries, keys, values, visible, shape.scale)
        for slot, end in enumerate(ends):
            alone = _attend_alone(queries, keys, values, visible, shape.scale, slot, pool_width(end))
            if not torch.equal(shared[slot : slot + 1], alone):
                return False
    return True


class KVPool:
    """The caches of decoding rows in one pool: per layer, keys and values ``(capacity, kv_heads, width,
    head_dim)``, one slot per row. A decoding pass (:class:`PoolPlan`) runs every slot, a free one as a scratch
    row, so its shapes are the pool's alone: ``capacity`` (a power of two, at least the rows the pool was made
    for, which the engine derives from public information: texts in progress × (B + 1)) and ``width`` (a multiple
    of :data:`KV_TILE`, at least every row's next length, grown by whole tiles). ``heads`` query heads attend
    with each ``scales`` (the model's attention modules' scales).

    One attention call per layer serves every row; every reallocation probes the new shape
    (:func:`tile_invariant_attention`, kept in ``shared``), and where it fails the pass computes each public row
    (``insert(row, public=True)``) alone (:func:`_attend_alone`): either way a public row's bits are its alone
    computation at ``pool_width(length + 1)`` (docs/design/engine.md, "In the pool"). ``version`` changes whenever
    the buffers are reallocated (a captured CUDA graph reads the old ones)."""

    def __init__(self, num_layers: int, rows: int, *, heads: int, scales: Sequence[float | None]):
        self.num_layers = num_layers
        self.capacity = pool_capacity(rows)
        self.heads, self.scales = heads, tuple(scales)
        self.width = 0
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.slots: list[StoredRow | None] = [None] * self.capacity
        self.version = 0
        self.shared = False

    def _resize(self, like: torch.Tensor | None, capacity: int, width: int) -> None:
        for layer, (k, v) in enumerate(zip(self.keys, self.values) if like is not None else ()):
            shape = (capacity, like.shape[1], width, like.shape[3])
            grown_k, grown_v = like.new_zeros(shape), like.new_zeros(shape)
            if k is not None:
                grown_k[: k.shape[0], :, : k.shape[2]].copy_(k)
                grown_v[: v.shape[0], :, : v.shape[2]].copy_(v)
            self.keys[layer], self.values[layer] = grown_k, grown_v
        self.slots += [None] * (capacity - len(self.slots))
        self.capacity, self.width, self.version = capacity, width, self.version + 1
        if like is not None:
            kv_heads, head_dim = like.shape[1], like.shape[3]
            self.shared = all(
                tile_invariant_attention(PoolShape(capacity, kv_heads, self.heads // kv_heads, head_dim, width,
                                                   like.dtype, like.device, scale))
                for scale in self.scales
            )

    def insert(self, row: RowKV, *, public: bool = False) -> StoredRow:
        """Move a prefilled row into a free slot (its cache is copied; the :class:`RowKV` can be dropped)."""
        width = max(self.width, pool_width(row.length + 1))
        if self.keys[0] is None or None not in self.slots or width > self.width:
            self._resize(row.keys[0], self.capacity * (1 if None in self.slots else 2), width)
        stored = StoredRow(self, None, self.slots.index(None), row.length, public)
        self.slots[stored.slot] = stored
        for layer in range(self.num_layers):
            self.keys[layer][stored.slot, :, : row.length].copy_(row.keys[layer][0, :, : row.length])
            self.values[layer][stored.slot, :, : row.length].copy_(row.values[layer][0, :, : row.length])
        return stored

    def reserve(self) -> StoredRow:
        """A slot held for a null reference, so that which slot every other row takes, and so where it sits in
        the pass, does not depend on which references are null; it runs as a scratch row. :meth:`remove` frees it."""
        if None not in self.slots:
            self._resize(self.keys[0], 2 * self.capacity, self.width)
        held = StoredRow(self, None, self.slots.index(None), 0)
        self.slots[held.slot] = held
        return held

    def remove(self, row: StoredRow) -> None:
        if row.slot is not None and self.slots[row.slot] is row:
            self.slots[row.slot], row.slot = None, None

    def ready(self, row: StoredRow) -> None:
        """Before a decoding pass: widen the pool (by whole tiles) if ``row``'s next token would not fit."""
        if row.length + 1 > self.width:
            self._resize(self.keys[0], self.capacity, pool_width(row.length + 1))

    def allocated_bytes(self) -> int:
        """Bytes of the pool's key/value buffers, every slot allocated (a read-only report)."""
        return sum(t.nbytes for t in (*self.keys, *self.values) if t is not None)


class PoolPlan:
    """The layout of one decoding pass over pools: every slot of each pool in turn, one token per slot.

    ``rows`` (the caller's order; ``None`` a placeholder) say where the caller's tokens go; the other slots are
    scratch rows (a free slot writes its key at position 0 and attends to it; a stored row left out writes after
    its cached tokens, where its next token will overwrite it). :attr:`host` holds the pass's token ids and
    positions per slot and, per caller row, the slot its output is read from (a placeholder reads slot 0's:
    meaningless, as a placeholder's output is). :attr:`alone` lists, per pool whose shape failed the tile
    invariance probe (``KVPool.shared`` false), its public rows' (slot, own width): those the pass computes
    alone. :meth:`bind` gives the device tensors the attention reads.
    """

    def __init__(self, pools: Sequence[KVPool], rows: Sequence[StoredRow | None], ids: Sequence[int]):
        self.pools, self.rows, self.starts = list(pools), list(rows), []
        total = 0
        for pool in self.pools:
            self.starts.append(total)
            total += pool.capacity
        start = {id(pool): s for pool, s in zip(self.pools, self.starts)}
        flat_ids, positions = [0] * total, [0] * total
        for pool in self.pools:
            for slot, row in enumerate(pool.slots):
                if row is not None:
                    positions[start[id(pool)] + slot] = row.length
        order = []
        for row, token in zip(self.rows, ids):
            if row is None:
                order.append(0)
                continue
            order.append(start[id(row.store)] + row.slot)
            flat_ids[order[-1]] = token
        self.host = (flat_ids, positions, order)
        self.alone = [() if pool.shared else tuple(
            (slot, pool_width(row.length + 1)) for slot, row in enumerate(pool.slots) if row is not None and row.public
        ) for pool in self.pools]
        self.ids = self.positions = None
        self.masks: dict = {}

    def signature(self) -> tuple:
        """What fixes the pass's shapes and buffers: each pool's identity, buffers' version and size, and the rows
        it computes alone (public information: public rows' slots and lengths)."""
        return tuple((id(p), p.version, p.capacity, p.width, alone) for p, alone in zip(self.pools, self.alone))

    def bind(self, ids: torch.Tensor, positions: torch.Tensor) -> None:
        """The pass's token ids and positions (1, slots) on the device; masks are computed from them."""
        self.ids, self.positions = ids, positions
        self.masks.clear()

    def slots(self, index: int) -> torch.Tensor:
        """0..capacity-1 on the device, for pool ``index`` (made once per pass)."""
        if ("slots", index) not in self.masks:
            self.masks[("slots", index)] = torch.arange(self.pools[index].capacity, device=self.positions.device)
        return self.masks[("slots", index)]

    def visible(self, index: int, window: int | None) -> torch.Tensor:
        """(capacity, 1, 1, width) bool for pool ``index``: key j is visible to its slot's new token at its
        position (and within the sliding window, if any)."""
        if (index, window) not in self.masks:
            pool, start = self.pools[index], self.starts[index]
            positions = self.positions[0, start : start + pool.capacity, None]
            j = torch.arange(pool.width, device=positions.device)
            mask = j <= positions
            if window is not None:
                mask &= j > positions - window
            self.masks[(index, window)] = mask[:, None, None, :]
        return self.masks[(index, window)]

    def commit(self) -> None:
        for row in self.rows:
            if row is not None:
                row.length += 1


def _pool_attention(plan: PoolPlan, layer, query, key, value, scaling, window) -> torch.Tensor:
    """One new token per slot: per pool, write the slots' new keys/values at their positions, then one attention
    call over the pool (each slot's keys past its position masked); in a pool whose shape is not tile invariant,
    each public row's result is then replaced by the row computed alone at its own width (:class:`KVPool`). A
    query head group shares its key/value head: the group's heads enter the call as that head's query positions
    (the same arithmetic, no repeated keys)."""
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    queries = query[0].transpose(0, 1).reshape(-1, kv_heads, heads // kv_heads, head_dim)
    new_keys, new_values = key[0].transpose(0, 1), value[0].transpose(0, 1)
    outputs = []
    for index, pool in enumerate(plan.pools):
        part = slice(plan.starts[index], plan.starts[index] + pool.capacity)
        slots, positions = plan.slots(index), plan.positions[0, part]
        pool.keys[layer][slots, :, positions] = new_keys[part]
        pool.values[layer][slots, :, positions] = new_values[part]
        keys, values, visible = pool.keys[layer], pool.values[layer], plan.visible(index, window)
        outputs.append(_attend(queries[part], keys, values, visible, scaling))
        for slot, width in plan.alone[index]:
            outputs[-1][slot : slot + 1] = _attend_alone(queries[part], keys, values, visible, scaling, slot, width)
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    return output.view(1, -1, heads, head_dim)


def _visible(count: int, past: int, window: int | None, device) -> torch.Tensor | None:
    """Boolean mask (count, past + count): query i (position past + i) sees key j iff j <= past + i and,
    with a sliding window W, j > past + i - W. None when plain causal attention from 0 is exact."""
    total = past + count
    if window is None and past == 0:
        return None
    query = torch.arange(past, total, device=device)[:, None]
    key = torch.arange(total, device=device)[None, :]
    visible = key <= query
    if window is not None:
        visible &= key > query - window
    return visible


def rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function over a :class:`PrefillChunk` or a :class:`DecodePlan`: each row
    attends to its own cache only.

    ``query`` (1, heads, N, head_dim), ``key``/``value`` (1, kv_heads, N, head_dim) hold the pass's new
    tokens. A prefill chunk's keys and values are appended to its row's cache and its queries attend to
    that cache (causally, within the sliding window if any); a decoding pass goes to
    :func:`_decode_attention`. Returns (1, N, heads, head_dim).
    """
    pack: PrefillChunk | DecodePlan | PoolPlan | None = kwargs.get(_PACK_KWARG)
    if pack is None:
        raise RuntimeError(
            f"the {ATTENTION_NAME!r} attention needs the engine's packed layout; this forward pass did not pass it"
        )
    if getattr(module, "attn_logit_softcapping", None) is not None or kwargs.get("softcap") is not None:
        raise ValueError("attention logit soft-capping is not supported by the packed rows attention")
    if dropout:
        raise ValueError("attention dropout must be off (the model is in evaluation mode)")
    layer = module.layer_idx
    window = sliding_window if sliding_window is not None else getattr(module, "sliding_window", None)
    if isinstance(pack, DecodePlan):
        return _decode_attention(pack, layer, query, key, value, scaling, window), None
    if isinstance(pack, PoolPlan):
        return _pool_attention(pack, layer, query, key, value, scaling, window), None
    past = pack.row.length
    keys, values = pack.row.append(layer, key, value)
    mask = _visible(pack.count, past, window, query.device)
    out = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=mask is None, scale=scaling,
        enable_gqa=query.shape[1] > key.shape[1],
    )
    return out.transpose(1, 2), None


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, rows_attention)


@contextlib.contextmanager
def packed_attention(network: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``network``'s attention is :func:`rows_attention`; every config's own setting is
    restored afterwards (its sub-configs' too)."""
    _register()
    config = network.config
    configs = [config, *(getattr(config, name, None) for name in getattr(config, "sub_configs", {}))]
    configs = [c for c in configs if c is not None and hasattr(c, "_attn_implementation_internal")]
    saved = [c._attn_implementation_internal for c in configs]
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        for part, value in zip(configs, saved):
            part._attn_implementation_internal = value


def pack_kwargs(pack: PrefillChunk | DecodePlan | PoolPlan, device: torch.device) -> dict:
    """Keyword arguments of a packed forward pass: the layout, no cache object, and a prepared 4-D mask
    placeholder (transformers returns a 4-D mask as given and builds none; this attention ignores it)."""
    return {
        _PACK_KWARG: pack,
        "use_cache": False,
        # a prepared 4-D mask is passed through untouched; all False, so that a layer which bypassed this
        # attention would attend to nothing and fail loudly (NaN), never across rows
        "attention_mask": torch.zeros((1, 1, 1, 1), dtype=torch.bool, device=device),
    }
