"""A release's files on disk: its records, resume state, sampled-batch journal, shards and their merge.

Next to ``<output>``: ``.state.json`` and ``.pending.json`` (:class:`OutputState`, :func:`start_output`),
the ``.sampled`` journal whose first claim per batch wins (:class:`Journal`, :func:`release_text`),
``.lock``, and the per-process shards (:class:`RecordSink`) merged by :func:`merge_shards`;
:func:`inspect_output` reads them. Nothing is written before the ledger charge succeeded.

Design: docs/design/release-protocol.md (§"The files next to the output").
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import io
import json
import logging
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from accounting.atomic import atomic_write_bytes, atomic_write_json, fsync_directory
from accounting.strict_json import DuplicateKeyError, loads_strict
from invink_audit.not_private import open_no_follow, refuse_symlink

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
    "read_journal_claims",
    "read_numbered_records",
    "read_state",
    "release_text",
    "release_texts",
    "shard_path",
    "shard_paths",
    "start_output",
    "state_path",
    "write_records",
]

_LOG = logging.getLogger(__name__)

#: Version of ``<output>.state.json``; version 2 added the ``<output>.sampled`` journal.
STATE_VERSION = 2
_LOCK_TIMEOUT_SECONDS = 120.0


def _file_lock(path, timeout: float):
    """An exclusive ``flock`` lock on ``path``; never filelock's marker-file fallback, which would not
    exclude a process on another machine (:class:`OSError` where ``flock`` does not work). The lock file
    is created here (owner-only) without following a symbolic link, and a link at ``path`` is refused:
    older filelock versions open it following links and truncating (a planted link would clobber its
    target)."""
    from filelock import FileLock

    os.close(open_no_follow(path, os.O_RDONLY | os.O_CREAT))
    return FileLock(str(path), timeout=timeout, fallback_to_soft=False)


def _open(path: Path, mode: str, *, create: bool = False, file_mode: int = 0o600):
    """``open(path, mode)`` without following a symbolic link (refused); ``create``: create a missing file
    (with ``file_mode``), never truncating an existing one."""
    extra = os.O_CREAT if create else 0
    return open(path, mode, opener=lambda name, flags: open_no_follow(name, flags | extra, file_mode))


def _read_no_follow(path: Path) -> bytes:
    """The bytes of ``path``, refusing a symbolic link (:class:`FileNotFoundError` when it is missing)."""
    with _open(path, "rb") as handle:
        return handle.read()


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
    return sorted(output.parent.glob(f"{glob.escape(output.name)}.shard-*.jsonl"))


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
    for number, line in enumerate(io.BytesIO(data), start=1):  # split on b"\n" only
        yield number, line, line.endswith(b"\n")


def _repeats(err: DuplicateKeyError) -> str:
    """What a line repeating a key is, for a message: the key is a field name of the project's own files, shown
    escaped (one printable line)."""
    return (f"repeats the key {err.key_shown()} in one JSON object (a reader keeping the first value would read "
            "another record)")


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
                record = loads_strict(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                problem = f"line {number} is not JSON ({getattr(err, 'msg', type(err).__name__)})"
            except DuplicateKeyError as err:
                problem = f"line {number} {_repeats(err)}"
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
    """The text records of an output file: a torn last line from an interrupted run is ignored; a last line
    that lacks only its newline but parses as a record is kept. Seeded runs' records carry ``guarantee: None``
    and a ``guarantee_void_reason``; records written before that change carry the planned figures."""
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
            entry = loads_strict(line)
            index, recorded_release = entry["batch_index"], entry["release_id"]
        except DuplicateKeyError as err:
            raise ValueError(f"sampled-batch journal {str(path)!r} is corrupt at line {number}: it "
                             f"{_repeats(err)}") from None
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


class Journal:
    """The shared sampled-batch journal of one release: :meth:`claim` is first-wins across processes.

    Appends happen under a file lock, after reading what others appended since, through an ``O_APPEND``
    descriptor; a torn last line (its writer died mid-append) is cut off under the lock. The file must exist
    (:func:`start_output` creates it); it is opened without following a symbolic link, owner-only (0600).
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
        """Record ``batch_index`` as sampled, with its ``record``; ``False`` (nothing written) if some process did."""
        return self.claim_many([(batch_index, record)])[0]

    def claim_many(self, entries) -> list[bool]:
        """:meth:`claim` for several ``(batch_index, record)`` at once: one lock, one append, one fsync
        (the texts that finish in one decoding step). Returns which claims won."""
        with self._lock:
            with _open(self.path, "rb") as reader:
                reader.seek(self._offset)
                data = reader.read()
            new = _parse_journal(data, self.path, self.release_id, self.num_batches, self._lines + 1)
            self._claimed.update(index for index, _ in new.records)
            self._lines += len(new.records)
            self._offset += new.keep
            if new.keep < len(data):
                fd = open_no_follow(self.path, os.O_WRONLY)  # drop a torn last line, never through a link
                try:
                    os.ftruncate(fd, self._offset)
                finally:
                    os.close(fd)
            won, lines = [], []
            for batch_index, record in entries:
                ok = batch_index not in self._claimed
                won.append(ok)
                if ok:
                    self._claimed.add(batch_index)
                    lines.append({"batch_index": batch_index, "release_id": self.release_id,
                                  **({} if record is None else {"record": record})})
            if lines:
                with _open(self.path, "ab") as handle:
                    _append_lines(handle, lines)
                    self._offset = handle.tell()
                self._lines += len(lines)
            return won


