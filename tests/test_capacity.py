"""Capacity planning (invink_audit.capacity, ``invink-audit memory``) and the lock pre-flight
(invink_audit.preflight, ``invink-audit check-locks``).

The KV formula is checked against the model's own cache (a forward pass with ``use_cache=True``), and
the upper bound on the KV cache against the real engine (every KV buffer it allocates, counted while it
lives, and its own report of what it holds) on random schedules and on Yelp prompts. The lock check is run
for real (a second process must be excluded, then get the lock) and with ``flock`` made to fail.
"""

from __future__ import annotations

import csv
import dataclasses
import errno
import gc
import json
import multiprocessing
import math
import random
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from invink_audit import capacity, preflight
from invink_audit.capacity import (
    ModelShape,
    Workload,
    estimate_memory,
    kv_bound_bytes,
    kv_bytes_per_token,
    max_batch_rows_for_budget,
    shape_of,
    text_kv_tokens,
)
from invink_audit.cli import EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_INCONCLUSIVE, main
from invink_audit.engine import Engine
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.models import build_tiny_model
from invink_audit.prompts import TextRequest, encode_request, get_preset
from invink_audit.rows import bucket_length

SMOLLM2 = ModelShape(name="SmolLM2-135M", num_layers=30, num_attention_heads=9, num_kv_heads=3, head_dim=64,
                     hidden_size=576, intermediate_size=1536, vocab_size=49152, num_parameters=134515008,
                     dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model()


def _cache_tensors(cache) -> list[torch.Tensor]:
    if hasattr(cache, "layers"):  # transformers >= 4.56: DynamicCache of DynamicLayer
        return [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return [t for layer in cache for t in layer]  # legacy tuple of (keys, values)


# --------------------------------------------------------------------------------------------
# the formula against the model and the engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layers", [2, 3])
def test_kv_per_row_and_token_is_the_models_own_cache(dtype, layers):
    loaded = build_tiny_model(num_layers=layers, dtype=dtype)
    tokens = 11
    ids = torch.arange(3, 3 + tokens).view(1, tokens)
    with torch.inference_mode():
        cache = loaded.model(input_ids=ids, use_cache=True).past_key_values
    tensors = _cache_tensors(cache)
    assert len(tensors) == 2 * layers and all(t.shape[-2] == tokens for t in tensors)
    measured = sum(t.numel() * t.element_size() for t in tensors)
    shape = shape_of(loaded)
    assert shape.dtype == dtype and shape.num_layers == layers
    assert measured == tokens * kv_bytes_per_token(shape)  # exactly, per row and token
    assert shape.num_parameters == sum(p.numel() for p in loaded.model.parameters())


class _Tracker:
    """Every KV buffer the engine allocates (rows.py: ``new_zeros``, 4-D, kv_heads and head_dim in dims 1
    and 3), summed while it lives; ``peak`` is the most held at once."""

    def __init__(self, shape: ModelShape):
        self.shape, self.live, self.peak = shape, 0, 0

    def wrap(self, original):
        def new_zeros(tensor, *size, **kwargs):
            out = original(tensor, *size, **kwargs)
            if out.dim() == 4 and out.shape[1] == self.shape.num_kv_heads and out.shape[3] == self.shape.head_dim:
                count = out.numel() * out.element_size()
                self.live += count
                self.peak = max(self.peak, self.live)
                weakref.finalize(out, self._free, count)
            return out

        return new_zeros

    def _free(self, count: int) -> None:
        self.live -= count


#: the bound over the engine's measured KV peak, at most, on real Yelp prompts with every text decoding all T tokens
#: (measured 1.5-2.0 on the tiny model; on SmolLM2 1.4, and 2.0-2.3 with short prompts of few texts, where private rows
#: share buckets; the bound gives every private row 4 slots); on the random schedules below, with EOS, nulls and
#: texts joining mid-run, at most KV_BOUND_SLACK_ANY (measured up to 2.6 over 60 seeds)
KV_BOUND_SLACK = 2.5
KV_BOUND_SLACK_ANY = 3.0
YELP = Path(__file__).resolve().parents[2] / "shared" / "data" / "yelp" / "dev.csv"


def _measured_run(loaded, requests, batch_size, texts_in_flight, max_new_tokens, seed=0, stop_at_eos=True,
                  kv_layout="buckets"):
    """Generate ``requests`` counting every KV buffer the engine allocates (:class:`_Tracker`) and asking the
    engine what it holds after each step (:meth:`Engine.kv_bytes`); returns (tracker, engine, its reports)."""
    mechanism = MechanismConfig(clip_norm=1.0, batch_size=batch_size, temperature=1.0, top_k=20)
    engine = Engine(loaded, mechanism, max_batch_rows=texts_in_flight * (batch_size + 1), kv_layout=kv_layout)
    with pytest.warns(SeededGeneratorWarning):
        generator = make_generator(seed)
    gc.collect()  # the engine's own probes' buffers are gone before counting
    tracker, reports = _Tracker(shape_of(loaded)), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "new_zeros", tracker.wrap(torch.Tensor.new_zeros))
        list(engine.generate(requests, max_new_tokens=max_new_tokens, generator=generator, stop_at_eos=stop_at_eos,
                             progress=lambda _n: reports.append((engine.kv_bytes(), tracker.live))))
    gc.collect()
    assert tracker.live == 0 and engine.kv_bytes() == 0  # everything freed once the run is over
    return tracker, engine, reports


def _lengths(requests) -> list[list[int | None]]:
    return [[len(r.public_ids)] + [None if p is None else len(p) for p in r.private_ids] for r in requests]


def _check_bound(loaded, requests, batch_size, texts_in_flight, max_new_tokens, slack, **options) -> None:
    """The engine's peak KV bytes within :func:`kv_bound_bytes` of the prompts' lengths, the bound at most ``slack``
    times the peak, and the engine's own report what its buffers hold after every step."""
    tracker, engine, reports = _measured_run(loaded, requests, batch_size, texts_in_flight, max_new_tokens, **options)
    assert reports and all(reported == live for reported, live in reports)  # the engine reports its own allocation
    prefix = {r.private_prefix for r in requests if len(r.private_prefix) >= 4}
    bound = kv_bound_bytes(shape_of(loaded), _lengths(requests), max_new_tokens, engine.max_texts,
                           prefix_tokens=sum(map(len, prefix)), kv_layout=engine.kv_layout)
    assert max(reported for reported, _ in reports) <= tracker.peak <= bound <= slack * tracker.peak, (bound, tracker.peak)


@pytest.mark.parametrize("kv_layout", ["buckets", "pool"])
@pytest.mark.parametrize("seed", range(5))
def test_the_engines_kv_peak_is_within_the_bound_on_any_schedule(seed, kv_layout):
    """Random prompt lengths, null references, EOS on or off, texts joining mid-run: the engine's KV buffers at
    their peak (every buffer counted while it lives, transients included) never exceed the bound of its layout.
    In a pool, one row of up to 700 tokens widens every slot past the first tile, mid-run."""
    rng = random.Random(seed)
    loaded = build_tiny_model(num_layers=(2, 3)[seed % 2])
    b, texts_in_flight, t = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 5, 20, 40])
    requests, longest = [], 70 if kv_layout == "buckets" else 700
    for i in range(rng.choice([texts_in_flight, 2 * texts_in_flight + 1])):
        private = [None if rng.random() < 0.15 else rng.randint(3, rng.choice([70, longest])) for _ in range(b)]
        requests.append(TextRequest(public_ids=tuple(range(5, 5 + rng.randint(3, 40))), key=i,
                                    private_ids=tuple(None if n is None else tuple(7 + j % 100 for j in range(n)) for n in private)))
    _check_bound(loaded, requests, b, texts_in_flight, t, KV_BOUND_SLACK_ANY, seed=seed, stop_at_eos=seed % 3 != 0,
                 kv_layout=kv_layout)


