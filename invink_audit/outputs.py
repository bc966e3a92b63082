"""A release's files on disk: its records, resume state, sampled-batch journal, shards and their merge.

Next to the JSON Lines output ``<output>``:

* ``<output>.state.json``: the release id, a fingerprint of the input and the run's settings, written
  once the ledger charge has succeeded. It holds a hash of the private input: bookkeeping, not part of
  the release.
* ``<output>.sampled``: the sampled-batch journal, one fsynced line per batch whose text has been
  drawn, holding that text's whole record. A process appends a batch's line (under
  ``<output>.sampled.lock``) *before* the text is written anywhere, and only if no line for that batch
  exists yet: the first claim wins, and a process that loses drops its text unseen (readers apply the
  same rule: the first line for a batch is its text). So at most one text per batch is ever released,
  whatever crashes, reruns, Ray task retries or stray processes of an earlier run do; and since the
  claim carries the record, a crash after it loses nothing: a record missing from the output and its
  shards is restored from the journal, never drawn again. (Journals written before records were
  journaled hold bare claims; a bare claim whose record is missing is refused, never redrawn.)
* ``<output>.lock``: held by the coordinating process (rank 0) for the whole run.
* ``<output>.shard-<attempt>-<rank>.jsonl`` (and its ``.lock``, held while it is written): the records of
  one process of a multi-process run. When every process has finished, rank 0 merges the shards and any
  record only the journal holds into ``<output>``, ordered by batch index, atomically
  (:func:`merge_shards`); a later run reads and merges what an interrupted run left. A single-process
  run appends to ``<output>`` directly. Locks are ``flock`` locks; a filesystem without them is refused
  rather than silently given a weaker lock.

Reading is read-only (:func:`inspect_output`); nothing is written before the ledger charge succeeded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from accounting.atomic import atomic_write_bytes, atomic_write_json, fsync_directory

__all__ = [
    "Journal",
    "OutputInUseError",
    "OutputState",
    "RecordSink",
    "check_run",
    "inspect_output",
    "journal_path",
    "lock_path",
    "merge_shards",
    "output_lock",
    "read_generation_output",
    "release_text",
    "release_texts",
    "shard_path",
    "shard_paths",
    "start_output",
    "state_path",
]

_LOG = logging.getLogger(__name__)

#: Version of ``<output>.state.json``; version 2 added the ``<output>.sampled`` journal.
STATE_VERSION = 2
_LOCK_TIMEOUT_SECONDS = 120.0


def _file_lock(path, timeout: float):
    """An exclusive ``flock`` lock on ``path``; never filelock's marker-file fallback, which would not
    exclude a process on another machine (:class:`OSError` where ``flock`` does not work)."""
    from filelock import FileLock

    return FileLock(str(path), timeout=timeout, fallback_to_soft=False)


class OutputInUseError(ValueError):
    """Another run holds the lock on this output file (two runs must never write one output)."""


# --------------------------------------------------------------------------------------------
# paths


def state_path(output: Path) -> Path:
    return output.with_name(output.name + ".state.json")


def journal_path(output: Path) -> Path:
    return output.with_name(output.name + ".sampled")


def lock_path(output: Path) -> Path:
    return output.with_name(output.name + ".lock")


def pending_path(output: Path) -> Path:
    return output.with_name(output.name + ".pending.json")


def shard_path(output: Path, attempt: str, rank: int) -> Path:
    """The shard of process ``rank`` in run ``attempt`` (a fresh id per run, so no two writers share one)."""
    return output.with_name(f"{output.name}.shard-{attempt}-{rank:05d}.jsonl")


def shard_paths(output: Path) -> list[Path]:
    """Every shard next to ``output``, in name order."""
    return sorted(output.parent.glob(f"{_glob_escape(output.name)}.shard-*.jsonl"))


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


# --------------------------------------------------------------------------------------------
# JSON lines


@dataclasses.dataclass(frozen=True)
class _Lines:
    """Complete JSON lines of an append-only file: the parsed objects, the byte length to keep (a torn
    last line is cut off), and whether the kept part ends without a newline (a complete last record)."""

    records: list
    keep: int
    needs_newline: bool


def _split_lines(data: bytes):
    """``(line_number, line, complete)`` for each ``\\n``-terminated line, then an unterminated tail."""
    position, number = 0, 0
    while position < len(data):
        end = data.find(b"\n", position)
        number += 1
        if end < 0:
            yield number, data[position:], False
            return
        yield number, data[position : end + 1], True
        position = end + 1


def _read_records(path: Path) -> _Lines:
    """Records of the output ``path``; a last line without newline is kept when it parses as a record."""
    if not path.exists():
        return _Lines([], 0, False)
    data = path.read_bytes()
    records, keep, needs_newline = [], 0, False
    for number, line, complete in _split_lines(data):
        if line.strip():
            record, problem = None, None
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                problem = f"line {number} is not JSON ({getattr(err, 'msg', type(err).__name__)})"
            if problem is None and (not isinstance(record, dict) or "batch_index" not in record):
                problem = f"line {number} is not a text record (no batch_index)"
            if problem is not None:
                if not complete:
                    _LOG.warning("ignoring an incomplete last line in %s (interrupted run)", path)
                    break
                raise ValueError(f"{str(path)!r} is not a generation output file: {problem}")
            records.append(record)
            needs_newline = not complete
        keep += len(line)
    return _Lines(records, keep, needs_newline)


def read_generation_output(path: str | os.PathLike) -> list[dict]:
    """The text records of an output file.

    A torn last line from an interrupted run is ignored; a last line that lacks only its newline but
    parses as a record is kept. Records of seeded runs carry ``guarantee: None`` and a
    ``guarantee_void_reason``; records written before that change carry the planned figures.
    """
    return _read_records(Path(path)).records


def _append_line(handle, data: dict) -> None:
    """Append one JSON line and make it durable before returning."""
    handle.write((json.dumps(data, ensure_ascii=False) + "\n").encode("utf-8"))
    handle.flush()
    os.fsync(handle.fileno())


def _append_lines(handle, items: Sequence[dict]) -> None:
    """Append JSON lines with one write and one fsync (:func:`_append_line` for one)."""
    if len(items) == 1:
        _append_line(handle, items[0])
        return
    handle.write(b"".join((json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8") for d in items))
    handle.flush()
    os.fsync(handle.fileno())


def _short_list(indices: Sequence[int], limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in indices[:limit])
    return shown + (f", … ({len(indices)} in all)" if len(indices) > limit else "")


# --------------------------------------------------------------------------------------------
# the sampled-batch journal


def _parse_journal(data: bytes, path: Path, release_id: str, num_batches: int, first_line: int = 1) -> _Lines:
    """``(batch_index, record or None)`` of the complete journal lines in ``data`` (a torn last line is
    not counted: the line is fsynced before the text is written anywhere, so that text never left its
    process). ``record`` is ``None`` for a bare claim (journals written before records were journaled)."""
    entries, keep = [], 0
    for number, line, complete in _split_lines(data):
        if not complete:
            break
        number += first_line - 1
        try:
            entry = json.loads(line)
            index, recorded_release = entry["batch_index"], entry["release_id"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"sampled-batch journal {str(path)!r} is corrupt at line {number}: {err}") from None
        if recorded_release != release_id:
            raise ValueError(f"sampled-batch journal {str(path)!r} line {number} belongs to another release")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_batches:
            raise ValueError(f"sampled-batch journal {str(path)!r} line {number} holds an invalid batch_index")
        record = entry.get("record")
        if record is not None and (not isinstance(record, dict) or record.get("batch_index") != index):
            raise ValueError(f"sampled-batch journal {str(path)!r} line {number} holds an invalid record")
        entries.append((index, record))
        keep += len(line)
    return _Lines(entries, keep, False)


def _first_claims(entries) -> dict:
    """Batch index → its first journal entry's record (``None`` for a bare claim): the first claim wins."""
    first: dict = {}
    for index, record in entries:
        first.setdefault(index, record)
    return first