# --------------------------------------------------------------------------------------------
# writing records


class RecordSink:
    """Where one process appends its records: the output itself (one process) or its own shard, whose lock
    is held while the sink is open (a later run refuses to start while a stray process may still write). The
    file is opened without following a symbolic link; a new one gets mode ``0o666`` less the umask."""

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
            self._handle = _open(path, "r+b", create=True, file_mode=0o666)
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
    """What :func:`inspect_output` found (nothing is written until the ledger charge succeeds): ``records``,
    one per batch by batch index, from the output, its shards and the journal; ``keep``/``needs_newline``: how
    a single process appends to the output (a torn last line dropped); ``recovered``: records only the journal
    holds (to be merged into the output)."""

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
    for shard in shards:
        refuse_symlink(shard)  # a shard is this tool's own file, never a link to another
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


def read_state(output: Path) -> dict:
    """The resume state ``<output>.state.json`` of a release (its id, run and input fingerprint), checked
    (a ``ValueError`` names a corrupt one)."""
    state_file = state_path(output)
    try:
        state = loads_strict(state_file.read_text(encoding="utf-8"))
        run, release_id, _ = state["run"], state["release_id"], state["input_sha256"]  # each key must be there
    except DuplicateKeyError as err:
        raise ValueError(f"resume state {str(state_file)!r} is corrupt: it {_repeats(err)}") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"resume state {str(state_file)!r} is corrupt: {err}") from None
    if not isinstance(release_id, str) or not isinstance(run, dict):
        raise ValueError(f"resume state {str(state_file)!r} is corrupt")
    return state


def read_numbered_records(path: str | os.PathLike) -> list[tuple[int, dict]]:
    """``(line_number, record)`` for every non-blank line of a published output, strictly: a line that is not
    a JSON object, a torn last line included, is a ``ValueError`` naming the file and the line (an audit reads
    what was published, all of it; :func:`read_generation_output` is the lenient reader a resume uses)."""
    path = Path(path)
    numbered = []
    for number, line, _complete in _split_lines(_read_no_follow(path)):
        if not line.strip():
            continue
        try:
            record = loads_strict(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}:{number}: not a JSON line ({getattr(err, 'msg', type(err).__name__)})") from None
        except DuplicateKeyError as err:
            raise ValueError(f"{path}:{number}: not a text record: it {_repeats(err)}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a text record (a JSON {type(record).__name__}, not an object)")
        numbered.append((number, record))
    return numbered


