"""The batched engine computes exactly the mechanism's distribution, row for row.

Oracle: for every text and step, the logits of each row recomputed independently (one unpadded,
uncached forward pass per row with the text's prefix) and fed to ``token_log_probs``. The engine
(left padding, KV cache, shards, eviction, continuous batching) must give the same log-probabilities.
A float64 tiny model makes the comparison tight (padding/caching change only rounding).
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from scipy import stats

from invink_audit.engine import DecodeStep, Engine
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator, token_log_probs
from invink_audit.models import build_tiny_model
from invink_audit.prompts import encode_request, get_preset

# float64 model: batched/padded/cached logits agree with the unbatched ones to ~1e-12.
FLOAT64_ATOL = 1e-9
# the same float64 logits through two formulas (the mechanism's step, log_softmax(pub/τ) when every
# reference is null): a few ulps of log-probabilities of order 10
FORMULA_ATOL = 1e-12
# float32 model: the same comparison up to float32 rounding of the logits (~1e-6 relative).
FLOAT32_ATOL = 2e-4
# significance level of the goodness-of-fit test of the engine's draws (seeded: deterministic).
GOF_ALPHA = 1e-3

REFERENCES = [
    ["The food was great and the service was slow.", "", "Mr Smith was admitted to the hospital."],
    ["", "", ""],
    ["Discharge instructions: rest.", "Review stars: 5.0", "a"],
    ["The applicant lodged a complaint with the court on Monday, and the court replied.", "x", ""],
    ["0123456789", "", "Business category: Restaurants."],
]


def _generator(seed: int) -> torch.Generator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(seed)


@pytest.fixture(scope="module")
def tiny64():
    return build_tiny_model(seed=1, dtype="float64")


@pytest.fixture(scope="module")
def tiny32():
    return build_tiny_model(seed=2)


def _requests(model, references=REFERENCES):
    template = get_preset("generic")
    return [encode_request(model.tokenizer, template, refs, key=f"text{i}") for i, refs in enumerate(references)]


def _oracle_all_steps(model, request, tokens, mechanism, steps):
    """Oracle log-probabilities at each step in ``steps`` of a forced sequence ``tokens``.

    One plain forward pass per row over prompt + tokens (no padding, no cache, batch of one); the
    causal model's logits at position ``len(prompt) + t - 1`` are those of step ``t``.
    """
    rows = [request.public_ids] + [ids if ids is not None else request.public_ids for ids in request.private_ids]
    per_row = []
    with torch.inference_mode():
        for ids in rows:
            x = torch.tensor([list(ids) + list(tokens)], dtype=torch.long)
            logits = model.model(input_ids=x).logits[0]
            per_row.append(torch.stack([logits[len(ids) + t - 1] for t in steps]))
    return token_log_probs(
        torch.stack(per_row[1:], dim=1),
        per_row[0],
        clip_norm=mechanism.clip_norm,
        temperature=mechanism.temperature,
        top_k=mechanism.top_k,
    )


def _forced_run(model, requests, forced, mechanism, **engine_kwargs):
    """Run the engine with every text's tokens forced; returns {(text, t): log_probs} and finished texts."""
    seen = {}

    def rule(step: DecodeStep) -> torch.Tensor:
        weights = torch.full_like(step.log_probs, -math.inf)
        for g, (index, t) in enumerate(zip(step.request_indices.tolist(), step.positions.tolist())):
            weights[g, forced[index][t]] = 0.0
        return weights

    def observer(step: DecodeStep) -> None:
        for g, (index, t) in enumerate(zip(step.request_indices.tolist(), step.positions.tolist())):
            assert (index, t) not in seen
            seen[(index, t)] = step.log_probs[g].clone()
            assert step.tokens[g].item() == forced[index][t]

    engine = Engine(model, mechanism, **engine_kwargs)
    max_new_tokens = max(len(f) for f in forced)
    finished = list(
        engine.generate(
            requests, max_new_tokens=max_new_tokens, generator=_generator(0), observer=observer, sampling_rule=rule
        )
    )
    return seen, finished