class Journal:
    """The shared sampled-batch journal of one release: :meth:`claim` is first-wins across processes.

    Appends happen under a file lock, after reading what other processes appended since, through an
    ``O_APPEND`` descriptor (a line is never written over another); a torn last line (its writer died
    mid-append, before its claim returned) is cut off under the lock. Readers take the first line of a
    batch as its claim. The file must exist (:func:`start_output` creates it).
    """

    def __init__(self, output: Path, release_id: str, num_batches: int) -> None:
        self.path = journal_path(output)
        self.release_id = release_id
        self.num_batches = num_batches
        self._lock = _file_lock(str(self.path) + ".lock", _LOCK_TIMEOUT_SECONDS)
        self._offset = 0
        self._lines = 0
        self._claimed: set[int] = set()

    def claim(self, batch_index: int, record: dict | None = None) -> bool:
        """Record ``batch_index`` as sampled, with its ``record``; ``False`` (nothing written) if some
        process already did."""
        return self.claim_many([(batch_index, record)])[0]

    def claim_many(self, entries) -> list[bool]:
        """:meth:`claim` for several ``(batch_index, record)`` at once: one lock, one append, one fsync
        (the texts that finish in one decoding step). Returns which claims won."""
        with self._lock:
            with self.path.open("rb") as reader:
                reader.seek(self._offset)
                data = reader.read()
            new = _parse_journal(data, self.path, self.release_id, self.num_batches, self._lines + 1)
            self._claimed.update(index for index, _ in new.records)
            self._lines += len(new.records)
            self._offset += new.keep
            if new.keep < len(data):
                os.truncate(self.path, self._offset)
            won, lines = [], []
            for batch_index, record in entries:
                ok = batch_index not in self._claimed
                won.append(ok)
                if ok:
                    self._claimed.add(batch_index)
                    line = {"batch_index": batch_index, "release_id": self.release_id}
                    if record is not None:
                        line["record"] = record
                    lines.append(line)
            if lines:
                with self.path.open("ab") as handle:
                    _append_lines(handle, lines)
                    self._offset = handle.tell()
                self._lines += len(lines)
            return won