def _yelp_requests(loaded, batch_size: int, count: int, chars: int) -> list[TextRequest]:
    """``count`` texts of ``batch_size`` Yelp reviews each, in file order, each cut at ``chars`` characters."""
    with open(YELP, newline="", encoding="utf-8") as handle:
        reviews = [row["text"][:chars] for row in csv.DictReader(handle) if row["text"].strip()]
    template = get_preset("generic")
    return [encode_request(loaded.tokenizer, template, reviews[i * batch_size : (i + 1) * batch_size], key=i)
            for i in range(count)]


#: (B, texts in flight G, texts, T, characters kept of each review): one wave or several, short prompts and long
_YELP_RUNS = [(2, 2, 2, 8, 200), (3, 2, 5, 12, 10_000), (4, 3, 3, 16, 600), (7, 2, 4, 8, 10_000), (2, 3, 3, 40, 150)]


@pytest.mark.skipif(not YELP.is_file(), reason="Yelp data not present (../shared/data/yelp)")
@pytest.mark.parametrize("kv_layout", ["buckets", "pool"])
def test_the_bound_on_yelp_prompts_tiny_model(kv_layout):
    loaded = build_tiny_model()
    for b, g, count, t, chars in _YELP_RUNS:
        _check_bound(loaded, _yelp_requests(loaded, b, count, chars), b, g, t, KV_BOUND_SLACK, stop_at_eos=False,
                     kv_layout=kv_layout)


