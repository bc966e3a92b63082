r"""Generate texts with any :class:`~invink_audit.mechanisms.Mechanism` (comparisons, audits, examples).

:func:`generate_with_mechanism` partitions the references into disjoint batches of ``B`` in input
order (:func:`invink_audit.data.partition_references`, paper Corollary 11 (coro:parallel-batches)), encodes each batch with
a prompt preset and runs the engine with the mechanism in its sampled state (as deployed), one text
per batch. It returns the texts as the release's one text record (:class:`~invink_audit.generation.GeneratedText`)
with their modes (e.g. which tokens were private) and finish reasons (a mechanism's stop rule ends a text with
``"budget"``).

It is **not** the production pipeline: no budget ledger, no resume journal, no output lock
(:func:`invink_audit.generation.generate` does those, for InvisibleInk). A fixed ``generator`` seed
makes the texts reproducible and therefore not private: the run is marked as
:func:`~invink_audit.generation.generate` marks a seeded release (``seeded``, ``void_reason``, and
:meth:`MechanismRun.record_fields` writes ``"guarantee": null`` with ``"guarantee_void_reason"``). A
data-dependent mechanism's per-text spend (AdaPMixED's) is computed from the references: it is private, so
the run does not keep it (the engine's :class:`~invink_audit.engine.FinishedText` has it, for tests).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from invink_audit.mechanisms.base import Mechanism, MechanismGuarantee
from invink_audit.models import DtypeChoice

if TYPE_CHECKING:
    from invink_audit.generation import GeneratedText

__all__ = ["MechanismRun", "generate_with_mechanism"]


@dataclasses.dataclass(frozen=True)
class MechanismRun:
    """The texts of one :func:`generate_with_mechanism` call and the mechanism's guarantee for each.

    ``seeded``: the texts were drawn from a reproducible generator (:func:`~invink_audit.mechanism.is_seeded`),
    so they carry no privacy and ``void_reason`` says so; ``guarantee`` keeps the mechanism's figures
    (what an unseeded run would carry), which a seeded run's records must not present as its own.
    """

    mechanism: Mechanism
    guarantee: MechanismGuarantee
    texts: tuple[GeneratedText, ...]
    prompt: str
    prompt_fields: dict
    max_new_tokens: int
    batch_size: int
    seconds: float
    seeded: bool = False
    void_reason: str | None = None
    #: the dtype the model ran in and why (:class:`~invink_audit.models.DtypeChoice`)
    dtype_choice: DtypeChoice | None = None

    @property
    def holds(self) -> bool:
        """Whether the texts carry :attr:`guarantee` (``False`` for a seeded run)."""
        return self.void_reason is None

    def record_fields(self) -> dict:
        """What a record of this run writes: ``{"guarantee": label}``, or for a seeded run
        ``{"guarantee": None, "guarantee_void_reason": ...}``, as a record of
        :func:`~invink_audit.generation.generate` does (no ε that a reader could take at face value)."""
        dtype = {} if self.dtype_choice is None else {"model_dtype": self.dtype_choice.to_json()}
        if self.void_reason is not None:
            return {"guarantee": None, "guarantee_void_reason": self.void_reason, **dtype}
        return {"guarantee": self.guarantee.label(), **dtype}

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
    mechanisms on the same references, :class:`~invink_audit.engine.Engine`). ``generator``: by
    default one seeded from the OS; a reproducible one (a fixed seed) marks the run ``seeded``, its
    guarantee void.
    """
    from invink_audit.data import partition_references
    from invink_audit.engine import Engine
    from invink_audit.generation import SEEDED_VOID_REASON, GeneratedText
    from invink_audit.mechanism import is_seeded, make_generator
    from invink_audit.models import load_model
    from invink_audit.prompts import PromptTemplate, encode_request, get_preset, release_text

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
    seeded = is_seeded(gen)
    engine = Engine(loaded, mechanism, max_batch_rows=max_batch_rows, prefill_cache=prefill_cache)
    texts = {}
    with torch.inference_mode():
        for f in engine.generate(requests, max_new_tokens=max_new_tokens, generator=gen):
            texts[f.request_index] = GeneratedText(
                batch_index=f.request_index,
                text=release_text(loaded.tokenizer, f.token_ids, template.stop),
                token_ids=f.token_ids,
                finish_reason=f.finish_reason,
                topk_plus_size_mean=f.topk_plus_size_mean,  # the size of the outcome support
                topk_plus_size_std=f.topk_plus_size_std,
                expansion_tokens=f.expansion_tokens,
                modes=f.modes,
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
        seeded=seeded,
        void_reason=SEEDED_VOID_REASON if seeded else None,
        dtype_choice=loaded.dtype_choice,
    )
