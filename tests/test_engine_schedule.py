"""The engine's schedule and the published file's order depend on public information and released
tokens only, never on the private references.

The probe: a text admitted while others decode used to be prefilled at most ``4 * max_prefill_tokens``
tokens per step, so a long private reference delayed it; replacing that reference by null then
changed which texts shared each decoding pass (the public rows of *other* batches changed in the
last bits) and the order texts finished in (a single process wrote its output in that order).

Here a long reference joins mid-run (texts leave as others finish) and is replaced by null or by a
short one; the step-by-step schedule (which texts are in progress, which draw, at which position)
and every public row are compared bitwise.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import invink_audit.engine as engine_module
import invink_audit.generation as generation_module
from invink_audit.distributed import assign_batches, request_cost
from invink_audit.engine import KV_LAYOUTS, Engine
from invink_audit.generation import GenerationConfig, generate, read_generation_output
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.models import build_tiny_model
from invink_audit.prompts import encode_request, get_preset

LONG = "The service was slow but the food was worth the wait, and the dessert was better still. " * 12
# five texts of B = 3; two in progress at a time (max_batch_rows 8), so texts 2..4 join mid-run
REFERENCES = [
    ["The food was great.", "Review stars: 5.0", "Mr Smith was admitted."],
    ["Rest for a week.", "x", "The court replied on Monday."],
    ["0123456789", LONG, "a"],
    ["tiny", "two", "three"],
    ["four", "five", LONG[:200]],
]


def _variants():
    nulled = [list(r) for r in REFERENCES]
    nulled[2][1] = ""
    short = [list(r) for r in REFERENCES]
    short[2][1] = "short"
    other = [list(r) for r in REFERENCES]
    other[4][2] = ""
    return {"original": REFERENCES, "nulled": nulled, "short": short, "other-nulled": other}


def _generator(seed: int, device="cpu") -> torch.Generator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(seed, device=device)


# per dtype, a model seed whose text 0 draws a token no other text draws (_staggering_eos): bfloat16 rounds
# the logits otherwise, and seed 5 has none there
_SEEDS = {"float32": 5, "bfloat16": 6}


@pytest.fixture(scope="module")
def tiny(cpu_dtype):
    # hidden size 64: wide enough for batch effects to show
    model = build_tiny_model(seed=_SEEDS[cpu_dtype], hidden_size=64, dtype=cpu_dtype)
    model.model.config.max_position_embeddings = 4096
    return model


def _run(model, references, monkeypatch, *, rule=None, eos=None, max_prefill_tokens=16, max_new_tokens=6,
         kv_layout=None):
    """Every step's schedule ((request, position) of each text in progress, and of the ready ones),
    each (request, position)'s public row as the step's arithmetic sees it, and the texts in the
    order the engine yielded them. ``eos``: the one end-of-sequence token (texts then finish at
    different steps, so texts join while others decode); ``None``: every text runs to ``max_new_tokens``."""
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6 if rule is None else None, batch_size=3)
    schedule, public = [], {}
    real_draw = engine_module._StepMath.draw

    def spy(self, rows, ready, hooks):
        slots = [(t.request_index, len(t.tokens)) for t in self.run.texts]
        schedule.append((tuple(slots), tuple(slots[s] for s in ready)))
        for slot, key in enumerate(slots):
            public[key] = rows[slot, 0].clone()
        return real_draw(self, rows, ready, hooks)

    if eos is not None:
        model = dataclasses.replace(model, eos_token_ids=(eos,))
    monkeypatch.setattr(engine_module._StepMath, "draw", spy)
    # the prompt as the schedule cases were built on (prompt lengths decide who joins when): no answer prefix
    preset = dataclasses.replace(get_preset("generic"), answer_prefix="", stop=())
    requests = [encode_request(model.tokenizer, preset, refs, key=i) for i, refs in enumerate(references)]
    engine = Engine(model, mechanism, max_batch_rows=8, max_prefill_tokens=max_prefill_tokens, kv_layout=kv_layout)
    texts = list(engine.generate(requests, max_new_tokens=max_new_tokens, generator=_generator(3, model.device),
                                 stop_at_eos=eos is not None, sampling_rule=rule))
    monkeypatch.setattr(engine_module._StepMath, "draw", real_draw)
    return schedule, public, [(t.request_index, t.token_ids) for t in texts]


def _staggering_eos(model, monkeypatch, changed: int) -> int:
    """A token that text 0 draws early and no other text draws in either variant: as the end-of-sequence
    token, text 0 finishes while text 1 still decodes, so text 2 (the long reference) joins mid-run."""
    runs = [_run(model, refs, monkeypatch)[2] for refs in (REFERENCES, _variants()["nulled"])]
    for position in range(1, 4):
        token = dict(runs[0])[0][position]
        if token not in dict(runs[0])[0][:position] and all(
            token not in tokens for texts in runs for i, tokens in texts if i != 0
        ):
            return token
    pytest.fail("no token separates text 0 from the others: pick another seed")


def _check_schedule_and_public_rows(runs, changed, every_row=False):
    base_schedule, base_public, base_texts = runs["original"]
    assert len({len(ready) for _, ready in base_schedule}) > 1  # texts joined while others decoded
    for name, (schedule, public, texts) in runs.items():
        assert schedule == base_schedule, name
        # the engine yields texts in an order fixed by the schedule and the tokens, not by private lengths
        assert [i for i, _ in texts] == [i for i, _ in base_texts], name
        assert public.keys() == base_public.keys()
        for key, row in public.items():
            if every_row or key[0] != changed.get(name) or key[1] == 0:  # the changed text's later tokens may differ
                assert torch.equal(row, base_public[key]), (name, key)
        for (i, tokens), (_, base_tokens) in zip(texts, base_texts):
            if every_row or i != changed.get(name):
                assert tokens == base_tokens, (name, i)


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_schedule_and_public_rows_do_not_depend_on_private_lengths_on_the_default_path(tiny, monkeypatch, kv_layout):
    # 128-token chunks: the old per-step budget (4 chunks) admitted text 2 with its reference nulled or
    # short in one step, and took three steps with the long one
    eos = _staggering_eos(tiny, monkeypatch, changed=2)
    runs = {
        name: _run(tiny, refs, monkeypatch, eos=eos, max_prefill_tokens=128, kv_layout=kv_layout)
        for name, refs in _variants().items() if name != "other-nulled"
    }
    _check_schedule_and_public_rows(runs, {"nulled": 2, "short": 2})


# teacher-forced tokens; EOS (token 3) ends text 0 after 2 tokens, text 2 after 3, text 3 after 4
EOS = 3
FORCED = [[5, EOS], [7, 8, 9, 10, 11, 12], [13, 14, EOS], [15, 16, 17, EOS], [18, 19, 20, 21, 22, 23]]


def _forced_rule(step):
    weights = torch.full_like(step.log_probs, -math.inf)
    for g, (i, t) in enumerate(zip(step.request_indices.tolist(), step.positions.tolist())):
        weights[g, FORCED[i][t]] = 0.0
    return weights


@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_every_public_row_is_bitwise_the_same_with_forced_tokens_on_the_full_path(tiny, monkeypatch, kv_layout):
    """Full-logits path, every text teacher-forced (texts finish at different steps): the changed texts'
    public rows too, at every step."""
    runs = {name: _run(tiny, refs, monkeypatch, rule=_forced_rule, eos=EOS, kv_layout=kv_layout)
            for name, refs in _variants().items()}
    _check_schedule_and_public_rows(runs, {}, every_row=True)


@pytest.mark.slow
@pytest.mark.parametrize("kv_layout", KV_LAYOUTS)
def test_real_model_schedule_and_public_rows_do_not_depend_on_a_long_reference_joining_mid_run(monkeypatch, cpu_dtype,
                                                                                              kv_layout):
    """The probe on SmolLM2 (float32, and bfloat16 where native): a long review in a batch that joins mid-run,
    replaced by null. The pool (CUDA's layout, bfloat16 there) runs in bfloat16 only here, to keep the suite short;
    in float32 it is checked on the tiny model by tests/test_engine_rows.py and, on CUDA, by `make gpu-check`."""
    from invink_audit.models import load_model

    if kv_layout == "pool" and cpu_dtype == "float32":
        pytest.skip("the pool is checked in bfloat16 on SmolLM2 here (float32 on the tiny model: tests/test_engine_rows.py)")

    model = load_model(None, device="cpu", dtype=cpu_dtype)
    runs = {
        name: _run(model, refs, monkeypatch, rule=_forced_rule, eos=EOS, max_prefill_tokens=32, kv_layout=kv_layout)
        for name, refs in _variants().items() if name in ("original", "nulled")
    }
    _check_schedule_and_public_rows(runs, {}, every_row=True)


def test_a_single_process_output_is_written_in_batch_order_whatever_the_finishing_order(tmp_path, monkeypatch):
    """The probe: one process wrote ``--output`` in finishing order ([0, 2, 1] under replace-by-null).
    The engine is made to finish texts in reverse order; the published file is in batch order."""
    tiny = build_tiny_model(seed=5)
    real = generation_module.Engine.generate

    def reversed_finish(self, requests, **kwargs):
        yield from reversed(list(real(self, requests, **kwargs)))

    monkeypatch.setattr(generation_module.Engine, "generate", reversed_finish)
    output = tmp_path / "out.jsonl"
    references = ["Anna has a cough.", "", "Bo has a rash.", "Cy needs rest.", "Di is fine.", "Ed is tired."]
    result = generate(references, GenerationConfig(batch_size=2, max_new_tokens=4, delta=1e-6, epsilon=5.0, top_k=8),
                      model=tiny, output=output)
    assert [t.batch_index for t in result.texts] == [0, 1, 2]
    records = read_generation_output(output)
    assert [r["batch_index"] for r in records] == [0, 1, 2]


def test_batches_are_assigned_to_processes_by_public_information_only(tiny):
    """Which process draws a batch (and so which batches share its decoding passes) must not follow a
    private length: a long reference, nulled or shortened, gives the same costs and the same assignment."""
    # the prompt as the schedule cases were built on (prompt lengths decide who joins when): no answer prefix
    preset = dataclasses.replace(get_preset("generic"), answer_prefix="", stop=())
    assignments = set()
    for references in _variants().values():
        requests = [encode_request(tiny.tokenizer, preset, refs, key=i) for i, refs in enumerate(references)]
        costs = {i: request_cost(r, 6) for i, r in enumerate(requests)}
        assignments.add(tuple(tuple(part) for part in assign_batches(costs, 2)))
    assert len(assignments) == 1
