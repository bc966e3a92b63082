r"""Reading references and the data-independent partition into batches.

Parallel composition across texts (paper Corollary 11, coro:parallel-batches) needs *disjoint* batches chosen
*independently of the data*: references are taken in input order, ``B`` at a time, and never dropped, filtered or
reordered because of their content (an empty one stays in its position as a null, contributing exactly the public
logits), so changing one reference changes exactly one batch or none; unused references are reported (the
reference package's ``drop_empty=True`` shifts every later reference into another batch instead). Files are read
a line at a time, quotes strictly and every field bounded (:func:`text_lines`, :data:`MAX_FIELD_CHARS`): bad
input is refused in one line naming the file and the line, never its text. Guide: docs/guide/generating.md.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import enum
import json
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

from accounting.limits import check_count
from accounting.strict_json import DuplicateKeyError, loads_strict

__all__ = [
    "ContributionRule",
    "PrivacyUnit",
    "RULE_STATEMENTS",
    "UNIT_SEPARATOR",
    "UnitReferences",
    "read_unit_references",
    "unit_partition",
    "unit_slots",
    "MAX_FIELD_CHARS",
    "MAX_LINE_BYTES",
    "ReferencesFile",
    "as_references",
    "check_unicode",
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
    "text_lines",
]

_CSV_SUFFIXES = (".csv",)
_JSONL_SUFFIXES = (".jsonl", ".ndjson")

#: The longest field a references file may hold, in characters (a CSV cell, a JSON Lines record's text): about
#: 250,000 tokens, beyond the context of any model this package runs. A longer one is refused while the file is
#: read, before it is held in memory whole (it would only be refused later, as too long for the model, after
#: seconds to minutes of tokenizing and gigabytes of memory).
MAX_FIELD_CHARS = 1_000_000
#: The longest physical line a references file may hold, in bytes: room for a field of :data:`MAX_FIELD_CHARS`
#: characters written as JSON ``\uXXXX`` escapes (6 bytes each) and the record's other fields. Lines are read
#: one at a time, each at most this long, so a file is refused in memory bounded by it, whatever its size.
MAX_LINE_BYTES = 8 * MAX_FIELD_CHARS


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
    if suffix in _CSV_SUFFIXES:
        return _read_csv(path, name)
    return _read_jsonl(path, name)


def read_text(path: Path) -> str:
    """The file's text: UTF-8, a leading byte-order mark dropped; a decoding error names the line."""
    data = path.read_bytes()
    skip = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = skip + err.start
        raise _not_utf8(path, data.count(b"\n", 0, offset) + 1, offset) from None


