"""Rows do not leak into each other, texts do not depend on their schedule, one host sync per step.

* Row independence: the public row's logits are bitwise identical whether a private
  reference (of the same text or another) is changed, made null, or left alone, in the engine's real
  batching (texts decoded together, texts joining as others finish), on the default Top-k+ path and
  the full-logits path.
* Schedule invariance: with a fixed seed a text's tokens are the same whether it runs with others,
  alone, or with a different ``max_batch_rows`` (each text samples from its own stream).
* GPU-ready loop: the decoding loop transfers to the host once per step (counted on CPU through the
  tensor methods that synchronise on CUDA; on CUDA with ``torch.cuda.set_sync_debug_mode``).
* The first three hold in every dtype the model runs in: on the CPU in float32 and, where the CPU computes
  it natively (``dtype="auto"`` picks it there), bfloat16 (the ``cpu_dtype`` fixture); on CUDA in both.
* Long references: prefilled in chunks; the cache holds real tokens only; a prompt beyond the model's
  positions is refused up front, naming the request.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

import invink_audit.engine as engine_module
from invink_audit.engine import KV_LAYOUTS, Engine, ForwardStats
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.models import build_tiny_model
from invink_audit.prompts import encode_request, get_preset

# float64 model: the engine against an unbatched recomputation on the same device; the bound test_engine.py
# uses for the batched and unbatched CPU logits (~1e-12 apart)
FLOAT64_ATOL = 1e-9

REFERENCES = [
    ["The food was great and the service was slow.", "Review stars: 5.0", "Mr Smith was admitted to hospital."],
    ["Discharge instructions: rest for a week and drink water.", "x", "The court replied on Monday."],
    ["0123456789", "A much longer reference that makes this row the longest of its text by far, and then some.", "a"],
]


def _generator(seed: int, device="cpu") -> torch.Generator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(seed, device=device)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=5, hidden_size=64)  # float32: wide enough for batch effects to show


@pytest.fixture(scope="module")
def tiny_in_dtype(cpu_dtype):
    """The same tiny model in float32, and in bfloat16 where this CPU computes it natively."""
    return build_tiny_model(seed=5, hidden_size=64, dtype=cpu_dtype)


def _requests(model, references):
    template = get_preset("generic")
    return [encode_request(model.tokenizer, template, refs, key=i) for i, refs in enumerate(references)]


def _variants():
    changed = [list(r) for r in REFERENCES]
    changed[1][0] = "Something else entirely, and a good deal longer than the text it replaces, to change lengths."
    nulled = [list(r) for r in REFERENCES]
    nulled[1][2] = ""
    other = [list(r) for r in REFERENCES]
    other[0][1] = ""
    return {"original": REFERENCES, "changed": changed, "nulled": nulled, "other-text-nulled": other}


def _public_rows_support_path(model, mechanism, references, monkeypatch, max_batch_rows, kv_layout=None):
    """Default (Top-k+) path: every step's public logits per text, and the texts."""
    real = engine_module._support_log_probs
    steps = []

    def spy(head, mech, public, support, private_states, null, index):
        steps.append(public.clone())
        return real(head, mech, public, support, private_states, null, index)

    monkeypatch.setattr(engine_module, "_support_log_probs", spy)
    engine = Engine(model, mechanism, max_batch_rows=max_batch_rows, kv_layout=kv_layout)
    texts = list(engine.generate(_requests(model, references), max_new_tokens=6,
                                 generator=_generator(3, model.device), stop_at_eos=False))
    monkeypatch.setattr(engine_module, "_support_log_probs", real)
    return steps, {t.request_index: t.token_ids for t in texts}


def _check_public_rows_independent(model, monkeypatch, max_batch_rows, kv_layout=None):
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6, batch_size=3)
    runs = {
        name: _public_rows_support_path(model, mechanism, refs, monkeypatch, max_batch_rows, kv_layout)
        for name, refs in _variants().items()
    }
    base_steps, base_tokens = runs["original"]
    for name, (steps, tokens) in runs.items():
        # texts whose references did not change draw the same tokens from the same public and private rows
        untouched = [0, 2] if name in ("changed", "nulled") else [1, 2]
        for index in untouched:
            assert tokens[index] == base_tokens[index], name
        assert len(steps) == len(base_steps)
        for step, (a, b) in enumerate(zip(steps, base_steps)):
            # slot order is the admission order (0, 1, 2), whatever the data
            for slot in range(a.shape[0]):
                text = slot if max_batch_rows == 64 or step < 6 else 2
                if text in untouched or step == 0:
                    assert torch.equal(a[slot], b[slot]), (name, step, slot)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("max_batch_rows", [64, 8])  # all texts together; two at a time, the third joins
