r"""Generate texts with any :class:`~invink_audit.mechanisms.Mechanism` (comparisons, audits, examples).

:func:`generate_with_mechanism` partitions the references into disjoint batches of ``B`` in input
order (:func:`invink_audit.data.partition_references`, paper Corollary 11 (coro:parallel-batches)), encodes each batch with
a prompt preset and runs the engine with the mechanism in its sampled state (as deployed), one text
per batch. It returns the texts with their modes (e.g. which tokens were private), finish reasons
(a mechanism's stop rule ends a text with ``"budget"``) and, for a data-dependent mechanism, the
spend of each text.

It is **not** the production pipeline: no budget ledger, no resume journal, no output lock
(:func:`invink_audit.generation.generate` does those, for InvisibleInk). A fixed ``generator`` seed
makes the texts reproducible and therefore not private.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from invink_audit.mechanisms.base import Mechanism, MechanismGuarantee

__all__ = ["MechanismRun", "MechanismText", "generate_with_mechanism"]


@dataclasses.dataclass(frozen=True)
class MechanismText:
    """One text: its batch, decoded text, tokens, each token's mode, finish reason and spend."""

    batch_index: int
    text: str
    token_ids: tuple[int, ...]
    modes: tuple[int, ...]
    finish_reason: str
    spend: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class MechanismRun:
    """The texts of one :func:`generate_with_mechanism` call and the mechanism's guarantee for each."""

    mechanism: Mechanism
    guarantee: MechanismGuarantee
    texts: tuple[MechanismText, ...]
    prompt: str
    prompt_fields: dict
    max_new_tokens: int
    batch_size: int
    seconds: float

    @property
    def forward_rows_per_token(self) -> int:
        """``B + 1``: the model rows every generated token costs (B private prompts and the public one)."""
        return self.batch_size + 1

    def mode_counts(self) -> dict[str, int]:
        counts = {name: 0 for name in self.mechanism.mode_names}
        for t in self.texts:
            for m in t.modes:
                counts[self.mechanism.mode_names[m]] += 1
        return counts


def generate_with_mechanism(
    references: Sequence[str | None],
    mechanism: Mechanism,
    *,
    max_new_tokens: int,
    delta: float = 1e-6,
    model=None,
    prompt="generic",
    prompt_fields: dict | None = None,
    num_texts: int | None = None,
    generator: torch.Generator | None = None,
    max_batch_rows: int | None = None,
    prefill_cache: dict | None = None,
) -> MechanismRun:
    """One text per disjoint batch of ``mechanism.batch_size`` references (module docstring).

    ``model``: a :class:`~invink_audit.models.LoadedModel`, a name or path (default: the embedded
    SmolLM2); ``prompt``: a preset name or :class:`~invink_audit.prompts.PromptTemplate`;
    ``max_new_tokens``: T, fixed by the caller; ``delta``: for the reported guarantee;
    ``prefill_cache``: a dict kept by the caller to share prefilled prompts across calls (several
    mechanisms on the same references, :class:`~invink_audit.engine.Engine`).
    """
    from invink_audit.data import partition_references
    from invink_audit.engine import Engine
    from invink_audit.mechanism import make_generator
    from invink_audit.models import load_model
    from invink_audit.prompts import PromptTemplate, encode_request, get_preset

    if not isinstance(mechanism, Mechanism):
        raise ValueError(f"mechanism must be an invink_audit.mechanisms.Mechanism; got {type(mechanism).__name__}")
    start = time.perf_counter()
    guarantee = mechanism.guarantee(max_new_tokens, delta)
    loaded = load_model(model)
    template = prompt if isinstance(prompt, PromptTemplate) else get_preset(prompt, **(prompt_fields or {}))
    partition = partition_references(references, mechanism.batch_size, num_texts=num_texts)
    requests = [
        encode_request(loaded.tokenizer, template, [r if r else None for r in batch], key=i)
        for i, batch in enumerate(partition.batches)
    ]
    gen = generator if generator is not None else make_generator(device=loaded.device)
    engine = Engine(loaded, mechanism, max_batch_rows=max_batch_rows, prefill_cache=prefill_cache)
    texts = {}
    with torch.inference_mode():
        for f in engine.generate(requests, max_new_tokens=max_new_tokens, generator=gen):
            texts[f.request_index] = MechanismText(
                batch_index=f.request_index,
                text=loaded.tokenizer.decode(list(f.token_ids), skip_special_tokens=True),
                token_ids=f.token_ids,
                modes=f.modes,
                finish_reason=f.finish_reason,
                spend=f.spend,
            )
    return MechanismRun(
        mechanism=mechanism,
        guarantee=guarantee,
        texts=tuple(texts[i] for i in sorted(texts)),
        prompt=template.name,
        prompt_fields=dict(prompt_fields or {}),
        max_new_tokens=int(max_new_tokens),
        batch_size=mechanism.batch_size,
        seconds=time.perf_counter() - start,
    )
