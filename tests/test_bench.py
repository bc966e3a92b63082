"""bench: the lockstep measurements, the whole-workload run, and how the reference package is timed.

The harness lives in the checkout's ``benchmarks/`` folder (not installed; ``invink-audit bench`` finds it there).
The reference package itself is not a dependency; a stand-in module with its calling convention checks
what :func:`benchmarks.reference.time_reference` passes to it and which part of its run it times.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
import types

import pytest

from invink_audit.cli import main
from invink_audit.cli._bench import BENCHMARKS, harness
from invink_audit.engine import Engine
from invink_audit.mechanism import MechanismConfig
from invink_audit.models import build_tiny_model
from invink_audit.prompts import encode_request, get_preset

# the harness's modules, found as the command finds them (benchmarks/ put on sys.path)
bench, dtypes, ops, reference, command, workload = (
    harness(name) for name in ("engine", "dtypes", "ops", "reference", "command", "workload")
)
benchmark, compare_dtypes, time_reference, format_bench = (
    bench.benchmark, dtypes.compare_dtypes, reference.time_reference, command.format_bench
)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=3)


def test_benchmark_measures_lockstep_steps_and_the_whole_workload(tiny):
    result = benchmark(tiny, batch_size=3, max_new_tokens=5, num_texts=2, repeats=1, top_k=8)
    assert result.rows_per_step == 2 * 4
    assert result.overhead_ratio == pytest.approx(result.private_step_seconds / result.forward_step_seconds)
    assert result.tokens_per_second == pytest.approx(2 / result.private_step_seconds)
    assert 2 <= result.workload_tokens <= 2 * 5  # two texts of 1..T tokens each (EOS honoured)
    assert result.workload_token_seconds == pytest.approx(result.workload_seconds / result.workload_tokens)
    report = result.to_json()
    assert report["references"] == [] and report["workload_token_seconds"] > 0
    assert report["stop_at_eos"] is True and "end-of-sequence stopping texts" in format_bench(result)


def test_benchmark_full_length_runs_every_text_to_t_tokens(tiny):
    runs = {stop: benchmark(tiny, batch_size=2, max_new_tokens=8, num_texts=3, repeats=0, top_k=8, floor=False,
                            count_ops=False, stop_at_eos=stop) for stop in (True, False)}
    assert runs[True].workload_tokens < 3 * 8  # this seed's texts do end early
    result = runs[False]
    assert result.workload_tokens == 3 * 8 and result.one_at_a_time_tokens == 3 * 8  # equal work in both runs
    assert result.to_json()["stop_at_eos"] is False and "every text to T: --full-length" in format_bench(result)


def test_the_kernel_op_counter_counts_operations_and_not_views():
    import torch

    x = torch.arange(6.0)
    with ops.KernelOpCounter() as counter:
        y = (x + 1).view(2, 3).t()  # add: one kernel; view and transpose alias it
        torch.empty(4)  # allocation only
        (y * 2).sum()  # two kernels
    assert counter.count == 3


def _decode_ops(tiny, num_texts):
    result = benchmark(tiny, batch_size=3, max_new_tokens=4, num_texts=num_texts, repeats=0, top_k=8,
                       one_at_a_time=False, floor=False)
    return result


def test_bench_counts_kernel_ops_per_decoding_step_ours_and_a_plain_padded_decodes(tiny):
    result = _decode_ops(tiny, 1)
    ops = result.decode_ops
    assert ops.steps == 4 and ops.padded > 0
    assert ops.engine > ops.padded  # the mechanism's math and the private rows' extra work
    assert result.to_json()["decode_ops"] == {"engine": ops.engine, "padded": ops.padded, "layout": "pool",
                                              "ratio": pytest.approx(ops.engine / ops.padded), "steps": 4}
    # a plain padded decode issues the same operations whatever the number of rows
    assert _decode_ops(tiny, 3).decode_ops.padded == ops.padded
    skipped = benchmark(tiny, batch_size=2, max_new_tokens=3, num_texts=1, repeats=0, top_k=8, one_at_a_time=False,
                        floor=False, count_ops=False)
    assert skipped.decode_ops is None and skipped.to_json()["decode_ops"] is None


def test_the_engines_kernel_ops_per_step_do_not_grow_with_the_number_of_texts(tiny):
    """Rows in one pool (the GPU's layout): one attention call per layer and the mechanism's math once per step,
    whatever the number of texts; the CPU's length buckets launch one attention per bucket (more with more texts)."""
    one, four = _decode_ops(tiny, 1).decode_ops, _decode_ops(tiny, 4).decode_ops
    assert one.layout == four.layout == "pool"
    assert four.engine == one.engine
    buckets = ops.count_decode_ops(Engine(tiny, MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=8, batch_size=3),
                                          kv_layout="buckets"), _tiny_requests(tiny, 4))
    assert buckets.layout == "buckets" and buckets.engine > four.engine  # the counter sees the difference