def test_public_rows_are_bitwise_independent_of_private_references_on_the_default_path(
    tiny_in_dtype, monkeypatch, max_batch_rows, kv_layout
):
    _check_public_rows_independent(tiny_in_dtype, monkeypatch, max_batch_rows, kv_layout)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_public_rows_are_bitwise_independent_of_private_references_on_cuda(monkeypatch, dtype):
    model = build_tiny_model(seed=5, hidden_size=64, device="cuda", dtype=dtype)
    for max_batch_rows, kv_layout in itertools.product((64, 8), KV_LAYOUTS):  # the pool: captured CUDA graphs
        _check_public_rows_independent(model, monkeypatch, max_batch_rows, kv_layout)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_engine_matches_an_unbatched_oracle_with_forced_tokens():
    """float64 on CUDA, teacher-forced: the engine's distributions equal an unbatched recomputation on the same
    device (one row at a time through transformers, then the mechanism's reference arithmetic) to 1e-9; measured
    on an H100, 2e-15. The same recomputation on the CPU differs by ~2e-5 in the logits: transformers' RMSNorm
    and rotary embeddings compute in float32 even in a float64 model, and CPU and CUDA round float32 sums
    differently (the tiny model's large weights amplify it); that bound is checked too, not assumed."""
    from invink_audit.mechanism import token_log_probs

    cpu = build_tiny_model(seed=1, dtype="float64")
    cuda = build_tiny_model(seed=1, dtype="float64", device="cuda")
    mechanism = MechanismConfig(clip_norm=1.3, temperature=0.9, top_k=8, batch_size=3)
    forced = [[5, 9, 7, 11], [17, 19, 23, 29], [37, 41, 43, 47]]
    seen = {}
    rule = _forcing_rule(forced, seen, record=lambda step, g: step.log_probs[g].cpu())
    engine = Engine(cuda, mechanism, max_batch_rows=8)  # CUDA's default: the pool, its passes as CUDA graphs
    requests = _requests(cuda, REFERENCES)
    list(engine.generate(requests, max_new_tokens=4, generator=_generator(0, "cuda"), sampling_rule=rule))
    assert engine.kv_layout == "pool" and engine.forward.graphs.captures >= 1

    def unbatched_logits(model, prompt, tokens):
        ids = torch.tensor([list(prompt) + tokens], device=model.device)
        with torch.inference_mode():
            return model.model(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + 3].cpu()

    for i, request in enumerate(requests):
        rows = [request.public_ids] + [p if p is not None else request.public_ids for p in request.private_ids]
        logits = [unbatched_logits(cuda, p, forced[i]) for p in rows]
        on_cpu = [unbatched_logits(cpu, p, forced[i]) for p in rows]
        assert max((a - b).abs().max().item() for a, b in zip(logits, on_cpu)) < 1e-3
        expected = token_log_probs(torch.stack(logits[1:], dim=1), logits[0], clip_norm=1.3, temperature=0.9, top_k=8)
        for t in range(4):
            finite = torch.isfinite(expected[t])
            assert torch.equal(finite, torch.isfinite(seen[(i, t)]))
            assert torch.allclose(seen[(i, t)][finite], expected[t][finite], atol=FLOAT64_ATOL, rtol=0)


