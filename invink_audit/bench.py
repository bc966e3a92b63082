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

Under ``torchrun`` / ``accelerate launch`` the processes share the workload's G texts (whole texts,
balanced by public prompt length: :func:`invink_audit.distributed.assign_batches`), each keeping its random
stream; ``processes`` lists each one's texts, tokens and seconds, and the workload figures become the
total tokens over the slowest process's seconds. The lockstep steps, the one-at-a-time and floor runs
and the reference are single-process measurements and are skipped there.

:func:`compare_dtypes` runs the whole workload in float32 and in bfloat16 side by side in one process,
alternating the dtypes round by round (float32, bfloat16, then bfloat16, float32, ...) so that load on the
machine falls on both alike, and reports what ``dtype="auto"`` chooses here and why
(:class:`~invink_audit.models.DtypeChoice`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import statistics
import time
import warnings
from collections.abc import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accounting.limits import check_count
from invink_audit.distributed import assign_batches, current_cluster, request_cost
from invink_audit.engine import Engine, ForwardStats
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, make_generator
from invink_audit.models import DtypeChoice, LoadedModel, follow_dtype, load_model, resolve_device, resolve_dtype
from invink_audit.prompts import PromptTemplate, encode_request, get_preset

__all__ = [
    "BenchResult",
    "DecodeOps",
    "DtypeComparison",
    "DtypeRun",
    "ReferenceTiming",
    "benchmark",
    "compare_dtypes",
    "count_decode_ops",
    "demo_references",
    "time_reference",
]


def demo_references() -> list[str]:
    """The fictional demo dataset shipped with the package (``resources/demo_references.jsonl``)."""
    import importlib.resources
    import json

    text = (importlib.resources.files("invink_audit") / "resources" / "demo_references.jsonl").read_text("utf-8")
    return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]


def demo_reviews_path():
    """The fictional restaurant reviews shipped for ``make demo`` (``resources/demo_reviews.jsonl``: 24
    invented reviews, 8 each at 1, 3 and 5 stars, with Yelp-style ``label1``/``label2`` columns)."""
    import importlib.resources

    return importlib.resources.files("invink_audit") / "resources" / "demo_reviews.jsonl"


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
    prefill_seconds: float = math.nan
    decode_forward_seconds: float = math.nan
    prompt_tokens: int = 0
    longest_prompt: int = 0
    prefill_efficiency: float = math.nan
    prefill_tokens_computed: int = 0
    decode_row_efficiency: float = math.nan
    kv_efficiency: float = math.nan
    left_padded_prefill_efficiency: float = math.nan
    left_padded_kv_efficiency: float = math.nan
    one_at_a_time_seconds: float = math.nan
    one_at_a_time_tokens: int = 0
    floor_prefill_seconds: float = math.nan
    floor_decode_seconds: float = math.nan
    support_only: bool = True
    vocab_size: int = 0
    full_logits_seconds: float = math.nan
    full_logits_tokens: int = 0
    plain_prompts: bool = False
    references: tuple[ReferenceTiming, ...] = ()
    #: per process (torchrun / accelerate launch): rank, device, texts, tokens, seconds; the workload
    #: figures above are then the total tokens over the slowest process's seconds
    processes: tuple[dict, ...] = ()
    rank: int = 0
    #: why the model ran in ``dtype`` (``auto``: the bfloat16 probe's figures on a CPU with native bfloat16)
    dtype_choice: DtypeChoice | None = None
    #: kernel-launching operations per decoding step, ours and a plain padded decode's (``None``: not counted)
    decode_ops: DecodeOps | None = None

    @property
    def workload_token_seconds(self) -> float:
        """Seconds per generated token of the whole workload (prefill and end-of-sequence included)."""
        return self.workload_seconds / self.workload_tokens

    @property
    def workload_tokens_per_second(self) -> float:
        """Generated tokens per second of the whole workload (all processes together when distributed)."""
        return self.workload_tokens / self.workload_seconds

    @property
    def decode_seconds(self) -> float:
        """Workload seconds outside prefill (decoding forward passes, mechanism, sampling)."""
        return self.workload_seconds - self.prefill_seconds

    @property
    def one_at_a_time_token_seconds(self) -> float:
        return self.one_at_a_time_seconds / self.one_at_a_time_tokens if self.one_at_a_time_tokens else math.nan

    @property
    def floor_seconds(self) -> float:
        """The bare unpadded forward passes of the same workload (same texts, same token counts)."""
        return self.floor_prefill_seconds + self.floor_decode_seconds

    @property
    def floor_ratio(self) -> float:
        """Workload seconds ÷ the floor's: the price of the engine and the mechanism over bare forwards."""
        return self.workload_seconds / self.floor_seconds

    @property
    def full_logits_token_seconds(self) -> float:
        return self.full_logits_seconds / self.full_logits_tokens if self.full_logits_tokens else math.nan

    @property
    def speedup_over_full_logits(self) -> float:
        """Full private logits ÷ Top-k+ columns only, per token of the same workload."""
        return self.full_logits_token_seconds / self.workload_token_seconds

    @property
    def speedup_over_one_at_a_time(self) -> float:
        return self.one_at_a_time_token_seconds / self.workload_token_seconds

    def speedup(self, reference: ReferenceTiming) -> float:
        """The reference's decode-loop seconds per token ÷ ours, both over the whole same workload."""
        return reference.token_seconds / self.workload_token_seconds

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        for name in ("workload_token_seconds", "workload_tokens_per_second", "decode_seconds", "one_at_a_time_token_seconds", "floor_seconds",
                     "floor_ratio", "speedup_over_one_at_a_time", "full_logits_token_seconds",
                     "speedup_over_full_logits"):
            out[name] = getattr(self, name)
        out["references"] = [
            {**dataclasses.asdict(reference), "configuration": reference.configuration, "speedup": self.speedup(reference)}
            for reference in self.references
        ]
        out["decode_ops"] = None if self.decode_ops is None else self.decode_ops.to_json()
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generator(device: torch.device) -> torch.Generator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(0, device=device)  # benchmarks need no privacy; reproducible tokens


