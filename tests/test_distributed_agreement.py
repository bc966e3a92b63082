"""What the processes of one release agree on and send each other.

R10: the master key stays on rank 0. Each process receives the stream keys of its own batches only
(``derive_key(master, batch)``, the keys the engine derived itself before, so the texts are the same);
the engine takes them as ``stream_keys``; :meth:`Cluster.scatter` delivers each part to its own rank.
A launch that spans machines (read from the launcher's environment, before any process group exists)
is refused unless ``INVINK_ALLOW_MULTI_MACHINE=1``.

R2: every process must name the same ledger, in the same state (or none), before rank 0 charges it;
otherwise every process refuses and the ledger is untouched (end to end under ``torchrun``).
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import warnings

import pytest
import torch

import invink_audit.distributed as distributed
import invink_audit.generation as generation
from invink_audit.distributed import Cluster, check_single_machine
from invink_audit.engine import Engine
from invink_audit.mechanism import MechanismConfig, SeededGeneratorWarning, derive_key, make_generator
from invink_audit.outputs import journal_path, read_generation_output
from invink_audit.prompts import encode_request, get_preset
from invink_audit.generation import GenerationConfig

MASTER = 0x0123_4567_89AB_CDEF_FEDC_BA98_7654_3210  # a known master key, to look for in what is sent
REFERENCES = [
    ["The soup was cold.", "Great tacos, long wait.", ""],
    ["Friendly staff and a rude owner.", "", "Never again, never."],
    ["", "Best pho in town, and cheap.", "Loud music, good beer."],
    ["Burnt toast.", "Fresh bread every morning.", "The waiter forgot us."],
]


def _generator(seed: int) -> torch.Generator:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SeededGeneratorWarning)
        return make_generator(seed, device="cpu")


def _requests(model):
    template = get_preset("generic")
    return [encode_request(model.tokenizer, template, refs, key=i) for i, refs in enumerate(REFERENCES)]


# ------------------------------------------------------------------------------------------------
# the engine: per-text stream keys


def test_stream_keys_draw_exactly_the_tokens_of_the_master_key_and_stream_ids(tiny):
    mechanism = MechanismConfig(clip_norm=1.5, temperature=1.0, top_k=6, batch_size=3)
    requests = _requests(tiny)
    ids = [7, 2, 11, 0]  # batch indices, as a release passes them

    def run(**keys):
        engine = Engine(tiny, mechanism, max_batch_rows=8)
        texts = engine.generate(requests, max_new_tokens=8, generator=_generator(0), **keys)
        return {t.request_index: t.token_ids for t in texts}

    by_master = run(key=MASTER, stream_ids=ids)
    assert run(stream_keys=[derive_key(MASTER, i) for i in ids]) == by_master
    assert run(stream_keys=[derive_key(MASTER + 1, i) for i in ids]) != by_master  # the keys are what counts


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"stream_keys": [1, 2, 3]}, "one key per request"),
        ({"stream_keys": [1, 2, 3, 4, 5]}, "one key per request"),
        ({"stream_keys": [1, 2, 3, -4]}, r"\[0, 2\*\*128\)"),
        ({"stream_keys": [1, 2, 3, 2**128]}, r"\[0, 2\*\*128\)"),
        ({"stream_keys": [1, 2, 3, True]}, r"\[0, 2\*\*128\)"),
        ({"stream_keys": [1, 2, 3, 4.0]}, r"\[0, 2\*\*128\)"),
        ({"stream_keys": [1, 2, 3, 1]}, "distinct"),
        ({"stream_keys": [1, 2, 3, 4], "key": 5}, "not both"),
        ({"stream_keys": [1, 2, 3, 4], "stream_ids": [0, 1, 2, 3]}, "not both"),
    ],
)
def test_stream_keys_are_validated(tiny, options, match):
    engine = Engine(tiny, MechanismConfig(clip_norm=1.0, temperature=1.0, top_k=6, batch_size=3))
    with pytest.raises(ValueError, match=match):
        list(engine.generate(_requests(tiny), max_new_tokens=2, generator=_generator(0), **options))


# ------------------------------------------------------------------------------------------------
# the admission each process receives


@dataclasses.dataclass(frozen=True)
class _RecordingCluster(Cluster):
    """Rank 0 of a launch of ``world_size``, whose :meth:`scatter` records the part sent to each rank."""

    sent: list = dataclasses.field(default_factory=list)

    def scatter(self, parts=None):
        self.sent.extend(parts)
        return parts[0]


def _ints(obj):
    """Every integer inside ``obj`` (dataclasses, mappings and sequences, keys included)."""
    if dataclasses.is_dataclass(obj):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return [v for k, x in obj.items() for v in (*_ints(k), *_ints(x))]
    if isinstance(obj, (list, tuple)):
        return [v for x in obj for v in _ints(x)]
    return [obj] if isinstance(obj, int) and not isinstance(obj, bool) else []


def test_each_process_receives_its_own_batches_stream_keys_and_never_the_master_key(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(generation, "release_key", lambda seed: MASTER)
    references = [f"Review {i}: the soup was {'great' if i % 2 else 'cold'}." for i in range(21)]
    release = generation.prepare_release(
        references, generation.GenerationConfig(batch_size=3, max_new_tokens=4, delta=1e-6, epsilon=8.0), model=tiny,
        output=tmp_path / "o.jsonl",
    )
    release.cluster = cluster = _RecordingCluster(rank=0, world_size=3)
    with contextlib.ExitStack() as stack:
        release._open_output(stack)
        admission = release._admit(tiny)
        mine = release._hand_out(admission)
    assert "key" not in {f.name for f in dataclasses.fields(admission)}
    assert admission.stream_keys == {i: derive_key(MASTER, i) for i in range(7)}  # rank 0 holds them all
    assert len(cluster.sent) == 3 and mine is cluster.sent[0]
    assert sorted(i for part in admission.assignment for i in part) == list(range(7))
    master_bytes = MASTER.to_bytes(16, "little")
    for rank, part in enumerate(cluster.sent):
        assert part.assignment == admission.assignment and part.release_id == admission.release_id
        assert part.stream_keys == {i: derive_key(MASTER, i) for i in admission.assignment[rank]}
        others = [derive_key(MASTER, i) for r, p in enumerate(admission.assignment) if r != rank for i in p]
        assert MASTER not in _ints(part) and not set(others) & set(_ints(part))
        wire = pickle.dumps(part)  # what the process group carries
        assert master_bytes[:12] not in wire
        assert not any(key.to_bytes(16, "little")[:12] in wire for key in others)


def _scatter_then_shutdown(rank: int, port: int, queue) -> None:
    os.environ.update({"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})  # fmt: skip
    from invink_audit.distributed import current_cluster, shutdown

    cluster = current_cluster()
    parts = [{"rank": 0, "keys": [1, 2]}, {"rank": 1, "keys": [3]}] if rank == 0 else None
    received = cluster.scatter(parts)
    shutdown()
    queue.put((rank, received))


def test_scatter_gives_each_rank_its_own_part():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_scatter_then_shutdown, args=(rank, port, queue)) for rank in range(2)]
    for worker in workers:
        worker.start()
    results = sorted((queue.get(timeout=120) for _ in workers), key=lambda r: r[0])
    for worker in workers:
        worker.join(timeout=60)
    assert results == [(0, {"rank": 0, "keys": [1, 2]}), (1, {"rank": 1, "keys": [3]})]
    assert Cluster().scatter([5]) == 5  # one process: its own part


# ------------------------------------------------------------------------------------------------
# launches that span machines


_LAUNCH_VARIABLES = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE", distributed.ALLOW_MULTI_MACHINE_ENV,
)  # fmt: skip


@pytest.fixture
def launch_env(monkeypatch):
    """A clean launcher environment; returns a setter."""
    for name in _LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values):
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


@pytest.mark.parametrize(
    ("env", "world", "why"),
    [
        ({"LOCAL_WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1"}, 4, "LOCAL_WORLD_SIZE=2"),
        ({"OMPI_COMM_WORLD_LOCAL_SIZE": 1, "MASTER_ADDR": "localhost"}, 2, "LOCAL_WORLD_SIZE=1"),
        ({"MV2_COMM_WORLD_LOCAL_SIZE": 3, "MASTER_ADDR": "localhost"}, 6, "LOCAL_WORLD_SIZE=3"),
        ({"LOCAL_WORLD_SIZE": 2, "MASTER_ADDR": "203.0.113.7"}, 2, "MASTER_ADDR='203.0.113.7'"),  # TEST-NET-3
        ({"MASTER_ADDR": "203.0.113.7"}, 2, "MASTER_ADDR"),
    ],
)
def test_a_launch_across_machines_is_refused_unless_allowed(launch_env, env, world, why):
    launch_env(**env)
    assert why in distributed._machines_reason(world)
    with pytest.raises(ValueError, match="spans more than one machine") as refused:
        check_single_machine(world)
    message = str(refused.value)
    assert why in message and "INVINK_ALLOW_MULTI_MACHINE=1" in message
    for travels in ("stream keys", "release id", "batch assignment", "pickle", "texts", "neither authenticated"):
        assert travels in message
    for allowed in ("1", "true", "YES"):
        launch_env(INVINK_ALLOW_MULTI_MACHINE=allowed)
        check_single_machine(world)
    launch_env(INVINK_ALLOW_MULTI_MACHINE="0")
    with pytest.raises(ValueError, match="spans more than one machine"):
        check_single_machine(world)


@pytest.mark.parametrize("master", ["127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]", socket.gethostname(), None])
def test_a_launch_on_this_machine_passes(launch_env, master):
    launch_env(LOCAL_WORLD_SIZE=4, **({} if master is None else {"MASTER_ADDR": master}))
    assert distributed._machines_reason(4) is None
    check_single_machine(4)
    launch_env(LOCAL_WORLD_SIZE=1, MASTER_ADDR="203.0.113.7")
    assert distributed._machines_reason(1) is None  # one process talks to no one


def test_a_host_name_is_this_machine_only_when_every_address_it_resolves_to_is(launch_env, monkeypatch):
    answers = {"here": ["127.0.0.1", "::1"], "mixed": ["127.0.0.1", "203.0.113.7"], "there": ["203.0.113.7"]}

    def resolve(name, *args, **kwargs):  # no DNS
        if name not in answers:
            raise socket.gaierror("unknown host")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in answers[name]]

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert distributed._is_this_machine("here")
    for name in ("mixed", "there", "nowhere", ""):
        assert not distributed._is_this_machine(name)
    launch_env(LOCAL_WORLD_SIZE=2, MASTER_ADDR="there")
    assert "MASTER_ADDR='there'" in distributed._machines_reason(2)


def test_the_opt_in_must_be_a_yes_or_a_no(launch_env):
    launch_env(LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", INVINK_ALLOW_MULTI_MACHINE="maybe")
    with pytest.raises(ValueError, match="INVINK_ALLOW_MULTI_MACHINE='maybe' must be 1"):
        check_single_machine(2)


def test_generate_refuses_a_launch_across_machines_before_any_process_group_or_charge(
    launch_env, monkeypatch, tiny, tmp_path
):
    import torch.distributed as dist

    from accounting import BudgetLedger

    ledger = tmp_path / "ledger.json"
    BudgetLedger.create(ledger, epsilon=100.0, delta=1e-5)
    before = ledger.read_bytes()
    monkeypatch.setattr(distributed, "_CLUSTER", None)

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was initialised")

    monkeypatch.setattr(dist, "init_process_group", no_group)
    launch_env(WORLD_SIZE=4, RANK=0, LOCAL_RANK=0, LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    output = tmp_path / "out.jsonl"
    with pytest.raises(ValueError, match="spans more than one machine"):
        generation.generate([f"review {i}" for i in range(6)],
                            GenerationConfig(batch_size=3, max_new_tokens=4, delta=1e-6, epsilon=8.0), model=tiny,
                            output=output, ledger=ledger)  # fmt: skip
    assert ledger.read_bytes() == before and not output.exists()
    assert not dist.is_initialized()


# ------------------------------------------------------------------------------------------------
# end to end under torchrun: every process names the same ledger, or none is charged

WORKER = """
import os, sys
from invink_audit.cli import main
argv = sys.argv[1:]
ledger = os.environ.get("TEST_LEDGER_RANK" + os.environ.get("RANK", "0"))
if ledger:
    argv += ["--ledger", ledger]
