"""Scale-out: one release over many processes, keyed by batch, at most one text per batch.

Unit tests of the pieces (batch assignment, the first-wins journal across processes, shard merge,
deferred termination), then end-to-end runs under ``torchrun`` (gloo, CPU, the tiny model): 1, 2 and
3 processes give the same release; a process killed or failing midway and the command rerun gives
every batch exactly once, with the texts an uninterrupted run gives; a changed rerun is refused.
"""

from __future__ import annotations

import csv
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from invink_audit.distributed import Cluster, assign_batches, batch_cost
from invink_audit.outputs import (
    Journal,
    OutputInUseError,
    RecordSink,
    inspect_output,
    journal_path,
    merge_shards,
    read_generation_output,
    release_text,
    shard_path,
    shard_paths,
    start_output,
)

# ------------------------------------------------------------------------------------------------
# batch assignment


def _makespan(parts, costs):
    return max(sum(costs[i] for i in part) for part in parts)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_assignment_gives_every_batch_to_exactly_one_rank_deterministically(world):
    costs = {i: (i * 37) % 11 + 1 for i in range(23)}
    parts = assign_batches(costs, world)
    assert len(parts) == world
    assert sorted(i for part in parts for i in part) == list(range(23))
    assert all(part == sorted(part) for part in parts)
    assert assign_batches(dict(reversed(list(costs.items()))), world) == parts  # input order does not matter


def test_assignment_is_within_graham_bound_of_the_best_by_brute_force():
    # LPT is within 4/3 - 1/(3m) of the optimal makespan (Graham 1969); brute force over all assignments
    for costs_list in ([7, 5, 4, 3, 3, 2], [10, 1, 1, 1, 1, 1, 1], [3, 3, 2, 2, 2]):
        costs = dict(enumerate(costs_list))
        for world in (2, 3):
            best = min(
                _makespan([[i for i, r in enumerate(choice) if r == rank] for rank in range(world)], costs)
                for choice in itertools.product(range(world), repeat=len(costs))
            )
            got = _makespan(assign_batches(costs, world), costs)
            assert got <= (4 / 3 - 1 / (3 * world)) * best + 1e-9


def test_long_tailed_batches_are_balanced_not_dealt_round_robin():
    # one 1,000-token batch among 100-token ones: it gets a rank nearly to itself
    costs = {i: batch_cost([100] * 4, 64) for i in range(9)}
    costs[3] = batch_cost([1000] * 4, 64)
    parts = assign_batches(costs, 2)
    heavy = next(part for part in parts if 3 in part)
    assert len(heavy) < len(next(part for part in parts if 3 not in part))
    assert _makespan(parts, costs) < _makespan([list(range(0, 9, 2)), list(range(1, 9, 2))], costs)


def test_assignment_rejects_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        assign_batches({0: 1.0}, 0)


def test_a_single_process_cluster_communicates_nothing():
    cluster = Cluster()
    assert not cluster.distributed and cluster.is_main
    assert cluster.broadcast(5) == 5 and cluster.gather(6) == [6]
    assert cluster.lead(lambda: 7) == 7
    cluster.agree(None)
    with pytest.raises(KeyError):
        cluster.agree(KeyError("x"))


def _cluster_then_shutdown(rank: int, port: int, queue) -> None:
    os.environ.update({"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    import torch.distributed as dist

    from invink_audit.distributed import current_cluster, shutdown

    cluster = current_cluster()
    gathered = cluster.gather(rank)
    first = shutdown()
    second = shutdown()  # the second call (the atexit handler after the CLI's) is a no-op
    queue.put((rank, gathered, dist.is_initialized(), first, second))


def test_the_process_group_the_cluster_created_is_destroyed_by_shutdown():
    # a gloo group left to interpreter finalisation aborted a rank after a complete release (SIGABRT,
    # "terminate called without an active exception", pytorch/pytorch#190489): the CLI destroys it, then
    # ends the process with os._exit (every torchrun test below fails on a "terminate called")
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_cluster_then_shutdown, args=(rank, port, queue)) for rank in range(2)]
    for worker in workers:
        worker.start()
    results = sorted(queue.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=60)
    assert results == [(0, [0, 1], False, True, False), (1, None, False, True, False)]
    assert [worker.exitcode for worker in workers] == [0, 0]


