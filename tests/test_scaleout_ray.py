"""Scale-out on Ray: the same release as a Ray Data pipeline, on CPU.

``ray.init(num_cpus=2)`` and the tiny model: the Ray release equals the single-process one for a fixed
seed (one ledger charge, one output file ordered by batch); a retried task never releases a second
text for a batch; bad input is refused before anything is charged.
"""

from __future__ import annotations

import csv
import json
import warnings

import pytest

from accounting import BudgetLedger
from invink_audit.generation import ExternalRelease, generate, generate_texts, prepare_release
from invink_audit.mechanism import derive_key
from invink_audit.outputs import journal_path, read_generation_output, shard_paths
from releases import call_flat

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow

NUM_REFERENCES = 40
OPTIONS = dict(batch_size=3, max_new_tokens=8, delta=1e-6, epsilon=8.0, top_k=20, seed=7, device="cpu")


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    path = tmp_path_factory.mktemp("ray") / "refs.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        for i in range(NUM_REFERENCES):
            writer.writerow([f"Review {i}: the soup was {'great' if i % 2 else 'cold'}. " * (10 if i % 7 == 0 else 1)])
    return path


@pytest.fixture(scope="module")
def cluster():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _texts(output):
    return [(r["batch_index"], r["token_ids"], r["text"]) for r in read_generation_output(output)]


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def test_a_ray_release_equals_the_single_process_release(cluster, tiny_dir, refs, tmp_path):
    from invink_audit.ray_release import generate_on_ray

    single = tmp_path / "single.jsonl"
    _quiet(call_flat, generate, refs, model=str(tiny_dir), output=single, **OPTIONS)
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=100.0, delta=1e-5)
    output = tmp_path / "ray.jsonl"
    result = _quiet(
        call_flat, generate_on_ray, refs, model=str(tiny_dir), output=output, ledger=ledger, concurrency=2, texts_per_call=4, **OPTIONS
    )
    assert _texts(output) == _texts(single)  # same texts, ordered by batch index
    assert [t.batch_index for t in result.texts] == list(range(NUM_REFERENCES // 3))
    assert len(ledger.status().releases) == 1 and shard_paths(output) == []
    again = _quiet(call_flat, generate_on_ray, refs, model=str(tiny_dir), output=output, ledger=ledger, concurrency=2, **OPTIONS)
    assert again.num_resumed == NUM_REFERENCES // 3 and again.tokens_generated == 0
    assert len(ledger.status().releases) == 1  # a resumed release is not charged again


def test_a_mechanism_release_on_ray_equals_the_single_process_one(cluster, tiny_dir, refs, tmp_path):
    """Amin et al. through the same Ray pipeline: same texts and modes as one process, one zCDP charge."""
    from invink_audit.generation import ModelSpec, ReleaseConfig
    from invink_audit.mechanisms import AminConfig, AminMechanism
    from invink_audit.ray_release import generate_on_ray

    config = ReleaseConfig(AminMechanism(AminConfig(clip_norm=2.0, batch_size=3, max_private_tokens=4, svt_noise=2.0)),
                              max_new_tokens=6, delta=1e-6, num_texts=6)
    model = ModelSpec(str(tiny_dir), device="cpu")
    single = tmp_path / "single.jsonl"
    _quiet(generate, refs, config, model=model, output=single, seed=7)
    ledger = BudgetLedger.create(tmp_path / "ledger.json", epsilon=1000.0, delta=1e-6)
    output = tmp_path / "ray.jsonl"
    _quiet(generate_on_ray, refs, config, model=model, output=output, ledger=ledger, seed=7, concurrency=2, texts_per_call=2)
    modes = [r["modes"] for r in read_generation_output(output)]
    assert _texts(output) == _texts(single) and modes == [r["modes"] for r in read_generation_output(single)]
    entry = ledger.status().releases[0]
    assert entry["release"]["kind"] == "zcdp" and entry["rho"] == pytest.approx(config.guarantee().rho_sequence)


def test_a_retried_task_never_releases_a_second_text(tiny_dir, refs, tmp_path):
    # what Ray does when an actor dies after writing: the task runs again on another actor
    output = tmp_path / "retry.jsonl"
    external = ExternalRelease(_quiet(call_flat, prepare_release, refs, model=str(tiny_dir), output=output, **OPTIONS))
    try:
        todo = external.admit()
        state = external.worker_state()
        assert "key" not in state  # no key travels with the workers' arguments
        keys = {i: derive_key(2**100 + 7, i) for i in todo}  # what the key holder hands out, batch by batch
        loaded, engine = state["load"].build(state["mechanism"], "cpu")
        items = [(i, external.references(i)) for i in todo[:5]]
        first = list(generate_texts(state, loaded, engine, items, output.with_name("retry.jsonl.shard-a-0.jsonl"), keys))
        retried = list(generate_texts(state, loaded, engine, items[2:], output.with_name("retry.jsonl.shard-a-1.jsonl"),
                                      keys))
        rest = [(i, external.references(i)) for i in todo[5:]]
        with pytest.raises(ValueError, match="no stream key"):  # a worker without its batch's key draws nothing
            list(generate_texts(state, loaded, engine, rest, output.with_name("retry.jsonl.shard-a-3.jsonl"), {}))
        list(generate_texts(state, loaded, engine, rest, output.with_name("retry.jsonl.shard-a-2.jsonl"), keys))
        assert all(released for _, released, _ in first)
        assert [released for _, released, _ in retried] == [False, False, False]
        result = external.finish(1.0)
    finally:
        external.close()
    batches = [r["batch_index"] for r in read_generation_output(output)]
    assert batches == list(range(NUM_REFERENCES // 3)) and len(result.texts) == len(batches)
    journal = [json.loads(x)["batch_index"] for x in journal_path(output).read_text().splitlines()]
    assert sorted(journal) == batches


def test_ray_refuses_what_it_cannot_guard(tiny, tiny_dir, refs, tmp_path):
    from invink_audit.ray_release import generate_on_ray

    with pytest.raises(ValueError, match="needs an output file"):
        _quiet(call_flat, generate_on_ray, refs, model=str(tiny_dir), **OPTIONS)
    with pytest.raises(ValueError, match="not a LoadedModel"):
        _quiet(call_flat, generate_on_ray, refs, model=tiny, output=tmp_path / "x.jsonl", **OPTIONS)
    with pytest.raises(ValueError, match="concurrency must be"):
        call_flat(generate_on_ray, refs, concurrency=0, model=str(tiny_dir), output=tmp_path / "x.jsonl", **OPTIONS)
    with pytest.raises(TypeError):
        _quiet(call_flat, generate_on_ray, refs, model=str(tiny_dir), output=tmp_path / "x.jsonl", no_such_option=1, **OPTIONS)
    assert not (tmp_path / "x.jsonl").exists()


def test_the_cli_runs_a_ray_release(cluster, tiny_dir, refs, tmp_path, capsys):
    from invink_audit.cli import main

    output = tmp_path / "cli.jsonl"
    args = ["generate", "--input", str(refs), "--output", str(output), "--batch-size", "3", "--max-new-tokens", "8",
            "--delta", "1e-6", "--epsilon", "8", "--top-k", "20", "--model", str(tiny_dir), "--device", "cpu",
            "--no-progress", "--json", "--ray-actors", "1"]  # fmt: skip
    assert _quiet(main, args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["texts"] == NUM_REFERENCES // 3 and summary["processes"][0]["device"] == "ray"
    assert [r["batch_index"] for r in read_generation_output(output)] == list(range(NUM_REFERENCES // 3))
    assert _quiet(main, [*args[:-1], "0"]) == 2  # --ray-actors 0: bad input, nothing run


def test_the_key_holder_hands_out_stream_keys_of_the_release_only():
    """Ray workers get each call's batches' stream keys, never the master key they derive from."""
    from invink_audit.generation import release_key
    from invink_audit.ray_release import _KeyHolder

    holder = _KeyHolder(5, num_batches=3)
    assert holder.stream_keys([0, 2]) == {0: derive_key(release_key(5), 0), 2: derive_key(release_key(5), 2)}
    assert not any(callable(getattr(holder, name)) and name == "key" for name in dir(holder))
    with pytest.raises(ValueError, match="not in the release"):
        holder.stream_keys([3])
