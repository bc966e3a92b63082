"""Benchmark: the per-token cost of private decoding against the bare forward passes it needs.

One run measures, on the same model, prompts, rows and cache lengths:

* ``private_step_seconds``: one step of :class:`~invink_audit.engine.Engine` for ``G`` texts ×
  ``B + 1`` rows (forward pass, mechanism, sampling, bookkeeping), end-of-sequence ignored so that
  every step has the same shape;
* ``forward_step_seconds``: the forward pass alone over the same rows with the same tokens
  (teacher-forced from the private run, so cache lengths match step for step);
* ``nonprivate_step_seconds``: one step of ordinary sampling of one text (one row, softmax sample).

The three are measured in lockstep (after each private step, one bare forward step and one
non-private step) and summarised by their medians, so load on the machine affects them alike.
``overhead_ratio`` = private / forward is the price of the mechanism itself;
``relative_to_nonprivate`` = (private / G) / non-private is the price of privacy per token.

The reference package (PyPI ``invink`` 0.1.0) can be timed on the same workload when importable
(:func:`time_reference`): it calls ``model.generate(max_new_tokens=1)`` once per token and moves the
logits through numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import statistics
import time
import warnings
from collections.abc import Sequence

import torch

from invink_audit.engine import Engine
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.models import LoadedModel, load_model
from invink_audit.prompts import PromptTemplate, encode_request, get_preset

__all__ = ["BenchResult", "ReferenceTiming", "benchmark", "demo_references", "time_reference"]


def demo_references() -> list[str]:
    """The fictional demo dataset shipped with the package (``resources/demo_references.jsonl``)."""
    import importlib.resources
    import json

    text = (importlib.resources.files("invink_audit") / "resources" / "demo_references.jsonl").read_text("utf-8")
    return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]


@dataclasses.dataclass(frozen=True)
class ReferenceTiming:
    """Wall-clock cost of the reference package's decode loop (model loading excluded)."""

    token_seconds: float
    tokens: int
    seconds: float
    version: str
    dtype: str


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """Medians over the measured steps (seconds). See the module docstring for definitions."""

    model: str
    device: str
    dtype: str
    threads: int
    batch_size: int
    num_texts: int
    max_new_tokens: int
    rows_per_step: int
    repeats: int
    private_step_seconds: float
    forward_step_seconds: float
    overhead_ratio: float
    tokens_per_second: float
    nonprivate_step_seconds: float
    relative_to_nonprivate: float
    reference: ReferenceTiming | None = None

    @property
    def speedup_vs_reference(self) -> float | None:
        """Reference seconds per token of one text ÷ ours (G texts share a step)."""
        if self.reference is None:
            return None
        return self.reference.token_seconds / (self.private_step_seconds / self.num_texts)

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["speedup_vs_reference"] = self.speedup_vs_reference
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generator(device: torch.device) -> torch.Generator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(0, device=device)  # benchmarks need no privacy; reproducible tokens


class _BareRows:
    """The forward passes of the same rows without the mechanism, one decoding step at a time."""

    def __init__(self, engine: Engine, requests, max_new_tokens: int, device):
        from invink_audit.engine import _Live

        lives = [_Live.from_request(i, r) for i, r in enumerate(requests)]
        self.engine = engine
        self.device = device
        with torch.inference_mode():
            self.shards, _ = engine._prefill([p for live in lives for p in live.prompts], max_new_tokens)
        # the forward pass costs the same for any token ids: feed a fixed one
        rows = sum(shard.num_rows for shard in self.shards)
        self.input_ids = torch.full((rows,), engine.model.eos_token_ids[0], dtype=torch.long, device=device)

    @torch.inference_mode()
    def step(self) -> float:
        _sync(self.device)
        started = time.perf_counter()
        start_row, updated = 0, []
        for shard in self.shards:
            shard, _logits = self.engine._decode(shard, self.input_ids[start_row : start_row + shard.num_rows])
            start_row += shard.num_rows
            updated.append(shard)
        _sync(self.device)
        self.shards = updated
        return time.perf_counter() - started