def check_unicode(value: str, where: str) -> None:
    """Refuse strings that are not valid Unicode text (lone surrogates, e.g. from a JSON ``\\ud800``): a
    ``ValueError`` naming ``where`` and the character's position, never the text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"{where} holds a lone surrogate at character position {err.start}: not valid Unicode text"
        ) from None


def _not_utf8(path: Path, line: int, offset: int) -> ValueError:
    return ValueError(
        f"{str(path)!r} is not valid UTF-8: line {line} (byte offset {offset}) holds a byte sequence that is not "
        "UTF-8 (re-save the file as UTF-8; an encoded lone surrogate is not valid UTF-8 either)"
    )


def text_lines(path: str | os.PathLike) -> Iterator[str]:
    """The file's lines (split on ``"\\n"`` only, each with its line ending), decoded as UTF-8 (a leading
    byte-order mark dropped), read one at a time. A line longer than :data:`MAX_LINE_BYTES` is refused after
    reading at most that many bytes of it, so the memory it takes is bounded whatever the file holds; a byte
    sequence that is not UTF-8 is refused naming its line. Messages name the file and the line, never its text."""
    path = Path(path)
    with path.open("rb") as stream:
        number, offset = 0, 0
        while raw := stream.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(
                    f"{str(path)!r} line {number} is longer than {MAX_LINE_BYTES:,} bytes (refused without reading the "
                    f"rest of it: a field may hold at most {MAX_FIELD_CHARS:,} characters, beyond any model's "
                    "context); truncate every reference to one fixed length first (a rule that does not depend on the data)"
                )
            skip = len(codecs.BOM_UTF8) if number == 1 and raw.startswith(codecs.BOM_UTF8) else 0
            try:
                line = raw[skip:].decode("utf-8")
            except UnicodeDecodeError as err:
                raise _not_utf8(path, number, offset + skip + err.start) from None
            offset += len(raw)
            yield line


def _csv_lines(lines: Iterable[str]) -> Iterator[str]:
    """``lines`` with a lone ``"\\r"`` also ending a line (old Mac files), as a file opened with ``newline=""``
    gives them to the csv module."""
    for line in lines:
        if "\r" in line.rstrip("\r\n"):
            yield from re.split(r"(?<=\r)(?!\n)", line)
        else:
            yield line


def _csv_error(path: Path, start: int, end: int, err: csv.Error) -> ValueError:
    """The one-line message of a CSV parse error in the record that starts on line ``start`` (read up to ``end``)."""
    where, reason = f"{str(path)!r} line {start}", str(err)
    if "field limit" in reason:
        return ValueError(
            f"{where}: the record starting on this line holds a field longer than {MAX_FIELD_CHARS:,} characters (the "
            "bound on one field, beyond any model's context; refused without reading the rest), or a quote opened in "
            "it is never closed; truncate every reference to one fixed length first, or close the quote (a quote "
            'inside a quoted field is written twice: "")'
        )
    if "unexpected end of data" in reason:
        return ValueError(
            f"{where}: a quote opened in the record starting on this line is never closed (the file ends inside it, "
            f"at line {end}), so every line after it would read as one field; close the quote, or write a quote "
            'inside a quoted field twice ("")'
        )
    if "expected after" in reason:
        return ValueError(
            f"{where}: a quoted field opened in the record starting on this line closes on line {end} but text follows "
            "its closing quote before the next delimiter (a stray or unescaped quote: a field that starts with a quote "
            'must be quoted whole, with each quote inside it written twice: "")'
        )
    return ValueError(f"{where} is not valid CSV: {reason}")  # the csv module names characters, never a cell


def _csv_records(path: Path) -> Iterator[tuple[int, list[str]]]:
    """``(line, row)`` of each CSV record of ``path``, ``line`` the line it starts on. Strict quoting (a quote that
    opens a field must close it, right before a delimiter or the line's end) and :data:`MAX_FIELD_CHARS`, checked
    as the file is read: a stray quote is refused naming the line where its record starts, instead of swallowing
    the lines after it into one field."""
    reader = csv.reader(_csv_lines(text_lines(path)), strict=True)
    previous = csv.field_size_limit(MAX_FIELD_CHARS)
    try:
        while True:
            start = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                return
            except csv.Error as err:
                raise _csv_error(path, start, reader.line_num, err) from None
            yield start, row
    finally:
        csv.field_size_limit(previous)


def _read_csv(path: Path, column: str) -> list[str]:
    records = _csv_records(path)
    first = next(records, None)
    if first is None:
        raise ValueError(f"{str(path)!r} is empty: no CSV header")
    header = first[1]
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
    # a blank line is not a record (csv.DictReader skips it too)
    return [row[position] if position < len(row) else "" for _, row in records if row]


def jsonl_records(path: Path, lines: str | Iterable[str], field: str, hint: str):
    """Each ``(where, record, value)`` of the JSON Lines read from ``path`` (``lines``: its :func:`text_lines`, or
    its whole text): ``where`` names the file and the line, ``value`` is the record's ``field`` (``""`` for null).
    Blank lines are not records; a line that is not a JSON object, repeats a key in any of its objects (read as
    its last value by ``json.loads``, its first by other readers), or whose ``field`` is missing (``hint``: how to
    name another), not a string or null, longer than :data:`MAX_FIELD_CHARS` or not valid Unicode (a lone
    surrogate, e.g. a JSON ``"\\ud800"`` escape), is refused with a message naming the line, never its text or its
    keys (they may be data)."""
    # split on "\n" only: a JSON string may hold U+2028 or U+0085, which str.splitlines() would split on
    for number, line in enumerate(lines.split("\n") if isinstance(lines, str) else lines, start=1):
        if not line.strip():
            continue
        where = f"{str(path)!r} line {number}"
        try:
            record = loads_strict(line)
        except json.JSONDecodeError as err:
            # the decoder's message names a position (line/column/char), never the text
            raise ValueError(f"{where} is not valid JSON: {err.msg} (column {err.colno})") from None
        except DuplicateKeyError:  # json.loads would keep the last value, another reader the first
            raise ValueError(f"{where}: a JSON object repeats a key (its name is not shown: it may be data); give "
                             "each field once") from None
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
        if len(value) > MAX_FIELD_CHARS:
            raise ValueError(
                f"{where}: field {field!r} holds {len(value):,} characters, more than the {MAX_FIELD_CHARS:,} "
                "characters a field may hold (beyond any model's context); truncate every reference to one fixed "
                "length first"
            )
        check_unicode(value, where)
        yield where, record, value


def _read_jsonl(path: Path, field: str) -> list[str]:
    hint = "give the field holding the references with --column / column="
    return [value for _, _, value in jsonl_records(path, text_lines(path), field, hint)]


@dataclasses.dataclass(frozen=True)
class Partition:
    """Disjoint batches of ``batch_size`` references, in input order: ``batches[i]`` holds references
    ``i*B .. (i+1)*B - 1``; ``num_leftover`` references did not fill a last batch and ``num_skipped`` full
    batches were beyond ``num_texts`` (both unused). A per-unit release's partition (:func:`unit_partition`) has
    ``units``: each slot's privacy-unit ordinal (``num_references`` counting the slots after the unit's rule),
    kept in memory for the auditor's neighbours and never written.
    """

    batches: tuple[tuple[str, ...], ...]
    batch_size: int
    num_references: int
    num_leftover: int
    num_skipped: int
    units: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        if any(len(batch) != self.batch_size for batch in self.batches):
            raise ValueError(f"every batch must hold exactly batch_size={self.batch_size} references")
        if self.units is not None and [len(u) for u in self.units] != [len(b) for b in self.batches]:
            raise ValueError("units must give one unit ordinal per slot of every batch")
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
    check_unicode(reference, f"references[{i}]")
    return reference


def partition_references(
    references: Sequence[str | None], batch_size: int, *, num_texts: int | None = None
) -> Partition:
    """Split ``references`` into consecutive disjoint batches of ``batch_size`` (paper Corollary 11): the first
    ``num_texts`` (``None``: every full batch). ``None`` references become ``""`` (null); nothing else is changed,
    dropped or reordered."""
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
    privacy_unit: PrivacyUnit | str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(os.fspath(self.path)).strip():
            # a list of references given here by mistake is private: it is named by its type only
            raise ValueError(f"path must be a file path (str or os.PathLike); got {type(self.path).__name__}")
        if self.label_columns is not None:
            object.__setattr__(self, "label_columns", _check_label_columns(self.label_columns, self.column or "text"))
        object.__setattr__(self, "privacy_unit", PrivacyUnit.of(self.privacy_unit))

    def read(self) -> list[str] | LabelledReferences | UnitReferences:
        """The references (:func:`read_references`), with ``label_columns`` the labelled ones
        (:func:`read_labelled_references`), with ``privacy_unit`` (a :class:`PrivacyUnit`, or a column name for
        rule ``combine``) each with its unit (:func:`read_unit_references`)."""
        if self.privacy_unit is not None:
            return read_unit_references(self.path, self.privacy_unit, column=self.column, label_columns=self.label_columns)
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

    The ``where`` columns are **public attributes of each record's slot**, as labels are: a replace-by-null
    neighbour keeps them, so the same records are selected from both; the text column itself is refused (a
    partition would depend on a private text). Values are compared exactly, as read (a missing CSV cell or JSON
    ``null`` is ``""``)."""
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
        check_unicode(value, f"labels[{i}][{name!r}]")
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
    slots = [tuple(positions[j * batch_size : (j + 1) * batch_size]) for j in range(count)]
    batches = [
        LabelledBatch(references=tuple(cleaned[p] for p in slot), labels=group_labels, group=group, index_in_group=j,
                      positions=slot)
        for j, slot in enumerate(slots)
    ]  # fmt: skip
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
    """Partition ``references`` into disjoint batches of ``batch_size`` *within each label group* (records grouped
    by the tuple of their label values, every mapping with the same columns): a group's batch ``j`` is its
    references ``j·B .. (j+1)·B − 1`` in input order, its leftovers unused (reported per group), and only its
    first ``num_texts_per_group`` batches used (``None``: every full batch). No text is read: an empty reference
    stays in its slot as a null.

    What this assumes: labels are *public* attributes of each slot. A replace-by-null neighbour empties one
    record's text and keeps its label, so it changes one batch (or none) and the batches compose in parallel
    (paper Corollary 11); a change of a record's *label* is not a neighbour this guarantee covers
    (docs/guide/generating.md, "Label conditioning").
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


# --------------------------------------------------------------------------------------------
# the privacy unit: references sharing a column's value are one unit (docs/guide/privacy-unit.md)


class ContributionRule(enum.StrEnum):
    """How a unit's references are bounded before batching, each a public rule (file order, a public bound and
    the unit column; never a reference's content):

    * ``COMBINE`` (a): one slot per unit: its references joined in file order, truncated to a public length;
    * ``SPREAD`` (b): at most k references per unit, each in a different batch (charged k texts per unit);
    * ``FIRST`` (c): one reference per unit, its first in file order."""

    COMBINE = "combine"
    SPREAD = "spread"
    FIRST = "first"


#: What each rule does, as the records state it (``run["privacy_unit"]["rule_statement"]``).
RULE_STATEMENTS: Mapping[ContributionRule, str] = MappingProxyType({
    ContributionRule.COMBINE: (
        "one slot per unit, at the place of its first reference in file order: the unit's non-empty references in "
        "file order joined by a blank line, then cut to the first max_chars characters (no cut when null)"),
    ContributionRule.SPREAD: (
        "each unit's first unit_contributions references in file order; units in order of first appearance, each "
        "unit's references consecutive, the j-th of these to batch j mod M (M: the full batches), so a unit's "
        "references fall in different batches; the references after the first M*B are unused"),
    ContributionRule.FIRST: "each unit's first reference in file order (null or not); its other references unused",
})  # fmt: skip
#: How a unit's references are joined by :attr:`ContributionRule.COMBINE`.
UNIT_SEPARATOR = "\n\n"


@dataclasses.dataclass(frozen=True)
class PrivacyUnit:
    """The unit of privacy of a release: the references whose ``column`` holds the same value are one unit, and
    a neighbouring dataset replaces *every* reference of one unit by null (the unit column is kept, as labels
    are: it fixes the slots, so both datasets get the same partition). ``rule`` bounds a unit's contribution
    (:class:`ContributionRule`); ``unit_contributions`` is rule (b)'s k (1 for the others); ``max_chars`` is rule
    (a)'s public length bound (``None``: no cut). Unit values are read as the text is (a missing cell or JSON
    ``null`` is refused: every reference needs its unit) and never written anywhere: records name the column
    and the rule, never a unit's value (who wrote what is private too)."""

    column: str
    rule: ContributionRule | str = ContributionRule.COMBINE
    unit_contributions: int = 1
    max_chars: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.column, str) or not self.column.strip():
            raise ValueError(f"privacy unit column must be a non-empty string; got {self.column!r}")
        try:
            object.__setattr__(self, "rule", ContributionRule(self.rule))
        except ValueError:
            raise ValueError(f"rule must be one of {[r.value for r in ContributionRule]}; got {self.rule!r}") from None
        check_count("unit_contributions", self.unit_contributions)
        check_count("max_chars", self.max_chars, allow_none=True)
        if self.unit_contributions > 1 and self.rule is not ContributionRule.SPREAD:
            raise ValueError(f"unit_contributions > 1 needs rule 'spread' (rule {self.rule.value!r} keeps one slot per unit)")
        if self.max_chars is not None and self.rule is not ContributionRule.COMBINE:
            raise ValueError(f"max_chars bounds rule 'combine' only; got rule {self.rule.value!r}")

    @classmethod
    def of(cls, unit) -> PrivacyUnit | None:
        """``unit`` as a :class:`PrivacyUnit`: one already, a column name (rule ``combine``), or ``None``."""
        return unit if unit is None or isinstance(unit, cls) else cls(unit)

    @classmethod
    def from_json(cls, data: Mapping) -> PrivacyUnit:
        """The unit a record's ``run["privacy_unit"]`` names (:meth:`to_json`'s form)."""
        return cls(data["column"], data["rule"], data["unit_contributions"], data["max_chars"])

    def to_json(self) -> dict:
        """The unit as the records' ``run`` and the summary state it: the column, the rule and its bounds."""
        return {"column": self.column, "rule": self.rule.value, "unit_contributions": self.unit_contributions,
                "max_chars": self.max_chars, "rule_statement": RULE_STATEMENTS[self.rule]}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class UnitReferences:
    """References read with their privacy unit: ``units[i]`` is record ``i``'s unit as an ordinal (0 for the
    first unit in file order, 1 for the next new one, ...), never its value; ``labels`` as
    :class:`LabelledReferences` holds them (``None``: unlabelled)."""

    texts: tuple[str, ...]
    units: tuple[int, ...]
    privacy_unit: PrivacyUnit
    labels: LabelledReferences | None = None

    def __post_init__(self) -> None:
        if len(self.texts) != len(self.units):
            raise ValueError(f"{len(self.texts)} texts but {len(self.units)} unit ordinals")
        if self.labels is not None and self.privacy_unit.rule is not ContributionRule.FIRST:
            raise ValueError(
                f"label columns with a privacy unit need rule 'first' (rule {self.privacy_unit.rule.value!r} would "
                "put references of several labels in one slot or batch)"
            )