def _prompts(requests) -> list[tuple[int, ...]]:
    return [p for r in requests for p in (r.public_ids, *r.private_ids) if p is not None]


class _BareRows:
    """The engine's forward passes over the same rows without the mechanism, one decoding step at a time."""

    def __init__(self, engine: Engine, requests, max_new_tokens: int, device):
        forward = engine.forward
        self.forward, self.device = forward, device
        store = forward.new_store()
        self.rows = []
        for prompt in _prompts(requests):
            row = forward.new_row(max_new_tokens)
            forward.prefill(row, prompt, hidden=False)
            self.rows.append(store.insert(row))
        # the forward pass costs the same for any token ids: feed a fixed one
        self.ids = [engine.model.eos_token_ids[0]] * len(self.rows)

    def step(self) -> float:
        _sync(self.device)
        started = time.perf_counter()
        self.forward.decode(self.rows, self.ids, hidden=False)
        _sync(self.device)
        return time.perf_counter() - started


class _NonPrivateText:
    """Ordinary sampling of one text from the public prompt: one row, softmax at ``temperature``."""

    def __init__(self, engine: Engine, request, max_new_tokens: int, temperature: float, device):
        self.forward, self.device, self.temperature = engine.forward, device, temperature
        self.generator = _generator(device)
        row = self.forward.new_row(max_new_tokens)
        self.logits = self.forward.prefill(row, request.public_ids, hidden=False)[None]
        self.row = self.forward.new_store().insert(row)

    def step(self) -> float:
        _sync(self.device)
        started = time.perf_counter()
        probs = torch.softmax(self.logits.float() / self.temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=self.generator)[0, 0]
        self.logits = self.forward.decode([self.row], [token.item()], hidden=False)
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


@dataclasses.dataclass(frozen=True)
class _Workload:
    seconds: float
    tokens: int
    text_tokens: tuple[int, ...]  # per request, in request order
    stats: ForwardStats


def _workload_run(
    engine: Engine, requests, max_new_tokens: int, device, *, one_at_a_time: bool = False, indices=None
) -> _Workload:
    """The whole workload as a user runs it: all texts, prefill included, stopping at end-of-sequence;
    with ``one_at_a_time``, one :meth:`Engine.generate` call per text (the same streams). ``indices``:
    the texts this process runs (all by default; each keeps its stream)."""
    stats = ForwardStats()
    engine.forward.stats = stats
    counts = [0] * len(requests)
    indices = list(range(len(requests))) if indices is None else list(indices)
    calls = [[i] for i in indices] if one_at_a_time else ([indices] if indices else [])
    try:
        _sync(device)
        started = time.perf_counter()
        for call in calls:
            for text in engine.generate(
                [requests[i] for i in call], max_new_tokens=max_new_tokens, generator=_generator(device),
                stream_ids=call,
            ):
                counts[call[text.request_index]] = text.num_tokens
        _sync(device)
        seconds = time.perf_counter() - started
    finally:
        engine.forward.stats = None
    return _Workload(seconds, sum(counts), tuple(counts), stats)


# --------------------------------------------------------------------------------------------
# kernel-launching operations per decoding step (what bounds a step on a GPU: docs/design/engine.md, "On a GPU")

_ATEN = torch.ops.aten
#: operations that allocate or alias without running a kernel (views are recognised by their schema)
_NO_KERNEL = frozenset(
    getattr(_ATEN, name) for name in ("empty", "empty_strided", "detach", "alias", "lift_fresh", "set_", "resize_")
)


