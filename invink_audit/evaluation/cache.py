"""Per-text caches of what an evaluation derives from a text (embeddings, perplexities): one owner-only SQLite file
per kind, keyed by what produced the value and the text's SHA-256 (docs/guide/evaluating.md, §"Caches"). Concurrent
processes may share a file: SQLite serialises the writers, and a value is the same whoever computes it.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from invink_audit.not_private import owner_only_file

__all__ = ["TextCache", "check_texts", "text_digest"]

#: rows per ``SELECT ... IN (...)`` (below SQLite's default limit of 999 host parameters)
_CHUNK = 500


def check_texts(texts) -> None:
    """``texts`` a sequence of strings (one string is not); a ``ValueError`` naming the first item that is not."""
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise ValueError(f"texts must be a sequence of strings; got {type(texts).__name__}")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ValueError(f"texts[{i}] must be a string; got {type(text).__name__}")


def text_digest(text: str) -> str:
    """SHA-256 of ``text`` (UTF-8; lone surrogates kept), the per-text part of every cache key."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class TextCache:
    """SQLite store ``key → vector of dtype`` in table ``table`` of the file ``path`` (owner-only, 0600;
    a symbolic link at ``path`` is refused with :class:`OSError`)."""

    def __init__(self, path: Path, table: str, dtype: str = "float32") -> None:
        if not table.isidentifier():
            raise ValueError(f"table must be an identifier; got {table!r}")
        self.path, self.table, self.dtype = Path(path), table, np.dtype(dtype)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        owner_only_file(self.path)  # derived from private texts: owner only, never through a link
        self._db = sqlite3.connect(str(self.path), timeout=60)
        self._db.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, vector BLOB NOT NULL)")
        self._db.commit()

    def get_many(self, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The stored vectors of those ``keys`` that are present."""
        found = {}
        for start in range(0, len(keys), _CHUNK):
            chunk = list(keys[start : start + _CHUNK])
            marks = ",".join("?" * len(chunk))
            query = f"SELECT key, vector FROM {self.table} WHERE key IN ({marks})"
            for key, blob in self._db.execute(query, chunk):
                found[key] = np.frombuffer(blob, dtype=self.dtype)
        return found

    def put_many(self, items: dict[str, np.ndarray]) -> None:
        """Store (or replace) ``items`` in one transaction."""
        self._db.executemany(
            f"INSERT OR REPLACE INTO {self.table} (key, vector) VALUES (?, ?)",
            [(k, np.ascontiguousarray(v, dtype=self.dtype).tobytes()) for k, v in items.items()],
        )
        self._db.commit()

    def close(self) -> None:
        self._db.close()