def _forced_tokens(model, count: int, lengths: list[int]) -> list[list[int]]:
    """Token sequences of the given lengths; a sequence shorter than the longest ends with EOS."""
    longest = max(lengths)
    gen = torch.Generator().manual_seed(123)
    eos = model.eos_token_ids[0]
    out = []
    for n in lengths:
        tokens = torch.randint(3, model.vocab_size, (n,), generator=gen).tolist()
        if n < longest:
            tokens[-1] = eos
        out.append(tokens)
    return out


@pytest.mark.parametrize(
    "max_batch_rows, top_k, kv_layout",
    [
        (64, 8, "buckets"),  # everything in one shard, one forward per step
        (4, 8, "buckets"),  # several texts wait and join as others finish; texts split across shards
        (2, None, "buckets"),  # a text's rows span two shards; full vocabulary
        (64, 8, "pool"),  # the GPU's layout: one pool, one attention call per layer
        (4, None, "pool"),  # texts joining: slots freed and reused
    ],
)
def test_teacher_forced_distribution_equals_mechanism_on_independent_logits(tiny64, max_batch_rows, top_k, kv_layout):
    mechanism = MechanismConfig(clip_norm=0.7, temperature=1.3, top_k=top_k, batch_size=3)
    requests = _requests(tiny64)
    lengths = [6, 2, 9, 4, 9]
    forced = _forced_tokens(tiny64, len(requests), lengths)
    seen, finished = _forced_run(tiny64, requests, forced, mechanism, max_batch_rows=max_batch_rows,
                                 kv_layout=kv_layout)

    assert sorted(seen) == sorted((i, t) for i, n in enumerate(lengths) for t in range(n))
    for index, n in enumerate(lengths):
        oracle = _oracle_all_steps(tiny64, requests[index], forced[index], mechanism, steps=range(n))
        for t in range(n):
            engine_lp = seen[(index, t)]
            assert torch.equal(torch.isfinite(engine_lp), torch.isfinite(oracle[t])), (index, t)
            finite = torch.isfinite(oracle[t])
            assert torch.allclose(engine_lp[finite], oracle[t][finite], atol=FLOAT64_ATOL, rtol=0), (index, t)

    by_key = {f.key: f for f in finished}
    assert len(by_key) == len(requests)
    for i, request in enumerate(requests):
        text = by_key[request.key]
        assert list(text.token_ids) == forced[i]
        assert text.finish_reason == ("eos" if lengths[i] < max(lengths) else "length")
        sizes = [torch.isfinite(seen[(i, t)]).sum().item() for t in range(lengths[i])]
        assert text.topk_plus_size_mean == pytest.approx(sum(sizes) / len(sizes))


def test_float32_model_matches_oracle_up_to_float32_rounding(tiny32):
    mechanism = MechanismConfig(clip_norm=1.5, temperature=1.0, top_k=20, batch_size=3)
    requests = _requests(tiny32)[:3]
    forced = _forced_tokens(tiny32, 3, [5, 5, 5])
    seen, _ = _forced_run(tiny32, requests, forced, mechanism, max_batch_rows=5)
    for index in range(3):
        oracle = _oracle_all_steps(tiny32, requests[index], forced[index], mechanism, steps=range(5))
        for t in range(5):
            engine_lp = seen[(index, t)]
            both = torch.isfinite(oracle[t]) & torch.isfinite(engine_lp)
            assert torch.allclose(engine_lp[both], oracle[t][both], atol=FLOAT32_ATOL, rtol=0)
            # a token may only enter/leave the Top-k+ set by rounding when it sits at the threshold
            assert (torch.isfinite(oracle[t]) ^ torch.isfinite(engine_lp)).sum() <= 1


