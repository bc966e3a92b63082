"""Reading JSON from a file strictly: an object that repeats a key is refused, never read as its last value.

``json.loads`` keeps the last of a repeated key, and other readers keep the first: a file holding
``{"text": "a", "text": "b"}`` says two things, and whichever a reader sees, another reader sees the other (a
published record whose first ``text`` is a private reference, an input whose label filter matches a value that
another tool reads differently). Every JSON file the project reads (the budget ledger, a release's output, state
and journal, references and evaluation files) goes through :func:`loads_strict`; the caller names the file and
line, :class:`DuplicateKeyError` names the key only through :meth:`DuplicateKeyError.key_shown` (a key of a data
file may itself be data: the caller decides whether to show it).
"""

from __future__ import annotations

import json

__all__ = ["DuplicateKeyError", "loads_strict", "unique_keys"]


class DuplicateKeyError(ValueError):
    """A JSON object repeats ``key``. The message does not name the key (:meth:`key_shown` does)."""

    def __init__(self, key: str) -> None:
        super().__init__("a JSON object repeats a key (a reader keeping the first value would read another record)")
        self.key = key

    def key_shown(self) -> str:
        """The key as one printable ASCII line (control and other characters escaped), for a message."""
        return ascii(self.key)


def unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``object_pairs_hook`` for :func:`json.loads`: the object as a dict, or :class:`DuplicateKeyError` when a key
    appears twice."""
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise DuplicateKeyError(key)
        result[key] = value
    return result


def loads_strict(text: str | bytes | bytearray):
    """:func:`json.loads` that refuses an object repeating a key (:class:`DuplicateKeyError`, a ``ValueError``;
    invalid JSON is still :class:`json.JSONDecodeError`)."""
    return json.loads(text, object_pairs_hook=unique_keys)