@pytest.mark.slow
@pytest.mark.skipif(not YELP.is_file(), reason="Yelp data not present (../shared/data/yelp)")
def test_the_bound_on_yelp_prompts_smollm2():
    """SmolLM2's own KV shape (30 layers, grouped queries) on real prompts, in bfloat16 where this CPU has it natively
    (the dtype only scales the bytes: peaks and bounds are half float32's, their ratios the same), else float32."""
    from invink_audit.models import cpu_bfloat16_support, load_model

    loaded = load_model(None, device="cpu", dtype="bfloat16" if cpu_bfloat16_support() else "float32")
    for b, g, count, t, chars in [(2, 2, 3, 6, 300), (4, 2, 2, 10, 200), (3, 2, 3, 6, 600)]:
        _check_bound(loaded, _yelp_requests(loaded, b, count, chars), b, g, t, KV_BOUND_SLACK, stop_at_eos=False)


@given(
    b=st.integers(1, 8), t=st.integers(1, 150), p=st.integers(1, 600), p0=st.integers(1, 600),
    g=st.integers(1, 12), layers=st.integers(1, 40),
)
def test_the_bound_adds_up_from_its_rules(b, t, p, p0, g, layers):
    """The bound of a workload: every text's prefill rows (exact: p + T tokens each), its decoding allowance of 4
    slots of its last width per row, the G texts and one converting, the prefix, one move and a doubling's layers."""
    shape = dataclasses.replace(SMOLLM2, num_layers=layers)
    kappa, w = kv_bytes_per_token(shape), bucket_length
    workload = Workload(batch_size=b, max_new_tokens=t, prompt_tokens=p, public_prompt_tokens=p0,
                        max_batch_rows=g * (b + 1))
    prefill, stores = text_kv_tokens([p0] + [p] * b, t)
    assert prefill == (p0 + t) + b * (p + t)
    assert stores == (0 if t == 1 else 4 * (w(p0 + t - 1) + b * w(p + t - 1)))
    estimate = estimate_memory(shape, workload)
    bound = estimate.kv_peak_bytes
    assert estimate.kv_text_bytes == prefill * kappa and estimate.kv_decoding_bytes == stores * kappa
    tokens = g * max(prefill, stores) + min(prefill, stores) + capacity.prefix_slots(p - 1)
    if t == 1:
        assert bound == tokens * kappa  # no decoding pass: prefill rows and the prefix only
    else:
        widest = w(max(p, p0) + t - 1)
        grown = (capacity.bucket_rows(g * b) // 2 if g * b > 4 else 0) * widest * min(2, layers) * kappa // layers
        assert bound == (tokens + 4 * widest) * kappa + grown
    # more texts in flight, more tokens or longer prompts never lower it
    for more in (dict(max_batch_rows=(g + 1) * (b + 1)), dict(max_new_tokens=t + 1), dict(prompt_tokens=p + 1)):
        assert estimate_memory(shape, dataclasses.replace(workload, **more)).kv_peak_bytes >= bound


@given(
    b=st.integers(1, 8), t=st.integers(1, 1500), p=st.integers(1, 3000), p0=st.integers(1, 600),
    g=st.integers(1, 12), layers=st.integers(1, 40),
)
def test_the_pool_bound_adds_up_from_its_rules(b, t, p, p0, g, layers):
    """In a pool: every text's prefill rows, the pool's slots (a power of two, at least 8, for the G texts' rows)
    each as wide as the longest row in whole tiles of 512, the prefix, and three layers of the pool."""
    shape = dataclasses.replace(SMOLLM2, num_layers=layers)
    kappa = kv_bytes_per_token(shape)
    workload = Workload(batch_size=b, max_new_tokens=t, prompt_tokens=p, public_prompt_tokens=p0,
                        max_batch_rows=g * (b + 1), kv_layout="pool")
    estimate = estimate_memory(shape, workload)
    prefill = (p0 + t) + b * (p + t)
    tokens = g * prefill + capacity.prefix_slots(p - 1)
    if t == 1:
        assert estimate.kv_peak_bytes == tokens * kappa and estimate.kv_decoding_bytes == 0
        return
    slots = max(8, 2 ** math.ceil(math.log2(g * (b + 1))))
    width = 512 * math.ceil((max(p, p0) + t - 1) / 512)
    assert estimate.kv_decoding_bytes == (b + 1) * width * kappa
    assert estimate.kv_peak_bytes == (tokens + slots * width) * kappa + 3 * slots * width * kappa // layers
    for more in (dict(max_batch_rows=(g + 1) * (b + 1)), dict(max_new_tokens=t + 1), dict(prompt_tokens=p + 1)):
        assert estimate_memory(shape, dataclasses.replace(workload, **more)).kv_peak_bytes >= estimate.kv_peak_bytes


def test_text_kv_tokens_of_a_text_with_null_references():
    # the public row of 10 tokens and two private rows (12 and 40 tokens), a null reference between: T = 5
    assert text_kv_tokens([10, 12, None, 40], 5) == (15 + 17 + 45, 4 * (16 + 16 + 48))
    assert capacity.prefix_slots(512) == 512 and capacity.prefix_slots(513) == 1026


def test_bucket_rows_double_from_four():
    assert [capacity.bucket_rows(n) for n in (0, 1, 4, 5, 8, 9, 16, 17, 1000)] == [0, 4, 4, 8, 8, 16, 16, 32, 1024]


def test_estimate_adds_up_and_reports_json():
    workload = Workload(batch_size=7, max_new_tokens=500, prompt_tokens=200, public_prompt_tokens=40,
                        max_batch_rows=256)
    estimate = estimate_memory(SMOLLM2, workload)
    assert workload.texts_in_flight == 32 and SMOLLM2.weights_bytes == 134515008 * 2
    assert estimate.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert estimate.kv_text_bytes == ((40 + 500) + 7 * (200 + 500)) * 23040
    assert estimate.peak_bytes == (estimate.weights_bytes + estimate.kv_peak_bytes + estimate.sampling_bytes
                                   + estimate.activation_bytes)
    # the bound is never below the texts' prefill size nor their stores' allowance
    assert estimate.kv_peak_bytes >= 32 * max(estimate.kv_text_bytes, estimate.kv_decoding_bytes)
    data = json.loads(json.dumps(estimate.to_json()))
    assert data["workload"]["texts_in_flight"] == 32 and data["workload"]["rows_in_flight"] == 256
    assert data["peak_bytes"] == estimate.peak_bytes and "kappa" in data["formula"]
    assert data["model"]["kv_bytes_per_token"] == 23040
    # num_texts limits the texts in flight; the peak grows with max_batch_rows
    assert dataclasses.replace(workload, num_texts=5).texts_in_flight == 5
    smaller = estimate_memory(SMOLLM2, dataclasses.replace(workload, max_batch_rows=64))
    assert smaller.peak_bytes < estimate.peak_bytes


def test_max_batch_rows_for_a_budget():
    workload = Workload(batch_size=7, max_new_tokens=500, prompt_tokens=200, max_batch_rows=8)
    budget = 80 * capacity.GIB
    rows = max_batch_rows_for_budget(SMOLLM2, workload, budget)
    assert rows > 0 and rows % 8 == 0

    def peak(r):
        return estimate_memory(SMOLLM2, dataclasses.replace(workload, max_batch_rows=r)).peak_bytes

    assert peak(rows) <= budget < peak(rows + 8)
    assert max_batch_rows_for_budget(SMOLLM2, workload, 10**6) == 0  # not even the weights fit
    assert max_batch_rows_for_budget(SMOLLM2, dataclasses.replace(workload, num_texts=3), budget) == 24


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: Workload(batch_size=0, max_new_tokens=1, prompt_tokens=1, max_batch_rows=1), "batch_size"),
        (lambda: Workload(batch_size=True, max_new_tokens=1, prompt_tokens=1, max_batch_rows=1), "batch_size"),
        (lambda: Workload(batch_size=1, max_new_tokens=1.5, prompt_tokens=1, max_batch_rows=1), "max_new_tokens"),
        (lambda: Workload(batch_size=1, max_new_tokens=1, prompt_tokens=1, max_batch_rows=0), "max_batch_rows"),
        (lambda: Workload(batch_size=1, max_new_tokens=1, prompt_tokens=1, max_batch_rows=2, top_k=0), "top_k"),
        (lambda: dataclasses.replace(SMOLLM2, dtype="int8"), "dtype"),
        (lambda: dataclasses.replace(SMOLLM2, num_kv_heads=4), "multiple of num_kv_heads"),
        (lambda: dataclasses.replace(SMOLLM2, num_layers=0), "num_layers"),
        (lambda: estimate_memory("SmolLM2", None), "ModelShape"),
        (lambda: text_kv_tokens([5, 6], 0), "max_new_tokens"),
        (lambda: text_kv_tokens([None, 6], 4), "public prompt"),
        (lambda: text_kv_tokens([5, 0], 4), "prompt lengths"),
        (lambda: kv_bound_bytes(SMOLLM2, [], 4, 1), "at least one text"),
        (lambda: kv_bound_bytes(SMOLLM2, [[5, 6]], 4, 0), "texts_in_flight"),
        (lambda: capacity.prefix_slots(-1), "tokens"),
        (lambda: max_batch_rows_for_budget(SMOLLM2, Workload(1, 1, 1, 2), 0), "budget_bytes"),
    ],
)
def test_bad_input_is_a_clear_value_error(make, needle):
    with pytest.raises(ValueError, match=needle):
        make()