class _KernelOpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched that launch a kernel: every one, less views (``OpOverload.is_view``:
    they only alias a tensor's storage) and the allocating or aliasing operations of :data:`_NO_KERNEL`. The
    count is the same on every device: one launch per operation on CUDA (more for a few composite ones), one
    kernel call on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket not in _NO_KERNEL:
            self.count += 1
        return func(*args, **(kwargs or {}))


@dataclasses.dataclass(frozen=True)
class DecodeOps:
    """Kernel-launching operations per decoding step (medians over ``steps`` steps after the first): the
    engine's private step (forward passes, the mechanism's math and sampling) and a plain padded transformers
    decode of the same rows (one left-padded batch, its attention mask and cache, one forward, a softmax and a
    multinomial draw per step)."""

    engine: float
    padded: float
    steps: int

    @property
    def ratio(self) -> float:
        return self.engine / self.padded

    def to_json(self) -> dict:
        return {"engine": self.engine, "padded": self.padded, "ratio": self.ratio, "steps": self.steps}


def count_decode_ops(engine: Engine, requests, steps: int = 4) -> DecodeOps:
    """:class:`DecodeOps` of ``requests`` (each row's prompt as the workload has it), over ``steps`` decoding
    steps of each (the first step, which prefills, is not counted)."""
    check_count("steps", steps, minimum=1)
    device = engine.model.device
    counter, ticks = _KernelOpCounter(), []
    with counter:
        for _ in engine.generate(requests, max_new_tokens=steps + 1, generator=_generator(device), stop_at_eos=False,
                                 progress=lambda _n: ticks.append(counter.count)):
            pass
    ours = [after - before for before, after in zip(ticks, ticks[1:])]
    return DecodeOps(statistics.median(ours), _padded_decode_ops(engine, requests, steps), steps)


def _padded_decode_ops(engine: Engine, requests, steps: int) -> float:
    """Median operations per step of a plain padded transformers decode of the workload's rows."""
    network, device = engine.model.model, engine.model.device
    prompts = _prompts(requests)
    width = max(len(p) for p in prompts)
    pad = engine.model.eos_token_ids[0]
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    name, gen = cache_argument(network), _generator(device)
    with torch.inference_mode():
        out = network(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        cache, logits, counts = getattr(out, name), out.logits[:, -1], []
        for _ in range(steps):
            counter = _KernelOpCounter()
            with counter:
                token = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=gen)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = mask.sum(dim=1, keepdim=True) - 1
                out = network(input_ids=token, attention_mask=mask, position_ids=positions, use_cache=True,
                              logits_to_keep=1, **{name: cache})
            cache, logits = getattr(out, name), out.logits[:, -1]
            counts.append(counter.count)
    return statistics.median(counts)


@dataclasses.dataclass(frozen=True)
class _Floor:
    prefill_seconds: float
    decode_seconds: float


def _floor_run(engine: Engine, requests, text_tokens: Sequence[int], device) -> _Floor:
    """The bare unpadded forward passes the workload needs, with the model's own attention and cache.

    Prefill: each row's prompt alone (batch of one: no padding at all). Decode: for each text the
    steps it actually took (``text_tokens``), all decoding rows in one batch of *equal* lengths (the
    mean prompt length: the cost without length variance), last hidden states for every row and the
    output layer for the public rows only (what any implementation must compute). No mechanism, no
    sampling. This is the floor an engine is measured against.
    """
    network = engine.model.model
    decoder = engine.output_split.decoder if engine.output_split is not None else None
    prompts = _prompts(requests)
    rows_per_text = [1 + sum(p is not None for p in r.private_ids) for r in requests]
    with torch.inference_mode():
        _sync(device)
        started = time.perf_counter()
        for prompt in prompts:
            network(input_ids=torch.tensor([prompt], device=device), logits_to_keep=1)
        _sync(device)
        prefill = time.perf_counter() - started
        length = max(1, round(sum(len(p) for p in prompts) / len(prompts)))
        live = [t for t in range(len(requests)) if text_tokens[t] > 1]
        decode = 0.0
        if live:
            rows = sum(rows_per_text[t] for t in live)
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(3, engine.model.vocab_size, (rows, length), generator=gen).to(device)
            name = cache_argument(network)
            cache = getattr(network(input_ids=ids, use_cache=True, logits_to_keep=1), name)
            for step in range(1, max(text_tokens)):
                live_now = [t for t in live if text_tokens[t] > step]
                if not live_now:
                    break
                if live_now != live:
                    keep, offset = [], 0
                    for t in live:
                        if t in live_now:
                            keep.extend(range(offset, offset + rows_per_text[t]))
                        offset += rows_per_text[t]
                    cache.batch_select_indices(torch.tensor(keep, device=device))
                    live = live_now
                rows = sum(rows_per_text[t] for t in live)
                token = torch.full((rows, 1), engine.model.eos_token_ids[0], device=device)
                _sync(device)
                started = time.perf_counter()
                if decoder is not None:
                    states = decoder(input_ids=token, use_cache=True, **{cache_argument(decoder): cache}).last_hidden_state
                    engine.output_split.head(states[: len(live), -1])  # one row per text: the public row
                else:
                    network(input_ids=token, use_cache=True, logits_to_keep=1, **{name: cache})
                _sync(device)
                decode += time.perf_counter() - started
    return _Floor(prefill, decode)


def cache_argument(module) -> str:
    """The name of a transformers model's key/value cache, as its ``forward`` argument and in its output:
    ``cache`` from transformers 5.24 on (which deprecates ``past_key_values``), ``past_key_values`` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def _left_padded_efficiency(requests, max_batch_rows: int) -> float:
    """Efficiency of the left-padded layout (every row of a shard padded to its longest prompt), for
    comparison: real tokens / processed tokens, of prefill and, the same ratio, of the first step's KV."""
    prompts = _prompts(requests)
    processed = 0
    for start in range(0, len(prompts), max_batch_rows):
        shard = prompts[start : start + max_batch_rows]
        processed += len(shard) * max(len(p) for p in shard)
    return sum(len(p) for p in prompts) / processed


def _check_counts(**counts: tuple[int, int]) -> None:
    """Each ``name=(value, minimum)`` must be an integer (not a bool) >= its minimum."""
    for name, (value, minimum) in counts.items():
        check_count(name, value, minimum=minimum)


def _reference_pool(references: Sequence[str] | None) -> list[str]:
    """The private texts to cycle through: ``references``, or the shipped demo dataset's non-empty texts."""
    return list(references) if references is not None else [r for r in demo_references() if r]


def _workload_texts(pool: Sequence[str], batch_size: int, num_texts: int) -> list[list[str]]:
    """The references of each of ``num_texts`` texts: ``batch_size`` at a time from ``pool``, cycled when short."""
    return [[pool[(g * batch_size + i) % len(pool)] for i in range(batch_size)] for g in range(num_texts)]


def _encode_workload(loaded: LoadedModel, template: PromptTemplate, texts: list[list[str]]) -> tuple[list, bool]:
    """One request per text (key = its index), and whether the prompts are plain text (no chat template)."""
    plain = getattr(loaded.tokenizer, "chat_template", None) is None
    requests = [encode_request(loaded.tokenizer, template, batch, key=g, plain=plain) for g, batch in enumerate(texts)]
    return requests, plain


@dataclasses.dataclass(frozen=True)
class _Steps:
    """Medians of the lockstep step measurements (NaN when none were taken, ``repeats=0``)."""

    private: float
    forward: float
    single: float

    def fields(self, num_texts: int) -> dict:
        """The :class:`BenchResult` fields of the lockstep measurements."""
        return {
            "private_step_seconds": self.private,
            "forward_step_seconds": self.forward,
            "overhead_ratio": self.private / self.forward,
            "tokens_per_second": num_texts / self.private,
            "nonprivate_step_seconds": self.single,
            "relative_to_nonprivate": (self.private / num_texts) / self.single,
        }


def _lockstep_steps(engine: Engine, requests, max_new_tokens: int, temperature: float, device, repeats: int) -> _Steps:
    """``repeats`` interleaved runs (:func:`_interleaved_run`), summarised by their medians."""
    private_steps, forward_steps, single_steps = [], [], []
    for _ in range(repeats):
        private, forward, single = _interleaved_run(engine, requests, max_new_tokens, temperature, device)
        private_steps += private
        forward_steps += forward
        single_steps += single

    def median(steps: list[float]) -> float:
        return statistics.median(steps) if steps else math.nan

    return _Steps(median(private_steps), median(forward_steps), median(single_steps))


@dataclasses.dataclass(frozen=True)
class _SharedWorkload:
    """The workload run: this process's run, every process's figures, and the totals reported."""

    run: _Workload
    processes: tuple[dict, ...]
    seconds: float  # the slowest process's (this process's when not distributed)
    tokens: int  # all processes' together


def _shared_workload(cluster, engine: Engine, requests, max_new_tokens: int, device) -> _SharedWorkload:
    """Run the workload, its texts shared by the processes when distributed (whole texts, balanced by cost)."""
    mine = None
    if cluster.distributed:
        costs = {g: request_cost(r, max_new_tokens) for g, r in enumerate(requests)}
        mine = assign_batches(costs, cluster.world_size)[cluster.rank]
        cluster.agree(None)  # every process loaded: start the clocks together
    workload = _workload_run(engine, requests, max_new_tokens, device, indices=mine)
    processes = cluster.gather(
        {"rank": cluster.rank, "device": str(device), "texts": len(requests) if mine is None else len(mine),
         "tokens": workload.tokens, "seconds": workload.seconds}
    )  # fmt: skip
    processes = tuple(processes or ())
    seconds = max(p["seconds"] for p in processes) if processes else workload.seconds
    tokens = sum(p["tokens"] for p in processes) if processes else workload.tokens
    return _SharedWorkload(workload, processes, seconds, tokens)


def _efficiency_fields(stats: ForwardStats, requests, max_batch_rows: int) -> dict:
    """The :class:`BenchResult` fields of the workload's forward passes: prefill/decode split and efficiencies."""
    prompt_lengths = [len(p) for p in _prompts(requests)]
    padded = _left_padded_efficiency(requests, max_batch_rows)
    return {
        "prefill_seconds": stats.prefill_seconds,
        "decode_forward_seconds": stats.decode_seconds,
        "prompt_tokens": sum(prompt_lengths),
        "longest_prompt": max(prompt_lengths),
        # real / processed: no padded token is ever processed (the shared template prefix makes the
        # tokens computed fewer than the prompt tokens: prefill_tokens_computed)
        "prefill_efficiency": min(1.0, sum(prompt_lengths) / max(stats.prefill_tokens, 1)),
        "prefill_tokens_computed": stats.prefill_tokens,
        "decode_row_efficiency": stats.decode_rows / max(stats.decode_rows + stats.placeholder_rows, 1),
        "kv_efficiency": stats.kv_tokens / max(stats.kv_processed, 1),
        "left_padded_prefill_efficiency": padded,
        "left_padded_kv_efficiency": padded,
    }


@dataclasses.dataclass(frozen=True)
class _Comparisons:
    """The optional runs the workload is compared with (``None``: not run)."""

    one_at_a_time: _Workload | None
    floor: _Floor | None
    full_logits: _Workload | None

    def fields(self) -> dict:
        """The :class:`BenchResult` fields of the comparison runs (NaN seconds and 0 tokens when not run)."""
        alone, bare, full = self.one_at_a_time, self.floor, self.full_logits
        return {
            "one_at_a_time_seconds": alone.seconds if alone else math.nan,
            "one_at_a_time_tokens": alone.tokens if alone else 0,
            "floor_prefill_seconds": bare.prefill_seconds if bare else math.nan,
            "floor_decode_seconds": bare.decode_seconds if bare else math.nan,
            "full_logits_seconds": full.seconds if full else math.nan,
            "full_logits_tokens": full.tokens if full else 0,
        }


def _comparison_runs(
    engine: Engine, requests, max_new_tokens: int, text_tokens: Sequence[int], *, one_at_a_time: bool, floor: bool,
    compare_full_logits: bool,
) -> _Comparisons:  # fmt: skip
    """One text per call, the bare forward floor, and full private logits, each when asked for (in that order)."""
    device = engine.model.device
    alone = _workload_run(engine, requests, max_new_tokens, device, one_at_a_time=True) if one_at_a_time else None
    bare = _floor_run(engine, requests, text_tokens, device) if floor else None
    full = None
    if compare_full_logits:
        full_engine = Engine(engine.model, engine.mechanism, max_batch_rows=engine.max_batch_rows, support_only=False)
        full = _workload_run(full_engine, requests, max_new_tokens, device)
    return _Comparisons(alone, bare, full)


def _bench_model(model, cluster, device, dtype) -> LoadedModel:
    """The model :func:`benchmark` decodes with; under torchrun every process runs in process 0's dtype."""
    loaded = load_model(model, device=cluster.device(device), dtype=dtype)
    if cluster.distributed and not isinstance(model, LoadedModel):
        reload = lambda choice: load_model(model, device=loaded.device, dtype=choice)  # noqa: E731
        loaded = follow_dtype(loaded, cluster.broadcast(loaded.dtype_choice), reload)
    return loaded


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
    one_at_a_time: bool = True,
    floor: bool = True,
    compare_full_logits: bool = False,
    count_ops: bool = True,
) -> BenchResult:
    """Measure private decoding on ``num_texts`` × (``batch_size`` + 1) rows (module docstring).

    ``references``: the private texts, used in order (``num_texts * batch_size`` of them; cycled when
    fewer); default the shipped fictional demo dataset. The mechanism's parameters do not change the
    cost; the defaults are typical values. ``repeats=0`` skips the lockstep step measurements.
    ``compare_full_logits`` also runs the workload with full private logits (``Engine(support_only=False)``)
    to show what the Top-k+ columns save. ``count_ops``: count the kernel-launching operations per decoding
    step, ours and a plain padded decode's (:func:`count_decode_ops`; one more prefill of each). A model whose
    tokenizer has no chat template (a base model) gets plain-text prompts
    (:func:`~invink_audit.prompts.encode_messages` with ``plain=True``).
    """
    _check_counts(
        batch_size=(batch_size, 1), max_new_tokens=(max_new_tokens, 3), num_texts=(num_texts, 1), repeats=(repeats, 0)
    )
    pool = _reference_pool(references)
    if not pool or not any(pool):
        raise ValueError("references must hold at least one non-empty text")
    cluster = current_cluster()
    if cluster.distributed:  # the workload only: its texts shared by the processes
        repeats, one_at_a_time, floor, compare_full_logits, count_ops = 0, False, False, False, False
    loaded = _bench_model(model, cluster, device, dtype)
    mechanism = MechanismConfig(clip_norm=clip_norm, temperature=temperature, top_k=top_k, batch_size=batch_size)
    rows = num_texts * (batch_size + 1)
    engine = Engine(loaded, mechanism, max_batch_rows=rows if max_batch_rows is None else max_batch_rows)
    requests, plain = _encode_workload(loaded, get_preset(prompt), _workload_texts(pool, batch_size, num_texts))
    steps = _lockstep_steps(engine, requests, max_new_tokens, temperature, loaded.device, repeats)
    workload = _shared_workload(cluster, engine, requests, max_new_tokens, loaded.device)
    comparisons = _comparison_runs(
        engine, requests, max_new_tokens, workload.run.text_tokens, one_at_a_time=one_at_a_time, floor=floor,
        compare_full_logits=compare_full_logits,
    )  # fmt: skip
    result = _bench_result(
        loaded, engine, requests, cluster, steps, workload, comparisons, batch_size=batch_size, num_texts=num_texts,
        max_new_tokens=max_new_tokens, rows=rows, repeats=repeats, plain=plain,
    )  # fmt: skip
    return dataclasses.replace(result, decode_ops=count_decode_ops(engine, requests)) if count_ops else result