class _NonPrivateText:
    """Ordinary sampling of one text from the public prompt: one row, softmax at ``temperature``."""

    def __init__(self, engine: Engine, request, max_new_tokens: int, temperature: float, device):
        self.engine = engine
        self.device = device
        self.temperature = temperature
        self.generator = _generator(device)
        with torch.inference_mode():
            (self.shard,), self.logits = engine._prefill([request.public_ids], max_new_tokens)

    @torch.inference_mode()
    def step(self) -> float:
        _sync(self.device)
        started = time.perf_counter()
        probs = torch.softmax(self.logits.float() / self.temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
        self.shard, self.logits = self.engine._decode(self.shard, token)
        _sync(self.device)
        return time.perf_counter() - started


def _interleaved_run(engine: Engine, requests, max_new_tokens: int, temperature: float, device):
    """One private run; after each of its steps, one bare forward step and one non-private step.

    Lockstep alternation makes the three measurements see the same machine load. Returns the
    per-step seconds of each (the private run's first step, which includes its prefill, is dropped).
    """
    bare = _BareRows(engine, requests, max_new_tokens, device)
    single = _NonPrivateText(engine, requests[0], max_new_tokens, temperature, device)
    private_steps, forward_steps, single_steps = [], [], []
    last = [0.0]

    def tick(_count: int) -> None:
        _sync(device)
        private_steps.append(time.perf_counter() - last[0])
        if len(private_steps) < max_new_tokens:  # cache lengths stay in step with the private rows
            forward_steps.append(bare.step())
            single_steps.append(single.step())
        last[0] = time.perf_counter()

    last[0] = time.perf_counter()
    for _ in engine.generate(
        requests, max_new_tokens=max_new_tokens, generator=_generator(device), stop_at_eos=False, progress=tick
    ):
        pass
    return private_steps[1:], forward_steps, single_steps


def benchmark(
    model: str | LoadedModel | None = None,
    *,
    batch_size: int = 7,
    max_new_tokens: int = 32,
    num_texts: int = 1,
    repeats: int = 3,
    clip_norm: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = 100,
    prompt: str | PromptTemplate = "generic",
    references: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    max_batch_rows: int | None = None,
) -> BenchResult:
    """Measure private decoding against bare forward passes on ``num_texts`` × (``batch_size`` + 1) rows.

    The references default to the shipped fictional demo dataset (cycled). The mechanism's parameters
    do not change the cost; the defaults are typical values.
    """
    for name, value, minimum in (
        ("batch_size", batch_size, 1),
        ("max_new_tokens", max_new_tokens, 3),
        ("num_texts", num_texts, 1),
        ("repeats", repeats, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")
    loaded = load_model(model, device=device, dtype=dtype)
    mechanism = MechanismConfig(clip_norm=clip_norm, temperature=temperature, top_k=top_k, batch_size=batch_size)
    rows = num_texts * (batch_size + 1)
    engine = Engine(loaded, mechanism, max_batch_rows=rows if max_batch_rows is None else max_batch_rows)
    pool = list(references) if references is not None else [r for r in demo_references() if r]
    if not pool:
        raise ValueError("references must hold at least one non-empty text")
    template = get_preset(prompt)
    requests = [
        encode_request(
            loaded.tokenizer,
            template,
            [pool[(g * batch_size + i) % len(pool)] for i in range(batch_size)],
            key=g,
        )
        for g in range(num_texts)
    ]
    private_steps, forward_steps, single_steps = [], [], []
    for _ in range(repeats):
        private, forward, single = _interleaved_run(engine, requests, max_new_tokens, temperature, loaded.device)
        private_steps += private
        forward_steps += forward
        single_steps += single
    private = statistics.median(private_steps)
    forward = statistics.median(forward_steps)
    single = statistics.median(single_steps)
    return BenchResult(
        model=loaded.name,
        device=str(loaded.device),
        dtype=str(loaded.dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        batch_size=batch_size,
        num_texts=num_texts,
        max_new_tokens=max_new_tokens,
        rows_per_step=rows,
        repeats=repeats,
        private_step_seconds=private,
        forward_step_seconds=forward,
        overhead_ratio=private / forward,
        tokens_per_second=num_texts / private,
        nonprivate_step_seconds=single,
        relative_to_nonprivate=(private / num_texts) / single,
    )


def time_reference(
    model_dir: str,
    *,
    batch_size: int = 7,
    max_new_tokens: int = 32,
    num_texts: int = 1,
    references: Sequence[str] | None = None,
    template: PromptTemplate | str = "generic",
    temperature: float = 1.0,
    top_k: int = 100,
    dtype: str = "float32",
) -> ReferenceTiming:
    """Time the reference ``invink`` package's ``generate`` on the same workload (model loading excluded).

    Its ``batch_size`` is ``B + 1``; it is given our prompt template (same prompt lengths) in its
    positional format, ``dtype`` (float32 by default, as ours on CPU; its own default ``"bfloat16"``
    becomes float16 on a CPU-only machine), and ``max_toks = T`` explicitly. It stops at end-of-sequence,
    so the cost is normalised per generated token. Raises ``ImportError`` when it is not installed.
    """
    import importlib
    import importlib.metadata

    # ``invink.generate`` the attribute is the function; the module is in sys.modules
    reference = importlib.import_module("invink.generate")  # ImportError: not installed

    template = get_preset(template)
    description = template.fields.get("description", "")
    private = template.private.replace("{description}", "{0}").replace("{reference}", "{1}")
    public = template.public.replace("{description}", "{0}")
    pool = list(references) if references is not None else [r for r in demo_references() if r]
    texts = [pool[i % len(pool)] for i in range(num_texts * batch_size)]

    loading = []
    original = reference.load_hf_model

    def timed_load(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            loading.append(time.perf_counter() - started)

    reference.load_hf_model = timed_load
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = reference.generate(
                texts,
                model_name_or_path=model_dir,
                dataset_desc=description,
                system_prompt=template.system,
                pub_prompt=public,
                prv_prompt=private,
                epsilon=10.0,
                batch_size=batch_size + 1,
                num=num_texts,
                max_toks=max_new_tokens,
                temperature=temperature,
                topk=top_k,
                dtype=dtype,
                device_map=-1,
                drop_empty=False,
                allow_download=False,
                trust_remote_code=False,
                random_seed=0,
            )
    finally:
        reference.load_hf_model = original
    seconds = time.perf_counter() - started - sum(loading)
    tokens = int(sum(out.lens))
    return ReferenceTiming(
        token_seconds=seconds / tokens,
        tokens=tokens,
        seconds=seconds,
        version=importlib.metadata.version("invink") if _has_metadata("invink") else "unknown",
        dtype=dtype,
    )


def _has_metadata(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