def test_read_model_shape_reads_the_config_only(tiny, tiny_dir):
    shape = capacity.read_model_shape(tiny_dir, dtype="bfloat16", device="cpu")
    assert dataclasses.replace(shape, name=tiny.name, dtype="float32") == shape_of(tiny)
    assert capacity.read_model_shape(tiny_dir, device="cpu").dtype == "float32"  # auto on CPU
    assert capacity.read_model_shape(tiny_dir, device="cuda").dtype == "bfloat16"  # auto on CUDA
    with pytest.raises(ValueError, match="device"):
        capacity.read_model_shape(tiny_dir, device="tpu")


# --------------------------------------------------------------------------------------------
# invink-audit memory


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_memory_command_json_is_the_estimate(tiny, tiny_dir, capsys):
    argv = ["memory", "--model", str(tiny_dir), "--batch-size", "3", "--max-new-tokens", "20", "--prompt-tokens", "30",
            "--public-prompt-tokens", "12", "--device", "cpu", "--max-batch-rows", "10", "--json"]
    rc, out, _ = _run(argv, capsys)
    assert rc == 0
    data = json.loads(out)
    workload = Workload(batch_size=3, max_new_tokens=20, prompt_tokens=30, public_prompt_tokens=12, max_batch_rows=10)
    expected = estimate_memory(dataclasses.replace(shape_of(tiny), name=str(tiny_dir)), workload).to_json()
    assert data == {**expected, "memory_budget_gib": None, "fitted_with": None}
    assert data["workload"]["texts_in_flight"] == 2


