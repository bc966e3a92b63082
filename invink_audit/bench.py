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

A last, separate run decodes the whole workload as a user would (all G texts, prefill included,
stopping at end-of-sequence): ``workload_seconds`` / ``workload_tokens`` is our cost per generated
token. The reference package (PyPI ``invink`` 0.1.0) can be timed on the same workload when importable
(:func:`time_reference`): the same G texts of the same B references and prompts, one text after another
as it works, calling ``model.generate(max_new_tokens=1)`` once per token and moving the logits through
numpy. The speedup is the ratio of the two costs per generated token.
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
    """Wall-clock cost of the reference package's decode loop on the benchmark's workload.

    ``seconds`` is its decode loop alone (prompt encoding, prefill and every per-token step of every
    text); ``setup_seconds`` the rest of its ``generate`` call except model loading. ``token_seconds`` =
    ``seconds`` / ``tokens`` (it stops at end-of-sequence). ``dtype`` is the dtype its model ran in;
    ``requested_dtype`` and ``requested_device_map`` are ``None`` where the package chose (its defaults:
    bfloat16, which it turns into float16 on a machine without CUDA bfloat16, and ``device_map="auto"``,
    which places the model through accelerate's dispatch hooks).
    """

    token_seconds: float
    tokens: int
    seconds: float
    setup_seconds: float
    version: str
    dtype: str
    requested_dtype: str | None
    requested_device_map: str | int | None

    @property
    def configuration(self) -> str:
        """``"shipped"`` when dtype and device map are the package's defaults, else what was forced."""
        if self.requested_dtype is None and self.requested_device_map is None:
            return "shipped"
        return f"dtype={self.requested_dtype or 'default'}, device_map={self.requested_device_map!r}"


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """Medians over the measured steps (seconds), and the whole-workload run. See the module docstring."""

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
    workload_seconds: float
    workload_tokens: int
    references: tuple[ReferenceTiming, ...] = ()

    @property
    def workload_token_seconds(self) -> float:
        """Seconds per generated token of the whole workload (prefill and end-of-sequence included)."""
        return self.workload_seconds / self.workload_tokens

    def speedup(self, reference: ReferenceTiming) -> float:
        """The reference's decode-loop seconds per token ÷ ours, both over the whole same workload."""
        return reference.token_seconds / self.workload_token_seconds

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["workload_token_seconds"] = self.workload_token_seconds
        out["references"] = [
            {**dataclasses.asdict(reference), "configuration": reference.configuration, "speedup": self.speedup(reference)}
            for reference in self.references
        ]
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


def _workload_run(engine: Engine, requests, max_new_tokens: int, device) -> tuple[float, int]:
    """The whole workload as a user runs it: all texts, prefill included, stopping at end-of-sequence.

    Returns (wall seconds, tokens generated)."""
    tokens = 0
    _sync(device)
    started = time.perf_counter()
    for text in engine.generate(requests, max_new_tokens=max_new_tokens, generator=_generator(device)):
        tokens += text.num_tokens
    _sync(device)
    return time.perf_counter() - started, tokens


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
    workload_seconds, workload_tokens = _workload_run(engine, requests, max_new_tokens, loaded.device)
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
        workload_seconds=workload_seconds,
        workload_tokens=workload_tokens,
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
    dtype: str | None = None,
    device_map: str | int | None = None,
) -> ReferenceTiming:
    """Time the reference ``invink`` package's decode loop on the benchmark's workload.

    The workload is the one :func:`benchmark` runs: ``num_texts`` texts, each from ``batch_size``
    references of the same pool (its ``batch_size`` argument is ``B + 1``), our prompt template in its
    positional format (same prompts), ``max_toks = T`` explicitly. ``dtype=None`` and
    ``device_map=None`` leave them to the package (its shipped defaults); a value forces one (its
    ``device_map`` takes ``-1`` for CPU, a CUDA index, or ``"auto"``). The decode loop is timed from
    its first text to its last (its ``tqdm`` loop); model loading and its other setup are excluded
    from ``token_seconds``. Raises ``ImportError`` when it is not installed.
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

    loading, loop, dtypes = [], [], []
    original_load, original_tqdm = reference.load_hf_model, reference.tqdm

    def timed_load(*args, **kwargs):
        started = time.perf_counter()
        try:
            model = original_load(*args, **kwargs)
        finally:
            loading.append(time.perf_counter() - started)
        dtypes.append(str(model.dtype).removeprefix("torch."))
        return model

    def timed_loop(iterable, *args, **kwargs):
        started = time.perf_counter()
        yield from iterable
        loop.append(time.perf_counter() - started)

    reference.load_hf_model, reference.tqdm = timed_load, timed_loop
    options = {}
    if dtype is not None:
        options["dtype"] = dtype
    if device_map is not None:
        options["device_map"] = device_map
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
                drop_empty=False,
                allow_download=False,
                trust_remote_code=False,
                random_seed=0,
                **options,
            )
    finally:
        reference.load_hf_model, reference.tqdm = original_load, original_tqdm
    total = time.perf_counter() - started
    if len(loop) != 1:
        raise RuntimeError("could not time the reference package's decode loop (its tqdm loop was not used)")
    tokens = int(sum(out.lens))
    return ReferenceTiming(
        token_seconds=loop[0] / tokens,
        tokens=tokens,
        seconds=loop[0],
        setup_seconds=total - loop[0] - sum(loading),
        version=importlib.metadata.version("invink") if _has_metadata("invink") else "unknown",
        dtype=dtypes[0] if dtypes else "unknown",
        requested_dtype=dtype,
        requested_device_map=device_map,
    )


def _has_metadata(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
