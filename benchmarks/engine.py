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
token. The reference package can be timed on the same workload (:mod:`benchmarks.reference`); the
speedup is the ratio of the two costs per generated token.

Under ``torchrun`` / ``accelerate launch`` the processes share the workload's G texts (whole texts,
balanced by public prompt length: :func:`invink_audit.distributed.assign_batches`), each keeping its random
stream; ``processes`` lists each one's texts, tokens and seconds, and the workload figures become the
total tokens over the slowest process's seconds. The lockstep steps, the one-at-a-time and floor runs
and the reference are single-process measurements and are skipped there.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence

import torch

from invink_audit.distributed import assign_batches, current_cluster, request_cost
from invink_audit.engine import Engine, ForwardStats
from invink_audit.mechanism import MechanismConfig
from invink_audit.models import DtypeChoice, LoadedModel, follow_dtype, load_model
from invink_audit.prompts import PromptTemplate, get_preset

from .ops import DecodeOps, cache_argument, count_decode_ops
from .reference import ReferenceTiming
from .workload import (
    WorkloadRun,
    check_counts,
    encode_workload,
    reference_pool,
    row_prompts,
    seeded_generator,
    sync,
    to_length,
    workload_run,
    workload_texts,
)


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
    #: False: every text drew ``max_new_tokens`` (end-of-sequence did not stop it), here and in the reference's runs
    stop_at_eos: bool = True

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


class _BareRows:
    """The engine's forward passes over the same rows without the mechanism, one decoding step at a time."""

    def __init__(self, engine: Engine, requests, max_new_tokens: int, device):
        forward = engine.forward
        self.forward, self.device = forward, device
        store = forward.new_store()
        self.rows = []
        for prompt in row_prompts(requests):
            row = forward.new_row(max_new_tokens)
            forward.prefill(row, prompt, hidden=False)
            self.rows.append(store.insert(row))
        # the forward pass costs the same for any token ids: feed a fixed one
        self.ids = [engine.model.eos_token_ids[0]] * len(self.rows)

    def step(self) -> float:
        sync(self.device)
        started = time.perf_counter()
        self.forward.decode(self.rows, self.ids, hidden=False)
        sync(self.device)
        return time.perf_counter() - started


class _NonPrivateText:
    """Ordinary sampling of one text from the public prompt: one row, softmax at ``temperature``."""

    def __init__(self, engine: Engine, request, max_new_tokens: int, temperature: float, device):
        self.forward, self.device, self.temperature = engine.forward, device, temperature
        self.generator = seeded_generator(device)
        row = self.forward.new_row(max_new_tokens)
        self.logits = self.forward.prefill(row, request.public_ids, hidden=False)[None]
        self.row = self.forward.new_store().insert(row)

    def step(self) -> float:
        sync(self.device)
        started = time.perf_counter()
        probs = torch.softmax(self.logits.float() / self.temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=self.generator)[0, 0]
        self.logits = self.forward.decode([self.row], [token.item()], hidden=False)
        sync(self.device)
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
        sync(device)
        private_steps.append(time.perf_counter() - last[0])
        if len(private_steps) < max_new_tokens:  # cache lengths stay in step with the private rows
            forward_steps.append(bare.step())
            single_steps.append(single.step())
        last[0] = time.perf_counter()

    last[0] = time.perf_counter()
    for _ in engine.generate(
        to_length(requests), max_new_tokens=max_new_tokens, generator=seeded_generator(device), stop_at_eos=False,
        progress=tick,
    ):
        pass
    return private_steps[1:], forward_steps, single_steps


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
    prompts = row_prompts(requests)
    rows_per_text = [1 + sum(p is not None for p in r.private_ids) for r in requests]
    with torch.inference_mode():
        sync(device)
        started = time.perf_counter()
        for prompt in prompts:
            network(input_ids=torch.tensor([prompt], device=device), logits_to_keep=1)
        sync(device)
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
                sync(device)
                started = time.perf_counter()
                if decoder is not None:
                    states = decoder(input_ids=token, use_cache=True, **{cache_argument(decoder): cache}).last_hidden_state
                    engine.output_split.head(states[: len(live), -1])  # one row per text: the public row
                else:
                    network(input_ids=token, use_cache=True, logits_to_keep=1, **{name: cache})
                sync(device)
                decode += time.perf_counter() - started
    return _Floor(prefill, decode)


def _left_padded_efficiency(requests, max_batch_rows: int) -> float:
    """Efficiency of the left-padded layout (every row of a shard padded to its longest prompt), for
    comparison: real tokens / processed tokens, of prefill and, the same ratio, of the first step's KV."""
    prompts = row_prompts(requests)
    processed = 0
    for start in range(0, len(prompts), max_batch_rows):
        shard = prompts[start : start + max_batch_rows]
        processed += len(shard) * max(len(p) for p in shard)
    return sum(len(p) for p in prompts) / processed


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

    run: WorkloadRun
    processes: tuple[dict, ...]
    seconds: float  # the slowest process's (this process's when not distributed)
    tokens: int  # all processes' together


