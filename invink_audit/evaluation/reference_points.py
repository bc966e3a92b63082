"""Reference points for a privacy budget's utility, on the same prompts as the private texts.

:func:`generate_reference_points`: the **floor** (public prompt only: the ε → 0 end) and the **ceiling**
(the private prompt with one reference, B = 1, no clipping, no privacy), both by ordinary top-k sampling
at the private texts' k, τ and T. The ceiling is **not private** (it can copy a reference): written like
every NOT PRIVATE artefact (:mod:`invink_audit.not_private`), never beside a release.

Design: docs/guide/evaluating.md (§"Reference points: floor and ceiling").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

from accounting.limits import check_count
from invink_audit.not_private import write_not_private_jsonl

__all__ = ["REFERENCE_POINT_NOTICE", "ReferenceTexts", "generate_reference_points", "sample_left_padded"]

#: The ``privacy_notice`` of every reference-point record.
REFERENCE_POINT_NOTICE = (
    "NOT PRIVATE: a reference point for evaluation, not a release (the ceiling is sampled from a private "
    "reference with no privacy protection and can copy it); never publish or release it."
)


@dataclasses.dataclass(frozen=True)
class ReferenceTexts:
    """Texts of one reference point, with each text's labels (or ``None``), token count and finish reason."""

    kind: str
    texts: tuple[str, ...]
    labels: tuple[Mapping[str, str] | None, ...]
    num_tokens: tuple[int, ...]
    finish_reasons: tuple[str, ...]

    def write_jsonl(self, path: str | Path) -> Path:
        """Write one JSON line per text, owner-only (0600), each marked NOT PRIVATE
        (:data:`REFERENCE_POINT_NOTICE`); a symbolic link at ``path`` is refused."""
        records = []
        for i, (text, labels, count, reason) in enumerate(zip(self.texts, self.labels, self.num_tokens, self.finish_reasons)):
            record = {"batch_index": i, "text": text, "num_tokens": count, "finish_reason": reason,
                      "reference_point": self.kind}
            if labels is not None:
                record["labels"] = dict(labels)
            records.append(record)
        return write_not_private_jsonl(path, records, notice=REFERENCE_POINT_NOTICE)


def sample_left_padded(loaded, prompts: Sequence[Sequence[int]], **settings) -> list[list[int]]:
    """Sampling (transformers' ``generate``, ``do_sample``) of each token-id prompt in one batch, left padded as
    decoder-only generation needs; each row's generated ids (padding after an early end included). ``settings``:
    ``generate``'s (``max_new_tokens``, ``temperature``, ``top_k``, ...)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), loaded.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = torch.tensor(prompt), 1
    with torch.inference_mode():
        out = loaded.model.generate(input_ids=ids.to(loaded.device), attention_mask=mask.to(loaded.device),
                                    do_sample=True, pad_token_id=loaded.pad_token_id,
                                    eos_token_id=list(loaded.eos_token_ids), **settings)  # fmt: skip
    return out[:, width:].tolist()


def _sample(loaded, prompts: Sequence[tuple[int, ...]], *, max_new_tokens, top_k, temperature, seed, batch, stop=()) -> list:
    """Plain sampling of each prompt; a text ends at EOS, at the template's first public stop string (cut,
    as :func:`invink_audit.prompts.release_text` cuts a release), or after ``max_new_tokens``."""
    import torch

    from invink_audit.prompts import reached_stop, release_text

    outputs = []
    tokenizer, eos = loaded.tokenizer, set(loaded.eos_token_ids)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for start in range(0, len(prompts), batch):
            generated = sample_left_padded(loaded, prompts[start : start + batch], top_k=top_k if top_k is not None else 0,
                                           top_p=1.0, temperature=temperature, max_new_tokens=max_new_tokens)
            for row in generated:
                tokens, reason = [], "length"
                for token in row:
                    if token in eos:
                        reason = "eos"
                        break
                    tokens.append(token)
                    if reached_stop(tokenizer, tokens, stop):
                        reason = "stop"
                        break
                outputs.append((release_text(tokenizer, tokens, stop), len(tokens), reason))
    return outputs


def generate_reference_points(
    batches: Sequence[Sequence[str]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = 100,
    model=None,
    prompt="generic",
    prompt_fields: Mapping[str, str] | None = None,
    batch_labels: Sequence[Mapping[str, str] | None] | None = None,
    label_fields: Mapping[str, str] | None = None,
    seed: int = 0,
    generation_batch: int = 8,
) -> dict[str, ReferenceTexts]:
    """The floor and the ceiling (module docstring) for ``batches`` (each the references of one private
    text, e.g. ``partition.batches``): one floor text and one ceiling text per batch, prompted like the
    private text (its labels fill the template when ``batch_labels`` is given). Seeded: these texts are
    reference points for evaluation, not releases."""
    from invink_audit.models import DEFAULT_GENERATOR, load_model
    from invink_audit.prompts import encode_prompt, get_preset, template_for_labels, template_for_model

    max_new_tokens = check_count("max_new_tokens", max_new_tokens)
    if not batches:
        raise ValueError("batches must not be empty")
    labels = list(batch_labels) if batch_labels is not None else [None] * len(batches)
    if len(labels) != len(batches):
        raise ValueError(f"batch_labels has {len(labels)} entries for {len(batches)} batches")
    loaded = load_model(DEFAULT_GENERATOR if model is None else model)  # the releases' default generator
    base = template_for_model(get_preset(prompt, **dict(prompt_fields or {})), loaded.tokenizer)
    public, private = [], []
    for references, batch_label in zip(batches, labels):
        template = base if batch_label is None else template_for_labels(base, batch_label, label_fields)
        public.append(encode_prompt(loaded.tokenizer, template, None))
        first = next((r for r in references if r), None)  # a null first slot: the next non-null reference
        private.append(encode_prompt(loaded.tokenizer, template, first))
    out = {}
    for kind, prompts, offset in (("floor", public, 0), ("ceiling", private, 1)):
        sampled = _sample(
            loaded, prompts, max_new_tokens=max_new_tokens, top_k=top_k, temperature=temperature,
            seed=seed * 2 + offset, batch=generation_batch, stop=base.stop,
        )
        out[kind] = ReferenceTexts(
            kind=kind,
            texts=tuple(s[0] for s in sampled),
            labels=tuple(labels),
            num_tokens=tuple(s[1] for s in sampled),
            finish_reasons=tuple(s[2] for s in sampled),
        )
    return out