def _bench_result(
    loaded: LoadedModel, engine: Engine, requests, cluster, steps: _Steps, workload: _SharedWorkload,
    comparisons: _Comparisons, *, batch_size: int, num_texts: int, max_new_tokens: int, rows: int, repeats: int,
    plain: bool,
) -> BenchResult:  # fmt: skip
    """:func:`benchmark`'s result from its measurements: the run's settings, the lockstep medians, the
    workload (the processes' figures when distributed), its efficiencies and the comparison runs."""
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
        **steps.fields(num_texts),
        workload_seconds=workload.seconds,
        workload_tokens=workload.tokens,
        **_efficiency_fields(workload.run.stats, requests, engine.max_batch_rows),
        **comparisons.fields(),
        support_only=engine.support_only,
        vocab_size=loaded.vocab_size,
        plain_prompts=plain,
        processes=workload.processes if cluster.distributed else (),
        rank=cluster.rank,
        dtype_choice=loaded.dtype_choice,
    )


@dataclasses.dataclass(frozen=True)
class DtypeRun:
    """One dtype's whole-workload runs in :func:`compare_dtypes`, one per round: seconds (prefill
    included, stopping at end-of-sequence), prefill seconds, generated tokens. ``choice``: why it ran in
    that dtype (``"requested"``, or ``auto``'s decision when auto chose it)."""

    choice: DtypeChoice
    seconds: tuple[float, ...]
    prefill_seconds: tuple[float, ...]
    tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.seconds or not len(self.seconds) == len(self.prefill_seconds) == len(self.tokens):
            raise ValueError("seconds, prefill_seconds and tokens must hold one entry per round (at least one)")

    @property
    def dtype(self) -> str:
        return self.choice.dtype

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_prefill_seconds(self) -> float:
        return statistics.median(self.prefill_seconds)

    @property
    def token_seconds(self) -> float:
        """Seconds per generated token over every round (prefill and end-of-sequence included)."""
        return sum(self.seconds) / sum(self.tokens)

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype, "choice": self.choice.to_json(), "seconds": list(self.seconds),
            "prefill_seconds": list(self.prefill_seconds), "tokens": list(self.tokens),
            "median_seconds": self.median_seconds, "median_prefill_seconds": self.median_prefill_seconds,
            "token_seconds": self.token_seconds,
        }  # fmt: skip