def _shared_workload(cluster, engine: Engine, requests, max_new_tokens: int, device, stop_at_eos: bool = True,
                     ) -> _SharedWorkload:
    """Run the workload, its texts shared by the processes when distributed (whole texts, balanced by cost)."""
    mine = None
    if cluster.distributed:
        costs = {g: request_cost(r, max_new_tokens) for g, r in enumerate(requests)}
        mine = assign_batches(costs, cluster.world_size)[cluster.rank]
        cluster.agree(None)  # every process loaded: start the clocks together
    workload = workload_run(engine, requests, max_new_tokens, device, indices=mine, stop_at_eos=stop_at_eos)
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
    prompt_lengths = [len(p) for p in row_prompts(requests)]
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

    one_at_a_time: WorkloadRun | None
    floor: _Floor | None
    full_logits: WorkloadRun | None

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
    compare_full_logits: bool, stop_at_eos: bool = True,
) -> _Comparisons:  # fmt: skip
    """One text per call, the bare forward floor, and full private logits, each when asked for (in that order)."""
    device = engine.model.device
    alone = (workload_run(engine, requests, max_new_tokens, device, one_at_a_time=True, stop_at_eos=stop_at_eos)
             if one_at_a_time else None)
    bare = _floor_run(engine, requests, text_tokens, device) if floor else None
    full = None
    if compare_full_logits:
        full_engine = Engine(engine.model, engine.mechanism, max_batch_rows=engine.max_batch_rows, support_only=False)
        full = workload_run(full_engine, requests, max_new_tokens, device, stop_at_eos=stop_at_eos)
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
    stop_at_eos: bool = True,
) -> BenchResult:
    """Measure private decoding on ``num_texts`` × (``batch_size`` + 1) rows (module docstring).

    ``references``: the private texts, used in order (``num_texts * batch_size`` of them; cycled when
    fewer); default the shipped fictional demo dataset. The mechanism's parameters do not change the
    cost; the defaults are typical values. ``repeats=0`` skips the lockstep step measurements.
    ``compare_full_logits`` also runs the workload with full private logits (``Engine(support_only=False)``)
    to show what the Top-k+ columns save. ``count_ops``: count the kernel-launching operations per decoding
    step, ours and a plain padded decode's (:func:`count_decode_ops`; one more prefill of each), ours with the rows in
    one pool (``kv_layout="pool"``: the step a GPU runs, whatever device this is; the CPU's length buckets issue one
    attention per bucket, which costs nothing there but launches). A model whose
    tokenizer has no chat template (a base model) gets plain-text prompts
    (:func:`~invink_audit.prompts.encode_messages` with ``plain=True``). ``stop_at_eos=False``: every text draws
    ``max_new_tokens`` in the workload and its comparison runs, neither end-of-sequence nor the template's stop
    strings ending it (equal work for per-token comparisons).
    """
    check_counts(
        batch_size=(batch_size, 1), max_new_tokens=(max_new_tokens, 3), num_texts=(num_texts, 1), repeats=(repeats, 0)
    )
    pool = reference_pool(references)
    cluster = current_cluster()
    if cluster.distributed:  # the workload only: its texts shared by the processes
        repeats, one_at_a_time, floor, compare_full_logits, count_ops = 0, False, False, False, False
    loaded = _bench_model(model, cluster, device, dtype)
    mechanism = MechanismConfig(clip_norm=clip_norm, temperature=temperature, top_k=top_k, batch_size=batch_size)
    rows = num_texts * (batch_size + 1)
    engine = Engine(loaded, mechanism, max_batch_rows=rows if max_batch_rows is None else max_batch_rows)
    requests, plain = encode_workload(loaded, get_preset(prompt), workload_texts(pool, batch_size, num_texts),
                                      stop=stop_at_eos)
    steps = _lockstep_steps(engine, requests, max_new_tokens, temperature, loaded.device, repeats)
    workload = _shared_workload(cluster, engine, requests, max_new_tokens, loaded.device, stop_at_eos)
    comparisons = _comparison_runs(
        engine, requests, max_new_tokens, workload.run.text_tokens, one_at_a_time=one_at_a_time, floor=floor,
        compare_full_logits=compare_full_logits, stop_at_eos=stop_at_eos,
    )  # fmt: skip
    result = _bench_result(
        loaded, engine, requests, cluster, steps, workload, comparisons, batch_size=batch_size, num_texts=num_texts,
        max_new_tokens=max_new_tokens, rows=rows, repeats=repeats, plain=plain, stop_at_eos=stop_at_eos,
    )  # fmt: skip
    if not count_ops:
        return result
    pooled = engine if engine.kv_layout == "pool" else Engine(loaded, mechanism, max_batch_rows=engine.max_batch_rows,
                                                               kv_layout="pool")
    return dataclasses.replace(result, decode_ops=count_decode_ops(pooled, requests))


def _bench_result(
    loaded: LoadedModel, engine: Engine, requests, cluster, steps: _Steps, workload: _SharedWorkload,
    comparisons: _Comparisons, *, batch_size: int, num_texts: int, max_new_tokens: int, rows: int, repeats: int,
    plain: bool, stop_at_eos: bool,
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
        stop_at_eos=stop_at_eos,
    )