def _forcing_rule(forced, seen: dict, record=lambda step, g: step.public_logits[g].clone()):
    """A sampling rule drawing text i's token ``forced[i][t]`` at position t and recording ``record(step, g)`` (by
    default its public logits) in ``seen[(i, t)]``."""

    def rule(step):
        weights = torch.full_like(step.log_probs, -math.inf)
        for g, (i, t) in enumerate(zip(step.request_indices.tolist(), step.positions.tolist())):
            weights[g, forced[i][t]] = 0.0
            seen[(i, t)] = record(step, g)
        return weights

    return rule


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_public_rows_are_bitwise_independent_of_private_references_with_forced_tokens(tiny_in_dtype, kv_layout):
    """Full-logits path, every text teacher-forced to the same tokens: every public row at every step is
    bitwise the same under every variant (the changed text's included)."""
    tiny = tiny_in_dtype
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=3)
    forced = [[5, 9, 7, 11, 13], [17, 19, 23, 29, 31], [37, 41, 43, 47, 53]]

    def run(references):
        seen = {}

        rule = _forcing_rule(forced, seen)

        engine = Engine(tiny, mechanism, max_batch_rows=8, kv_layout=kv_layout)
        list(engine.generate(_requests(tiny, references), max_new_tokens=5, generator=_generator(0),
                             sampling_rule=rule))
        return seen

    runs = {name: run(refs) for name, refs in _variants().items()}
    for name, seen in runs.items():
        assert seen.keys() == runs["original"].keys()
        for key, logits in seen.items():
            assert torch.equal(logits, runs["original"][key]), (name, key)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_tokens_do_not_depend_on_the_schedule(tiny_in_dtype, kv_layout):
    """Same seed: together, one at a time (same stream ids), and with other max_batch_rows, the same texts."""
    tiny = tiny_in_dtype
    mechanism = MechanismConfig(clip_norm=1.5, temperature=1.0, top_k=6, batch_size=3)
    requests = _requests(tiny, REFERENCES)

    def run(max_batch_rows, groups):
        out = {}
        for group in groups:
            engine = Engine(tiny, mechanism, max_batch_rows=max_batch_rows, max_prefill_tokens=7, kv_layout=kv_layout)
            for text in engine.generate([requests[i] for i in group], max_new_tokens=8, generator=_generator(9),
                                        stream_ids=group):
                out[group[text.request_index]] = text.token_ids
        return out

    together = run(64, [[0, 1, 2]])
    assert run(4, [[0, 1, 2]]) == together  # one text in progress at a time, the others join
    assert run(8, [[0, 1, 2]]) == together
    assert run(64, [[0], [1], [2]]) == together  # separate calls
    assert run(64, [[2, 0], [1]]) == together  # another order


def test_stream_ids_are_validated(tiny):
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6, batch_size=3)
    engine = Engine(tiny, mechanism)
    requests = _requests(tiny, REFERENCES[:2])
    for bad in ([0], [1, 1], [0, -1], [0, True]):
        with pytest.raises(ValueError, match="stream_ids"):
            list(engine.generate(requests, max_new_tokens=2, generator=_generator(0), stream_ids=bad))