def test_null_reference_rows_are_the_public_row_bitwise(tiny64):
    mechanism = MechanismConfig(clip_norm=0.5, temperature=1.0, top_k=5, batch_size=3)
    requests = _requests(tiny64)
    checked = []

    def observer(step: DecodeStep) -> None:
        for g, index in enumerate(step.request_indices.tolist()):
            for j, ids in enumerate(requests[index].private_ids):
                if ids is None:
                    assert torch.equal(step.private_logits[g, j], step.public_logits[g])
                    checked.append((index, j))
                else:
                    assert not torch.equal(step.private_logits[g, j], step.public_logits[g])

    engine = Engine(tiny64, mechanism, max_batch_rows=6)
    list(engine.generate(requests, max_new_tokens=3, generator=_generator(1), observer=observer, stop_at_eos=False))
    assert len(checked) == 3 * 6  # six null references (three in text 1), three steps each


def test_all_null_batch_samples_from_the_public_distribution(tiny64):
    """With every reference null, the aggregate is the public logits: log_probs = log_softmax(pub/τ) on V_k+."""
    mechanism = MechanismConfig(clip_norm=0.3, temperature=0.8, top_k=None, batch_size=3)
    requests = _requests(tiny64, [["", "", ""]])

    def observer(step: DecodeStep) -> None:
        expected = torch.log_softmax(step.public_logits.double() / 0.8, dim=-1)
        assert torch.allclose(step.log_probs, expected, atol=FORMULA_ATOL, rtol=0)

    engine = Engine(tiny64, mechanism)
    list(engine.generate(requests, max_new_tokens=4, generator=_generator(2), observer=observer))


def test_engine_draws_follow_the_reported_distribution(tiny32):
    """First-token draws of many identical texts pass a G-test against exp(log_probs)."""
    mechanism = MechanismConfig(clip_norm=2.0, temperature=1.0, top_k=6, batch_size=2)
    request = _requests(tiny32, [["The food was great", "Mr Smith"]])[0]
    count = 1200
    requests = [request] * count
    first = {}

    def observer(step: DecodeStep) -> None:
        first["log_probs"] = step.log_probs[0].clone()
        assert torch.equal(step.log_probs, step.log_probs[:1].expand_as(step.log_probs))

    engine = Engine(tiny32, mechanism, max_batch_rows=count * 3)
    texts = list(engine.generate(requests, max_new_tokens=1, generator=_generator(3), observer=observer))
    probs = first["log_probs"].exp()
    support = torch.isfinite(first["log_probs"]).nonzero().flatten().tolist()
    observed = torch.bincount(torch.tensor([t.token_ids[0] for t in texts]), minlength=probs.numel())
    assert observed[[i for i in range(probs.numel()) if i not in support]].sum() == 0
    expected = probs[support] * count
    statistic, p_value = stats.power_divergence(observed[support].numpy(), expected.numpy(), lambda_="log-likelihood")
    assert p_value > GOF_ALPHA, (statistic, p_value)


