r"""Perplexity of texts under a scorer LM, ΔPPL, and lengths.

Paper App. D.4 (sec:expt:eval-metrics), "Generation Perplexity":

.. math::

    \mathrm{PPL}(x) = \exp\Big(-\frac{1}{|x|}\sum_{t=1}^{|x|} \log \hat P(x_t \mid x_{<t})\Big),\qquad
    \Delta\mathrm{PPL} = \Big|\frac{1}{|X|}\sum_{x\in X}\mathrm{PPL}(x) - \frac{1}{|R|}\sum_{r\in R}\mathrm{PPL}(r)\Big|

(Holtzman et al. 2020 for ΔPPL). ``x_{<1} = ∅`` is realised by one context token before the text (the
tokenizer's BOS when it adds one itself, else ``<|endoftext|>``, the document separator of GPT-2-style
and SmolLM2 vocabularies, else EOS), so every token of the text is scored. The paper's scorer is GPT-2
small; ours is any causal LM of :func:`invink_audit.models.load_model` (default the embedded
SmolLM2-135M), so absolute values differ from the paper's and only comparisons under one scorer mean
anything. Texts are scored on at most ``max_tokens`` tokens (default 512; said in the result).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from invink_audit.evaluation.stats import DEFAULT_CONFIDENCE, Interval, percentile_interval, wald_interval

__all__ = ["PerplexityScores", "delta_ppl_interval", "score_perplexity"]


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


def score_perplexity(
    texts: Sequence[str], loaded_model, *, max_tokens: int = 512, batch_tokens: int = 1024, progress=None
) -> PerplexityScores:
    """PPL of each text under ``loaded_model`` (a :class:`invink_audit.models.LoadedModel`), batched by
    length (right padding; about ``batch_tokens`` tokens per forward pass). ``progress``: called with
    the number of texts just scored."""
    import torch

    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1; got {max_tokens!r}")
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise ValueError(f"texts must be a sequence of strings; got {type(texts).__name__}")
    tokenizer, model = loaded_model.tokenizer, loaded_model.model
    start = _context_token(tokenizer)
    encoded, truncated = [], 0
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{i}] must be a string; got {type(text).__name__}")
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        if len(ids) > max_tokens:
            ids, truncated = ids[:max_tokens], truncated + 1
        encoded.append(ids)
    perplexities: list[float | None] = [None] * len(texts)
    order = sorted((i for i in range(len(texts)) if encoded[i]), key=lambda i: len(encoded[i]))
    pad = int(loaded_model.pad_token_id)
    device = loaded_model.device
    position = 0
    while position < len(order):
        longest = len(encoded[order[position]]) + 1
        count = 1
        while position + count < len(order):
            longest = len(encoded[order[position + count]]) + 1
            if longest * (count + 1) > batch_tokens:
                break
            count += 1
        batch = order[position : position + count]
        width = max(len(encoded[i]) + 1 for i in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, i in enumerate(batch):
            sequence = [start, *encoded[i]]
            ids[row, : len(sequence)] = torch.tensor(sequence)
            mask[row, : len(sequence)] = 1
        with torch.inference_mode():
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, :-1]
            targets = ids[:, 1:].to(device)
            # fused log-softmax + gather: -log P(x_t | x_<t), never materialising log-probabilities
            token_nll = torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
            ).view(targets.shape)
        target_mask = mask[:, 1:].to(device).to(token_nll.dtype)
        nll = (token_nll * target_mask).sum(dim=1) / target_mask.sum(dim=1)
        for row, i in enumerate(batch):
            perplexities[i] = float(math.exp(float(nll[row])))
        position += count
        if progress is not None:
            progress(len(batch))
    if progress is not None and len(order) < len(texts):
        progress(len(texts) - len(order))
    return PerplexityScores(
        perplexities=tuple(perplexities),
        num_tokens=tuple(len(ids) for ids in encoded),
        truncated=truncated,
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
    estimate = abs(x.mean() - r.mean())
    xs = x[rng.integers(0, x.size, size=(num_bootstrap, x.size))].mean(axis=1)
    rs = r[rng.integers(0, r.size, size=(num_bootstrap, r.size))].mean(axis=1)
    return percentile_interval(float(estimate), np.abs(xs - rs), confidence, method="bootstrap over texts")


def mean_interval(values: Sequence[float], confidence: float = DEFAULT_CONFIDENCE) -> Interval | None:
    """Wald interval of a mean (paper App. D.4), ``None`` for no values."""
    return wald_interval(values, confidence) if len(values) else None