class _SyncCounter:
    """Counts the tensor methods that transfer to the host (each a device synchronisation on CUDA)."""

    NAMES = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real))

    def _wrap(self, real):
        def counted(tensor, *args, **kwargs):
            if not tensor.is_cuda and tensor.device.type != "meta":
                self.count += 1
            return real(tensor, *args, **kwargs)

        return counted


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
@pytest.mark.parametrize("top_k", [6, None])  # Top-k+ path; full-vocabulary path
def test_the_decoding_loop_transfers_to_the_host_once_per_step(tiny_in_dtype, monkeypatch, top_k, kv_layout):
    tiny = tiny_in_dtype
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=top_k, batch_size=3)
    # two texts at a time: joins and finishes included
    engine = Engine(tiny, mechanism, max_batch_rows=8, kv_layout=kv_layout)
    requests = _requests(tiny, REFERENCES)
    counter = _SyncCounter(monkeypatch)
    per_step = []
    last = [0]

    def progress(_drawn):
        per_step.append(counter.count - last[0])
        last[0] = counter.count

    list(engine.generate(requests, max_new_tokens=6, generator=_generator(1), progress=progress))
    monkeypatch.undo()
    # (the run's key comes from the generator's 128-bit key, not from a draw: no transfer for it)
    assert set(per_step) == {1}, per_step
    assert engine.forward.graphs.captures == 0  # on the CPU the pool's pass, the function a graph captures, runs eagerly


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_graph_replays_draw_what_eager_passes_draw(dtype):
    """The pool's decoding passes captured once per layout and replayed: the same tokens, bitwise the same public
    logits, as the same passes run eagerly."""
    model = build_tiny_model(seed=5, hidden_size=64, device="cuda", dtype=dtype)
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=3)
    requests = _requests(model, REFERENCES)

    def run(kv_layout, graphs):
        engine = Engine(model, mechanism, max_batch_rows=8, kv_layout=kv_layout)
        engine.forward.graphs.enabled = graphs
        public = []
        texts = list(engine.generate(requests, max_new_tokens=8, generator=_generator(4, "cuda"), stop_at_eos=False,
                                     observer=lambda step: public.append(step.public_logits.clone())))
        return engine.forward.graphs.captures, sorted((t.request_index, t.token_ids) for t in texts), public

    captures, texts, public = run("pool", True)
    eager_captures, eager_texts, eager_public = run("pool", False)
    assert captures >= 1 and eager_captures == 0
    assert texts == eager_texts and len(public) == len(eager_public)
    assert all(torch.equal(a, b) for a, b in zip(public, eager_public))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_decoding_loop_does_not_synchronise_on_cuda_except_for_the_tokens():
    model = build_tiny_model(seed=5, hidden_size=64, device="cuda")
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6, batch_size=3)
    engine = Engine(model, mechanism, max_batch_rows=8)
    requests = _requests(model, REFERENCES)
    generator = torch.Generator(device="cuda").manual_seed(0)
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # warns that the mode is a prototype (recorded, not counted)
        try:
            list(engine.generate(requests, max_new_tokens=6, generator=generator, progress=steps.append))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    messages = [str(w.message) for w in caught]
    syncs = [m for m in messages if "synchroniz" in m.lower() and "prototype" not in m]
    # capturing a CUDA graph synchronises (once per layout of the pool: here one); replays do not
    assert len(syncs) <= len(steps) + 1 + 2 * engine.forward.graphs.captures, syncs[:5]


def test_a_long_reference_is_prefilled_in_chunks_and_the_cache_holds_real_tokens_only():
    """One reference of 50,000 characters among short ones: it completes, its prefill is chunked, and the
    cache of every row is its own length plus the reserve (no row is padded to the longest)."""
    tiny = build_tiny_model(seed=5, hidden_size=64)
    tiny.model.config.max_position_embeddings = 65_536  # rotary positions: any length works
    long_reference = ("The service was slow but the food was worth the wait. " * 1000)[:50_000]
    references = [["short one", long_reference, ""], ["tiny", "two", "three"]]
    requests = _requests(tiny, references)
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6, batch_size=3)
    engine = Engine(tiny, mechanism, max_prefill_tokens=1024)
    assert len(requests[0].private_ids[1]) > 20 * 1024  # chunks over several steps
    stats = ForwardStats()
    engine.forward.stats = stats
    cached = []
    real = engine_module._Text.finished_text

    def spy(text, reason, tokenizer):
        cached.append([(row.length, row.bucket.width) for row in text.stored if row is not None])
        return real(text, reason, tokenizer)

    try:
        engine_module._Text.finished_text = spy
        texts = list(engine.generate(requests, max_new_tokens=4, generator=_generator(2), stop_at_eos=False))
    finally:
        engine_module._Text.finished_text = real
    assert sorted(t.request_index for t in texts) == [0, 1] and all(t.num_tokens == 4 for t in texts)
    prompts = [p for r in requests for p in (r.public_ids, *r.private_ids) if p is not None]
    prefix = requests[0].private_prefix
    sharing = [p for r in requests for p in r.private_ids if p is not None and p[: len(prefix)] == prefix]
    assert len(prefix) >= 4 and len(sharing) == 5  # the template's part before each reference
    # no padding, nothing twice: the shared template prefix is computed once
    assert stats.prefill_tokens == sum(len(p) for p in prompts) - (len(sharing) - 1) * len(prefix)
    assert stats.prefill_calls >= len(prompts) + 20
    assert stats.kv_tokens / stats.kv_processed >= 0.85  # each row padded to its own length bucket only
    for rows in cached:
        for length, width in rows:
            # a row's attention width follows its own length, whatever the other rows' lengths
            assert length < width <= max(16, length * 9 // 8 + 16)


def test_a_prompt_beyond_the_models_positions_is_refused_up_front(tiny):
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6, batch_size=3)
    engine = Engine(tiny, mechanism)
    positions = tiny.model.config.max_position_embeddings
    requests = _requests(tiny, [["a", "b", "c"], ["a", "word " * positions, "c"]])
    with pytest.raises(ValueError, match=r"requests\[1\]: a prompt of \d+ tokens plus max_new_tokens=4 exceeds"):
        list(engine.generate(requests, max_new_tokens=4, generator=_generator(0)))


