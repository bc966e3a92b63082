"""What the benchmarks share: the workload's texts (the shipped demo references or given ones), its requests,
and its whole run as a user runs it."""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Sequence

import torch

from accounting.limits import check_count
from invink_audit.engine import Engine, ForwardStats
from invink_audit.mechanism import SeededGeneratorWarning, make_generator
from invink_audit.models import LoadedModel
from invink_audit.prompts import PromptTemplate, encode_request


def demo_references() -> list[str]:
    """The fictional demo dataset shipped with the package (``resources/demo_references.jsonl``)."""
    import importlib.resources
    import json

    text = (importlib.resources.files("invink_audit") / "resources" / "demo_references.jsonl").read_text("utf-8")
    return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seeded_generator(device: torch.device) -> torch.Generator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(0, device=device)  # benchmarks need no privacy; reproducible tokens


def row_prompts(requests) -> list[tuple[int, ...]]:
    return [p for r in requests for p in (r.public_ids, *r.private_ids) if p is not None]


@dataclasses.dataclass(frozen=True)
class WorkloadRun:
    """One whole-workload run: its seconds, tokens generated, each text's tokens and its forward passes' stats."""

    seconds: float
    tokens: int
    text_tokens: tuple[int, ...]  # per request, in request order
    stats: ForwardStats


def workload_run(
    engine: Engine, requests, max_new_tokens: int, device, *, one_at_a_time: bool = False, indices=None,
    stop_at_eos: bool = True,
) -> WorkloadRun:
    """The whole workload as a user runs it: all texts, prefill included, stopping at end-of-sequence
    (``stop_at_eos=False``: every text draws ``max_new_tokens``, the equal work a per-token comparison needs);
    with ``one_at_a_time``, one :meth:`Engine.generate` call per text (the same streams). ``indices``:
    the texts this process runs (all by default; each keeps its stream)."""
    stats = ForwardStats()
    engine.forward.stats = stats
    counts = [0] * len(requests)
    indices = list(range(len(requests))) if indices is None else list(indices)
    calls = [[i] for i in indices] if one_at_a_time else ([indices] if indices else [])
    try:
        sync(device)
        started = time.perf_counter()
        for call in calls:
            for text in engine.generate(
                [requests[i] for i in call], max_new_tokens=max_new_tokens, generator=seeded_generator(device),
                stream_ids=call, stop_at_eos=stop_at_eos,
            ):
                counts[call[text.request_index]] = text.num_tokens
        sync(device)
        seconds = time.perf_counter() - started
    finally:
        engine.forward.stats = None
    return WorkloadRun(seconds, sum(counts), tuple(counts), stats)


def check_counts(**counts: tuple[int, int]) -> None:
    """Each ``name=(value, minimum)`` must be an integer (not a bool) >= its minimum."""
    for name, (value, minimum) in counts.items():
        check_count(name, value, minimum=minimum)


def reference_pool(references: Sequence[str] | None) -> list[str]:
    """The private texts to cycle through: ``references``, or the shipped demo dataset's non-empty texts."""
    pool = list(references) if references is not None else [r for r in demo_references() if r]
    if not any(pool):
        raise ValueError("references must hold at least one non-empty text")
    return pool


def workload_texts(pool: Sequence[str], batch_size: int, num_texts: int) -> list[list[str]]:
    """The references of each of ``num_texts`` texts: ``batch_size`` at a time from ``pool``, cycled when short."""
    return [[pool[(g * batch_size + i) % len(pool)] for i in range(batch_size)] for g in range(num_texts)]


def encode_workload(loaded: LoadedModel, template: PromptTemplate, texts: list[list[str]], *, stop: bool = True,
                    ) -> tuple[list, bool]:
    """One request per text (key = its index), and whether the prompts are plain text (no chat template);
    ``stop=False`` drops the template's stop strings (a full-length run: the reference package has none)."""
    plain = getattr(loaded.tokenizer, "chat_template", None) is None
    requests = [encode_request(loaded.tokenizer, template, batch, key=g, plain=plain) for g, batch in enumerate(texts)]
    return (requests if stop else to_length(requests)), plain


def to_length(requests) -> list:
    """``requests`` without their template's stop strings: with ``stop_at_eos=False`` every text then draws
    ``max_new_tokens`` (runs whose steps must be the same rows: lockstep timings, op counts, equal work)."""
    return [dataclasses.replace(r, stop=()) for r in requests]