@dataclasses.dataclass(frozen=True)
class DtypeComparison:
    """The same workload in several dtypes, alternating round by round (:func:`compare_dtypes`), and what
    ``dtype="auto"`` chooses on this machine (``auto``, with the bfloat16 probe's figures where it ran).
    ``references``: the reference package timed on the same workload (``matched``: in each of our dtypes)."""

    model: str
    device: str
    threads: int
    batch_size: int
    num_texts: int
    max_new_tokens: int
    rounds: int
    auto: DtypeChoice
    runs: tuple[DtypeRun, ...]
    references: tuple[ReferenceTiming, ...] = ()

    def run(self, dtype: str) -> DtypeRun:
        for run in self.runs:
            if run.dtype == dtype:
                return run
        raise ValueError(f"no run in {dtype!r}; ran {[r.dtype for r in self.runs]}")

    def speedup(self, dtype: str = "bfloat16", baseline: str = "float32") -> float:
        """``baseline``'s seconds per generated token ÷ ``dtype``'s (over all rounds)."""
        return self.run(baseline).token_seconds / self.run(dtype).token_seconds

    def workload_speedup(self, dtype: str = "bfloat16", baseline: str = "float32") -> float:
        """``baseline``'s median whole-workload seconds ÷ ``dtype``'s."""
        return self.run(baseline).median_seconds / self.run(dtype).median_seconds

    def to_json(self) -> dict:
        out = {
            name: getattr(self, name)
            for name in ("model", "device", "threads", "batch_size", "num_texts", "max_new_tokens", "rounds")
        }
        out["auto"] = self.auto.to_json()
        out["runs"] = [run.to_json() for run in self.runs]
        dtypes = [run.dtype for run in self.runs]
        if "float32" in dtypes and "bfloat16" in dtypes:
            out["bfloat16_speedup_per_token"] = self.speedup()
            out["bfloat16_speedup_workload"] = self.workload_speedup()
        out["references"] = [
            {**dataclasses.asdict(r), "configuration": r.configuration,
             "speedup": (r.token_seconds / self.run(r.requested_dtype).token_seconds) if r.requested_dtype in dtypes else None}
            for r in self.references
        ]  # fmt: skip
        return out