def read_journal_claims(output: Path, release_id: str, num_batches: int) -> dict | None:
    """Batch index → the record its first journal line holds (``None`` for a bare claim of an older journal),
    as a resume reads them; ``None`` when the release has no journal (a corrupt one is a ``ValueError``)."""
    journal_file = journal_path(Path(output))
    try:
        data = _read_no_follow(journal_file)
    except FileNotFoundError:
        return None
    first: dict = {}
    for index, record in _parse_journal(data, journal_file, release_id, num_batches).records:
        first.setdefault(index, record)  # the first claim wins
    return first


def inspect_output(output: Path, fingerprint: str, num_batches: int) -> OutputState:
    """Read the output's resume state and refuse what cannot be resumed safely (read-only, except that a
    stale pending file beside a state file is removed first, whatever is refused after: its id belongs to
    the release the state file records, and must never be charged, or not charged, for another one)."""
    state_file, journal_file, shards = state_path(output), journal_path(output), shard_paths(output)
    journal_lock = journal_file.with_name(journal_file.name + ".lock")
    shard_files = [path for shard in shards for path in (shard, shard.with_name(shard.name + ".lock"))]
    for path in (output, state_file, journal_file, journal_lock, pending_path(output), *shard_files):
        refuse_symlink(path)  # bookkeeping files are this tool's own, never links (refused before the charge)
    if not state_file.exists():
        return _fresh_output_state(output, fingerprint, state_file, journal_file, shards)
    clear_pending(output)
    state = read_state(output)
    old_run, old_fingerprint, release_id = state["run"], state["input_sha256"], state["release_id"]
    version = state.get("version", 1)
    if old_fingerprint != fingerprint:
        raise ValueError(f"{str(output)!r} was written from a different input; use a new --output file")
    _check_shards_idle(output, shards)
    claims = read_journal_claims(output, release_id, num_batches) if version == STATE_VERSION else None
    records, main, recovered = _collect_records(output, release_id, num_batches, shards, claims)
    seen = {record["batch_index"] for record in records}
    _check_no_sampled_batch_lost(output, state_file, journal_file, version, num_batches, claims, seen)
    if recovered:
        _LOG.warning("%d record(s) of %s are restored from its journal (written there before a crash)", recovered, output)
    return OutputState(release_id, False, old_run, records, main.keep, main.needs_newline, tuple(shards), recovered)


def _fresh_output_state(output: Path, fingerprint: str, state_file: Path, journal_file: Path, shards) -> OutputState:
    """The state of an output without a resume state: a new release (or the pending one of this input),
    refused when the output, its journal or shards hold anything."""
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
    pending = _read_pending(output, fingerprint)
    if pending is not None:  # a run of this input charged (or was about to charge) this id, then stopped
        return OutputState(pending["release_id"], True, pending["run"], [], 0, False)
    return OutputState(uuid.uuid4().hex, True, None, [], 0, False)


def _check_no_sampled_batch_lost(
    output: Path, state_file: Path, journal_file: Path, version, num_batches: int, claims, seen: set
) -> None:
    """Refuse to resume when a batch may have been sampled (and released) but its record is gone, or when
    the resume state's ``version`` is unknown."""
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


def _read_pending(output: Path, fingerprint: str) -> dict | None:
    """The pending file's record when it was written for this input (``input_sha256``), else ``None``: a
    pending file of another input, or of an earlier version (no fingerprint), is never honoured (the new
    release gets a fresh id and is charged)."""
    path = pending_path(output)
    try:
        pending = loads_strict(path.read_text(encoding="utf-8"))
        if isinstance(pending.get("release_id"), str) and isinstance(pending.get("run"), dict):
            if pending.get("input_sha256") == fingerprint:
                return pending
            _LOG.warning("ignoring %s: it was written for another input (or by an earlier version)", path.name)
            return None
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, DuplicateKeyError):
        pass
    _LOG.warning("ignoring an unreadable %s", path.name)
    return None


def _state_record(release_id: str, fingerprint: str, run: dict) -> dict:
    """The contents of the state file, and of the pending file that becomes it."""
    return {"version": STATE_VERSION, "release_id": release_id, "input_sha256": fingerprint, "run": run}


