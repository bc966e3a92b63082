r"""Reading references and the data-independent partition into batches.

Parallel composition across texts (paper Corollary 11, coro:parallel-batches) needs the batches to be
*disjoint* and chosen *independently of the data*: the partition here takes references in input order,
``B`` at a time, and never drops, filters or reorders anything because of its content. An empty reference stays in
its position as a null (it contributes exactly the public logits). References that do not fill a
last batch, and batches beyond ``num_texts``, are unused and reported. So changing one reference
changes exactly one batch (or none), which is what the accounting assumes; the reference package's
``drop_empty=True`` shifts every later reference into another batch instead.

Readers: a list of strings, a CSV file (one column), or a JSON Lines file (one field). A missing CSV
cell or a JSON ``null`` reads as the empty string (a null reference).
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import io
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from accounting.limits import check_count

__all__ = [
    "ReferencesFile",
    "as_references",
    "LabelGroup",
    "LabelledBatch",
    "LabelledPartition",
    "LabelledReferences",
    "Partition",
    "labelled_partition",
    "partition_by_labels",
    "partition_references",
    "read_labelled_references",
    "read_references",
    "read_text",
    "select_references",
]

_CSV_SUFFIXES = (".csv",)
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


def read_references(source: str | os.PathLike, *, column: str | None = None) -> list[str]:
    """Read references from a ``.csv`` file (``column``, default ``text``) or a ``.jsonl`` file
    (field ``column``, default ``text``), in file order. Empty values are kept as ``""`` (nulls).

    Files are UTF-8, with or without a byte-order mark (Excel's "CSV UTF-8"). Error messages name the
    file, line numbers, positions and counts, never a cell, a key or a header name read from the file
    (a file without a header would otherwise print its first record). A ``str`` that names no file is
    not echoed either: it may be a reference passed where a path was expected.
    """
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(f"source must be a file path (str or os.PathLike); got {type(source).__name__}")
    if column is not None and (not isinstance(column, str) or not column):
        raise ValueError(f"column must be a non-empty string; got {column!r}")
    name = column or "text"
    path = Path(source)
    if isinstance(source, str) and not path.exists():
        # not echoed: a reference passed where a path is expected must not end up in a log
        raise ValueError(
            f"input file not found (a string of {len(source)} characters that names no file; the string is not "
            "shown, as it may be a reference: pass references as a list of strings, a path as a pathlib.Path)"
        )
    if path.is_dir():
        raise ValueError(f"input {str(path)!r} is a directory, not a .csv or .jsonl file")
    if not path.is_file():
        raise ValueError(f"input file not found: {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix not in _CSV_SUFFIXES + _JSONL_SUFFIXES:
        raise ValueError(f"input must be a .csv or .jsonl file; got {str(path)!r}")
    text = read_text(path)
    if suffix in _CSV_SUFFIXES:
        return _read_csv(path, text, name)
    return _read_jsonl(path, text, name)


def read_text(path: Path) -> str:
    """The file's text: UTF-8, a leading byte-order mark dropped; a decoding error names the line."""
    data = path.read_bytes()
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = skip + err.start
        line = data.count(b"\n", 0, offset) + 1
        raise ValueError(
            f"{str(path)!r} is not valid UTF-8: line {line} (byte offset {offset}) holds a byte sequence that is not "
            "UTF-8 (re-save the file as UTF-8; an encoded lone surrogate is not valid UTF-8 either)"
        ) from None


def _check_unicode(value: str, where: str) -> None:
    """Refuse strings that are not valid Unicode text (lone surrogates, e.g. from a JSON ``\\ud800``)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{where} holds a lone surrogate at character position {err.start}: not valid Unicode text"
        ) from None


def _read_csv(path: Path, text: str, column: str) -> list[str]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long references (e.g. court cases)
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{str(path)!r} is empty: no CSV header")
        # header names are not echoed: in a file without a header, the "header" is a private record
        positions = [i for i, field in enumerate(header) if field == column]
        if not positions:
            raise ValueError(
                f"column {column!r} not found in the header (line 1) of {str(path)!r}, which has {len(header)} "
                f"column(s) (their names are not shown: in a file without a header they would be a record); "
                "give the column holding the references with --column / column="
            )
        if len(positions) > 1:
            raise ValueError(
                f"column {column!r} appears {len(positions)} times in the header of {str(path)!r} (columns "
                f"{', '.join(str(p + 1) for p in positions)}); rename the duplicates so the column is unambiguous"
            )
        position = positions[0]
        references = []
        for row in reader:
            if not row:
                continue  # a blank line is not a record (csv.DictReader skips it too)
            value = row[position] if position < len(row) else ""
            _check_unicode(value, f"{str(path)!r} line {reader.line_num}")
            references.append(value)
    except csv.Error as err:
        raise ValueError(f"{str(path)!r} line {reader.line_num} is not valid CSV: {err}") from None
    return references


def jsonl_records(path: Path, text: str, field: str, hint: str):
    """Each ``(where, record, value)`` of the JSON Lines ``text`` read from ``path``: ``where`` names the file and
    the line, ``value`` is the record's ``field`` (``""`` for null). Blank lines are not records; a line that is
    not a JSON object, or whose ``field`` is missing (``hint``: how to name another) or not a string or null, is
    refused with a message naming the line, never its text or its keys (they may be data)."""
    # split on "\n" only: a JSON string may hold U+2028 or U+0085, which str.splitlines() would split on
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{str(path)!r} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            # the decoder's message names a position (line/column/char), never the text
            raise ValueError(f"{where} is not valid JSON: {err.msg} (column {err.colno})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{where}: expected a JSON object; got {type(record).__name__}")
        if field not in record:
            raise ValueError(
                f"{where}: field {field!r} missing (the record has {len(record)} other field(s); their names are not "
                f"shown); {hint}"
            )
        value = "" if record[field] is None else record[field]
        if not isinstance(value, str):
            raise ValueError(f"{where}: field {field!r} must be a string or null; got {type(value).__name__}")
        yield where, record, value


def _read_jsonl(path: Path, text: str, field: str) -> list[str]:
    references = []
    for where, _, value in jsonl_records(path, text, field, "give the field holding the references with --column / column="):
        _check_unicode(value, where)
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


def _check_references(references) -> None:
    if isinstance(references, str) or not isinstance(references, Sequence):
        raise ValueError(f"references must be a sequence of strings; got {type(references).__name__}")


def _clean_reference(i: int, reference: str | None) -> str:
    """``references[i]`` as partitioned: ``None`` becomes ``""`` (null); anything but a valid string is refused."""
    if reference is None:
        reference = ""
    if not isinstance(reference, str):
        raise ValueError(f"references[{i}] must be a string or None; got {type(reference).__name__}")
    _check_unicode(reference, f"references[{i}]")
    return reference


def partition_references(
    references: Sequence[str | None], batch_size: int, *, num_texts: int | None = None
) -> Partition:
    """Split ``references`` into consecutive disjoint batches of ``batch_size`` (paper Corollary 11).

    ``num_texts``: use the first ``num_texts`` batches (one text each); ``None`` uses every full batch.
    ``None`` references become ``""`` (null); nothing else is changed, dropped or reordered.
    """
    check_count("batch_size", batch_size)
    _check_references(references)
    cleaned = [_clean_reference(i, reference) for i, reference in enumerate(references)]
    available = len(cleaned) // batch_size
    num_texts = check_count("num_texts", num_texts, allow_none=True)
    count = available if num_texts is None else num_texts
    if count > available:
        raise ValueError(
            f"num_texts={num_texts} needs {num_texts * batch_size} references at batch_size={batch_size}; "
            f"got {len(cleaned)} (enough for {available})"
        )
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


# --------------------------------------------------------------------------------------------
# label-conditioned partition (paper App. D.1 Table 4 (tab:prompts) and App. D.2 (sec:datasets), Yelp: each text is
# generated from references of one business category and star rating, and prompted with them)


@dataclasses.dataclass(frozen=True)
class LabelledReferences:
    """References read with their label columns: ``labels[i]`` maps each of ``label_columns`` to the
    value of record ``i`` (a missing CSV cell or JSON ``null`` reads as ``""``)."""

    texts: tuple[str, ...]
    labels: tuple[Mapping[str, str], ...]
    label_columns: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.labels):
            raise ValueError(f"{len(self.texts)} texts but {len(self.labels)} label mappings")
        columns = tuple(self.label_columns)
        object.__setattr__(self, "label_columns", columns)
        frozen = []
        for i, mapping in enumerate(self.labels):
            if set(mapping) != set(columns):
                raise ValueError(f"labels[{i}] must have exactly the label columns {list(columns)}")
            frozen.append(MappingProxyType({c: mapping[c] for c in columns}))
        object.__setattr__(self, "texts", tuple(self.texts))
        object.__setattr__(self, "labels", tuple(frozen))


def _check_label_columns(label_columns: Sequence[str], column: str) -> tuple[str, ...]:
    if isinstance(label_columns, str) or not isinstance(label_columns, Sequence) or not label_columns:
        raise ValueError(f"label_columns must be a non-empty sequence of column names; got {label_columns!r}")
    columns = tuple(label_columns)
    for name in columns:
        if not isinstance(name, str) or not name:
            raise ValueError(f"each label column must be a non-empty string; got {name!r}")
    if len(set(columns)) != len(columns):
        raise ValueError(f"label_columns must not repeat a column; got {list(columns)}")
    if column in columns:
        raise ValueError(f"the text column {column!r} cannot also be a label column")
    return columns


@dataclasses.dataclass(frozen=True)
class ReferencesFile:
    """A references file to read: ``path`` (``.csv`` or ``.jsonl``, UTF-8, with or without a byte-order mark),
    the text ``column`` (default ``text``) and, for label-conditioned generation, its ``label_columns`` (e.g.
    ``("label1", "label2")`` for Yelp)."""

    path: str | os.PathLike
    column: str | None = None
    label_columns: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(os.fspath(self.path)).strip():
            # a list of references given here by mistake is private: it is named by its type only
            raise ValueError(f"path must be a file path (str or os.PathLike); got {type(self.path).__name__}")
        if self.label_columns is not None:
            object.__setattr__(self, "label_columns", _check_label_columns(self.label_columns, self.column or "text"))

    def read(self) -> list[str] | LabelledReferences:
        """The references (:func:`read_references`), or with ``label_columns`` the labelled ones
        (:func:`read_labelled_references`)."""
        if self.label_columns is None:
            return read_references(self.path, column=self.column)
        return read_labelled_references(self.path, column=self.column, label_columns=self.label_columns)


def as_references(references) -> Sequence[str | None] | LabelledReferences:
    """References in any form ``generate`` takes, read: a :class:`ReferencesFile` is read, a path is read
    with :func:`read_references` (field ``text``), anything else (a list, :class:`LabelledReferences`) is
    returned as given."""
    if isinstance(references, ReferencesFile):
        return references.read()
    if isinstance(references, (str, os.PathLike)):
        return read_references(references)
    return references


def read_labelled_references(
    source: str | os.PathLike, *, column: str | None = None, label_columns: Sequence[str]
) -> LabelledReferences:
    """Read references (``column``, default ``text``) and the ``label_columns`` of each record, in file
    order, from a ``.csv`` or ``.jsonl`` file. The same rules as :func:`read_references` (encodings,
    errors that never echo a cell, key or header); each label column is read exactly as a text column is
    (a missing cell or ``null`` is ``""``). Label values are public attributes of each record's slot (see
    :func:`partition_by_labels`)."""
    name = column or "text"
    columns = _check_label_columns(label_columns, name)
    texts = read_references(source, column=name)
    per_column = [read_references(source, column=c) for c in columns]
    labels = tuple({c: values[i] for c, values in zip(columns, per_column)} for i in range(len(texts)))
    return LabelledReferences(texts=tuple(texts), labels=labels, label_columns=columns)


def select_references(
    source: str | os.PathLike,
    where: Mapping[str, str],
    *,
    column: str | None = None,
    label_columns: Sequence[str] = (),
) -> list[str] | LabelledReferences:
    """The records of ``source`` whose columns equal every value of ``where`` (``{column: value}``, e.g.
    ``{"label1": "Business Category: Restaurants"}``), in file order: their texts (``column``), or with
    ``label_columns`` a :class:`LabelledReferences` of them.

    The ``where`` columns are **public attributes of each record's slot**, as labels are
    (:func:`partition_by_labels`): under replace-by-null a neighbour empties one record's text and keeps
    its attributes, so the same records are selected from both. The text column itself is refused (a
    null text would leave the selection: a partition that depends on a private text). Values are
    compared exactly, as read (a missing CSV cell or JSON ``null`` is ``""``)."""
    if not isinstance(where, Mapping) or not where:
        raise ValueError("where must map at least one column to the value its records must have")
    name = column or "text"
    for key, value in where.items():
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise ValueError(f"where must map column names to string values; got {key!r}: {value!r}")
        if key == name:
            raise ValueError(
                f"where must not select on the text column {name!r}: the selection would depend on private texts"
            )
    labels = tuple(label_columns)
    extra = [c for c in where if c not in labels]
    everything = read_labelled_references(source, column=column, label_columns=(*labels, *extra))
    keep = [i for i, row in enumerate(everything.labels) if all(row[c] == v for c, v in where.items())]
    if not keep:
        raise ValueError(f"{Path(source).name}: no record has {', '.join(f'{c}={v}' for c, v in where.items())}")
    texts = [everything.texts[i] for i in keep]
    if not labels:
        return texts
    return LabelledReferences(
        texts=tuple(texts), labels=tuple({c: everything.labels[i][c] for c in labels} for i in keep), label_columns=labels
    )


def labelled_partition(
    labelled: LabelledReferences, batch_size: int, *, num_texts_per_group: int | None = None
) -> tuple[Partition, tuple[dict, ...], tuple[tuple[int, ...], ...]]:
    """A label-conditioned release's batches as a :class:`Partition` (:func:`partition_by_labels`), each
    batch's labels, and each batch's reference positions in the input."""
    grouped = partition_by_labels(labelled.texts, labelled.labels, batch_size, num_texts_per_group=num_texts_per_group)
    if not grouped.batches:
        raise ValueError(f"no label group holds a full batch of {batch_size} references")
    partition = Partition(
        batches=tuple(b.references for b in grouped.batches), batch_size=batch_size,
        num_references=grouped.num_references, num_leftover=grouped.num_unused, num_skipped=0,
    )  # fmt: skip
    return partition, tuple(dict(b.labels) for b in grouped.batches), tuple(b.positions for b in grouped.batches)


@dataclasses.dataclass(frozen=True)
class LabelledBatch:
    """One batch of ``B`` references that share their labels.

    ``labels``: label column → value (the group's); ``group``: the group's index in
    :attr:`LabelledPartition.groups`; ``index_in_group``: the batch's position within its group (batch
    ``j`` holds the group's references ``j·B .. (j+1)·B − 1`` in input order); ``positions``: the
    references' 0-based positions in the input (for messages that must not echo a reference)."""

    references: tuple[str, ...]
    labels: Mapping[str, str]
    group: int
    index_in_group: int
    positions: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LabelGroup:
    """One label group: its labels, how many references it has, and how many of them are unused."""

    labels: Mapping[str, str]
    num_references: int
    num_batches: int
    num_leftover: int
    num_skipped: int


@dataclasses.dataclass(frozen=True)
class LabelledPartition:
    """Disjoint batches of ``batch_size`` references, each within one label group (paper Corollary 11
    per group). ``batches`` are ordered by group (groups sorted by their label values), then by
    ``index_in_group``."""

    batches: tuple[LabelledBatch, ...]
    groups: tuple[LabelGroup, ...]
    batch_size: int
    label_columns: tuple[str, ...]
    num_references: int

    @property
    def num_unused(self) -> int:
        """References in no generated batch (leftovers of each group and skipped batches)."""
        return self.num_references - len(self.batches) * self.batch_size


def _check_labelled_arguments(references, labels, batch_size, num_texts_per_group) -> None:
    """The checks of :func:`partition_by_labels` that need no record: sizes, types, lengths."""
    check_count("batch_size", batch_size)
    check_count("num_texts_per_group", num_texts_per_group, allow_none=True)
    _check_references(references)
    if isinstance(labels, (str, Mapping)) or not isinstance(labels, Sequence):
        raise ValueError("labels must be a sequence of mappings (label column -> value), one per reference")
    if len(labels) != len(references):
        raise ValueError(f"got {len(references)} references but {len(labels)} label mappings")
    if not references:
        raise ValueError("references must not be empty")


def _label_key(i: int, mapping, columns: tuple[str, ...] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``labels[i]`` checked: its columns (sorted; those of ``labels[0]`` when ``columns`` is None) and its
    values in that order (the record's group key)."""
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(f"labels[{i}] must be a non-empty mapping of label column to value")
    if columns is None:
        columns = tuple(sorted(mapping))
    elif tuple(sorted(mapping)) != columns:
        raise ValueError(f"labels[{i}] has other label columns than labels[0] (expected {list(columns)})")
    key = []
    for name in columns:
        value = mapping[name]
        if not isinstance(value, str):
            raise ValueError(f"labels[{i}][{name!r}] must be a string; got {type(value).__name__}")
        _check_unicode(value, f"labels[{i}][{name!r}]")
        key.append(value)
    return columns, tuple(key)


def _group_records(references, labels) -> tuple[list[str], tuple[str, ...], dict[tuple[str, ...], list[int]]]:
    """Each record checked in input order (its reference, then its labels): the cleaned references, the label
    columns, and each group key's record positions in input order."""
    columns: tuple[str, ...] | None = None
    members: dict[tuple[str, ...], list[int]] = {}
    cleaned: list[str] = []
    for i, (reference, mapping) in enumerate(zip(references, labels)):
        cleaned.append(_clean_reference(i, reference))
        columns, key = _label_key(i, mapping, columns)
        members.setdefault(key, []).append(i)
    return cleaned, columns or (), members


def _batch_group(
    group: int, labels: dict[str, str], positions: list[int], cleaned: list[str], batch_size: int,
    num_texts_per_group: int | None,
) -> tuple[list[LabelledBatch], LabelGroup]:  # fmt: skip
    """One group's batches (its references ``j·B .. (j+1)·B − 1``, first ``num_texts_per_group`` of them) and its
    summary."""
    group_labels = MappingProxyType(labels)
    available = len(positions) // batch_size
    count = available if num_texts_per_group is None else min(available, num_texts_per_group)
    batches = []
    for j in range(count):
        slot = tuple(positions[j * batch_size : (j + 1) * batch_size])
        batches.append(
            LabelledBatch(
                references=tuple(cleaned[p] for p in slot), labels=group_labels, group=group, index_in_group=j,
                positions=slot,
            )
        )  # fmt: skip
    summary = LabelGroup(
        labels=group_labels,
        num_references=len(positions),
        num_batches=count,
        num_leftover=len(positions) - available * batch_size,
        num_skipped=available - count,
    )
    return batches, summary


def partition_by_labels(
    references: Sequence[str | None],
    labels: Sequence[Mapping[str, str]],
    batch_size: int,
    *,
    num_texts_per_group: int | None = None,
) -> LabelledPartition:
    """Partition ``references`` into disjoint batches of ``batch_size`` *within each label group*.

    Records are grouped by the tuple of their label values (every mapping must have the same
    columns); a group's batch ``j`` is its references ``j·B .. (j+1)·B − 1`` in input order, and the
    references that do not fill a last batch of a group are unused (reported per group). Nothing is
    read from any reference's text: which batch a record lands in depends on its position and the labels
    of the records before it, never on a text, and an empty reference stays in its slot as a null.
    ``num_texts_per_group``: use only each group's first batches (``None``: every full batch).

    What this assumes: labels are *public* attributes of each slot. Under replace-by-null adjacency a
    neighbouring dataset empties one record's text and keeps its label, so it changes exactly one batch
    (or none) and the batches compose in parallel (paper Corollary 11). Changing a record's *label*
    moves it to another group and shifts later records of two groups: that is not a neighbour this
    guarantee covers.
    """
    _check_labelled_arguments(references, labels, batch_size, num_texts_per_group)
    cleaned, columns, members = _group_records(references, labels)
    batches: list[LabelledBatch] = []
    groups: list[LabelGroup] = []
    for group, key in enumerate(sorted(members)):
        group_batches, summary = _batch_group(
            group, dict(zip(columns, key)), members[key], cleaned, batch_size, num_texts_per_group
        )
        batches += group_batches
        groups.append(summary)
    if not batches:
        raise ValueError(
            f"batch_size={batch_size} needs at least {batch_size} references with the same labels; no label group "
            f"of the {len(cleaned)} references has that many"
        )
    return LabelledPartition(
        batches=tuple(batches),
        groups=tuple(groups),
        batch_size=batch_size,
        label_columns=columns,
        num_references=len(cleaned),
    )