def _compared_dtypes(model, dtypes: Sequence[str], device) -> list[torch.dtype]:
    """:func:`compare_dtypes`'s model and dtypes checked: the torch dtypes to load, distinct, in one process."""
    if isinstance(model, LoadedModel):
        raise ValueError("compare_dtypes loads the model once per dtype: give its name or path, not a LoadedModel")
    if isinstance(dtypes, str) or any(not isinstance(name, str) or name == "auto" for name in dtypes):
        raise ValueError(f"dtypes must be a sequence of dtype names (not 'auto'); got {dtypes!r}")
    wanted = [resolve_dtype(name, resolve_device(device)) for name in dtypes]
    if not wanted or len(set(wanted)) != len(wanted):
        raise ValueError(f"dtypes must name distinct dtypes; got {list(dtypes)!r}")
    if current_cluster().distributed:
        raise ValueError("compare_dtypes runs in one process: run it without torchrun")
    return wanted


def _alternated_runs(loaded: dict, mechanism_args: dict, texts, prompt, max_new_tokens: int, rounds: int, device,
                     max_batch_rows: int) -> dict:
    """Each dtype's engine, warmed up on one short text, then the whole workload ``rounds`` times per dtype,
    alternating the order (:func:`compare_dtypes`): {dtype: (engine, requests, [workload runs])}."""
    mechanism = MechanismConfig(**mechanism_args)
    runs = {}
    for name, model_in_dtype in loaded.items():
        engine = Engine(model_in_dtype, mechanism, max_batch_rows=max_batch_rows)
        requests, _ = _encode_workload(model_in_dtype, get_preset(prompt), texts)
        list(engine.generate(requests[:1], max_new_tokens=2, generator=_generator(device)))  # warm-up
        runs[name] = (engine, requests, [])
    order = list(loaded)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            engine, requests, measured = runs[name]
            measured.append(_workload_run(engine, requests, max_new_tokens, device))
    return runs