def _unit_ordinals(values: Sequence[str], where: str) -> tuple[int, ...]:
    """Each value's ordinal by first appearance; an empty value is refused, naming its record, never a value."""
    seen: dict[str, int] = {}
    for i, value in enumerate(values):
        if value == "":
            raise ValueError(f"{where}: record {i + 1} has no privacy unit value (empty or null): every reference "
                             "needs its unit (give it one, or drop the record by a rule that reads no text)")
        seen.setdefault(value, len(seen))
    return tuple(seen[v] for v in values)


def read_unit_references(
    source: str | os.PathLike, privacy_unit: PrivacyUnit, *, column: str | None = None,
    label_columns: Sequence[str] | None = None,
) -> UnitReferences:  # fmt: skip
    """Read references (``column``, default ``text``), each one's privacy unit and, with ``label_columns``, its
    labels, in file order (:func:`read_references`' rules; the unit column is read as a text column is)."""
    name = column or "text"
    if privacy_unit.column == name or privacy_unit.column in (label_columns or ()):
        raise ValueError(f"the privacy unit column {privacy_unit.column!r} cannot also be the text or a label column")
    labels = None
    if label_columns is not None:
        labels = read_labelled_references(source, column=name, label_columns=label_columns)
    texts = read_references(source, column=name) if labels is None else labels.texts
    units = _unit_ordinals(read_references(source, column=privacy_unit.column), Path(source).name)
    return UnitReferences(tuple(texts), units, privacy_unit, labels)