sys.exit(main(argv))
"""


@pytest.fixture(scope="module")
def workload(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("agreement")
    refs = root / "refs.csv"
    with refs.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text"])
        for i in range(12):
            writer.writerow([f"Review {i}: the soup was {'great' if i % 2 else 'cold'}."])
    worker = root / "worker.py"
    worker.write_text(WORKER)
    return root, refs, worker


def _ledger(path):
    from accounting import BudgetLedger

    BudgetLedger.create(path, epsilon=100.0, delta=1e-5)
    return path


def _launch_two(workload, tiny_dir, output, ledgers):
    root, refs, worker = workload
    args = [
        "generate", "--input", str(refs), "--output", str(output), "--batch-size", "3", "--max-new-tokens", "4",
        "--delta", "1e-6", "--epsilon", "8", "--model", str(tiny_dir), "--top-k", "20", "--no-progress", "--json",
        "--device", "cpu",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for rank, ledger in enumerate(ledgers):
        env.pop(f"TEST_LEDGER_RANK{rank}", None)
        if ledger is not None:
            env[f"TEST_LEDGER_RANK{rank}"] = str(ledger)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker), *args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert "terminate called" not in done.stderr, done.stderr[-3000:]
    return done


@pytest.mark.slow
@pytest.mark.parametrize("probe", ["rank-0-without-a-ledger", "two-different-ledgers"])
def test_processes_with_other_ledgers_are_refused_and_nothing_is_charged(workload, tiny_dir, probe):
    root = workload[0]
    first, second = _ledger(root / f"{probe}-a.json"), _ledger(root / f"{probe}-b.json")
    ledgers = {"rank-0-without-a-ledger": (None, first), "two-different-ledgers": (first, second)}[probe]
    before = {path: path.read_bytes() for path in (first, second)}
    output = root / f"{probe}.jsonl"
    refused = _launch_two(workload, tiny_dir, output, ledgers)
    assert refused.returncode == 1, refused.stderr[-3000:]  # each process exits 2; torchrun reports 1
    assert refused.stderr.count("were launched with other ledger (--ledger") == 2, refused.stderr[-3000:]
    assert refused.stderr.count("nothing was charged") == 2
    assert {path: path.read_bytes() for path in before} == before  # no ledger charged
    assert not output.exists() and not journal_path(output).exists()
    assert not [p for p in root.glob(f"{probe}.jsonl*") if not p.name.endswith(".lock")]  # no state, no pending id


@pytest.mark.slow
def test_one_ledger_named_two_ways_is_one_ledger_and_is_charged_once(workload, tiny_dir):
    root = workload[0]
    ledger = _ledger(root / "shared-ledger.json")
    link = root / "link-to-ledger.json"
    link.symlink_to(ledger)
    output = root / "shared.jsonl"
    done = _launch_two(workload, tiny_dir, output, (ledger, link))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [r["batch_index"] for r in read_generation_output(output)] == [0, 1, 2, 3]
    from accounting import BudgetLedger

    assert len(BudgetLedger(ledger).status().releases) == 1 and link.is_symlink()