# --------------------------------------------------------------------------------------------
# writing records


class RecordSink:
    """Where one process appends its records: the output itself (one process) or its own shard.

    A shard's lock is held while the sink is open, so that a later run refuses to start while a stray
    process of this one may still write (:func:`inspect_output`).
    """

    def __init__(self, path: Path, *, keep: int | None = None, needs_newline: bool = False, lock: bool = False) -> None:
        self.path = path
        self._lock = None
        if lock:
            self._lock = _file_lock(str(path) + ".lock", 0)
            self._lock.acquire()
        try:
            if keep is None and path.exists():  # reopened (a Ray actor's next call): drop a torn tail
                lines = _read_records(path)
                keep, needs_newline = lines.keep, lines.needs_newline
            self._handle = path.open("r+b" if path.exists() else "wb")
            if keep is not None:
                self._handle.truncate(keep)  # drop a torn last line
                self._handle.seek(keep)
            else:
                self._handle.seek(0, os.SEEK_END)
            if needs_newline:  # a complete last record that only lacked its newline
                self._handle.write(b"\n")
        except BaseException:
            if self._lock is not None:
                self._lock.release()
            raise

    def write(self, record: dict) -> None:
        _append_line(self._handle, record)

    def write_many(self, records: Sequence[dict]) -> None:
        """Append several records with one fsync."""
        if records:
            _append_lines(self._handle, records)

    def close(self) -> None:
        self._handle.close()
        if self._lock is not None:
            self._lock.release()

    def __enter__(self) -> RecordSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def release_texts(journal: Journal | None, sink: RecordSink | None, items) -> list[bool]:
    """Claim each ``(batch_index, record)`` in the journal with its record, then write the records that
    won: ``False`` for a batch another process had claimed first (its text must be dropped, never handed
    out). One journal append and one sink write for all of them (a decoding step's texts). A crash
    between the two loses nothing: the journal's copies are merged into the output later. Without a
    journal (no output file) the texts are only returned to the caller."""
    items = list(items)
    won = [True] * len(items) if journal is None else journal.claim_many(items)
    if sink is not None:
        sink.write_many([record for (_, record), ok in zip(items, won) if ok])
    return won