def _unit_members(units: Sequence[int]) -> list[list[int]]:
    """Each unit's record positions in file order, units by ordinal (first appearance)."""
    members: list[list[int]] = [[] for _ in range(max(units, default=-1) + 1)]
    for position, unit in enumerate(units):
        members[unit].append(position)
    return members


def _one_slot_per_unit(refs: UnitReferences) -> tuple[list[str], list[int]]:
    """Rules (a) and (c): each unit's slot text and the record it stands at (its first), units in order."""
    members, unit = _unit_members(refs.units), refs.privacy_unit
    if unit.rule is ContributionRule.FIRST:
        return [refs.texts[m[0]] for m in members], [m[0] for m in members]
    # all null -> "": the unit's neighbour (every reference null) is a null slot; max_chars None cuts nothing
    texts = [UNIT_SEPARATOR.join(refs.texts[p] for p in m if refs.texts[p])[: unit.max_chars] for m in members]
    return texts, [m[0] for m in members]


def unit_slots(refs: UnitReferences) -> tuple[list[str], list[int]]:
    """The slot texts a unit's rule makes of ``refs`` before batching, and the record each stands at: one per unit
    (rules combine and first), or each unit's first k references (rule spread; their batches are
    :func:`unit_partition`'s)."""
    if refs.privacy_unit.rule is not ContributionRule.SPREAD:
        return _one_slot_per_unit(refs)
    k = refs.privacy_unit.unit_contributions
    kept = sorted(p for positions in _unit_members(refs.units) for p in positions[:k])
    return [refs.texts[p] for p in kept], kept


