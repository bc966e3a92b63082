"""Perplexity of texts under a scorer LM, ΔPPL, and lengths (paper App. D.4, sec:expt:eval-metrics, "Generation
Perplexity": PPL(x) = exp(−(1/|x|) Σ_t log P̂(x_t | x_<t)); ΔPPL, Holtzman et al. 2020). The scorer, its start token
and the cache: docs/guide/evaluating.md (rows ``perplexity_*``, ``delta_ppl``; §"Caches").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from accounting.limits import check_count
from invink_audit.evaluation.cache import TextCache, check_texts, text_digest
from invink_audit.evaluation.stats import DEFAULT_CONFIDENCE, Interval, bootstrap_interval

__all__ = ["PerplexityScores", "delta_ppl_interval", "perplexity_cache", "score_perplexity", "scorer_digest"]

#: weights sampled per parameter tensor by :func:`scorer_digest` (evenly strided)
_DIGEST_SAMPLES = 4096
#: the cache's value layout and scoring rule; a change to either makes old entries unreachable
_CACHE_FORMAT = "ppl-v1"


@dataclasses.dataclass(frozen=True)
class PerplexityScores:
    """Per-text perplexities (``None`` for an empty text, which has none) and token counts under the scorer."""

    perplexities: tuple[float | None, ...]
    num_tokens: tuple[int, ...]
    truncated: int
    max_tokens: int
    scorer: str

    @property
    def defined(self) -> np.ndarray:
        return np.asarray([p for p in self.perplexities if p is not None], dtype=np.float64)


def _context_token(tokenizer) -> int:
    probe = tokenizer("a")["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and probe and probe[0] == bos:
        return int(bos)
    vocab = tokenizer.get_vocab()
    if "<|endoftext|>" in vocab:
        return int(vocab["<|endoftext|>"])
    if bos is not None:
        return int(bos)
    if tokenizer.eos_token_id is None:
        raise ValueError("the scorer's tokenizer has no BOS, <|endoftext|> or EOS token to start a text with")
    return int(tokenizer.eos_token_id)


def scorer_digest(loaded_model) -> str:
    """A digest naming the scorer for the perplexity cache: model name, dtype, configuration, and for
    every parameter its name, shape and :data:`_DIGEST_SAMPLES` evenly strided weights (a fine-tuned or
    re-quantised copy under the same name gets another digest, without hashing gigabytes)."""
    import torch

    digest = hashlib.sha256()
    config = getattr(loaded_model.model, "config", None)
    digest.update(f"{loaded_model.name}|{loaded_model.dtype}|".encode())
    backend = getattr(loaded_model.tokenizer, "backend_tokenizer", None)  # vocabulary, merges, normalisation
    digest.update((backend.to_str() if backend is not None else json.dumps(loaded_model.tokenizer.get_vocab(), sort_keys=True)).encode())
    digest.update((config.to_json_string(use_diff=False) if config is not None else "").encode())
    with torch.no_grad():
        for name, tensor in loaded_model.model.state_dict().items():
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // _DIGEST_SAMPLES)
            sample = flat[::step][:_DIGEST_SAMPLES].to("cpu", torch.float32).contiguous().numpy()
            digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
            digest.update(sample.tobytes())
    return digest.hexdigest()


def perplexity_cache(root: Path | None = None) -> TextCache:
    """The per-text perplexity cache in ``root`` (default :func:`invink_audit.models.cache_dir`), file
    ``perplexities.sqlite`` (owner-only). Each value: (mean negative log-likelihood or NaN for an
    empty text, tokens scored, 1 if truncated)."""
    from invink_audit.models import cache_dir

    return TextCache((root or cache_dir()) / "perplexities.sqlite", "perplexities", "float64")


def _encode(texts: Sequence[str], tokenizer, max_tokens: int) -> tuple[list[list[int]], list[bool]]:
    """Token ids of each text (no special tokens), cut to ``max_tokens``, and whether each was cut."""
    encoded, cut = [], []
    for text in texts:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        cut.append(len(ids) > max_tokens)
        encoded.append(ids[:max_tokens])
    return encoded, cut


def _length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices of the non-empty sequences in batches of similar length (sorted; about ``batch_tokens``
    tokens per batch counting the context token, at least one sequence each)."""
    order = sorted((i for i, n in enumerate(lengths) if n), key=lambda i: lengths[i])
    batches, position = [], 0
    while position < len(order):
        count = 1
        while position + count < len(order) and (lengths[order[position + count]] + 1) * (count + 1) <= batch_tokens:
            count += 1
        batches.append(order[position : position + count])
        position += count
    return batches


