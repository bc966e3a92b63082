"""Scale-out launches and merges: each test reproduces a defect a review of the scale-out code found.

1. processes launched with other settings than rank 0 are refused before the charge (privacy);
2. a stop between a text's claim and its record loses nothing (the journal carries the record), in a
   worker thread too (where Ray Data runs a callable class);
3. a merge leaves a shard that a live process still writes alone, and loses none of its records;
4. a reopened shard drops its torn tail before appending;
5. a stop between the ledger charge and the resume state does not charge the rerun again.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import invink_audit.generation as generation_module
from accounting import BudgetLedger
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
    start_output,
)
from releases import generate_flat


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    path = tmp_path_factory.mktemp("review") / "refs.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        for i in range(12):
            writer.writerow([f"Review {i}: the soup was {'great' if i % 2 else 'cold'}."])
    return path


def _started(tmp_path, num_batches=6):
    output = tmp_path / "out.jsonl"
    state = inspect_output(output, "fp", num_batches)
    start_output(output, state, "fp", {"x": 1})
    return output, state.release_id


def _record(index, release):
    return {"batch_index": index, "text": "t", "release_id": release, "run": {"x": 1}}


# ------------------------------------------------------------------------------------------------
# 1. processes are never checked to run the release rank 0 admitted (privacy)

NODE = """
import os, sys
args = sys.argv[1:]
if os.environ.get("RANK") == "1":  # a second machine launched with another command line
    i = args.index("--seed"); del args[i:i + 2]
    args[args.index("--epsilon") + 1] = "80"
from invink_audit.cli import main
sys.exit(main(args))
"""


@pytest.mark.slow
def test_a_process_launched_with_other_settings_is_refused(tiny_dir, refs, tmp_path):
    worker = tmp_path / "node.py"
    worker.write_text(NODE)
    output = tmp_path / "mixed.jsonl"
    args = ["generate", "--input", str(refs), "--output", str(output), "--batch-size", "3", "--max-new-tokens", "4",
            "--delta", "1e-6", "--epsilon", "8", "--model", str(tiny_dir), "--top-k", "20", "--no-progress",
            "--json", "--device", "cpu", "--seed", "7"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    records = read_generation_output(output) if output.exists() else []
    # a seeded release must never write a guarantee, and the processes must run one configuration
    assert not [r["batch_index"] for r in records if r["run"]["seeded"] and r["guarantee"] is not None]
    assert done.returncode != 0
    assert "launched with other settings" in done.stderr and records == []  # refused before anything was drawn


# ------------------------------------------------------------------------------------------------
# 2. a stop between the claim and the write, in a worker thread (where Ray Data runs a callable class)

THREADED_CLAIM = """
import os, signal, sys, threading
from pathlib import Path
from invink_audit.outputs import Journal, RecordSink, journal_path, release_text, shard_path
out = Path(sys.argv[1])
journal_path(out).write_bytes(b"")
class Sink(RecordSink):
    def write_many(self, records):
        os.kill(os.getpid(), signal.SIGTERM)  # a polite stop between the claim and the write
        super().write_many(records)
def work():  # Ray Data calls a callable class from a ThreadPoolExecutor thread (make_callable_class_single_threaded)
    with Sink(shard_path(out, "a", 0), lock=True) as sink:
        release_text(Journal(out, "r", 4), sink, 1, {"batch_index": 1, "text": "x", "release_id": "r"})
thread = threading.Thread(target=work)
thread.start()
thread.join()
"""


def test_a_stop_between_claim_and_write_loses_nothing_in_a_worker_thread(tmp_path):
    output = tmp_path / "o.jsonl"
    subprocess.run([sys.executable, "-c", THREADED_CLAIM, str(output)], timeout=120, capture_output=True)
    lines = [json.loads(line) for line in journal_path(output).read_text().splitlines()]
    assert [line["batch_index"] for line in lines] == [1]
    assert read_generation_output(shard_path(output, "a", 0)) == []  # killed before the write
    assert lines[0]["record"] == {"batch_index": 1, "text": "x", "release_id": "r"}  # the journal holds it


# ------------------------------------------------------------------------------------------------
# 4. merge_shards folds and deletes a shard (and its lock file) that a live process still writes


def test_merge_leaves_a_shard_that_is_still_being_written_and_loses_none_of_its_records(tmp_path):
    output, release = _started(tmp_path)
    journal = Journal(output, release, 6)
    stray_path = shard_path(output, "old", 1)
    with RecordSink(stray_path, lock=True) as stray:
        assert release_text(journal, stray, 1, _record(1, release))
        assert merge_shards(output, release, 6) == 1  # batch 1 from the journal; the live shard untouched
        assert stray_path.exists()
        with pytest.raises(OutputInUseError):
            inspect_output(output, "fp", 6)  # a rerun waits for the stray
        release_text(journal, stray, 2, _record(2, release))  # it goes on writing
    state = inspect_output(output, "fp", 6)
    assert [r["batch_index"] for r in state.records] == [1, 2]
    assert merge_shards(output, release, 6) == 2 and not stray_path.exists()
    assert Path(str(stray_path) + ".lock").exists()  # lock files are never removed


# ------------------------------------------------------------------------------------------------
# 5. a reopened shard is appended after a torn tail (a Ray actor reuses its shard across calls)


def test_a_reopened_shard_drops_its_torn_tail_before_appending(tmp_path):
    output, release = _started(tmp_path)
    shard = shard_path(output, "ray1", 0)
    shard.write_bytes((json.dumps(_record(0, release)) + "\n").encode() + b'{"batch_index": 1, "te')  # failed write
    with RecordSink(shard, lock=True) as sink:  # the actor's next call
        sink.write(_record(2, release))
    assert [r["batch_index"] for r in read_generation_output(shard)] == [0, 2]


# ------------------------------------------------------------------------------------------------
# 6. a failure between the ledger charge and the state file charges the rerun again


def test_a_failure_right_after_the_charge_does_not_charge_the_rerun_again(tiny, refs, tmp_path, monkeypatch):
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=100.0, delta=1e-5)
    output = tmp_path / "out.jsonl"
    options = dict(batch_size=3, max_new_tokens=2, delta=1e-6, epsilon=8.0, model=tiny, output=output, ledger=ledger)
    real = generation_module.start_output

    def crash(*args, **kwargs):
        raise OSError("disk full")  # or Ctrl-C / a kill right after the charge

    monkeypatch.setattr(generation_module, "start_output", crash)
    with pytest.raises(OSError):
        generate_flat(refs, **options)
    monkeypatch.setattr(generation_module, "start_output", real)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generate_flat(refs, **options)
    assert len(ledger.status().releases) == 1
    assert not (tmp_path / "out.jsonl.pending.json").exists()