def test_sampling_rule_draws_from_a_neighbour_while_every_row_is_computed(tiny64):
    """The auditor's use: sample from R'_j (reference j nulled) through the same engine."""
    mechanism = MechanismConfig(clip_norm=0.9, temperature=1.0, top_k=8, batch_size=3)
    requests = _requests(tiny64)[:1]
    j = 0
    observed, observed_log_probs, differs = [], [], []

    def rule(step: DecodeStep) -> torch.Tensor:
        return step.neighbour_log_probs().neighbours[:, j, :]

    def observer(step: DecodeStep) -> None:
        neighbours = step.neighbour_log_probs()
        assert torch.equal(step.sampling_log_probs, neighbours.neighbours[:, j, :])
        assert torch.equal(neighbours.actual, step.log_probs)
        differs.append(not torch.equal(step.sampling_log_probs, step.log_probs))
        observed.append(step.tokens.clone())
        observed_log_probs.append(step.sampling_log_probs[0].clone())

    engine = Engine(tiny64, mechanism)
    (text,) = engine.generate(
        requests, max_new_tokens=5, generator=_generator(4), observer=observer, sampling_rule=rule, neighbours=True
    )
    assert list(text.token_ids) == [int(t) for t in observed]
    assert any(differs)  # (a step can coincide: clipping saturated on every token of a small support)

    # the neighbour's distribution is the mechanism's on the neighbouring dataset, computed independently
    nulled = [list(REFERENCES[0])]
    nulled[0][j] = ""
    neighbour_request = _requests(tiny64, nulled)[0]
    sampled = observed_log_probs
    steps = range(text.num_tokens)
    expected = _oracle_all_steps(tiny64, neighbour_request, list(text.token_ids), mechanism, steps=steps)
    for t in range(text.num_tokens):
        finite = torch.isfinite(expected[t])
        assert torch.equal(finite, torch.isfinite(sampled[t]))
        assert torch.allclose(sampled[t][finite], expected[t][finite], atol=FLOAT64_ATOL, rtol=0)


def test_no_step_object_is_built_without_hooks(tiny32, monkeypatch):
    import invink_audit.engine as engine_module

    def forbidden(*args, **kwargs):
        raise AssertionError("DecodeStep built although no observer or sampling rule was given")

    monkeypatch.setattr(engine_module, "DecodeStep", forbidden)
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=10, batch_size=3)
    texts = list(Engine(tiny32, mechanism).generate(_requests(tiny32), max_new_tokens=3, generator=_generator(5)))
    assert len(texts) == len(REFERENCES)


def test_progress_counts_every_drawn_token(tiny32):
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=10, batch_size=3)
    counts = []
    texts = list(
        Engine(tiny32, mechanism, max_batch_rows=5).generate(
            _requests(tiny32), max_new_tokens=7, generator=_generator(6), progress=counts.append
        )
    )
    assert sum(counts) == sum(t.num_tokens for t in texts)


def test_expansion_tokens_count_draws_below_the_kth_public_logit(tiny64):
    mechanism = MechanismConfig(clip_norm=3.0, temperature=2.0, top_k=2, batch_size=3)
    requests = _requests(tiny64)[:2]
    below = {}

    def observer(step: DecodeStep) -> None:
        kth = torch.topk(step.public_logits, 2, dim=-1).values[:, -1]
        for g, index in enumerate(step.request_indices.tolist()):
            token = step.tokens[g]
            below[index] = below.get(index, 0) + int(step.public_logits[g, token] < kth[g])

    engine = Engine(tiny64, mechanism)
    texts = list(engine.generate(requests, max_new_tokens=30, generator=_generator(7), observer=observer))
    assert {int(t.key.removeprefix("text")): t.expansion_tokens for t in texts} == below
    assert sum(below.values()) > 0  # the large band makes expansion draws likely: the count is exercised


def test_full_vocabulary_has_no_expansion_and_full_support(tiny32):
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=None, batch_size=3)
    texts = list(Engine(tiny32, mechanism).generate(_requests(tiny32), max_new_tokens=4, generator=_generator(8)))
    for text in texts:
        assert text.expansion_tokens == 0
        assert text.topk_plus_size_mean == tiny32.vocab_size
        assert text.topk_plus_size_std == 0.0


def test_seeded_runs_are_reproducible_and_max_new_tokens_is_respected(tiny32):
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=10, batch_size=3)
    runs = []
    for _ in range(2):
        engine = Engine(tiny32, mechanism, max_batch_rows=7)
        texts = engine.generate(_requests(tiny32), max_new_tokens=6, generator=_generator(9))
        runs.append(sorted((t.key, t.token_ids) for t in texts))
    assert runs[0] == runs[1]
    assert all(1 <= len(ids) <= 6 for _, ids in runs[0])