def _spread_partition(refs: UnitReferences, batch_size: int, num_texts: int | None) -> tuple[Partition, tuple]:
    """Rule (b): each unit's first k references, units consecutive, the j-th to batch j mod M (so a unit's at
    most k ≤ M references land in k different batches); refused when M < k. The partition and each batch's record
    positions."""
    k = refs.privacy_unit.unit_contributions
    order = [p for positions in _unit_members(refs.units) for p in positions[:k]]
    available = len(order) // batch_size
    if available == 0:
        raise ValueError(f"batch_size={batch_size} needs at least {batch_size} references; got {len(order)} after "
                         f"keeping each unit's first {k}")
    largest = max(len(m[:k]) for m in _unit_members(refs.units))
    if available < largest:
        raise ValueError(f"rule 'spread' puts a unit's {largest} references in {largest} different batches, but there "
                         f"are only {available} full batches; lower unit_contributions or batch_size")
    count = available if num_texts is None else check_count("num_texts", num_texts)
    if count > available:
        raise ValueError(f"num_texts={num_texts} needs {num_texts} batches; the references fill {available}")
    slots = [[order[j * available + i] for j in range(batch_size)] for i in range(count)]
    cleaned = [_clean_reference(i, t) for i, t in enumerate(refs.texts)]
    partition = Partition(
        batches=tuple(tuple(cleaned[p] for p in batch) for batch in slots), batch_size=batch_size,
        num_references=len(order), num_leftover=len(order) - available * batch_size, num_skipped=available - count,
        units=tuple(tuple(refs.units[p] for p in batch) for batch in slots),
    )  # fmt: skip
    return partition, tuple(tuple(batch) for batch in slots)