def _tiny_requests(model, count):
    refs = [[f"review {g}-{i} " * (1 + 3 * i + g) for i in range(3)] for g in range(count)]
    return [encode_request(model.tokenizer, get_preset("generic"), r, key=g) for g, r in enumerate(refs)]


YELP = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "yelp" / "dev.csv"


@pytest.mark.slow
@pytest.mark.skipif(not YELP.exists(), reason="needs ../shared/data/yelp/dev.csv beside the checkout")
def test_the_gpu_decode_step_launches_at_most_1_1x_a_plain_padded_decode_on_real_reviews():
    """SmolLM2, B = 7, the first Yelp restaurant reviews, top-k 100: per decoding step, the engine with its rows in one
    pool issues at most 1.1x the kernel operations of a plain padded transformers decode of the same rows, at G = 1
    and G = 4, and no more at G = 4 than at G = 1. The reviews are cut at 60 characters (a prompt is the template's 44
    tokens and a review's first 60 characters) and the model runs in bfloat16 where this CPU has it natively (the GPU
    benchmark's dtype) to keep the test short: neither changes a count (one attention call per layer whatever the
    widths; docs/results/engine-benchmarks.md has the full-length bfloat16 figures, 1,167 against 1,114, the counts
    this test gets at 60 and at 200 characters in float32 and in bfloat16)."""
    import csv

    from invink_audit.models import cpu_bfloat16_support, load_model

    with YELP.open(newline="", encoding="utf-8") as handle:
        pool = [r["text"][:60] for r in csv.DictReader(handle) if r["label1"] == "Business Category: Restaurants"]
    model = load_model(None, device="cpu", dtype="bfloat16" if cpu_bfloat16_support() else "float32")
    mechanism = MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=100, batch_size=7)
    counts = {}
    for texts in (1, 4):
        requests, _ = workload.encode_workload(model, get_preset("generic"), workload.workload_texts(pool, 7, texts))
        engine = Engine(model, mechanism, max_batch_rows=8 * texts, kv_layout="pool")
        counts[texts] = ops.count_decode_ops(engine, requests, steps=3)  # medians: the steps after the rows moved in
    assert counts[1].ratio <= 1.1 and counts[4].ratio <= 1.1, counts
    assert counts[4].engine <= counts[1].engine, counts


class _FakeModel:
    def __init__(self, dtype):
        self.dtype = dtype
        self.generation_config = types.SimpleNamespace(eos_token_id=2)
        self.config = types.SimpleNamespace(vocab_size=50)


def _fake_reference(monkeypatch, *, load_seconds=0.05, setup_seconds=0.05, step_seconds=0.002, eos_from_config=True):
    """A stand-in for ``invink.generate``: loads a model, does setup, then a tqdm loop over texts, each stopped
    one token early by end-of-sequence (as it does: while its model's ``generation_config`` names an end-of-sequence
    id; ``eos_from_config=False``: whatever the config says)."""
    import torch

    module = types.ModuleType("invink.generate")
    calls = []

    def load_hf_model(name_or_path, dtype=None, device_map=None, **kwargs):
        time.sleep(load_seconds)
        return _FakeModel(torch.float32 if dtype == "float32" else torch.float16)

    def tqdm(iterable):
        return iter(iterable)

    def generate(texts, *, num, max_toks, batch_size, dtype="bfloat16", device_map="auto", **kwargs):
        calls.append(dict(texts=list(texts), num=num, max_toks=max_toks, batch_size=batch_size, dtype=dtype,
                          device_map=device_map, **kwargs))
        model = module.load_hf_model(kwargs["model_name_or_path"], dtype=dtype, device_map=device_map)
        time.sleep(setup_seconds)
        stops = model.generation_config.eos_token_id < model.config.vocab_size or not eos_from_config
        lens = []
        for _ in module.tqdm(range(num)):
            for _step in range(max_toks - stops):  # each text stops one token early (end-of-sequence)
                time.sleep(step_seconds)
            lens.append(max_toks - stops)
        return types.SimpleNamespace(lens=lens)

    module.load_hf_model, module.tqdm, module.generate = load_hf_model, tqdm, generate
    monkeypatch.setitem(sys.modules, "invink.generate", module)
    monkeypatch.setitem(sys.modules, "invink", types.ModuleType("invink"))
    return calls