def pending_release_id(output: Path, state: OutputState, run: dict, fingerprint: str) -> str:
    """The release id to charge for a new output, written to ``<output>.pending.json`` (with the input's
    ``fingerprint`` and the settings ``run``) *before* the charge: a run stopped between the charge and
    :func:`start_output` leaves it, and a rerun with the same input and settings charges the same id
    again, which the ledger records once. Another input or other settings: a new id."""
    release_id = state.release_id if state.is_new and state.run == run else uuid.uuid4().hex
    atomic_write_json(pending_path(output), _state_record(release_id, fingerprint, run), indent=1, keep_mode=False)
    return release_id


def clear_pending(output: Path) -> None:
    """Remove the pending file (the charge was refused, or a state file holds the release's id)."""
    pending_path(output).unlink(missing_ok=True)


def start_output(output: Path, state: OutputState, fingerprint: str, run: dict, release_id: str | None = None) -> None:
    """Create the journal (empty, owner-only, never through a link), then turn the pending file into the
    state file by one atomic rename, only after the ledger charge succeeded (what a stop before or after the
    rename leaves: docs/design/release-protocol.md, "The files next to the output")."""
    fd = open_no_follow(journal_path(output), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    pending = pending_path(output)
    atomic_write_json(pending, _state_record(release_id or state.release_id, fingerprint, run), indent=1, keep_mode=False)
    os.replace(pending, state_path(output))  # the state file: owner-only, it holds a hash of the private input
    fsync_directory(output.parent)


@contextlib.contextmanager
def output_lock(output: Path):
    """Hold ``<output>.lock`` exclusively for the whole run; a second run is refused at once, and so is a
    symbolic link at the lock's path (one ``ValueError`` line: a lock never follows a link)."""
    from filelock import Timeout

    path = lock_path(output)
    try:
        refuse_symlink(path)
        lock = _file_lock(path, 0)
        lock.acquire()
    except Timeout:
        raise OutputInUseError(
            f"another run is writing {str(output)!r} (it holds {path.name!r}); two runs must not write one "
            "output: wait for it to finish, or use another --output file"
        ) from None
    except OSError as err:
        if path.is_symlink():  # refused above, or a link made since the check (filelock's open fails)
            raise ValueError(
                f"the lock file {str(path)!r} of output {str(output)!r} is a symbolic link; refusing to follow it "
                "(remove the link: the lock is a plain file beside the output)"
            ) from err
        raise
    try:
        yield
    finally:
        lock.release()


def write_records(path: Path, records, *, keep_mode: bool = True, allow_nan: bool = True) -> None:
    """``records`` as JSON Lines at ``path``, replaced atomically; a new file gets the usual mode of a release file
    (``0o666`` less the umask; ``keep_mode=False``: that mode even over an existing file's)."""
    data = b"".join((json.dumps(r, ensure_ascii=False, allow_nan=allow_nan) + "\n").encode("utf-8") for r in records)
    umask = os.umask(0)
    os.umask(umask)
    atomic_write_bytes(path, data, mode=0o666 & ~umask, keep_mode=keep_mode)


def merge_shards(output: Path, release_id: str, num_batches: int) -> int:
    """Fold every idle shard and every record only the journal holds into ``output``, ordered by batch
    index, atomically (an output in finishing order is rewritten too: the line order never depends on the
    schedule); then remove the merged shards. Returns the number of records in the output.

    Call it holding the output lock. Each shard's lock is taken (without waiting) and held until the shard is
    removed; a shard still locked by a live writer is left for the next merge (its records are in the journal). A
    crash before the replace leaves the old files; after it, identical copies, merged again next time.
    Lock files are never removed (removing one while held would let two processes hold "the" lock).
    """
    from filelock import Timeout

    claims = read_journal_claims(output, release_id, num_batches)
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
        in_order = [r["batch_index"] for r in main.records] == sorted(r["batch_index"] for r in main.records)
        if not shards and not recovered and in_order and not main.needs_newline and main.keep == _file_size(output):
            return len(records)
        write_records(output, records)
        for shard in shards:
            shard.unlink(missing_ok=True)
        fsync_directory(output.parent)
    return len(records)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0