def compare_dtypes(
    model: str | None = None,
    *,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    rounds: int = 2,
    batch_size: int = 7,
    max_new_tokens: int = 32,
    num_texts: int = 1,
    clip_norm: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = 100,
    prompt: str | PromptTemplate = "generic",
    references: Sequence[str] | None = None,
    device: str | torch.device | None = None,
    max_batch_rows: int | None = None,
) -> DtypeComparison:
    """The whole workload (as :func:`benchmark` runs it) in each of ``dtypes``, ``rounds`` times each,
    alternating: round ``r`` runs the dtypes in order, reversed on odd rounds (float32, bfloat16, bfloat16,
    float32, ...), so that a change of load on the machine falls on both. Each model first decodes one
    short untimed text (first-touch costs). The model is loaded once with ``dtype="auto"`` (its decision
    and probe are reported as ``auto``) and once per other dtype. One process only; ``model``: a name or
    path (each dtype is loaded from it)."""
    _check_counts(
        batch_size=(batch_size, 1), max_new_tokens=(max_new_tokens, 3), num_texts=(num_texts, 1), rounds=(rounds, 1)
    )
    wanted = _compared_dtypes(model, dtypes, device)
    pool = _reference_pool(references)
    if not pool or not any(pool):
        raise ValueError("references must hold at least one non-empty text")
    auto = load_model(model, device=device, dtype="auto")
    loaded = {}  # the auto-loaded model serves its own dtype
    for name, torch_dtype in zip(dtypes, wanted):
        in_dtype = auto if auto.dtype == torch_dtype else load_model(model, device=auto.device, dtype=name)
        loaded[in_dtype.dtype_choice.dtype] = in_dtype
    mechanism = dict(clip_norm=clip_norm, temperature=temperature, top_k=top_k, batch_size=batch_size)
    rows = num_texts * (batch_size + 1) if max_batch_rows is None else max_batch_rows
    texts = _workload_texts(pool, batch_size, num_texts)
    runs = _alternated_runs(loaded, mechanism, texts, prompt, max_new_tokens, rounds, auto.device, rows)
    return DtypeComparison(
        model=auto.name,
        device=str(auto.device),
        threads=torch.get_num_threads(),
        batch_size=batch_size,
        num_texts=num_texts,
        max_new_tokens=max_new_tokens,
        rounds=rounds,
        auto=auto.dtype_choice,
        runs=tuple(
            DtypeRun(
                choice=loaded[name].dtype_choice,
                seconds=tuple(w.seconds for w in measured),
                prefill_seconds=tuple(w.stats.prefill_seconds for w in measured),
                tokens=tuple(w.tokens for w in measured),
            )
            for name, (_, _, measured) in runs.items()
        ),
    )