@pytest.mark.slow
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_real_model_public_row_is_bitwise_independent_of_a_null_reference(cpu_dtype, kv_layout):
    """The issue's probe on SmolLM2 (float32, and bfloat16 where native; B = 2, real reviews): the public
    row's first-step logits are bitwise the same when a reference is replaced by null (it changed 45,364
    of 49,152 logits)."""
    from invink_audit.models import load_model

    model = load_model(None, device="cpu", dtype=cpu_dtype)
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=50, batch_size=2)
    template = get_preset("generic")
    reviews = ["The pasta was cold, the waiter forgot our drinks and we waited an hour. " * 4, "Great tacos!"]
    seen = {}
    for name, refs in (("original", reviews), ("nulled", [reviews[0], None])):
        requests = [encode_request(model.tokenizer, template, refs), encode_request(model.tokenizer, template, reviews)]
        engine = Engine(model, mechanism, kv_layout=kv_layout)

        def observer(step, name=name):
            seen.setdefault(name, step.public_logits.clone())

        list(engine.generate(requests, max_new_tokens=1, generator=_generator(0), observer=observer))
    assert torch.equal(seen["original"], seen["nulled"])


# ------------------------------------------------------------------ review findings (regressions)


def test_text_streams_have_128_bit_keys_and_never_share_noise():
    """torch's CPU generator keeps 32 bits of a seed: with 63-bit stream seeds, texts of a 200,000-text run
    shared their Gumbel noise (about n^2 / 2^33 collisions). Streams are now Philox keyed by 128 bits."""
    from invink_audit.engine import _Stream
    from invink_audit.mechanism import derive_key, run_key

    key = derive_key(12345, 1)
    firsts = {_Stream(derive_key(key, s)).uniforms(1).item() for s in range(200_000)}
    assert len(firsts) == 200_000
    # keys differing only above bit 32 (or 64) give different streams
    a, b = _Stream(5), _Stream(5 + (1 << 40))
    c = _Stream(5 + (1 << 100))
    assert (a.uniforms(8) != b.uniforms(8)).any() and (a.uniforms(8) != c.uniforms(8)).any()
    # OS-seeded generators carry 128-bit keys; every run drawn from one gets a fresh key
    first, second = make_generator(), make_generator()
    keys = [run_key(first), run_key(first), run_key(second)]
    assert len(set(keys)) == 3 and max(keys) >= 1 << 64
    # a seeded generator gives the same sequence of run keys (reproducible, hence not private)
    assert [run_key(_generator(7)) for _ in range(2)] == [run_key(_generator(7))] * 2


def test_models_with_attention_terms_the_rows_do_not_reproduce_are_refused():
    """gpt-oss's attention sinks (and ALiBi, position biases, ...) are refused at Engine construction
    instead of being computed wrongly."""
    import dataclasses

    from transformers import GptOssConfig, GptOssForCausalLM

    from invink_audit.forward import UnsupportedModelError

    tiny = build_tiny_model(seed=1)
    config = GptOssConfig(
        vocab_size=tiny.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        network = GptOssForCausalLM(config).eval()
    model = dataclasses.replace(tiny, model=network, name="tiny-gpt-oss")
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=5, batch_size=2)
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        Engine(model, mechanism)


