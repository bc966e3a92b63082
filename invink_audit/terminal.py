"""Text shown on a terminal: what the command line prints is escaped here when it may hold characters a
terminal would interpret (a path, a file's field, a library's message quoting a file).

Files are written as they are; only what is printed goes through :func:`printable`.
"""

from __future__ import annotations

__all__ = ["printable"]


def printable(value, limit: int | None = None) -> str:
    """``value`` as text safe for a terminal: every non-printable character (C0 controls, newline and tab
    included, ESC and so escape sequences, DEL, C1 controls, bidirectional overrides such as U+202E and other
    format characters) written as its Python escape, as ``repr`` does (``"\\x1b"``, ``"\\u202e"``), so
    that one line stays one line; at most ``limit`` characters kept (``None``: all). Anything but a string
    is shown as its ``repr``."""
    text = value if isinstance(value, str) else repr(value)
    shown = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[: None if limit is None else limit + 1])
    if limit is not None and len(shown) > limit:
        return f"{shown[:limit]}... ({len(text)} characters)"
    return shown