def test_memory_command_text_and_budget(tiny_dir, capsys):
    base = ["memory", "--model", str(tiny_dir), "--batch-size", "7", "--max-new-tokens", "50", "--prompt-tokens", "40",
            "--device", "cpu"]
    rc, out, _ = _run(base, capsys)
    assert rc == 0
    for needle in ("KV per row, token", "KV per text", "KV, decoding", "KV cache peak", "upper bound", "texts in flight",
                   "R = 64", "G = 8 texts", "peak estimate", "formula: peak = weights + KV", "buckets"):
        assert needle in out, out
    cuda = [*base[:-2], "--dtype", "float32", "--max-batch-rows", "64"]  # the engine's layout on CUDA: the pool
    rc, out, _ = _run(cuda, capsys)
    assert rc == 0 and "one pool, every slot as wide as the longest row" in out and "in the pool" in out
    rc, out, _ = _run([*cuda, "--json"], capsys)
    assert json.loads(out)["workload"]["kv_layout"] == "pool"
    rc, out, _ = _run([*base, "--memory-budget", "0.01", "--json"], capsys)
    assert rc == 0
    data = json.loads(out)
    rows = data["workload"]["max_batch_rows"]
    assert rows % 8 == 0 and data["peak_bytes"] <= 0.01 * capacity.GIB and data["memory_budget_gib"] == 0.01
    assert data["fitted_with"] == "upper bound"
    rc, out, _ = _run([*base, "--memory-budget", "0.01", "--equal-prompts", "--json"], capsys)
    equal = json.loads(out)  # accepted as before; the bound holds for equal prompts too
    assert rc == 0 and equal == data
    rc, out, _ = _run([*base, "--memory-budget", "0.01"], capsys)
    assert rc == 0 and "the largest that fits 0.01 GiB" in out


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--batch-size", "0"], "batch_size must be an integer >= 1"),
        (["--batch-size", "x"], "--batch-size must be an integer"),
        (["--max-batch-rows", "0"], "max_batch_rows"),
        (["--memory-budget", "-1"], "--memory-budget must be"),
        (["--memory-budget", "0.000001"], "even one text"),
    ],
)
def test_memory_command_bad_input_is_one_line_exit_2(tiny_dir, extra, needle, capsys):
    argv = ["memory", "--model", str(tiny_dir), "--batch-size", "3", "--max-new-tokens", "20", "--prompt-tokens", "30",
            "--device", "cpu"]
    # later flags win: the bad value replaces the good one
    rc, out, err = _run(argv + extra, capsys)
    assert rc == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and needle in err, err


