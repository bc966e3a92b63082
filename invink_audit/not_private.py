"""Files derived from private data that carry no privacy guarantee: marked and closed.

Every evaluation or audit report, plot, per-text cache and reference point this package writes goes
through here: owner-only, never through a symbolic link (:func:`refuse_symlink`, :func:`open_no_follow`,
:func:`owner_only_file`), and marked (:func:`mark_not_private`, :data:`NOT_PRIVATE_BANNER`,
``write_not_private_*``). A release's journal, locks and shards use :func:`open_no_follow` too.

Design: docs/design/release-protocol.md (§"What is private, and what is not").
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from accounting.atomic import atomic_write_bytes

__all__ = [
    "NOT_PRIVATE_BANNER",
    "NOT_PRIVATE_KEY",
    "PRIVACY_NOTICE_KEY",
    "agg_pyplot",
    "mark_not_private",
    "md_table",
    "open_no_follow",
    "owner_only_file",
    "refuse_symlink",
    "save_not_private_figure",
    "unmark",
    "write_not_private_json",
    "write_not_private_jsonl",
    "write_not_private_text",
]

#: The boolean marker every NOT PRIVATE JSON record carries (``true``).
NOT_PRIVATE_KEY = "not_private"
#: The human-readable notice next to it; its text always starts with ``NOT PRIVATE``.
PRIVACY_NOTICE_KEY = "privacy_notice"
#: The first line of every NOT PRIVATE Markdown file, and the default notice of a JSON record.
NOT_PRIVATE_BANNER = "NOT PRIVATE: derived from private data without privacy protection; do not publish."

OWNER_ONLY = 0o600


def mark_not_private(record: Mapping, notice: str | None = None) -> dict:
    """``record`` with the marker first: ``{"not_private": true, "privacy_notice": ..., **record}``; the notice
    is ``notice``, else the record's own, else :data:`NOT_PRIVATE_BANNER`, and must start with ``NOT PRIVATE``.
    Idempotent; the input is not modified."""
    text = notice if notice is not None else record.get(PRIVACY_NOTICE_KEY, NOT_PRIVATE_BANNER)
    if not isinstance(text, str) or not text.startswith("NOT PRIVATE"):
        raise ValueError(f"a privacy notice must start with 'NOT PRIVATE'; got {text!r}")
    return {NOT_PRIVATE_KEY: True, PRIVACY_NOTICE_KEY: text, **unmark(record)}


def unmark(record: Mapping) -> dict:
    """``record`` without the marker (to rebuild the typed object it was written from)."""
    return {k: v for k, v in record.items() if k not in (NOT_PRIVATE_KEY, PRIVACY_NOTICE_KEY)}


def _symlink_error(path: Path) -> OSError:
    return OSError(
        errno.ELOOP,
        "refusing to follow a symbolic link: this file holds or is derived from private data and is opened "
        "only as a regular file of its own (remove the link, or choose another path)",
        str(path),
    )


def refuse_symlink(path: str | os.PathLike) -> None:
    """Raise :class:`OSError` (``ELOOP``, a clear message) when ``path`` itself is a symbolic link,
    dangling or not (its parent directories may be links)."""
    path = Path(path)
    if path.is_symlink():
        raise _symlink_error(path)


def open_no_follow(path: str | os.PathLike, flags: int, mode: int = OWNER_ONLY) -> int:
    """``os.open(path, flags | O_NOFOLLOW | O_CLOEXEC, mode)``: a symbolic link at ``path`` is refused
    with a clear :class:`OSError` instead of being followed (a new file gets ``mode``, 0600 by default)."""
    path = Path(path)
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as err:
        if err.errno == errno.ELOOP or (err.errno == errno.EEXIST and path.is_symlink()):
            raise _symlink_error(path) from None
        raise


def owner_only_file(path: str | os.PathLike) -> Path:
    """Make ``path`` a regular owner-only file: create it with mode 0600, or tighten an existing file of
    this user's to 0600 (with a warning: it was readable by others until now). Refuses a symbolic link
    (even a dangling one) and a file another user owns (:class:`OSError`)."""
    path = Path(path)
    fd = open_no_follow(path, os.O_RDONLY | os.O_CREAT)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        loose = stat.S_IMODE(info.st_mode) & ~OWNER_ONLY
        if loose:
            if info.st_uid != os.geteuid():
                raise OSError(
                    errno.EPERM,
                    f"file of another user with mode {stat.S_IMODE(info.st_mode):o}: refusing to store data derived "
                    "from private texts in it (choose another path)",
                    str(path),
                )
            os.fchmod(fd, OWNER_ONLY)
            warnings.warn(
                f"{str(path)!r} was readable by others (mode {stat.S_IMODE(info.st_mode):o}); it holds data derived "
                "from private texts, so its mode is now 600 (owner only)",
                UserWarning,
                stacklevel=3,
            )
    finally:
        os.close(fd)
    return path


def _write(path: str | os.PathLike, data: bytes) -> Path:
    """Replace ``path`` atomically by an owner-only file holding ``data`` (never through a link)."""
    path = Path(path)
    refuse_symlink(path)
    atomic_write_bytes(path, data, mode=OWNER_ONLY, keep_mode=False)
    return path


def write_not_private_text(path: str | os.PathLike, text: str, *, markdown: bool = False) -> Path:
    """Write ``text`` (UTF-8) owner-only; a Markdown file (``markdown=True``) opens with
    :data:`NOT_PRIVATE_BANNER` and a blank line (added unless it is the first line already)."""
    if markdown and text.split("\n", 1)[0] != NOT_PRIVATE_BANNER:
        text = f"{NOT_PRIVATE_BANNER}\n\n{text}"
    return _write(path, text.encode("utf-8"))


def _marked(payload, notice: str | None):
    if isinstance(payload, Mapping):
        return mark_not_private(payload, notice)
    if isinstance(payload, (list, tuple)):
        return [mark_not_private(item, notice) if isinstance(item, Mapping) else item for item in payload]
    raise ValueError(f"a NOT PRIVATE JSON payload is an object or a list of objects; got {type(payload).__name__}")


def write_not_private_json(path: str | os.PathLike, payload, *, indent: int | None = 1, notice: str | None = None) -> Path:
    """Write ``payload`` (an object, or a list of objects) as JSON, owner-only, each object marked
    (:func:`mark_not_private`); key order is kept, a trailing newline added."""
    text = json.dumps(_marked(payload, notice), indent=indent) + "\n"
    return _write(path, text.encode("utf-8"))


def write_not_private_jsonl(path: str | os.PathLike, records: Iterable[Mapping], *, notice: str | None = None) -> Path:
    """Write ``records`` as JSON Lines, owner-only, each record marked (:func:`mark_not_private`)."""
    lines = (json.dumps(mark_not_private(r, notice), ensure_ascii=False) + "\n" for r in records)
    return _write(path, "".join(lines).encode("utf-8"))


def save_not_private_figure(fig, path: str | os.PathLike, **savefig_kwargs) -> Path:
    """``fig.savefig`` into an owner-only file at ``path`` (format from its suffix, PNG by default)."""
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix.lstrip(".").lower() or "png", **savefig_kwargs)
    return _write(path, buffer.getvalue())


def agg_pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def md_table(header: str | Sequence, rows: Iterable[Sequence] = ()) -> list[str]:
    """The lines of a Markdown table: ``header`` (its cells, or one string ``"a | b"``), the ``|---|``
    separator, then one line per row, each cell formatted as an f-string formats it."""
    cells = header.split(" | ") if isinstance(header, str) else header

    def line(row) -> str:
        return "| " + " | ".join(map(format, row)) + " |"

    return [line(cells), "|" + "---|" * len(cells), *map(line, rows)]