def test_shutdown_leaves_a_process_group_the_caller_created(tmp_path, monkeypatch):
    import torch.distributed as dist

    import invink_audit.distributed as distributed
    from invink_audit.distributed import current_cluster, shutdown

    monkeypatch.setattr(distributed, "_CLUSTER", None)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert current_cluster().world_size == 1
        assert shutdown() is False
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# the journal: first claim wins, across processes


def _claim_all(output: str, release_id: str, indices, queue) -> None:
    journal = Journal(Path(output), release_id, 64)
    queue.put([i for i in indices if journal.claim(i)])


def test_each_batch_is_claimed_by_exactly_one_of_several_racing_processes(tmp_path):
    output = tmp_path / "out.jsonl"
    journal_path(output).write_bytes(b"")
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    orders = [list(range(64)), list(reversed(range(64))), list(range(0, 64, 2)) + list(range(1, 64, 2))]
    workers = [context.Process(target=_claim_all, args=(str(output), "r1", order, queue)) for order in orders]
    for worker in workers:
        worker.start()
    won = [queue.get(timeout=60) for _ in workers]
    for worker in workers:
        worker.join(timeout=60)
    assert sorted(i for part in won for i in part) == list(range(64))  # every batch once, none twice
    lines = [json.loads(line) for line in journal_path(output).read_text().splitlines()]
    assert sorted(e["batch_index"] for e in lines) == list(range(64))


def test_a_torn_journal_line_is_cut_and_its_batch_can_be_claimed(tmp_path):
    output = tmp_path / "out.jsonl"
    journal_path(output).write_bytes(b'{"batch_index": 0, "release_id": "r"}\n{"batch_in')
    journal = Journal(output, "r", 4)
    assert not journal.claim(0)
    assert journal.claim(1)
    assert [json.loads(x)["batch_index"] for x in journal_path(output).read_text().splitlines()] == [0, 1]
    other = Journal(output, "r", 4)  # a second process sees the first one's claims
    assert not other.claim(1) and other.claim(2)
    assert not journal.claim(2)


def test_a_lost_claim_writes_nothing(tmp_path):
    output = tmp_path / "out.jsonl"
    journal_path(output).write_bytes(b"")
    first, second = Journal(output, "r", 4), Journal(output, "r", 4)
    with RecordSink(shard_path(output, "a", 0), lock=True) as a, RecordSink(shard_path(output, "a", 1), lock=True) as b:
        assert release_text(first, a, 2, {"batch_index": 2, "text": "first"})
        assert not release_text(second, b, 2, {"batch_index": 2, "text": "second"})
    assert read_generation_output(shard_path(output, "a", 0)) == [{"batch_index": 2, "text": "first"}]
    assert read_generation_output(shard_path(output, "a", 1)) == []


# ------------------------------------------------------------------------------------------------
# shards: merge, resume, refusal


def _record(index, text="t", release="rel"):
    return {"batch_index": index, "text": text, "release_id": release, "run": {"x": 1}}


def _started(tmp_path, num_batches=6):
    output = tmp_path / "out.jsonl"
    state = inspect_output(output, "fp", num_batches)
    start_output(output, state, "fp", {"x": 1})
    return output, state.release_id


def test_shards_merge_into_the_output_ordered_by_batch_and_atomically(tmp_path):
    output, release = _started(tmp_path)
    journal = Journal(output, release, 6)
    with RecordSink(shard_path(output, "a", 0), lock=True) as s0, RecordSink(shard_path(output, "a", 1), lock=True) as s1:
        for index, sink in ((4, s0), (1, s1), (0, s0), (5, s1)):
            assert release_text(journal, sink, index, _record(index, release=release))
    state = inspect_output(output, "fp", 6)
    assert [r["batch_index"] for r in state.records] == [0, 1, 4, 5] and len(state.shards) == 2
    assert merge_shards(output, release, 6) == 4
    assert [r["batch_index"] for r in read_generation_output(output)] == [0, 1, 4, 5]
    assert shard_paths(output) == [] and Path(str(shard_path(output, "a", 0)) + ".lock").exists()  # locks stay