_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 100,
          "intermediate_size": 128}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        # probes: a traceback (a string where an int belongs), a raw transformers message (invalid JSON), a size
        # silently truncated (64.5), a negative layer count, a JSON array, no model_type, heads that do not divide
        ('{"model_type": "llama", ', "config.json' is not valid JSON: Expecting property name"),
        # (sizes that are not integers >= 1 are refused before transformers reads them: invink_audit.model_sizes)
        ({**_LLAMA, "hidden_size": "big"}, "config.json': hidden_size is \"big\", not an integer >= 1"),
        ({**_LLAMA, "hidden_size": 64.5}, "config.json': hidden_size is 64.5, not an integer >= 1"),
        ({**_LLAMA, "num_hidden_layers": -2}, "config.json': num_hidden_layers is -2, not an integer >= 1"),
        ({**_LLAMA, "num_attention_heads": 5}, "not a multiple of the number of attention heads"),
        ([1, 2], "config.json' must hold a JSON object"),
        ({"hidden_size": 64}, "Should have a `model_type` key"),
        (None, "has no config.json"),
    ],
)
def test_memory_refuses_a_malformed_model_config_in_one_line_naming_the_file(tmp_path, capsys, config, needle):
    folder = tmp_path / "model"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    argv = ["memory", "--model", str(folder), "--batch-size", "3", "--max-new-tokens", "20", "--prompt-tokens", "30"]
    rc, out, err = _run(argv, capsys)
    assert rc == EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and str(folder) in err and needle in err, err
    assert "Traceback" not in err
    (folder / "config.json").write_text(json.dumps(_LLAMA))  # the same folder, repaired, is planned for
    rc, out, err = _run([*argv, "--json"], capsys)
    assert rc == 0 and json.loads(out)["model"]["num_layers"] == 2, err