def test_bad_arguments_are_rejected(tiny32):
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=10, batch_size=2)
    engine = Engine(tiny32, mechanism)
    requests = _requests(tiny32)  # B = 3
    # refused when generate is called, not when its iterator is first advanced
    with pytest.raises(ValueError, match="batch_size=2"):
        engine.generate(requests, max_new_tokens=2, generator=_generator(0))
    good = _requests(tiny32, [["a", "b"]])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate(good, max_new_tokens=0, generator=_generator(0))
    with pytest.raises(ValueError, match="generator"):
        engine.generate(good, max_new_tokens=2, generator=None)
    with pytest.raises(ValueError, match="max_batch_rows"):
        Engine(tiny32, mechanism, max_batch_rows=0)
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        Engine(tiny32, mechanism, kv_layout="paged")
    assert Engine(tiny32, mechanism).kv_layout == "buckets"  # the CPU's default
    with pytest.raises(ValueError, match="LoadedModel"):
        Engine(tiny32.model, mechanism)
    def truncated(step):
        return step.log_probs[:, :3]

    with pytest.raises(ValueError, match="sampling_rule must return"):
        list(engine.generate(good, max_new_tokens=2, generator=_generator(0), sampling_rule=truncated))
    assert list(engine.generate([], max_new_tokens=2, generator=_generator(0))) == []


@pytest.mark.parametrize("kv_layout", ["buckets", "pool"])
def test_sliding_window_models_match_the_oracle(tiny64, kv_layout):
    """A model with sliding-window attention (Mistral, window 8, prompts of ~20 tokens): each row attends to
    its last 8 keys, exactly as the model's own (uncached, unpadded) forward pass does."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=tiny64.vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mistral = MistralForCausalLM(config).to(torch.float64).eval()
    model = dataclasses.replace(tiny64, model=mistral, name="tiny-mistral")
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=10, batch_size=3)
    requests = _requests(model)[:3]
    forced = _forced_tokens(model, 3, [6, 4, 6])
    seen, _ = _forced_run(model, requests, forced, mechanism, max_prefill_tokens=5, kv_layout=kv_layout)  # chunked
    for index, request in enumerate(requests):
        steps = range(len(forced[index]))
        expected = _oracle_all_steps(model, request, forced[index], mechanism, steps=steps)
        for t in steps:
            got = seen[(index, t)]
            finite = torch.isfinite(expected[t])
            assert torch.equal(finite, torch.isfinite(got))
            assert torch.allclose(got[finite], expected[t][finite], atol=FLOAT64_ATOL, rtol=0)


def test_row_cache_appends_in_place_and_grows():
    from invink_audit.rows import RowKV

    gen = torch.Generator().manual_seed(0)
    row = RowKV(num_layers=2, reserve=1)
    expected_k = torch.empty(1, 3, 0, 5)
    for count in (4, 1, 1, 1):  # the second append fits the reserve, the third doubles the capacity
        new_k, new_v = torch.randn(1, 3, count, 5, generator=gen), torch.randn(1, 3, count, 5, generator=gen)
        out_k, out_v = row.append(1, new_k, new_v)
        expected_k = torch.cat([expected_k, new_k], dim=2)
        assert torch.equal(out_k, expected_k) and torch.equal(out_v[:, :, -count:], new_v)
        row.length += count
    twin = row.copy(reserve=2)
    assert torch.equal(twin.keys[1][:, :, : row.length], row.keys[1][:, :, : row.length])
    assert twin.keys[1].data_ptr() != row.keys[1].data_ptr() and twin.keys[0] is None


# ------------------------------------------------------------------ private logits on Top-k+ columns only


def _recorded_run(model, mechanism, requests, monkeypatch, *, support_only, seed, max_batch_rows=None, **hooks):
    """Run the engine, recording every step's log-probabilities (G, V) of the texts that draw."""
    import invink_audit.engine as engine_module

    recorded = []
    real_support, real_draw = engine_module._support_log_probs, engine_module.gumbel_argmax
    real_step = engine_module._StepMath._draw_support
    attempt = []  # the Top-k+ path's last attempt of this step (a step is redone if its columns overflow)

    def support(head, mech, public, inside, private_states, null, index):
        log_probs, private = real_support(head, mech, public, inside, private_states, null, index)
        full = log_probs if index is None else torch.full(
            public.shape, -math.inf, dtype=log_probs.dtype).scatter_(-1, index, log_probs)
        attempt[:] = [full]
        return log_probs, private

    def support_step(self, *args):
        values = real_step(self, *args)
        recorded.append(attempt[0])
        return values

    def draw(log_probs, uniform):
        if not attempt:
            recorded.append(log_probs.clone())
        return real_draw(log_probs, uniform)

    monkeypatch.setattr(engine_module, "_support_log_probs", support)
    monkeypatch.setattr(engine_module, "gumbel_argmax", draw)
    monkeypatch.setattr(engine_module._StepMath, "_draw_support", support_step)
    engine = Engine(model, mechanism, support_only=support_only, max_batch_rows=max_batch_rows)
    texts = list(engine.generate(requests, max_new_tokens=6, generator=_generator(seed), **hooks))
    monkeypatch.setattr(engine_module, "_support_log_probs", real_support)
    monkeypatch.setattr(engine_module, "gumbel_argmax", real_draw)
    monkeypatch.setattr(engine_module._StepMath, "_draw_support", real_step)
    return engine, texts, recorded