def _mean_nll(batch: Sequence[Sequence[int]], start: int, loaded_model):
    """Mean negative log-likelihood of each sequence of ``batch`` after the context token ``start``."""
    import torch

    width = max(len(ids) for ids in batch) + 1
    ids = torch.full((len(batch), width), int(loaded_model.pad_token_id), dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, sequence in enumerate(batch):
        ids[row, : len(sequence) + 1] = torch.tensor([start, *sequence])
        mask[row, : len(sequence) + 1] = 1
    device = loaded_model.device
    with torch.inference_mode():
        logits = loaded_model.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, :-1]
        targets = ids[:, 1:].to(device)
        # fused log-softmax + gather: -log P(x_t | x_<t), never materialising log-probabilities
        token_nll = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
        ).view(targets.shape)
    target_mask = mask[:, 1:].to(device).to(token_nll.dtype)
    return ((token_nll * target_mask).sum(dim=1) / target_mask.sum(dim=1)).double().cpu().numpy()


def score_perplexity(
    texts: Sequence[str],
    loaded_model,
    *,
    max_tokens: int = 512,
    batch_tokens: int = 1024,
    progress=None,
    cache: TextCache | None = None,
) -> PerplexityScores:
    """PPL of each text under ``loaded_model`` (a :class:`invink_audit.models.LoadedModel`), batched by
    length (right padding; about ``batch_tokens`` tokens per forward pass). ``progress``: called with
    the number of texts just scored (or found in the cache). ``cache``: a :func:`perplexity_cache`;
    texts scored before under the same scorer and settings are not scored again."""
    max_tokens = check_count("max_tokens", max_tokens)
    check_texts(texts)
    tokenizer = loaded_model.tokenizer
    start = _context_token(tokenizer)
    prefix = f"{_CACHE_FORMAT}:{scorer_digest(loaded_model)}:{max_tokens}:{start}:" if cache is not None else ""
    keys = [prefix + text_digest(t) for t in texts]
    found = cache.get_many(sorted(set(keys))) if cache is not None else {}
    first = {k: i for i, k in reversed(list(enumerate(keys)))}  # each distinct text is scored once
    todo = sorted(i for k, i in first.items() if k not in found)
    encoded, cut = _encode([texts[i] for i in todo], tokenizer, max_tokens)
    values: dict[str, np.ndarray] = dict(found)
    if progress is not None and len(texts) - len(todo):
        progress(len(texts) - len(todo))
    new: dict[str, np.ndarray] = {}
    for batch in _length_batches([len(ids) for ids in encoded], batch_tokens):
        nll = _mean_nll([encoded[j] for j in batch], start, loaded_model)
        for row, j in enumerate(batch):
            new[keys[todo[j]]] = np.array([nll[row], len(encoded[j]), float(cut[j])])
        if progress is not None:
            progress(len(batch))
    for j, ids in enumerate(encoded):
        if not ids:  # an empty text has no perplexity
            new[keys[todo[j]]] = np.array([math.nan, 0.0, 0.0])
            if progress is not None:
                progress(1)
    values.update(new)
    # a non-finite score of a non-empty text (e.g. a float16 overflow) is reported but never kept
    keep = {k: v for k, v in new.items() if math.isfinite(v[0]) or v[1] == 0}
    if cache is not None and keep:
        cache.put_many(keep)
    rows = [values[k] for k in keys]
    return PerplexityScores(
        perplexities=tuple(None if r[1] == 0 else float(math.exp(r[0])) for r in rows),
        num_tokens=tuple(int(r[1]) for r in rows),
        truncated=int(sum(r[2] for r in rows)),
        max_tokens=max_tokens,
        scorer=str(loaded_model.name),
    )


def delta_ppl_interval(
    synthetic: np.ndarray,
    real: np.ndarray,
    *,
    num_bootstrap: int = 2000,
    confidence: float = DEFAULT_CONFIDENCE,
    rng: np.random.Generator | None = None,
) -> Interval:
    """ΔPPL = |mean PPL(synthetic) − mean PPL(real)| (paper App. D.4) with a percentile-bootstrap
    interval (both sets resampled independently)."""
    x = np.asarray(synthetic, dtype=np.float64)
    r = np.asarray(real, dtype=np.float64)
    if x.size == 0 or r.size == 0:
        raise ValueError("ΔPPL needs at least one scored text on each side")
    rng = rng if rng is not None else np.random.default_rng(20252)
    # scipy resamples two or more values; one text given twice resamples to itself, as it did alone
    x, r = (np.repeat(v, 2) if v.size == 1 else v for v in (x, r))
    return bootstrap_interval((x, r), lambda s, t, axis: np.abs(s.mean(axis=axis) - t.mean(axis=axis)), confidence,
                              num_resamples=num_bootstrap, rng=rng, method="bootstrap over texts", vectorized=True)