def unit_partition(refs: UnitReferences, batch_size: int, *, num_texts: int | None = None,
                   num_texts_per_group: int | None = None) -> tuple[Partition, tuple[dict, ...] | None, tuple]:
    """The batches of a per-unit release, each batch's labels (``None``: unlabelled) and each batch's record
    positions in the input (a joined slot: its unit's first), by the unit's :class:`ContributionRule`. Which references are used, cut, joined or dropped, and
    where each lands, depends on file order, the public bounds and the unit column only, so a neighbour (every
    reference of one unit null) has the same slots, and the unit's slots all null. Each batch holds at most one
    slot of a unit (``Partition.units``: each slot's unit ordinal, in memory only)."""
    check_count("batch_size", batch_size)
    if refs.privacy_unit.rule is ContributionRule.SPREAD:
        partition, positions = _spread_partition(refs, batch_size, num_texts)
        return partition, None, positions
    texts, firsts = _one_slot_per_unit(refs)
    if refs.labels is None:
        partition = partition_references(texts, batch_size, num_texts=num_texts)
        units = tuple(tuple(range(i * batch_size, (i + 1) * batch_size)) for i in range(len(partition.batches)))
        positions = tuple(tuple(firsts[s] for s in batch) for batch in units)
        return dataclasses.replace(partition, units=units), None, positions
    chosen = LabelledReferences(texts=tuple(texts), labels=tuple(refs.labels.labels[p] for p in firsts),
                                label_columns=refs.labels.label_columns)  # fmt: skip
    partition, labels, slots = labelled_partition(chosen, batch_size, num_texts_per_group=num_texts_per_group)
    partition = dataclasses.replace(partition, units=slots)  # slot s is unit s: one slot per unit
    return partition, labels, tuple(tuple(firsts[s] for s in batch) for batch in slots)