def _positional_prompts(template: PromptTemplate) -> tuple[str, str, str]:
    """``template`` in the reference package's positional format: (dataset description, private, public)."""
    description = template.fields.get("description", "")
    private = template.private.replace("{description}", "{0}").replace("{reference}", "{1}")
    public = template.public.replace("{description}", "{0}")
    return description, private, public


@dataclasses.dataclass
class _ReferenceClock:
    """What the reference package's patched hooks measure: model loading, its decode loop, its model's dtype."""

    loading: list[float] = dataclasses.field(default_factory=list)
    loop: list[float] = dataclasses.field(default_factory=list)
    dtypes: list[str] = dataclasses.field(default_factory=list)

    def timed_load(self, load):
        """``load`` (its ``load_hf_model``), timed, recording the loaded model's dtype."""

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                model = load(*args, **kwargs)
            finally:
                self.loading.append(time.perf_counter() - started)
            self.dtypes.append(str(model.dtype).removeprefix("torch."))
            return model

        return timed

    def timed_loop(self, iterable, *args, **kwargs):
        """Stands in for its ``tqdm``: the loop over its texts, timed from first to last."""
        started = time.perf_counter()
        yield from iterable
        self.loop.append(time.perf_counter() - started)


@contextlib.contextmanager
def _clocked(reference):
    """Patch the reference module's ``load_hf_model`` and ``tqdm`` with a :class:`_ReferenceClock`'s, undone on exit."""
    clock = _ReferenceClock()
    original_load, original_tqdm = reference.load_hf_model, reference.tqdm
    reference.load_hf_model, reference.tqdm = clock.timed_load(original_load), clock.timed_loop
    try:
        yield clock
    finally:
        reference.load_hf_model, reference.tqdm = original_load, original_tqdm


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
    description, private, public = _positional_prompts(template)
    texts = [text for batch in _workload_texts(_reference_pool(references), batch_size, num_texts) for text in batch]
    options = {name: value for name, value in (("dtype", dtype), ("device_map", device_map)) if value is not None}
    with _clocked(reference) as clock:
        started = time.perf_counter()
        out = _call_reference(
            reference, texts, model_dir=model_dir, system=template.system, prompts=(description, private, public),
            batch_size=batch_size, num_texts=num_texts, max_new_tokens=max_new_tokens, temperature=temperature,
            top_k=top_k, options=options,
        )  # fmt: skip
    total = time.perf_counter() - started
    if len(clock.loop) != 1:
        raise RuntimeError("could not time the reference package's decode loop (its tqdm loop was not used)")
    tokens = int(sum(out.lens))
    return ReferenceTiming(
        token_seconds=clock.loop[0] / tokens,
        tokens=tokens,
        seconds=clock.loop[0],
        setup_seconds=total - clock.loop[0] - sum(clock.loading),
        version=importlib.metadata.version("invink") if _has_metadata("invink") else "unknown",
        dtype=clock.dtypes[0] if clock.dtypes else "unknown",
        requested_dtype=dtype,
        requested_device_map=device_map,
    )


def _call_reference(
    reference, texts: list[str], *, model_dir: str, system, prompts: tuple[str, str, str], batch_size: int,
    num_texts: int, max_new_tokens: int, temperature: float, top_k: int, options: dict,
):  # fmt: skip
    """One call of the reference package's ``generate`` on the workload (:func:`time_reference`), its
    output and warnings silenced: ``prompts`` = (dataset description, private, public) in its positional
    format, ``batch_size + 1`` rows per text (it counts the public row), ε = 10, seed 0, no download;
    ``options``: its ``dtype`` / ``device_map`` where forced. Returns its output."""
    description, private, public = prompts
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return reference.generate(
            texts,
            model_name_or_path=model_dir,
            dataset_desc=description,
            system_prompt=system,
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


def _has_metadata(name: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
