"""Each task's columns, from a table as a source read it: shared by the sources.

Classification keeps the table's own ``data.text_column`` and ``data.label_column``;
causal_lm takes prompts and responses (Alpaca-style or chat ``messages``) and a domain;
token_classification takes words and their tags (a CoNLL file, or a table of word and
tag lists); extractive_qa takes SQuAD's columns and a class. Each becomes columns
``text`` (``question`` for QA), ``label`` and the task's own (``response``, ``tags``,
``context`` / ``answers`` / ``answer_starts``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedpeft.data.conll import entity_set_class, read_conll
from fedpeft.data.instructions import instruction_columns
from fedpeft.data.sources.build import Tables
from fedpeft.data.tables import check_columns, place
from fedpeft.data.types import Columns, DataError

if TYPE_CHECKING:
    from fedpeft.config import DataConfig


def task_tables(
    table: Columns,
    origin: str,
    test: Columns | None,
    test_origin: str,
    cfg: DataConfig,
    class_names: list[str] | None = None,
) -> Tables:
    """A file's or a hub dataset's tables (not extractive QA: :func:`qa_tables`) in the
    columns of ``data.task``; ``class_names``: the hub's names of the label ids, which for
    token classification name the tags."""
    if cfg.task == "causal_lm":  # domains are read as text
        test = _instruction_table(test, test_origin, cfg) if test is not None else None
        return Tables(_instruction_table(table, origin, cfg), origin, test, test_origin)
    if cfg.task == "token_classification":  # entity-set classes, as text
        if "tags" not in table:  # a table (file or hub) with word and tag columns
            table = _tagged_columns(table, origin, cfg, class_names)
            test = _tagged_columns(test, test_origin, cfg, class_names) if test is not None else None
        return Tables(table, origin, test, test_origin)
    check_columns(table, origin, cfg)
    return Tables(table, origin, test, test_origin, class_names, cfg.text_column, cfg.label_column)


def qa_tables(table: Columns, origin: str, test: Columns | None, test_origin: str, cfg: DataConfig) -> Tables:
    """Extractive-QA tables (SQuAD columns) with their class, ``label``: the
    ``data.label_column`` values (e.g. a SQuAD article's ``title``; WordNet's
    lexicographer category); else one class, ``all``."""
    for t, where in ((table, origin), (test, test_origin)):
        if t is None:
            continue
        if not t["question"]:
            raise DataError(f"{where}: no answerable questions")
        if cfg.label_column in t:
            t["label"] = [str(v) for v in t[cfg.label_column]]
        elif "label_column" in cfg.model_fields_set:
            raise DataError(f"{where}: no column {cfg.label_column!r} (columns: {sorted(t)})")
        else:
            t["label"] = ["all"] * len(t["question"])
    return Tables(table, origin, test, test_origin, text_column="question")


def conll_table(path: Path) -> Columns:
    """A CoNLL file as columns ``text`` (words), ``tags`` and ``label`` (entity set)."""
    sentences = read_conll(path)
    if not sentences:
        raise DataError(f"{path}: no sentences (a CoNLL file: one word and its tag per line)")
    return {
        "text": [w for w, _ in sentences],
        "tags": [t for _, t in sentences],
        "label": [entity_set_class(t) for _, t in sentences],
    }


def _tagged_columns(table: Columns, origin: str, cfg: DataConfig, tag_names: list[str] | None) -> Columns:
    """A table whose ``data.text_column`` holds each sentence's words and
    ``data.label_column`` their tags (names, or ids into the hub's ``tag_names``) as the
    CoNLL columns."""
    for col in (cfg.text_column, cfg.label_column):
        if col not in table:
            raise DataError(f"{origin}: no column {col!r} (columns: {sorted(table)})")
    out: Columns = {"text": [], "tags": [], "label": []}
    for row, (words, tags) in enumerate(zip(table[cfg.text_column], table[cfg.label_column], strict=True)):
        words, tags = list(words), list(tags)
        if tag_names is not None:
            tags = [tag_names[t] for t in tags]
        if not words or len(words) != len(tags) or not all(isinstance(x, str) for x in words + tags):
            raise DataError(
                f"{place(origin, row)}: {cfg.text_column!r} and {cfg.label_column!r} must be "
                "lists of words and of their tags, of the same length"
            )
        out["text"].append(words)
        out["tags"].append(tags)
        out["label"].append(entity_set_class(tags))
    return out


def _instruction_table(table: Columns, origin: str, cfg: DataConfig) -> Columns:
    """An instruction file or dataset (Alpaca-style or chat ``messages``) as columns
    ``text`` (the prompt's messages), ``response`` and ``label`` (the domain: the
    ``data.label_column`` values when the table has that column, else one domain, ``all``;
    a label column named in the config must exist), plus the group column if any."""
    prompts, responses = instruction_columns(table, origin)
    explicit = "label_column" in cfg.model_fields_set
    if cfg.label_column in table:
        domains = table[cfg.label_column]
        for row, d in enumerate(domains):
            if d is None or (isinstance(d, float) and np.isnan(d)):
                raise DataError(f"{place(origin, row)}: column {cfg.label_column!r} is missing")
    elif explicit:
        raise DataError(f"{origin}: no column {cfg.label_column!r} (columns: {sorted(table)})")
    else:
        domains = ["all"] * len(prompts)
    out = {"text": prompts, "response": responses, "label": list(domains)}
    if cfg.group_column:
        if cfg.group_column not in table:
            raise DataError(f"{origin}: no column {cfg.group_column!r} (columns: {sorted(table)})")
        out[cfg.group_column] = table[cfg.group_column]
    return out