def release_text(journal: Journal | None, sink: RecordSink | None, batch_index: int, record: dict) -> bool:
    """:func:`release_texts` for one text."""
    return release_texts(journal, sink, [(batch_index, record)])[0]


# --------------------------------------------------------------------------------------------
# reading the resume state


@dataclasses.dataclass(frozen=True)
class OutputState:
    """What :func:`inspect_output` found (nothing is written until the ledger charge succeeds).

    ``records``: every finished record, from the output, its shards and the journal, one per batch, by
    batch index. ``keep``/``needs_newline``: how a single process appends to the output (a torn last line
    dropped). ``recovered``: records only the journal holds (to be merged into the output).
    """

    release_id: str
    is_new: bool
    run: dict | None  # the settings recorded in the state file (for a new output: in a pending file, or None)
    records: list
    keep: int
    needs_newline: bool
    shards: tuple[Path, ...] = ()
    recovered: int = 0


def _check_shards_idle(output: Path, shards: Sequence[Path]) -> None:
    from filelock import Timeout

    for shard in shards:
        lock = _file_lock(str(shard) + ".lock", 0)
        try:
            lock.acquire()
        except Timeout:
            raise OutputInUseError(
                f"a process of another run is still writing {shard.name!r} next to {str(output)!r}: wait for it to "
                "finish (or stop it), then run again"
            ) from None
        lock.release()


def _collect_records(
    output: Path, release_id: str, num_batches: int, shards: Sequence[Path], claims: dict | None = None
) -> tuple[list, _Lines, int]:
    """The records of the output and its shards, one per batch (identical copies, left by a merge that was
    interrupted before it removed its shards, count once), completed by the journal's records (``claims``:
    batch → its first claim's record), the output's own lines, and how many came from the journal alone."""
    main = _read_records(output)
    by_index: dict[int, dict] = {}
    for source, records in [(output, main.records)] + [(s, _read_records(s).records) for s in shards]:
        for record in records:
            index = record["batch_index"]
            if record.get("release_id") != release_id:
                raise ValueError(
                    f"{str(source)!r} holds a record of another run (batch {index!r}); use a new --output file"
                )
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_batches:
                raise ValueError(f"{str(source)!r} holds an invalid or duplicate batch_index {index!r}")
            if index in by_index:
                if source == output:
                    raise ValueError(f"{str(output)!r} holds an invalid or duplicate batch_index {index!r}")
                if by_index[index] != record:
                    raise ValueError(
                        f"{str(output)!r} and its shards hold two different texts for batch {index}: at most one "
                        "text per batch may be released, so this output cannot be resumed or merged; keep the files "
                        "for inspection and use a new --output file"
                    )
                continue
            by_index[index] = record
    recovered = 0
    for index, record in (claims or {}).items():
        if record is None:
            continue
        if index not in by_index:
            by_index[index] = record
            recovered += 1
        elif by_index[index] != record:
            raise ValueError(
                f"{str(output)!r} holds a text for batch {index} other than the one its journal claimed first: at "
                "most one text per batch may be released, so this output cannot be resumed or merged; keep the "
                "files for inspection and use a new --output file"
            )
    return [by_index[i] for i in sorted(by_index)], main, recovered