@pytest.mark.parametrize("top_k, clip_norm", [(1, 1.3), (5, 1.3), (40, 1.3), (5, 1e6)])
def test_support_only_private_logits_give_the_oracle_distribution(tiny64, monkeypatch, top_k, clip_norm):
    """Default path (no hooks): private logits on the Top-k+ columns only, checked against the oracle
    (with C = 1e6 the band takes the whole vocabulary, and the full private logits are computed)."""
    mechanism = MechanismConfig(clip_norm=clip_norm, temperature=0.9, top_k=top_k, batch_size=3)
    (request,) = _requests(tiny64)[:1]
    engine, (text,), recorded = _recorded_run(tiny64, mechanism, [request], monkeypatch, support_only=True, seed=11)
    assert engine.support_only
    expected = _oracle_all_steps(tiny64, request, list(text.token_ids), mechanism, steps=range(text.num_tokens))
    assert len(recorded) == text.num_tokens
    for t in range(text.num_tokens):
        got = recorded[t][0]
        finite = torch.isfinite(expected[t])
        assert torch.equal(finite, torch.isfinite(got))
        assert torch.allclose(got[finite], expected[t][finite], atol=FLOAT64_ATOL, rtol=0)


def test_support_only_and_full_logits_draw_the_same_texts(tiny64, monkeypatch):
    """Same seed, joins and evictions (5 texts, 2 fit at a time): same distributions, same tokens, same stats."""
    mechanism = MechanismConfig(clip_norm=2.0, temperature=1.0, top_k=4, batch_size=3)
    requests = _requests(tiny64)
    runs = {
        mode: _recorded_run(tiny64, mechanism, requests, monkeypatch, support_only=mode, seed=12, max_batch_rows=8)
        for mode in (True, False)
    }
    assert runs[True][0].support_only and not runs[False][0].support_only
    (_, texts_s, steps_s), (_, texts_f, steps_f) = runs[True], runs[False]
    assert len(steps_s) == len(steps_f)
    for a, b in zip(steps_s, steps_f):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        assert torch.allclose(a[torch.isfinite(a)], b[torch.isfinite(b)], atol=FLOAT64_ATOL, rtol=0)
    key = lambda t: t.request_index  # noqa: E731
    for a, b in zip(sorted(texts_s, key=key), sorted(texts_f, key=key)):
        assert a.token_ids == b.token_ids and a.expansion_tokens == b.expansion_tokens
        assert a.topk_plus_size_mean == b.topk_plus_size_mean and a.topk_plus_size_std == b.topk_plus_size_std