def test_a_merge_interrupted_before_removing_shards_is_merged_again(tmp_path):
    output, release = _started(tmp_path)
    shard = shard_path(output, "a", 0)
    shard.write_text(json.dumps(_record(2, release=release)) + "\n")
    output.write_text(json.dumps(_record(2, release=release)) + "\n")  # the replace happened, the unlink did not
    assert [r["batch_index"] for r in inspect_output(output, "fp", 6).records] == [2]
    assert merge_shards(output, release, 6) == 1 and not shard.exists()


def test_two_different_texts_for_one_batch_are_refused_not_chosen(tmp_path):
    output, release = _started(tmp_path)
    shard_path(output, "a", 0).write_text(json.dumps(_record(2, "one", release)) + "\n")
    shard_path(output, "b", 0).write_text(json.dumps(_record(2, "two", release)) + "\n")
    with pytest.raises(ValueError, match="two different texts for batch 2"):
        inspect_output(output, "fp", 6)
    with pytest.raises(ValueError, match="two different texts for batch 2"):
        merge_shards(output, release, 6)


def test_a_shard_still_being_written_blocks_a_rerun(tmp_path):
    output, release = _started(tmp_path)
    with RecordSink(shard_path(output, "a", 1), lock=True):
        with pytest.raises(OutputInUseError, match="still writing"):
            inspect_output(output, "fp", 6)
    inspect_output(output, "fp", 6)


def test_shards_without_resume_state_are_refused(tmp_path):
    output = tmp_path / "out.jsonl"
    shard_path(output, "a", 0).write_text(json.dumps(_record(0)) + "\n")
    with pytest.raises(ValueError, match="shard files .* resume state"):
        inspect_output(output, "fp", 6)


# ------------------------------------------------------------------------------------------------
# end to end under torchrun (gloo, CPU)

NUM_REFERENCES = 40
BATCH_SIZE = 3
WORKER = '''
import os, sys
import invink_audit.outputs as outputs
mode, rank, after = os.environ.get("FAULT_MODE"), int(os.environ.get("RANK", "0")), int(os.environ.get("FAULT_AFTER", "0"))
if mode and rank == int(os.environ["FAULT_RANK"]):
    real, count = outputs.RecordSink.write_many, [0]
    def write_many(self, records):
        real(self, records)
        count[0] += len(records)
        if count[0] >= after:
            if mode == "kill":
                os._exit(17)
            raise RuntimeError("injected failure")
    outputs.RecordSink.write_many = write_many
from invink_audit.cli import main
sys.exit(main(sys.argv[1:]))
'''


