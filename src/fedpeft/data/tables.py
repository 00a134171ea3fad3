"""Tables as columns: reading a file (CSV, TSV, JSON Lines, JSON, Parquet), saying where
a row of it is as an editor shows it, and the checks and label keys every table source
shares."""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedpeft.data.types import Columns, DataError

if TYPE_CHECKING:
    from fedpeft.config import DataConfig

#: The suffixes :func:`read_table` reads (a token_classification file with another is CoNLL).
TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".json", ".parquet")


def read_table(path: Path, objects: bool = False) -> Columns:
    """A CSV, JSONL/JSON or Parquet file as columns. With ``objects`` a JSONL file's
    values stay Python objects (chat ``messages`` lists)."""
    import pandas as pd

    suffix = path.suffix.lower()
    if objects and suffix == ".jsonl":
        return read_jsonl_messages(path)
    try:
        if suffix in (".csv", ".tsv"):
            frame = pd.read_csv(path, sep="\t" if suffix == ".tsv" else ",")
        elif suffix in (".jsonl", ".json"):
            frame = pd.read_json(path, lines=suffix == ".jsonl")
        elif suffix == ".parquet":
            frame = pd.read_parquet(path)
        else:
            raise DataError(f"{path}: unsupported file type {suffix!r} (csv, tsv, jsonl, json, parquet)")
    except (ValueError, OSError, TypeError) as err:  # TypeError: pandas on a JSON line that is no object
        if isinstance(err, DataError):
            raise
        if not isinstance(err, OSError) and suffix != ".parquet":
            _find_the_bad_line(path, suffix)  # names the line, where one is at fault
        raise DataError(f"{path}: cannot be read as {suffix[1:]}: {' '.join(str(err).split())}") from None
    return {str(c): frame[c].tolist() for c in frame.columns}


def _find_the_bad_line(path: Path, suffix: str) -> None:
    """A DataError naming the first line of text file ``path`` that is not UTF-8 or (a JSON
    Lines file) not one JSON object; nothing where every line is."""
    if suffix == ".jsonl":
        for _ in _jsonl_objects(path):
            pass
        return
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            utf8_line(raw, path, lineno)


def utf8_line(raw: bytes, path: Path, lineno: int) -> str:
    """Line ``lineno`` of ``path`` as text; a DataError naming it where it is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(
            f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {err.start + 1})"
        ) from None


def _jsonl_objects(path: Path) -> Iterator[dict]:
    """The objects of a JSON Lines file, one a line (blank lines skipped); a DataError
    naming the file and line of one that is not UTF-8, not JSON, or not an object."""
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = utf8_line(raw, path, lineno)
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
            if not isinstance(obj, dict):
                got = {list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
                    type(obj), "a number"
                )
                raise DataError(f"{path}:{lineno}: each line must be a JSON object ({{...}}), not {got}")
            yield obj


def read_jsonl_messages(path: Path) -> dict[str, list]:
    """A JSONL file whose lines are objects, as columns (kept as Python objects: a
    ``messages`` list must not become a table of its own)."""
    rows = list(_jsonl_objects(path))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: [r.get(k) for r in rows] for k in keys}


def place(origin: str, row: int) -> str:
    """Where data row ``row`` (0-based, of the table read from ``origin``) is, as an editor
    shows it: a CSV or TSV file's line (the header is line 1; blank lines skipped as the
    reader skips them, a quoted field over several lines counted whole), a JSON Lines
    file's line, a JSON or Parquet file's record (1-based); elsewhere (a hub split, a
    held-out share) its row, 0-based."""
    path = Path(origin)
    suffix = path.suffix.lower()
    if path.is_file() and suffix in (".csv", ".tsv"):
        line = _csv_record_line(path, row, "\t" if suffix == ".tsv" else ",")
        return f"{origin}, line {line}"
    if path.is_file() and suffix == ".jsonl":
        lines = (n for n, text in enumerate(path.read_text().splitlines(), 1) if text.strip())
        return f"{origin}, line {next(itertools.islice(lines, row, None), '?')}"
    if path.is_file() and suffix in (".json", ".parquet"):
        return f"{origin}, record {row + 1}"
    return f"{origin}: row {row} (0-based)"


def _csv_record_line(path: Path, row: int, delimiter: str) -> int | str:
    """The line on which data record ``row`` (0-based, after the header) starts."""
    with path.open(newline="") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        next(reader, None)  # the header
        start, k = reader.line_num + 1, 0
        for record in reader:
            if record:  # a blank line is no record
                if k == row:
                    return start
                k += 1
            start = reader.line_num + 1
    return "?"


def check_columns(table: Columns, origin: str, cfg: DataConfig, groups: bool = True) -> None:
    """The text, label (and, for training data, group) columns exist and every row has
    text and a label."""
    keys = ["text_column", "label_column"] + (["group_column"] if cfg.group_column and groups else [])
    for key in keys:
        col = getattr(cfg, key)
        if col not in table:
            raise DataError(f"{origin}: no column {col!r} (data.{key}; columns: {sorted(table)})")
    for row, (text, label) in enumerate(zip(table[cfg.text_column], table[cfg.label_column], strict=True)):
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{place(origin, row)}: column {cfg.text_column!r} is empty or not text")
        if label is None or (isinstance(label, float) and np.isnan(label)):
            raise DataError(f"{place(origin, row)}: column {cfg.label_column!r} is missing")


def class_names_of(values: list[Any]) -> list[str]:
    """Distinct label values as class names: numeric order when all are numbers (so 2 < 10),
    else string order. ``1`` and ``1.0`` are the same class."""
    distinct = set(values)
    if all(_is_number(v) for v in distinct):
        return list(dict.fromkeys(label_key(v) for v in sorted(distinct)))
    return sorted({label_key(v) for v in distinct})


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def label_key(v: Any) -> str:
    """The class name of a label value: ``1`` and ``1.0`` -> ``"1"``; text as it is."""
    if _is_number(v):
        return str(int(v)) if float(v).is_integer() else str(float(v))
    return str(v)