def inspect_output(output: Path, fingerprint: str, num_batches: int) -> OutputState:
    """Read the output's resume state and refuse what cannot be resumed safely (read-only)."""
    state_file, journal_file, shards = state_path(output), journal_path(output), shard_paths(output)
    if not state_file.exists():
        if output.exists() and output.stat().st_size > 0:
            raise ValueError(
                f"{str(output)!r} exists and is not empty, but its resume state {state_file.name!r} is missing: "
                "refusing to overwrite or append to a file this tool did not start (use a new --output file)"
            )
        if journal_file.exists() and journal_file.stat().st_size > 0:
            raise ValueError(
                f"{journal_file.name!r} records sampled batches but {state_file.name!r} is missing: the release "
                f"of {str(output)!r} cannot be resumed (use a new --output file)"
            )
        if shards:
            raise ValueError(
                f"shard files of {str(output)!r} exist ({shards[0].name!r}, …) but its resume state "
                f"{state_file.name!r} is missing: refusing to resume (use a new --output file)"
            )
        pending = _read_pending(output)
        if pending is not None:  # a run charged (or about to charge) this release id, then stopped
            return OutputState(pending["release_id"], True, pending["run"], [], 0, False)
        return OutputState(uuid.uuid4().hex, True, None, [], 0, False)
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
        old_run, old_fingerprint, release_id = state["run"], state["input_sha256"], state["release_id"]
        version = state.get("version", 1)
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"resume state {str(state_file)!r} is corrupt: {err}") from None
    if not isinstance(release_id, str) or not isinstance(old_run, dict):
        raise ValueError(f"resume state {str(state_file)!r} is corrupt")
    if old_fingerprint != fingerprint:
        raise ValueError(f"{str(output)!r} was written from a different input; use a new --output file")
    _check_shards_idle(output, shards)
    claims = None
    if version == STATE_VERSION and journal_file.exists():
        claims = _first_claims(_parse_journal(journal_file.read_bytes(), journal_file, release_id, num_batches).records)
    records, main, recovered = _collect_records(output, release_id, num_batches, shards, claims)
    seen = {record["batch_index"] for record in records}
    if version == 1:
        # written before the journal existed: which batches were sampled is unknown, so all were
        missing = sorted(set(range(num_batches)) - seen)
        if missing:
            raise ValueError(
                f"{str(output)!r} lacks batch(es) {_short_list(missing)}, and its resume state predates the "
                "sampled-batch journal, so they may have been sampled and released already: drawing them again "
                "would be an uncharged second release. Use a new --output file (a new release, charged again)."
            )
    elif version == STATE_VERSION:
        if not journal_file.exists():
            raise ValueError(
                f"the sampled-batch journal {journal_file.name!r} of {str(output)!r} is missing, so which batches "
                "were already sampled is unknown; refusing to resume (use a new --output file: a new release, "
                "charged again)"
            )
        missing = sorted(set(claims) - seen)  # bare claims (older journals) whose record is gone
        if missing:
            raise ValueError(
                f"batch(es) {_short_list(missing)} of {str(output)!r} were already sampled (recorded in "
                f"{journal_file.name!r}) but their records are missing from the output (deleted, or torn by an "
                "interrupted write): their texts may have been released, and drawing them again would be a second "
                "release that the ledger was not charged for. Restore the missing lines, or use a new --output "
                "file (a new release, charged again)."
            )
    else:
        raise ValueError(f"resume state {str(state_file)!r} has an unknown version {version!r}")
    if recovered:
        _LOG.warning("%d record(s) of %s are restored from its journal (written there before a crash)", recovered, output)
    return OutputState(release_id, False, old_run, records, main.keep, main.needs_newline, tuple(shards), recovered)