@pytest.mark.parametrize("model", ["{tmp}/absent", "./absent-model-folder", "{tmp}/file.txt", "no-such-owner/no-such-model"])
def test_memory_refuses_a_missing_folder_in_one_line(tmp_path, capsys, monkeypatch, model):
    # probe: a missing folder printed transformers' "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is looked up in the local cache only
    (tmp_path / "file.txt").write_text("not a model")
    model = model.format(tmp=tmp_path)
    rc, out, err = _run(["memory", "--model", model, "--batch-size", "3", "--max-new-tokens", "20", "--prompt-tokens",
                         "30"], capsys)  # fmt: skip
    assert rc == EXIT_BAD_INPUT and out == "" and err.count("\n") == 1, err
    assert f"{model!r}" in err and ("does not exist" in err or "is a file" in err or "hub id" in err), err
    assert "Repo id" not in err


# --------------------------------------------------------------------------------------------
# the lock pre-flight


def test_check_locks_passes_and_observes_the_exclusion(tmp_path):
    result = preflight.check_locks(tmp_path)
    assert result.passed and result.status == "pass"
    steps = {step.name: step.detail for step in result.steps}
    assert steps["second process tries while it is held"] == preflight.EXCLUDED
    assert steps["second process tries after release"] == preflight.ACQUIRED
    assert "cannot" not in result.proves and "different machines" in result.cannot_prove
    assert list(tmp_path.iterdir()) == []  # scratch file and its lock removed


def test_a_second_process_is_excluded_while_this_one_holds_the_lock(tmp_path):
    from invink_audit.outputs import output_lock

    output = tmp_path / "texts.jsonl"
    with multiprocessing.get_context("spawn").Pool(1) as other:  # a fresh process, not a fork of this one
        with output_lock(output):
            assert other.apply(preflight.try_lock, (str(output),)) == preflight.EXCLUDED
        assert other.apply(preflight.try_lock, (str(output),)) == preflight.ACQUIRED
    assert preflight.try_lock(output) == preflight.ACQUIRED


