"""``data.source: file``: a local file (``data.path``), and a test file of its own
(``data.test_path``) if given.

A table (CSV, TSV, JSON Lines, JSON, Parquet) for classification, causal_lm (Alpaca-style
or chat ``messages`` JSON Lines) and token classification (word and tag lists); a CoNLL
file (any other suffix) for token classification; SQuAD-format JSON for extractive QA.
:func:`load_client_file` reads a deployed client's own file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedpeft.data.qa import read_squad
from fedpeft.data.sources.build import Tables
from fedpeft.data.sources.registry import source
from fedpeft.data.sources.tasks import conll_table, qa_tables, task_tables
from fedpeft.data.tables import TABLE_SUFFIXES, check_columns, label_key, place, read_table
from fedpeft.data.types import Columns, DataError

if TYPE_CHECKING:
    from fedpeft.config import DataConfig


@source("file")
def read(cfg: DataConfig) -> Tables:
    """``data.path`` (and ``data.test_path``) read as ``data.task`` needs."""
    assert cfg.path is not None
    table, origin = _read(cfg.path, cfg), str(cfg.path)
    test, test_origin = None, ""
    if cfg.test_path is not None:
        test, test_origin = _read(cfg.test_path, cfg), str(cfg.test_path)
    if cfg.task == "extractive_qa":
        return qa_tables(table, origin, test, test_origin, cfg)
    return task_tables(table, origin, test, test_origin, cfg)


def _read(path: Path, cfg: DataConfig) -> Columns:
    """One file as columns: SQuAD-format JSON (extractive QA), a CoNLL file (token
    classification, when ``data.path`` is no table) or a table."""
    assert cfg.path is not None
    if cfg.task == "extractive_qa":
        return read_squad(path)
    if cfg.task == "token_classification" and cfg.path.suffix.lower() not in TABLE_SUFFIXES:
        return conll_table(path)
    return read_table(path, objects=cfg.task == "causal_lm")


def load_client_file(path: Path, cfg: DataConfig, class_names: list[str]) -> tuple[list[str], np.ndarray]:
    """One deployed client's own data file: its texts and their label ids in the
    federation's class list (a label the federation does not know fails, naming the row)."""
    table = read_table(path)
    check_columns(table, str(path), cfg)
    index = {name: i for i, name in enumerate(class_names)}
    labels = []
    for row, value in enumerate(table[cfg.label_column]):
        key = label_key(value)
        if key not in index:
            raise DataError(
                f"{place(str(path), row)}: label {key!r} is not one of the federation's "
                f"{len(class_names)} classes (e.g. {class_names[:3]})"
            )
        labels.append(index[key])
    return list(table[cfg.text_column]), np.asarray(labels, dtype=np.int64)