@pytest.fixture(scope="module")
def workload(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("scaleout")
    refs = root / "refs.csv"
    with refs.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        for i in range(NUM_REFERENCES):
            # long-tailed: every seventh reference is ten times longer
            writer.writerow([f"Review {i}: the soup was {'great' if i % 2 else 'cold'}. " * (10 if i % 7 == 0 else 1)])
    worker = root / "worker.py"
    worker.write_text(WORKER)
    return root, refs, worker


def _launch(workload, tiny_dir, output, processes, *, extra=(), fault=None, seed="7"):
    root, refs, worker = workload
    args = [
        "generate", "--input", str(refs), "--output", str(output), "--batch-size", str(BATCH_SIZE),
        "--max-new-tokens", "8", "--delta", "1e-6", "--epsilon", "8", "--model", str(tiny_dir), "--top-k", "20",
        "--no-progress", "--json", "--device", "cpu", *extra,
    ]  # fmt: skip
    if seed is not None:
        args += ["--seed", seed]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("FAULT_MODE", None)
    if fault is not None:
        env.update({"FAULT_MODE": fault[0], "FAULT_RANK": str(fault[1]), "FAULT_AFTER": str(fault[2])})
    if processes == 1:
        command = [sys.executable, str(worker), *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                   str(worker), *args]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert "terminate called" not in done.stderr, done.stderr[-3000:]  # a rank aborted at exit
    return done


def _texts(output):
    return [(r["batch_index"], r["token_ids"], r["text"]) for r in read_generation_output(output)]


@pytest.fixture(scope="module")
def single(workload, tiny_dir):
    output = workload[0] / "single.jsonl"
    done = _launch(workload, tiny_dir, output, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    return _texts(output)


@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 3])
def test_several_processes_release_what_one_process_releases(workload, tiny_dir, single, processes):
    output = workload[0] / f"p{processes}.jsonl"
    done = _launch(workload, tiny_dir, output, processes)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _texts(output) == single  # same batches, token ids, texts, in batch order
    assert len(single) == NUM_REFERENCES // BATCH_SIZE
    summary = json.loads(done.stdout.strip().splitlines()[-1])  # rank 0 alone prints
    assert [p["rank"] for p in summary["processes"]] == list(range(processes))
    assert sum(p["texts"] for p in summary["processes"]) == len(single)
    assert shard_paths(output) == []
    journal = [json.loads(x)["batch_index"] for x in journal_path(output).read_text().splitlines()]
    assert sorted(journal) == list(range(len(single)))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "rerun_processes"),
    [(("kill", 1, 2), 3), (("raise", 0, 1), 1)],  # a rerun on more processes, and on fewer
    ids=["killed-rerun-on-3", "failed-rerun-alone"],
)
def test_a_failed_process_and_a_rerun_give_every_batch_exactly_once(workload, tiny_dir, single, fault, rerun_processes):
    output = workload[0] / f"fault-{fault[0]}-{rerun_processes}.jsonl"
    ledger = workload[0] / f"ledger-{fault[0]}-{rerun_processes}.json"
    created = subprocess.run(
        [sys.executable, "-m", "invink_audit.cli", "ledger", "init", str(ledger), "--epsilon", "100", "--delta", "1e-5"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert created.returncode == 0, created.stderr
    # one text at a time per process (B + 1 rows): each step releases one text, so the fault falls midway
    one_at_a_time = ("--max-batch-rows", str(BATCH_SIZE + 1))
    failed = _launch(workload, tiny_dir, output, 2, fault=fault, extra=("--ledger", str(ledger), *one_at_a_time))
    assert failed.returncode != 0
    if fault[0] == "raise":
        assert "incomplete" in failed.stderr and "injected failure" in failed.stderr
    # released so far: records in the output and shards, and records only the journal holds (a process
    # stopped between its claim and its write); the rerun restores the latter, never redraws them
    journaled = [json.loads(x) for x in journal_path(output).read_text().splitlines()]
    partial = {r["batch_index"] for r in read_generation_output(output)}
    partial |= {r["batch_index"] for s in shard_paths(output) for r in read_generation_output(s)}
    partial |= {e["batch_index"] for e in journaled if e.get("record") is not None}
    assert 0 < len(partial) < len(single)
    done = _launch(workload, tiny_dir, output, rerun_processes, extra=("--ledger", str(ledger)))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["resumed"] == len(partial)
    assert _texts(output) == single  # every batch once, each the text an uninterrupted run gives
    assert shard_paths(output) == []
    journal = [json.loads(x)["batch_index"] for x in journal_path(output).read_text().splitlines()]
    assert sorted(journal) == list(range(len(single)))  # no batch sampled twice
    releases = json.loads(ledger.read_text())["releases"]
    assert len(releases) == 1  # charged once, by rank 0, for the whole release


@pytest.mark.slow
def test_a_rerun_with_other_settings_is_refused_on_any_number_of_processes(workload, tiny_dir, single):
    output = workload[0] / "changed.jsonl"
    failed = _launch(workload, tiny_dir, output, 2, fault=("kill", 1, 1), extra=("--max-batch-rows", str(BATCH_SIZE + 1)))
    assert failed.returncode != 0
    before = {p.name: p.read_bytes() for p in workload[0].glob("changed.jsonl*")}
    for processes in (1, 2):
        refused = _launch(workload, tiny_dir, output, processes, extra=("--temperature", "1.5"))
        # every process exits with status 2 (bad input); torchrun itself reports a failed job with 1
        assert refused.returncode == (2 if processes == 1 else 1), refused.stderr[-2000:]
        assert refused.stderr.count("different settings (clip_norm, temperature)") == processes
    assert {p.name: p.read_bytes() for p in workload[0].glob("changed.jsonl*")} == before  # nothing touched


@pytest.mark.slow
def test_unseeded_processes_share_one_os_drawn_key_that_never_reaches_the_disk(workload, tiny_dir):
    outputs = [workload[0] / f"unseeded-{i}.jsonl" for i in range(2)]
    for output in outputs:
        done = _launch(workload, tiny_dir, output, 2, seed=None)
        assert done.returncode == 0, done.stderr[-3000:]
    first, second = (_texts(o) for o in outputs)
    assert [t[0] for t in first] == list(range(NUM_REFERENCES // BATCH_SIZE))
    assert first != second  # a fresh key per release
    state = json.loads((workload[0] / "unseeded-0.jsonl.state.json").read_text())
    assert set(state) == {"version", "release_id", "input_sha256", "run"} and state["run"]["seeded"] is False


@pytest.mark.slow
def test_accelerate_launch_runs_the_same_release(workload, tiny_dir, single):
    accelerate = Path(sys.executable).with_name("accelerate")
    if not accelerate.exists():
        pytest.skip("accelerate is not installed")
    root, refs, worker = workload
    output = root / "accelerate.jsonl"
    args = [
        "generate", "--input", str(refs), "--output", str(output), "--batch-size", str(BATCH_SIZE),
        "--max-new-tokens", "8", "--delta", "1e-6", "--epsilon", "8", "--model", str(tiny_dir), "--top-k", "20",
        "--no-progress", "--json", "--device", "cpu", "--seed", "7",
    ]  # fmt: skip
    # `--multi_gpu` is accelerate's torchrun path; with `--device cpu` it runs gloo processes on CPU
    command = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0",
               "-m", "invink_audit.cli", *args]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _texts(output) == single
    assert len(json.loads(done.stdout.strip().splitlines()[-1])["processes"]) == 2


@pytest.mark.slow
def test_bench_reports_each_process_and_the_total(workload, tiny_dir):
    root = workload[0]
    args = ["-m", "invink_audit.cli", "bench", "--model", str(tiny_dir), "--num-texts", "6", "--batch-size", "3",
            "--max-new-tokens", "8", "--device", "cpu", "--json", "--repeats", "0", "--no-one-at-a-time", "--no-floor"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    alone = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert alone.returncode == 0, alone.stderr[-2000:]
    shared = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args],
        env=env, capture_output=True, text=True, timeout=300, cwd=root,
    )  # fmt: skip
    assert shared.returncode == 0, shared.stderr[-2000:]
    one, two = json.loads(alone.stdout.strip().splitlines()[-1]), json.loads(shared.stdout.strip().splitlines()[-1])
    assert one["processes"] == [] and [p["rank"] for p in two["processes"]] == [0, 1]
    assert sum(p["texts"] for p in two["processes"]) == 6
    assert two["workload_tokens"] == one["workload_tokens"]  # the same texts, each from its own stream
    assert two["workload_seconds"] == max(p["seconds"] for p in two["processes"])


AUDIT_SPEC = """
name = "tiny-split"
kind = "white-box"
[model]
name = "{model}"
[data]
inline = ["The soup was cold and the waiter rude.", "Great tacos, friendly staff, long wait.", "Never again."]
[mechanism]
batch_size = 4
max_new_tokens = 5
temperature = 1.0
top_k = 20
clip_norm = 1.0
delta = 1e-6
[canaries]
secret = 0
[audit]
alphas = [2.0]
num_samples = 8
num_is_samples = 2
neighbours = [0, 1]
directions = ["forward", "reverse"]
min_samples = 8
"""


def _assert_same_numbers(one, two, path=""):
    """Equal structure and values; floats to 1e-9 relative (per-text log-probabilities are summed in another
    batch composition, so their last bits may differ); timings, notes on timings, the location of the worst prefix
    (a near-tie) and the count of checks within the float64 rounding tolerance (those last bits) excluded."""
    if isinstance(one, dict):
        drop = {"timings", "processes", "check_seconds", "notes", "text", "step", "neighbour", "prefix"}
        keys = set(one) - drop if path.endswith("worst_prefix") else set(one) - {"timings", "processes", "notes"}
        if path.endswith("model_dtype/probe"):
            keys -= {"seconds"}  # the dtype probe's wall clock (each process measured its own)
        if path.endswith("step_checks/numerics"):
            keys -= {"within_tolerance"}  # excesses of float64 rounding (InvisibleInk's range meets its claim exactly)
            assert bool(sum(one["within_tolerance"].values())) == bool(sum(two["within_tolerance"].values())), path
        assert keys <= set(two), path
        for key in keys:
            _assert_same_numbers(one[key], two[key], f"{path}/{key}")
    elif isinstance(one, list):
        assert len(one) == len(two), path
        for i, (a, b) in enumerate(zip(one, two)):
            _assert_same_numbers(a, b, f"{path}[{i}]")
    elif isinstance(one, float):
        assert two == pytest.approx(one, rel=1e-9, abs=1e-12), path
    else:
        assert one == two, path


@pytest.mark.slow
def test_a_sampled_audit_split_over_processes_gives_the_numbers_of_one_process(workload, tiny_dir):
    root = workload[0]
    spec = root / "tiny_split.toml"
    spec.write_text(AUDIT_SPEC.format(model=tiny_dir))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    reports = {}
    for processes in (1, 2):
        args = ["-m", "invink_audit.cli", "audit", str(spec), "--seed", "11", "--json", "--no-plots"]
        launcher = [] if processes == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        command = [sys.executable, *launcher, *args]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=root)
        assert done.returncode in (0, 1), done.stderr[-3000:]
        reports[processes] = json.loads(done.stdout)  # rank 0 alone prints
    one, two = reports[1], reports[2]
    assert one["verdict"] == two["verdict"]
    assert two["settings"]["processes"] == 2 and one["settings"]["processes"] == 1
    _assert_same_numbers(one, two)


def test_a_launched_process_ends_through_exit_process_even_on_an_unexpected_error(monkeypatch, capsys):
    # an error that escapes the command on a launched rank must not fall into interpreter finalisation
    # (where the collective library's threads can abort it): it is printed, and the process exits with 1
    import invink_audit.cli as cli
    import invink_audit.distributed as distributed

    class Exited(Exception):
        pass

    def fake_exit(status):
        raise Exited(status)

    def failing(argv):
        raise RuntimeError("a collective failed")

    monkeypatch.setattr(distributed, "shutdown", lambda: True)
    monkeypatch.setattr(distributed, "exit_process", fake_exit)
    monkeypatch.setattr(cli, "_run", failing)
    with pytest.raises(Exited) as ended:
        cli.main(["generate"])
    assert ended.value.args == (1,) and "a collective failed" in capsys.readouterr().err
    monkeypatch.setattr(cli, "_run", lambda argv: 0)
    with pytest.raises(Exited) as ended:
        cli.main(["generate"])
    assert ended.value.args == (0,)
    monkeypatch.setattr(distributed, "shutdown", lambda: False)  # not launched: errors propagate as before
    monkeypatch.setattr(cli, "_run", failing)
    with pytest.raises(RuntimeError, match="a collective failed"):
        cli.main(["generate"])
