"""Perplexity (paper App. D.4) against a brute-force computation, and its per-text cache.

The brute force scores one text at a time, one prefix at a time, with an explicit log-softmax: no
batching, padding or fused cross-entropy. The cache must return exactly what scoring returns, never
score a text twice under the same scorer and settings, and key on the scorer's weights (a changed model
under the same name is scored again), the token limit and the text.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from invink_audit.evaluation import EvaluationConfig, TextSet, evaluate
from invink_audit.evaluation.perplexity import _context_token, perplexity_cache, score_perplexity, scorer_digest
from invink_audit.models import build_tiny_model

#: batched float32 scoring vs one-prefix-at-a-time: agreement up to float32 summation order
PPL_RELATIVE_TOLERANCE = 1e-4

TEXTS = ["the soup was cold", "great service and a lovely room, would come back", "", "ok", "the soup was cold"]


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=3)


def _brute_force_perplexity(text: str, loaded, max_tokens: int) -> float | None:
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens] if text else []
    if not ids:
        return None
    sequence = [_context_token(loaded.tokenizer), *ids]
    total = 0.0
    with torch.no_grad():
        for t in range(1, len(sequence)):
            logits = loaded.model(input_ids=torch.tensor([sequence[:t]])).logits[0, -1].double()
            total -= float(torch.log_softmax(logits, dim=-1)[sequence[t]])
    return math.exp(total / len(ids))


@pytest.mark.parametrize("max_tokens", [512, 3])
def test_perplexity_matches_brute_force_one_prefix_at_a_time(tiny, max_tokens):
    scores = score_perplexity(TEXTS, tiny, max_tokens=max_tokens, batch_tokens=16)
    for text, got in zip(TEXTS, scores.perplexities):
        expected = _brute_force_perplexity(text, tiny, max_tokens)
        if expected is None:
            assert got is None
        else:
            assert got == pytest.approx(expected, rel=PPL_RELATIVE_TOLERANCE)
    lengths = [len(tiny.tokenizer(t, add_special_tokens=False)["input_ids"]) if t else 0 for t in TEXTS]
    assert scores.num_tokens == tuple(min(n, max_tokens) for n in lengths)
    assert scores.truncated == sum(n > max_tokens for n in lengths)


def _refuse(*args, **kwargs):
    raise AssertionError("scored a text the cache holds")


def test_the_cache_returns_what_scoring_returns_and_scores_each_text_once(tiny, tmp_path):
    plain = score_perplexity(TEXTS, tiny)
    cache = perplexity_cache(tmp_path)
    seen = []
    first = score_perplexity(TEXTS, tiny, cache=cache, progress=seen.append)
    assert first == plain and sum(seen) == len(TEXTS)
    refusing = copy.copy(tiny)
    object.__setattr__(refusing, "model", copy.deepcopy(tiny.model))
    refusing.model.forward = _refuse  # the same weights, but it must not run: every text is in the cache
    assert scorer_digest(refusing) == scorer_digest(tiny)
    seen.clear()
    again = score_perplexity(list(reversed(TEXTS)), refusing, cache=cache, progress=seen.append)
    assert again.perplexities == tuple(reversed(plain.perplexities)) and sum(seen) == len(TEXTS)
    cache.close()
    assert (tmp_path / "perplexities.sqlite").stat().st_mode & 0o077 == 0  # derived from private texts: owner only


def test_the_cache_keys_on_the_weights_and_the_token_limit(tiny, tmp_path):
    cache = perplexity_cache(tmp_path)
    score_perplexity(TEXTS, tiny, cache=cache)
    changed = build_tiny_model(seed=3)
    with torch.no_grad():
        changed.model.get_output_embeddings().weight.mul_(1.5)  # same name, other weights
    assert scorer_digest(changed) != scorer_digest(tiny)
    rescored = score_perplexity(TEXTS, changed, cache=cache)
    assert rescored == score_perplexity(TEXTS, changed)  # scored again, not taken from the first model's rows
    assert rescored.perplexities != score_perplexity(TEXTS, tiny).perplexities
    cut = score_perplexity(TEXTS, tiny, max_tokens=2, cache=cache)
    assert cut == score_perplexity(TEXTS, tiny, max_tokens=2)
    cache.close()


def test_an_evaluation_without_caches_keeps_nothing_on_disk(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("INVINK_AUDIT_CACHE", str(tmp_path))
    synthetic = TextSet(texts=tuple(TEXTS[:2] + ["a third text"]))
    real = TextSet(texts=("one real text", "another real one", "and a third"))
    # turning the embedding cache off turns the perplexity cache off too (perplexity_cache=None follows it)
    config = EvaluationConfig(embedding_model="minilm", mauve_seeds=1, mauve_bootstrap=0, embedding_cache=False)
    try:
        evaluate(synthetic, real, config, scorer_model=tiny)
    except ValueError as err:  # pragma: no cover - MiniLM not installed
        pytest.skip(str(err))
    assert not (tmp_path / "perplexities.sqlite").exists() and not (tmp_path / "embeddings.sqlite").exists()


def test_scoring_rejects_non_strings_before_scoring_anything(tiny, tmp_path):
    cache = perplexity_cache(tmp_path)
    with pytest.raises(ValueError, match=r"texts\[1\] must be a string"):
        score_perplexity(["fine", 3], tiny, cache=cache)
    assert cache.get_many([]) == {}
    cache.close()


def test_a_non_finite_score_is_reported_but_never_cached(tiny, tmp_path, monkeypatch):
    import numpy as np

    import invink_audit.evaluation.perplexity as perplexity

    monkeypatch.setattr(perplexity, "_mean_nll", lambda batch, start, loaded: np.full(len(batch), np.nan))
    cache = perplexity_cache(tmp_path)
    scores = score_perplexity(["a text that overflowed", ""], tiny, cache=cache)
    assert math.isnan(scores.perplexities[0]) and scores.perplexities[1] is None
    assert len(cache.get_many([k for k in _all_keys(cache)])) == 1  # only the empty text's row
    cache.close()


def _all_keys(cache):
    return [row[0] for row in cache._db.execute(f"SELECT key FROM {cache.table}")]