def test_kv_store_keeps_only_buckets_in_use():
    """Rows moving up through the length buckets leave no empty buckets (and their memory) behind."""
    from invink_audit.rows import KVStore, RowKV, bucket_length

    store = KVStore(num_layers=1)
    rows = []
    for length in (14, 30, 31, 100):
        row = RowKV(1, reserve=0)
        row.append(0, torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4))
        row.length = length
        rows.append(store.insert(row))
    for _ in range(200):
        for row in rows:
            row.ready()
            row.length += 1
        assert set(store.buckets) == {bucket_length(r.length + 1) for r in rows} or set(store.buckets) == {
            r.bucket.key for r in rows
        }
    for row in rows:
        store.remove(row)
    assert store.buckets == {}
    twins = []
    for public in (True, True, True, False, False):
        row = RowKV(1, reserve=0)
        row.append(0, torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 4))
        row.length = 20
        twins.append(store.insert(row, public=public))
    assert len(store.buckets) == 4  # one bucket per public row (no shared attention call); the private rows share one
    for _ in range(20):  # moving up a bucket, a public row stays alone
        for row in twins:
            row.ready()
            row.length += 1
    assert len(store.buckets) == 4 and all(twins[0].bucket is not row.bucket for row in twins[1:])


def test_the_pool_keeps_static_shapes_and_reuses_its_slots():
    """Capacity a power of two (at least 8) from the rows asked for, doubling only when every slot is taken; width
    whole tiles, grown when a row would not fit; freed slots reused; every reallocation changes the version."""
    from invink_audit.rows import KV_TILE, KVPool, RowKV

    def row(length):
        cache = RowKV(1, 0)
        cache.append(0, torch.randn(1, 2, length, 4), torch.randn(1, 2, length, 4))
        cache.length = length
        return cache

    pool = KVPool(num_layers=1, rows=5, heads=2, scales=(None,))
    first = pool.insert(row(3))
    assert (pool.capacity, pool.width, first.slot) == (8, KV_TILE, 0)
    second = pool.insert(row(KV_TILE))  # its next token needs a second tile
    assert (pool.width, second.slot, pool.keys[0].shape) == (2 * KV_TILE, 1, (8, 2, 2 * KV_TILE, 4))
    assert torch.equal(pool.keys[0][0, :, :3], row_keys := pool.keys[0][0, :, :3]) and row_keys.abs().sum() > 0
    pool.remove(first)
    assert pool.insert(row(2)).slot == 0 and first.slot is None
    version = pool.version
    rows = [pool.insert(row(1)) for _ in range(7)]  # the ninth row: twice the slots
    assert pool.capacity == 16 and pool.version > version and [r.slot for r in rows][-1] == 8
    second.length = 2 * KV_TILE
    pool.ready(second)
    assert pool.width == 3 * KV_TILE and pool.allocated_bytes() == 2 * 16 * 2 * 3 * KV_TILE * 4 * 4


def test_a_pools_slots_do_not_depend_on_which_references_are_null(tiny, monkeypatch):
    """A null reference holds its slot: every row's slot, so its place in the pass, is the same under
    replace-by-null (texts joining as others finish included)."""
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6, batch_size=3)
    real = engine_module._Run._record

    def slots(references):
        seen = []

        def spy(run, ready, draws):
            seen.append([(t.request_index, [None if r is None else r.slot for r in t.stored]) for t in run.texts if t.stored])
            return real(run, ready, draws)

        monkeypatch.setattr(engine_module._Run, "_record", spy)
        engine = Engine(tiny, mechanism, max_batch_rows=8, kv_layout="pool")
        list(engine.generate(_requests(tiny, references), max_new_tokens=4, generator=_generator(1), stop_at_eos=False))
        return seen

    base = slots(REFERENCES)
    for name, references in _variants().items():
        got = slots(references)
        assert [[(i, row[0]) for i, row in step] for step in got] == [[(i, row[0]) for i, row in step] for step in base]
        nulls = {(g, j) for g, refs in enumerate(references) for j, ref in enumerate(refs, 1) if not ref}
        for step_got, step_base in zip(got, base):
            for (i, row), (_, base_row) in zip(step_got, step_base):
                assert [s for j, s in enumerate(row) if (i, j) not in nulls] == [
                    s for j, s in enumerate(base_row) if (i, j) not in nulls], name


@pytest.fixture
def fresh_probe():
    """The tile invariance probe's cache emptied before and after (a test that patches the attention probes anew)."""
    from invink_audit.rows import tile_invariant_attention

    tile_invariant_attention.cache_clear()
    yield
    tile_invariant_attention.cache_clear()