def test_time_reference_times_only_the_decode_loop_of_the_same_workload(monkeypatch):
    calls = _fake_reference(monkeypatch, load_seconds=0.2, setup_seconds=0.2, step_seconds=0.004)
    refs = ["alpha", "beta", "gamma"]
    timing = time_reference("/model", batch_size=2, max_new_tokens=6, num_texts=2, references=refs)
    (call,) = calls
    assert call["batch_size"] == 3 and call["num"] == 2 and call["max_toks"] == 6
    assert call["texts"] == ["alpha", "beta", "gamma", "alpha"]  # G*B references, the pool cycled
    assert call["drop_empty"] is False and call["allow_download"] is False
    assert call["dtype"] == "bfloat16" and call["device_map"] == "auto"  # its shipped defaults, untouched
    assert timing.tokens == 2 * 5 and timing.configuration == "shipped" and timing.dtype == "float16"
    # the loop slept 10 x 4 ms; loading (0.2 s) and setup (0.2 s) are not in it
    assert 0.04 <= timing.seconds < 0.2
    assert timing.token_seconds == pytest.approx(timing.seconds / timing.tokens)
    assert timing.setup_seconds >= 0.2
    assert sys.modules["invink.generate"].tqdm.__name__ == "tqdm"  # patches undone


def test_time_reference_can_match_our_dtype_and_device(monkeypatch):
    calls = _fake_reference(monkeypatch)
    timing = time_reference("/model", batch_size=2, max_new_tokens=3, dtype="float32", device_map=-1)
    assert calls[0]["dtype"] == "float32" and calls[0]["device_map"] == -1
    assert timing.dtype == "float32" and timing.configuration == "dtype=float32, device_map=-1"


def test_time_reference_full_length_draws_every_token_or_says_it_could_not(monkeypatch):
    _fake_reference(monkeypatch)
    assert time_reference("/model", batch_size=2, max_new_tokens=4, num_texts=2).tokens == 2 * 3  # stops early
    assert time_reference("/model", batch_size=2, max_new_tokens=4, num_texts=2, stop_at_eos=False).tokens == 2 * 4
    _fake_reference(monkeypatch, eos_from_config=False)  # a version that stops some other way: no silent mismatch
    with pytest.raises(ValueError, match="drew 6 tokens, not 2 x 4"):
        time_reference("/model", batch_size=2, max_new_tokens=4, num_texts=2, stop_at_eos=False)