def _diff(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def check_run(output: Path, state: OutputState, run: dict) -> None:
    """Refuse to resume with settings other than the recorded ones."""
    if state.run is not None and state.run != run:
        raise ValueError(
            f"{str(output)!r} was written by a run with different settings ({', '.join(_diff(state.run, run))}); "
            "use a new --output file"
        )
    for record in state.records:
        if record.get("run") != run:
            raise ValueError(
                f"{str(output)!r} holds a record of another run (batch {record['batch_index']!r}); use a new --output file"
            )


def _read_pending(output: Path) -> dict | None:
    path = pending_path(output)
    try:
        pending = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(pending.get("release_id"), str) and isinstance(pending.get("run"), dict):
            return pending
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        pass
    _LOG.warning("ignoring an unreadable %s", path.name)
    return None


def pending_release_id(output: Path, state: OutputState, run: dict) -> str:
    """The release id to charge for a new output, written to ``<output>.pending.json`` *before* the
    charge: a run stopped between the charge and :func:`start_output` leaves it, and a rerun with the
    same settings charges the same id again, which the ledger records once. Other settings: a new id."""
    release_id = state.release_id if state.run == run else uuid.uuid4().hex
    atomic_write_json(pending_path(output), {"release_id": release_id, "run": run}, indent=1)
    return release_id


def clear_pending(output: Path) -> None:
    """Remove the pending file (the charge was refused, or the resume state now holds the id)."""
    pending_path(output).unlink(missing_ok=True)


def start_output(output: Path, state: OutputState, fingerprint: str, run: dict, release_id: str | None = None) -> None:
    """Create the journal (empty), then the state file: only after the ledger charge succeeded; then
    remove the pending file.

    In this order a crash in between leaves an empty journal without state, which is harmless.
    """
    with journal_path(output).open("wb") as handle:
        handle.flush()
        os.fsync(handle.fileno())
    atomic_write_json(
        state_path(output),
        {"version": STATE_VERSION, "release_id": release_id or state.release_id, "input_sha256": fingerprint, "run": run},
        indent=1,
    )
    clear_pending(output)


@contextlib.contextmanager
def output_lock(output: Path):
    """Hold ``<output>.lock`` exclusively for the whole run; a second run is refused at once."""
    from filelock import Timeout

    path = lock_path(output)
    lock = _file_lock(path, 0)
    try:
        lock.acquire()
    except Timeout:
        raise OutputInUseError(
            f"another run is writing {str(output)!r} (it holds {path.name!r}); two runs must not write one "
            "output: wait for it to finish, or use another --output file"
        ) from None
    try:
        yield
    finally:
        lock.release()


def merge_shards(output: Path, release_id: str, num_batches: int) -> int:
    """Fold every idle shard and every record only the journal holds into ``output``, ordered by batch
    index, atomically; then remove the merged shards. Returns the number of records in the output.

    Call it holding the output lock. Each shard's lock is taken (without waiting) and held until the
    shard is removed; a shard still locked by a live writer is left alone (its records are in the
    journal, and the next merge takes it). A crash before the replace leaves the old files; after it,
    shards whose records the output already holds (identical copies, merged again next time). Lock
    files are never removed (removing one while held would let two processes hold "the" lock).
    """
    from filelock import Timeout

    journal_file = journal_path(output)
    claims = None
    if journal_file.exists():
        claims = _first_claims(_parse_journal(journal_file.read_bytes(), journal_file, release_id, num_batches).records)
    with contextlib.ExitStack() as held:
        shards = []
        for shard in shard_paths(output):
            lock = _file_lock(str(shard) + ".lock", 0)
            try:
                lock.acquire()
            except Timeout:
                _LOG.warning("%s is still being written; left for the next merge", shard.name)
                continue
            held.callback(lock.release)
            shards.append(shard)
        records, main, recovered = _collect_records(output, release_id, num_batches, shards, claims)
        if not shards and not recovered and not main.needs_newline and main.keep == _file_size(output):
            return len(records)
        data = b"".join((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in records)
        umask = os.umask(0)
        os.umask(umask)
        atomic_write_bytes(output, data, mode=0o666 & ~umask)
        for shard in shards:
            shard.unlink(missing_ok=True)
        fsync_directory(output.parent)
    return len(records)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