def _split_kv_above(limit: int):
    """An attention whose batched calls over more than ``limit`` keys split the keys in two halves and merge the
    parts by their log-sum-exp (split-KV decoding, as GPU back ends choose from the shapes): a row's result then
    depends on the call's width. Calls of one row, or at most ``limit`` keys wide, run the real attention."""
    real = torch.nn.functional.scaled_dot_product_attention

    def attention(q, k, v, attn_mask=None, scale=None, **kwargs):
        if q.shape[0] == 1 or k.shape[-2] <= limit:
            return real(q, k, v, attn_mask=attn_mask, scale=scale, **kwargs)
        half, parts = k.shape[-2] // 2, []
        for part in (slice(0, half), slice(half, None)):
            scores = (q @ k[..., part, :].transpose(-1, -2)).float() * (q.shape[-1] ** -0.5 if scale is None else scale)
            scores = scores.masked_fill(~attn_mask[..., part], -math.inf)
            lse = torch.logsumexp(scores, dim=-1, keepdim=True)
            parts.append((torch.softmax(scores, dim=-1).nan_to_num() @ v[..., part, :].float(), lse))
        total = torch.logsumexp(torch.cat([lse for _, lse in parts], dim=-1), dim=-1, keepdim=True)
        return sum(out * torch.exp(lse - total) for out, lse in parts).to(v.dtype)

    return attention


def test_tile_invariance_is_probed_per_shape(monkeypatch, fresh_probe):
    """The probe passes for the CPU's attention at pool shapes (capacities, GQA groups, head dims, scales, widths,
    every dtype the engine runs) and, for a split-KV attention, holds up to the width where it starts splitting and
    fails past it: the decision is the shape's, not the device's."""
    from invink_audit.rows import KV_TILE, PoolShape, tile_invariant_attention

    cpu = torch.device("cpu")
    shapes = [PoolShape(8, 2, 2, 16, tiles * KV_TILE, dtype, cpu, None)
              for tiles in (1, 3) for dtype in (torch.float32, torch.bfloat16, torch.float64)]
    shapes.append(PoolShape(16, 3, 3, 64, 2 * KV_TILE, torch.float32, cpu, 0.125))
    assert all(tile_invariant_attention(shape) for shape in shapes)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _split_kv_above(2 * KV_TILE))
    tile_invariant_attention.cache_clear()
    assert tile_invariant_attention(PoolShape(8, 2, 2, 16, 2 * KV_TILE, torch.float32, cpu, None))
    assert not tile_invariant_attention(PoolShape(8, 2, 2, 16, 3 * KV_TILE, torch.float32, cpu, None))