def test_cli_bench_checks_reference_options_before_the_long_run(monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("the benchmark must not start")

    monkeypatch.setattr(bench, "benchmark", never)
    assert main(["bench", "--reference", "--reference-config", "shipped,fast"]) == 2
    err = capsys.readouterr().err
    assert "--reference-config" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    monkeypatch.setitem(sys.modules, "invink", None)  # not importable
    assert main(["bench", "--reference"]) == 2
    err = capsys.readouterr().err
    assert "not importable" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ dtypes side by side


def test_benchmark_says_which_dtype_ran_and_why(tiny):
    result = benchmark(tiny, batch_size=2, max_new_tokens=3, num_texts=1, repeats=0, top_k=8,
                       one_at_a_time=False, floor=False)  # fmt: skip
    assert result.dtype_choice == tiny.dtype_choice
    assert result.to_json()["dtype_choice"]["reason"] == tiny.dtype_choice.reason
    assert f"  dtype                    {tiny.dtype_choice.reason}" in format_bench(result)


def test_compare_dtypes_alternates_the_dtypes_and_reports_what_auto_chooses(tiny_dir, monkeypatch):
    import torch

    import invink_audit.models as models

    monkeypatch.setattr(models, "cpu_bfloat16_support", lambda: "avx512_bf16")  # auto probes here
    order = []
    real = dtypes.workload_run

    def spy(engine, requests, max_new_tokens, device, **kwargs):
        order.append(engine.model.dtype)
        return real(engine, requests, max_new_tokens, device, **kwargs)

    monkeypatch.setattr(dtypes, "workload_run", spy)
    result = compare_dtypes(str(tiny_dir), batch_size=2, max_new_tokens=3, num_texts=2, rounds=3, top_k=8)
    f32, bf16 = torch.float32, torch.bfloat16
    assert order == [f32, bf16, bf16, f32, f32, bf16]  # each round reverses the last: load falls on both alike
    assert [run.dtype for run in result.runs] == ["float32", "bfloat16"] and result.rounds == 3
    assert result.auto.probe is not None and result.auto.requested == "auto"
    assert result.run(result.auto.dtype).choice == result.auto  # the dtype auto chose runs with auto's record
    assert result.run("float32" if result.auto.dtype == "bfloat16" else "bfloat16").choice.reason == "requested"
    for run in result.runs:
        assert len(run.seconds) == len(run.prefill_seconds) == len(run.tokens) == 3
        assert run.token_seconds == pytest.approx(sum(run.seconds) / sum(run.tokens))
    assert result.speedup() == pytest.approx(result.run("float32").token_seconds / result.run("bfloat16").token_seconds)
    report = result.to_json()
    assert report["bfloat16_speedup_per_token"] == pytest.approx(result.speedup())
    assert report["auto"]["probe"]["positions"] == result.auto.probe.positions
    for bad, match in ((dict(dtypes=("float32", "fp32")), "distinct"), (dict(dtypes=("auto", "float32")), "not 'auto'"),
                       (dict(rounds=0), "rounds")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            compare_dtypes(str(tiny_dir), **bad)
    with pytest.raises(ValueError, match="LoadedModel"):
        compare_dtypes(build_tiny_model(seed=3))


def test_cli_bench_compare_dtypes_reports_both_dtypes_and_the_reference_in_each(tiny_dir, monkeypatch, capsys):
    import json

    calls = _fake_reference(monkeypatch)
    args = ["bench", "--compare-dtypes", "--model", str(tiny_dir), "--batch-size", "2", "--max-new-tokens", "3",
            "--num-texts", "1", "--rounds", "1", "--top-k", "8"]  # fmt: skip
    assert main([*args, "--reference", "--reference-config", "matched"]) == 0
    out = capsys.readouterr().out
    assert "--dtype auto chooses" in out and "bfloat16 speedup" in out
    rows = [line.split() for line in out.splitlines()]
    assert [row[0] for row in rows if len(row) > 1 and row[0] in ("float32", "bfloat16") and row[1][0].isdigit()] == [
        "float32", "bfloat16"
    ]
    assert [call["dtype"] for call in calls] == ["float32", "bfloat16"]  # the reference matched to each of ours
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [run["dtype"] for run in report["runs"]] == ["float32", "bfloat16"] and report["auto"]["reason"]
    assert report["stop_at_eos"] is True
    calls.clear()  # --full-length reaches every run, ours and the reference's, and the report says so
    assert main([*args, "--full-length", "--reference", "--reference-config", "matched", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stop_at_eos"] is False and [run["tokens"] for run in report["runs"]] == [[3], [3]]
    assert [r["tokens"] for r in report["references"]] == [3, 3] and len(calls) == 2
    assert main([*args, "--full-length"]) == 0 and "every text to T (--full-length)" in capsys.readouterr().out


def test_cli_bench_full_length_reaches_our_runs_and_the_reference(tiny_dir, monkeypatch, capsys):
    import json

    _fake_reference(monkeypatch)  # stops each text one token early unless its end-of-sequence id was moved
    args = ["bench", "--model", str(tiny_dir), "--batch-size", "2", "--max-new-tokens", "8", "--num-texts", "3",
            "--top-k", "8", "--repeats", "0", "--no-floor", "--no-op-count", "--reference", "--reference-config",
            "matched", "--json"]  # fmt: skip
    assert main([*args, "--full-length"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stop_at_eos"] is False and report["workload_tokens"] == report["one_at_a_time_tokens"] == 3 * 8
    assert report["references"][0]["tokens"] == 3 * 8
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stop_at_eos"] is True and report["references"][0]["tokens"] == 3 * 7


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--rounds", "2"], "--rounds needs --compare-dtypes"),
        (["--compare-dtypes", "--rounds", "0"], "--rounds must be"),
        (["--compare-dtypes", "--dtype", "float32"], "leave --dtype at auto"),
    ],
)
def test_cli_bench_compare_dtypes_options_are_checked_before_loading(extra, match, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("nothing may load")

    monkeypatch.setattr(bench, "benchmark", never)
    monkeypatch.setattr(dtypes, "compare_dtypes", never)
    assert main(["bench", *extra]) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


# ------------------------------------------------------------------ where the harness lives


def test_the_harness_is_not_in_the_installed_package():
    import invink_audit

    assert BENCHMARKS.parent == __import__("pathlib").Path(invink_audit.__file__).resolve().parents[1]
    assert bench.__file__.startswith(str(BENCHMARKS)) and not hasattr(invink_audit, "benchmark")
    with pytest.raises(ModuleNotFoundError):
        __import__("invink_audit.bench")


def test_cli_bench_without_a_source_checkout_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    import invink_audit.cli._bench as command

    monkeypatch.setattr(command, "BENCHMARKS", tmp_path / "benchmarks")  # as in a wheel: no benchmarks/ beside it
    assert main(["bench", "--no-floor"]) == 2
    err = capsys.readouterr().err
    assert "bench needs a source checkout" in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------ the paper-claims script's verdict lines


def test_paper_claims_summary_reads_the_best_and_the_cheapest_equal_point_and_says_why_none():
    from invink_audit.evaluation.profile import ComputeRatio, ProfileConfig
    from invink_audit.evaluation.stats import Interval

    claims = harness("paper_claims")
    config = ProfileConfig(epsilons=(1.0, 10.0), batch_sizes=(15, 31, 63), top_ks=(None,), max_new_tokens=32,
                           mechanisms=("invisibleink", "amin-paper"))  # the paper's sensitivities: 16 rows feasible
    amin = {p.batch_size: p for p in config.points() if p.mechanism == "amin-paper"}
    assert set(amin) == {15, 31, 63} and {p.epsilon for p in amin.values()} == {10.0}  # ε = 1: none feasible

    def ratio(b, gain, ratio, below):
        return ComputeRatio(amin[b], Interval(*gain, 0.95, "t"), Interval(b + 1, b + 1, b + 1, 0.95, "t"),
                            Interval(2.2, 2.0, 2.7, 0.95, "t"), Interval(*ratio, 0.95, "t"), below, 0.0)

    compute = (ratio(15, (0.035, 0.024, 0.048), (7.4, 5.9, 8.0), 0.26),  # the page's figures (paper-claims.md)
               ratio(31, (0.039, 0.029, 0.051), (13.8, 10.3, 16.0), 0.09),
               ratio(63, (0.040, 0.029, 0.052), (27.2, 11.7, 32.0), 0.07))
    lines = claims.summary(types.SimpleNamespace(config=config, compute=compute))
    assert lines[0] == ("- ε = 1, amin-paper: undecided: no feasible B + 1 up to 64 (the planner finds no clip norm), "
                        "nothing to compare")
    assert "at its best gain (B + 1 = 64" in lines[1] and "reproduced: the ratio's lower end 11.70 >= 8" in lines[1]
    assert "at its cheapest point of equal gain (B + 1 = 16" in lines[2] and "contains 8" in lines[2]
    assert len(lines) == 3
    below_floor = claims.verdict(Interval(32.0, 32.0, 32.0, 0.95, "t"), 1.0, 0.95, -0.111)  # the page's ε = 3, correct
    assert below_floor.startswith("no ratio at equal utility: the baseline is below the public floor")
    no_full = dataclasses.replace(config, epsilons=(10.0,), top_ks=(100,))  # InvisibleInk: no full-vocabulary point
    assert claims.summary(types.SimpleNamespace(config=no_full, compute=())) == [
        "- ε = 10, amin-paper: undecided: InvisibleInk has no full-vocabulary point at this ε, nothing to compare"]
