"""The whole workload (as :func:`benchmarks.engine.benchmark` runs it) in float32 and in bfloat16 side by side in
one process (:func:`compare_dtypes`), alternating the dtypes round by round (float32, bfloat16, then bfloat16,
float32, ...) so that load on the machine falls on both alike, and what ``dtype="auto"`` chooses here and why
(:class:`~invink_audit.models.DtypeChoice`)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

import torch

from invink_audit.distributed import current_cluster
from invink_audit.engine import Engine
from invink_audit.mechanism import MechanismConfig
from invink_audit.models import DtypeChoice, LoadedModel, load_model, resolve_device, resolve_dtype
from invink_audit.prompts import PromptTemplate, get_preset

from .reference import ReferenceTiming
from .workload import check_counts, encode_workload, reference_pool, seeded_generator, workload_run, workload_texts


@dataclasses.dataclass(frozen=True)
class DtypeRun:
    """One dtype's whole-workload runs in :func:`compare_dtypes`, one per round: seconds (prefill
    included; stopping at end-of-sequence unless the comparison's ``stop_at_eos`` is False), prefill seconds,
    generated tokens. ``choice``: why it ran in
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
        """Seconds per generated token over every round (prefill included)."""
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
    #: False: every text drew ``max_new_tokens`` (``--full-length``), here and in the reference's runs
    stop_at_eos: bool = True

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
            for name in ("model", "device", "threads", "batch_size", "num_texts", "max_new_tokens", "rounds",
                         "stop_at_eos")
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
                     max_batch_rows: int, stop_at_eos: bool = True) -> dict:
    """Each dtype's engine, warmed up on one short text, then the whole workload ``rounds`` times per dtype,
    alternating the order (:func:`compare_dtypes`): {dtype: (engine, requests, [workload runs])}."""
    mechanism = MechanismConfig(**mechanism_args)
    runs = {}
    for name, model_in_dtype in loaded.items():
        engine = Engine(model_in_dtype, mechanism, max_batch_rows=max_batch_rows)
        requests, _ = encode_workload(model_in_dtype, get_preset(prompt), texts, stop=stop_at_eos)
        list(engine.generate(requests[:1], max_new_tokens=2, generator=seeded_generator(device)))  # warm-up
        runs[name] = (engine, requests, [])
    order = list(loaded)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            engine, requests, measured = runs[name]
            measured.append(workload_run(engine, requests, max_new_tokens, device, stop_at_eos=stop_at_eos))
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
    stop_at_eos: bool = True,
) -> DtypeComparison:
    """The whole workload (as :func:`benchmark` runs it) in each of ``dtypes``, ``rounds`` times each,
    alternating: round ``r`` runs the dtypes in order, reversed on odd rounds (float32, bfloat16, bfloat16,
    float32, ...), so that a change of load on the machine falls on both. Each model first decodes one
    short untimed text (first-touch costs). The model is loaded once with ``dtype="auto"`` (its decision
    and probe are reported as ``auto``) and once per other dtype. One process only; ``model``: a name or
    path (each dtype is loaded from it)."""
    check_counts(
        batch_size=(batch_size, 1), max_new_tokens=(max_new_tokens, 3), num_texts=(num_texts, 1), rounds=(rounds, 1)
    )
    wanted = _compared_dtypes(model, dtypes, device)
    pool = reference_pool(references)
    auto = load_model(model, device=device, dtype="auto")
    loaded = {}  # the auto-loaded model serves its own dtype
    for name, torch_dtype in zip(dtypes, wanted):
        in_dtype = auto if auto.dtype == torch_dtype else load_model(model, device=auto.device, dtype=name)
        loaded[in_dtype.dtype_choice.dtype] = in_dtype
    mechanism = dict(clip_norm=clip_norm, temperature=temperature, top_k=top_k, batch_size=batch_size)
    rows = num_texts * (batch_size + 1) if max_batch_rows is None else max_batch_rows
    texts = workload_texts(pool, batch_size, num_texts)
    runs = _alternated_runs(loaded, mechanism, texts, prompt, max_new_tokens, rounds, auto.device, rows, stop_at_eos)
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
        stop_at_eos=stop_at_eos,
    )

