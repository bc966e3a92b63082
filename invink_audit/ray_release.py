"""One release as a Ray Data pipeline: ``pip install 'invink-audit[ray]'``.

:func:`generate_on_ray` runs the same release as :func:`invink_audit.generation.generate` (same checks,
one ledger charge, one output file, same texts for a fixed seed) with its batches as the rows of a
dataset mapped over Ray actors; the driver does rank 0's part, each actor claims a batch in the shared
journal before writing it, and the master key stays in one key-holder actor (``_KeyHolder``).

Design: docs/guide/scaling-out.md; the key and the journal: docs/design/release-protocol.md (§"Randomness").
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

from accounting.limits import check_count
from invink_audit.generation import ExternalRelease, GenerationResult, generate_texts, prepare_release

__all__ = ["generate_on_ray"]

#: tries at removing the temporary folder of a local Ray after it has stopped
_REMOVE_ATTEMPTS = 5


class _KeyHolder:
    """A Ray actor holding the release's master key in memory (128 bits from the OS, or derived from a
    fixed seed: :func:`invink_audit.generation.release_key`); it hands out the stream keys of the
    release's batches, never the master key."""

    def __init__(self, seed: int | None, num_batches: int) -> None:
        from invink_audit.generation import release_key

        self._key, self._num_batches = release_key(seed), num_batches

    def stream_keys(self, indices: list[int]) -> dict[int, int]:
        from invink_audit.mechanism import derive_key

        if any(not 0 <= int(i) < self._num_batches for i in indices):
            raise ValueError("a stream key was asked for a batch that is not in the release")
        return {int(i): derive_key(self._key, int(i)) for i in indices}


class _Worker:
    """A Ray Data callable class: loads the model once per actor, generates the batches of each call."""

    def __init__(self, state: dict, key_holder) -> None:
        self.state, self.key_holder = state, key_holder
        self.loaded, self.engine = state["load"].build(state["mechanism"], state["load"].device)
        # one shard per actor life: a restarted actor writes a new one
        self.shard = state["output"].with_name(
            f"{state['output'].name}.shard-{state['attempt']}-ray{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        )

    def __call__(self, batch: dict) -> dict:
        import ray

        items = [(int(index), [None if r is None else str(r) for r in refs]) for index, refs in zip(batch["batch_index"], batch["references"])]
        keys = ray.get(self.key_holder.stream_keys.remote([index for index, _ in items]))
        rows = list(generate_texts(self.state, self.loaded, self.engine, items, self.shard, keys))
        return {name: [row[i] for row in rows] for i, name in enumerate(("batch_index", "released", "num_tokens"))}


@contextlib.contextmanager
def _ray_session(ray):
    """Ray for one call: the caller's, when Ray is initialised; else ``ray.init()``, shut down on the way out.

    With ``RAY_ADDRESS`` it joins that cluster. Otherwise it starts a local one whose session files (logs,
    sockets, spilled blocks that carry the references) live in a new owner-only (0700) folder, removed after
    ``ray.shutdown()``, also on error. Ray makes its folders world-writable (0777), so every folder in it is
    made 0700 once Ray has started; the ones Ray adds later keep its modes, inside that closed folder.
    """
    if ray.is_initialized():
        yield
        return
    private = None
    try:
        if os.environ.get("RAY_ADDRESS"):
            ray.init(include_dashboard=False)
        else:
            # under /tmp on macOS as Ray does, since its long $TMPDIR overflows Unix socket paths
            private = Path(tempfile.mkdtemp(prefix="invink-ray-", dir="/tmp" if sys.platform == "darwin" else None))
            ray.init(include_dashboard=False, _temp_dir=str(private / "ray"))
            _close_folders(private)
        yield
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if private is not None:
            _remove_folder(private)


def _close_folders(top: Path) -> None:
    """Every folder under ``top`` (not through symbolic links) made owner-only (0700)."""
    for folder, _, _ in os.walk(top):
        if not os.path.islink(folder):
            with contextlib.suppress(FileNotFoundError):  # Ray may remove a folder of its own meanwhile
                os.chmod(folder, 0o700)


def _remove_folder(folder: Path) -> None:
    """``rmtree(folder)``; Ray's processes may write their last logs while they stop, so it tries again."""
    for attempt in range(_REMOVE_ATTEMPTS):
        shutil.rmtree(folder, ignore_errors=True)
        if not folder.exists():
            return
        time.sleep(0.2 * (attempt + 1))
    warnings.warn(f"Ray's temporary folder {str(folder)!r} (owner only) could not be removed: remove it by hand", stacklevel=3)


def generate_on_ray(
    references,
    config,
    *,
    concurrency: int = 1,
    num_gpus: float = 0.0,
    num_cpus: float = 1.0,
    texts_per_call: int = 8,
    **options,
) -> GenerationResult:
    """:func:`~invink_audit.generation.generate` on a Ray cluster. When Ray is not initialised, ``ray.init()``
    is called (``RAY_ADDRESS``: that cluster; else a local one in an owner-only temporary folder, removed after
    ``ray.shutdown()`` when the call returns); call ``ray.init()`` yourself to keep Ray.

    ``concurrency``: actors (each loads the model once); ``num_gpus`` / ``num_cpus``: per actor;
    ``texts_per_call``: batches per actor call. ``options``: :func:`~invink_audit.generation.generate`'s;
    ``output`` is required (its journal keeps one text per batch under task retries), ``model`` must be a path
    or name (or a ``ModelSpec`` of one), ``hooks.on_text`` is called on the driver once the pipeline has
    finished, and ``hooks.on_tokens`` is refused.
    """
    for name, value in (("concurrency", concurrency), ("texts_per_call", texts_per_call)):
        check_count(name, value)
    for name, value in (("num_gpus", num_gpus), ("num_cpus", num_cpus)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{name} must be a number >= 0; got {value!r}")
    try:
        import ray
    except ImportError as err:
        raise ValueError("Ray is not installed: pip install 'invink-audit[ray]'") from err
    external = ExternalRelease(prepare_release(references, config, **options))
    try:
        todo = external.admit()
        started = time.perf_counter()
        released = ()
        if todo:
            with _ray_session(ray):
                released = _run_pipeline(ray, external, todo, dict(concurrency=concurrency, num_gpus=num_gpus,
                                                                   num_cpus=num_cpus, batch_size=texts_per_call))
        return external.finish(time.perf_counter() - started, released)
    finally:
        external.close()


def _run_pipeline(ray, external: ExternalRelease, todo, map_options: dict) -> list[int]:
    """The batches ``todo`` through Ray Data (``map_options``: ``map_batches``'s sizes and resources), with
    one key-holder actor killed afterwards; the batch indices released, in order."""
    rows = [{"batch_index": i, "references": list(external.references(i))} for i in todo]
    holder = ray.remote(num_cpus=0)(_KeyHolder).remote(external.release.seed, external.release.num_batches)
    try:
        results = (
            ray.data.from_items(rows)
            .map_batches(_Worker, fn_constructor_kwargs={"state": external.worker_state(), "key_holder": holder},
                         **map_options)
            .take_all()
        )
    finally:
        ray.kill(holder)
    released = sorted(int(r["batch_index"]) for r in results if r["released"])
    if len(released) != len(set(released)):  # cannot happen: claims are first-wins
        raise RuntimeError("a batch was released twice")
    return released
