r"""Reading references and the data-independent partition into batches.

Parallel composition across texts (paper Corollary 1) needs the batches to be *disjoint* and chosen
*independently of the data*: the partition here takes references in input order, ``B`` at a time,
and never drops, filters or reorders anything because of its content. An empty reference stays in
its position as a null (it contributes exactly the public logits). References that do not fill a
last batch, and batches beyond ``num_texts``, are unused and reported. So changing one reference
changes exactly one batch (or none), which is what the accounting assumes; the reference package's
``drop_empty=True`` shifts every later reference into another batch instead.

Readers: a list of strings, a CSV file (one column), or a JSON Lines file (one field). A missing CSV
cell or a JSON ``null`` reads as the empty string (a null reference).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Partition", "partition_references", "read_references"]

_CSV_SUFFIXES = (".csv",)
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


def read_references(source: str | os.PathLike, *, column: str | None = None) -> list[str]:
    """Read references from a ``.csv`` file (``column``, default ``text``) or a ``.jsonl`` file
    (field ``column``, default ``text``), in file order. Empty values are kept as ``""`` (nulls)."""
    path = Path(source)
    if column is not None and (not isinstance(column, str) or not column):
        raise ValueError(f"column must be a non-empty string; got {column!r}")
    name = column or "text"
    suffix = path.suffix.lower()
    if not path.is_file():
        raise ValueError(f"input file not found: {str(path)!r}")
    if suffix in _CSV_SUFFIXES:
        return _read_csv(path, name)
    if suffix in _JSONL_SUFFIXES:
        return _read_jsonl(path, name)
    raise ValueError(f"input must be a .csv or .jsonl file; got {str(path)!r}")


def _read_csv(path: Path, column: str) -> list[str]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long references (e.g. court cases)
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames is None:
            raise ValueError(f"{str(path)!r} is empty: no CSV header")
        if column not in reader.fieldnames:
            raise ValueError(f"column {column!r} not found in {str(path)!r}; columns: {reader.fieldnames}")
        return [row[column] or "" for row in reader]


def _read_jsonl(path: Path, field: str) -> list[str]:
    references = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue  # blank lines are not records
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{str(path)!r} line {number} is not valid JSON: {err}") from err
            if not isinstance(record, dict):
                raise ValueError(f"{str(path)!r} line {number}: expected a JSON object; got {type(record).__name__}")
            if field not in record:
                raise ValueError(f"{str(path)!r} line {number}: field {field!r} missing; fields: {sorted(record)}")
            value = record[field]
            if value is None:
                value = ""
            if not isinstance(value, str):
                raise ValueError(
                    f"{str(path)!r} line {number}: field {field!r} must be a string or null; got {type(value).__name__}"
                )
            references.append(value)
    return references


@dataclasses.dataclass(frozen=True)
class Partition:
    """Disjoint batches of ``batch_size`` references, in input order.

    ``batches[i]`` holds references ``i*B .. (i+1)*B - 1`` of the input. ``num_leftover`` references
    did not fill a last batch; ``num_skipped`` full batches were beyond ``num_texts``. Both are unused.
    """

    batches: tuple[tuple[str, ...], ...]
    batch_size: int
    num_references: int
    num_leftover: int
    num_skipped: int

    def __post_init__(self) -> None:
        if any(len(batch) != self.batch_size for batch in self.batches):
            raise ValueError(f"every batch must hold exactly batch_size={self.batch_size} references")
        used = len(self.batches) * self.batch_size
        if used + self.num_leftover + self.num_skipped * self.batch_size != self.num_references:
            raise ValueError("partition counts do not add up to num_references")

    @property
    def num_unused(self) -> int:
        """References that belong to no generated batch."""
        return self.num_references - len(self.batches) * self.batch_size


def partition_references(
    references: Sequence[str | None], batch_size: int, *, num_texts: int | None = None
) -> Partition:
    """Split ``references`` into consecutive disjoint batches of ``batch_size`` (paper Corollary 1).

    ``num_texts``: use the first ``num_texts`` batches (one text each); ``None`` uses every full batch.
    ``None`` references become ``""`` (null); nothing else is changed, dropped or reordered.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1; got {batch_size!r}")
    if isinstance(references, str) or not isinstance(references, Sequence):
        raise ValueError(f"references must be a sequence of strings; got {type(references).__name__}")
    cleaned = []
    for i, reference in enumerate(references):
        if reference is None:
            reference = ""
        if not isinstance(reference, str):
            raise ValueError(f"references[{i}] must be a string or None; got {type(reference).__name__}")
        cleaned.append(reference)
    available = len(cleaned) // batch_size
    if num_texts is None:
        count = available
    elif isinstance(num_texts, bool) or not isinstance(num_texts, int) or num_texts < 1:
        raise ValueError(f"num_texts must be an integer >= 1 or None; got {num_texts!r}")
    elif num_texts > available:
        raise ValueError(
            f"num_texts={num_texts} needs {num_texts * batch_size} references at batch_size={batch_size}; "
            f"got {len(cleaned)} (enough for {available})"
        )
    else:
        count = num_texts
    if count == 0:
        raise ValueError(f"batch_size={batch_size} needs at least {batch_size} references; got {len(cleaned)}")
    batches = tuple(tuple(cleaned[i * batch_size : (i + 1) * batch_size]) for i in range(count))
    return Partition(
        batches=batches,
        batch_size=batch_size,
        num_references=len(cleaned),
        num_leftover=len(cleaned) - available * batch_size,
        num_skipped=available - count,
    )
