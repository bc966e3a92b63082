"""Crash-safe file replacement, shared by the budget ledger and the generation output.

A file is replaced whole: the new contents go to a temporary file in the same directory, which is
flushed and fsynced, renamed over the target (``os.replace``, atomic on POSIX), and the directory is
fsynced so that the rename itself survives a power loss. A crash at any point leaves either the old or
the new file, never a torn one. An existing file's permission bits are kept (unless ``keep_mode=False``);
a new file gets ``mode``.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["atomic_write_bytes", "atomic_write_json", "fsync_directory"]


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make renames and unlinks in ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o600, keep_mode: bool = True) -> None:
    """Replace ``path`` by ``data`` so that a crash leaves either the old or the new file. The new file
    has an existing file's permission bits, or ``mode`` (always ``mode`` with ``keep_mode=False``)."""
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if keep_mode:
        try:
            mode = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:
            pass
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fchmod(handle.fileno(), mode)
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_directory(directory)


def atomic_write_json(path: str | os.PathLike, data, *, indent: int = 2, mode: int = 0o600, keep_mode: bool = True) -> None:
    """:func:`atomic_write_bytes` of ``data`` as JSON (sorted keys, no NaN, trailing newline)."""
    text = json.dumps(data, indent=indent, sort_keys=True, allow_nan=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"), mode=mode, keep_mode=keep_mode)