def _long_reference_runs(model, monkeypatch, *, trust_the_call: bool = False):
    """Two texts teacher-forced (full path), text 0's first reference so long that its row's keys pass two tiles at
    the fourth decoding pass, then replaced by null: each run's public logits per (text, position), and the probe's
    (tiles, invariant) decisions. ``trust_the_call``: no probe, every row in the shared call (the control)."""
    import invink_audit.rows as rows

    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=2)
    forced = [[5, 9, 7, 11, 13, 17, 19, 23], [29, 31, 37, 41, 43, 47, 53, 59]]
    template = get_preset("generic")
    overhead = len(encode_request(model.tokenizer, template, ["a" * 100, ""]).private_ids[0]) - 100
    long = "a" * (2 * rows.KV_TILE - 3 - overhead)
    assert len(encode_request(model.tokenizer, template, [long, ""]).private_ids[0]) == 2 * rows.KV_TILE - 3
    probed, real_probe = {}, rows.tile_invariant_attention

    def spy(shape):
        decision = True if trust_the_call else real_probe(shape)
        probed.setdefault(name, []).append((shape.width // rows.KV_TILE, decision))
        return decision

    def run(references):
        seen = {}

        rule = _forcing_rule(forced, seen)

        engine = Engine(model, mechanism, max_batch_rows=6, kv_layout="pool")
        requests = [encode_request(model.tokenizer, template, refs, key=i) for i, refs in enumerate(references)]
        list(engine.generate(requests, max_new_tokens=8, generator=_generator(0, model.device), sampling_rule=rule))
        return seen

    monkeypatch.setattr(rows, "tile_invariant_attention", spy)
    runs = {}
    for name, first in (("long", long), ("null", "")):
        runs[name] = run([[first, "short"], ["x", "y"]])
    assert runs["long"].keys() == runs["null"].keys() and len(runs["null"]) == 16
    return runs["long"], runs["null"], probed


def test_a_probe_failing_mid_run_leaves_the_public_rows_bitwise_the_same(tiny, monkeypatch, fresh_probe):
    """The attention splits the keys of calls wider than two tiles. A long private reference widens the pool past
    two tiles mid-run: the probe fails at that width and the public rows are computed alone from then on. Replaced
    by null, the pool stays one tile wide and the shared call serves the public rows throughout. Every public row
    (teacher-forced tokens) is bitwise the same in both runs. Control: trusting the shared call without a probe,
    they differ once the pool is wide."""
    from invink_audit.rows import KV_TILE

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _split_kv_above(2 * KV_TILE))
    widened, null, probed = _long_reference_runs(tiny, monkeypatch)
    assert (2, True) in probed["long"] and (3, False) in probed["long"]  # shared at two tiles, alone at three
    assert {tiles for tiles, _ in probed["null"]} == {1}
    for key, logits in null.items():
        assert torch.equal(widened[key], logits), key
    trusting, null, _ = _long_reference_runs(tiny, monkeypatch, trust_the_call=True)
    assert any(not torch.equal(trusting[key], logits) for key, logits in null.items())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_long_private_reference_leaves_the_public_rows_bitwise_the_same_on_cuda(dtype, monkeypatch, fresh_probe):
    """CUDA's own attention back ends, CUDA graphs on: the pool one, two, then three tiles wide as a long private
    reference grows, against the run where it is null. Whatever the probe decides at each shape (printed), every
    public row is bitwise the same."""
    model = build_tiny_model(seed=5, hidden_size=64, device="cuda", dtype=dtype)
    widened, null, probed = _long_reference_runs(model, monkeypatch)
    print(f"tile invariance on CUDA ({dtype}), (tiles, shared call) per pool shape: {probed}")
    assert {tiles for tiles, _ in probed["long"]} >= {2, 3}
    for key, logits in null.items():
        assert torch.equal(widened[key], logits), key


def test_where_no_shape_is_tile_invariant_the_public_rows_are_computed_alone(tiny, monkeypatch):
    """Where the probe fails for every shape, the public rows share the pool but each is computed alone at its
    own width, and they stay bitwise independent of the private references."""
    import invink_audit.rows as rows

    monkeypatch.setattr(rows, "tile_invariant_attention", lambda shape: False)
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6, batch_size=3)
    engine = Engine(tiny, mechanism, kv_layout="pool")
    run = engine_module._Run(engine, _requests(tiny, REFERENCES), [1, 2, 3], 4, True)
    assert run.store.capacity == 16  # 3 texts × 4 rows, one pool
    _check_public_rows_independent(tiny, monkeypatch, 8, "pool")


def test_the_shared_template_prefix_is_computed_from_the_template_alone(tiny):
    """References that all start alike must not lengthen the shared prefix (that would make every row's
    arithmetic depend on the other references)."""
    from invink_audit.prompts import template_prefix

    template = get_preset("generic")
    prefix = template_prefix(tiny.tokenizer, template)
    request = encode_request(tiny.tokenizer, template, ["The same start, then one thing", "The same start, then two"])
    assert request.private_prefix == prefix and len(prefix) >= 4
    a, b = request.private_ids
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert common > len(prefix) and a[: len(prefix)] == prefix



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_last_position_by_index_gives_the_logits_of_logits_to_keep_1(dtype):
    """The rows' forward asks for a prefill's last logits with ``logits_to_keep`` an index tensor, not ``1`` (whose
    strided slice sent torch's bfloat16 CPU linear through a copy of the whole output layer, 1.5 s a call on Gemma
    3): the same logits, bitwise, in either dtype."""
    model = build_tiny_model(seed=5, dtype=dtype)
    ids = torch.tensor([[(7 * i + 3) % model.vocab_size for i in range(1, 12)]])
    with torch.inference_mode():
        sliced = model.model(input_ids=ids, logits_to_keep=1).logits
        indexed = model.model(input_ids=ids, logits_to_keep=torch.tensor([ids.shape[1] - 1])).logits
    assert sliced.shape == indexed.shape == (1, 1, model.vocab_size) and torch.equal(sliced, indexed)