def test_hooks_get_full_private_logits_even_when_support_only(tiny32):
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=3, batch_size=3)
    shapes = []
    engine = Engine(tiny32, mechanism)
    assert engine.support_only
    list(
        engine.generate(
            _requests(tiny32)[:2], max_new_tokens=2, generator=_generator(13),
            observer=lambda step: shapes.append(tuple(step.private_logits.shape)),
        )
    )
    assert shapes and all(shape[-1] == tiny32.vocab_size and shape[-2] == 3 for shape in shapes)


def test_models_whose_logits_are_not_the_output_layer_keep_full_logits(monkeypatch):
    """A logit transform after the output layer (here a scaling hook; or a soft-capping config) disables the split."""
    scaled = build_tiny_model(seed=4)

    def scale(module, args, kwargs, output):
        output.logits = output.logits * 1.5
        return output

    handle = scaled.model.register_forward_hook(scale, with_kwargs=True)
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=3, batch_size=3)
    try:
        assert not Engine(scaled, mechanism).support_only
    finally:
        handle.remove()
    assert Engine(scaled, mechanism).support_only
    monkeypatch.setattr(scaled.model.config, "final_logit_softcapping", 30.0, raising=False)
    assert not Engine(scaled, mechanism).support_only
    with pytest.raises(ValueError, match="support_only"):
        Engine(scaled, mechanism, support_only="yes")


def test_support_only_null_rows_are_the_public_row_bitwise(monkeypatch):
    """On the Top-k+ columns too, a null reference's logits are exactly the public logits (not a GEMM's rounding)."""
    import invink_audit.engine as engine_module

    model = build_tiny_model(seed=3, hidden_size=64)  # wide enough for two GEMMs to round differently
    mechanism = MechanismConfig(clip_norm=0.7, temperature=1.0, top_k=5, batch_size=3)
    seen = []
    real = engine_module._support_log_probs

    def recording(head, mech, public, support, private_states, null, index):
        log_probs, private = real(head, mech, public, support, private_states, null, index)
        seen.append((private.clone(), public.gather(-1, index) if index is not None else public, null.clone()))
        return log_probs, private

    monkeypatch.setattr(engine_module, "_support_log_probs", recording)
    engine = Engine(model, mechanism)
    assert engine.support_only
    for texts in (REFERENCES[:1], REFERENCES[:2]):  # one text in progress, then two (one of them all nulls)
        seen.clear()
        requests = _requests(model, texts)
        list(engine.generate(requests, max_new_tokens=4, generator=_generator(14), stop_at_eos=False))
        assert len(seen) == 4
        nulls = [[j for j, ref in enumerate(refs) if not ref] for refs in texts]
        for private, public, null in seen:
            assert private.shape[-1] < model.vocab_size  # the compacted columns
            for g, js in enumerate(nulls):
                assert null[g].tolist() == [j in js for j in range(3)]
                for j in js:
                    assert torch.equal(private[g, j], public[g])


def test_probe_rejects_a_small_logit_scaling_in_bfloat16_and_nested_transforms(monkeypatch):
    model = build_tiny_model(seed=6, dtype="bfloat16")
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=3, batch_size=3)
    assert Engine(model, mechanism).support_only

    def scale(module, args, kwargs, output):
        output.logits = output.logits * 1.1
        return output

    handle = model.model.register_forward_hook(scale, with_kwargs=True)
    try:
        assert not Engine(model, mechanism).support_only
    finally:
        handle.remove()
    text_config = type(model.model.config)(**model.model.config.to_dict())
    text_config.final_logit_softcapping = 30.0
    monkeypatch.setattr(type(model.model.config), "get_text_config", lambda self, *a, **k: text_config)
    assert not Engine(model, mechanism).support_only