def test_check_locks_from_a_script_without_a_main_guard(tmp_path):
    """The second process is a fresh interpreter: a calling script's top-level code is not run again."""
    script = tmp_path / "unguarded.py"
    marker = tmp_path / "runs.txt"
    script.write_text(
        f"with open({str(marker)!r}, 'a') as f: f.write('run\\n')\n"
        "from invink_audit.preflight import check_locks\n"
        f"print(check_locks({str(tmp_path)!r}, timeout=30).status)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "pass"
    assert marker.read_text().count("run") == 1


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS])
def test_check_locks_fails_clearly_when_flock_fails(tmp_path, monkeypatch, capsys, code):
    import fcntl

    def broken(fd, operation):
        raise OSError(code, "flock made to fail by the test")

    monkeypatch.setattr(fcntl, "flock", broken)
    result = preflight.check_locks(tmp_path)
    assert result.status == "fail" and not result.passed
    assert "flock failed" in result.message and "does not support flock" in result.message
    assert list(tmp_path.iterdir()) == []
    rc, out, _ = _run(["check-locks", str(tmp_path)], capsys)
    assert rc == EXIT_FAILURE and "FAIL" in out and "flock failed" in out and "cannot prove" in out


def test_check_locks_command(tmp_path, capsys):
    rc, out, _ = _run(["check-locks", str(tmp_path)], capsys)
    assert rc == 0 and "PASS" in out and "proves:" in out and "different machines" in out
    rc, out, _ = _run(["check-locks", str(tmp_path), "--json"], capsys)
    data = json.loads(out)
    assert rc == 0 and data["passed"] and data["mode"] == "local" and len(data["steps"]) == 3
    rc, out, err = _run(["check-locks", str(tmp_path / "missing")], capsys)
    assert rc == EXIT_BAD_INPUT and "is not a directory" in err and out == ""
    rc, _, err = _run(["check-locks", str(tmp_path), "--hold", "0"], capsys)
    assert rc == EXIT_BAD_INPUT and "seconds must be" in err


def test_hold_and_probe_two_processes(tmp_path, capsys):
    """Machine A (a subprocess here) holds the lock; the probe is excluded, and says that it ran on A's own
    machine (which proves nothing about other machines); once A is done the probe is inconclusive (nobody
    holds it). tests/test_preflight.py plays a second machine."""
    rc, out, _ = _run(["check-locks", str(tmp_path), "--probe"], capsys)
    assert rc == EXIT_INCONCLUSIVE and "nobody holds the lock" in out
    holder = tmp_path / (preflight.LOCK_NAME + ".holder.json")
    command = [sys.executable, "-m", "invink_audit.cli", "check-locks", str(tmp_path), "--hold", "4", "--json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not holder.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.05)
        assert holder.exists(), process.communicate()
        probe = preflight.probe_lock(tmp_path)
        assert probe.status == preflight.SAME_HOST and not probe.passed, probe
        assert "proves nothing about other machines" in probe.message  # honest: both ends ran on this machine
    finally:
        out, err = process.communicate(timeout=60)
    assert process.returncode == 0 and json.loads(out)["passed"], err
    assert not holder.exists()
    assert preflight.probe_lock(tmp_path).status == "inconclusive"


def test_probe_fails_when_it_gets_a_lock_another_machine_claims_to_hold(tmp_path, capsys):
    """A holder record without the lock actually held: the probe acquires the lock. A failure needs the
    holder alive (its heartbeat: tests/test_preflight.py); a record that never beats is a killed holder's."""
    holder = tmp_path / (preflight.LOCK_NAME + ".holder.json")
    holder.write_text(json.dumps({"host": "machine-a", "boot": "a" * 32, "pid": 1, "token": "t", "beat": 0,
                                  "interval": 0.1, "until": time.time() + 60}))
    rc, out, _ = _run(["check-locks", str(tmp_path), "--probe"], capsys)
    assert rc == EXIT_INCONCLUSIVE and "STALE" in out and "ACQUIRED" not in out and not holder.exists()
