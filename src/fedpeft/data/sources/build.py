"""From what a source read to a :class:`~fedpeft.data.types.Corpus`: the one path every
source shares.

A source reads its tables (:class:`Tables`); :func:`build_corpus` then holds out a
seeded test share when the source has no test set of its own, names the classes and
encodes the labels, subsamples (``data.max_samples``, ``data.max_test_samples``), puts
the test set in its seeded order, and takes the group column and each task's own fields
(a response, tags, a context and its answers).

The global test set is a seeded permutation of its rows (a test file's rows first put
in an order of their content): an evaluation batch is a random draw of the test set,
never a run of one label as a sorted source lists them, and the same rows give the
same batches in whatever order a file lists them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fedpeft.data.conll import tag_names_of
from fedpeft.data.tables import check_columns, class_names_of, label_key, place
from fedpeft.data.types import Columns, Corpus, DataError

if TYPE_CHECKING:
    from fedpeft.config import DataConfig

log = logging.getLogger(__name__)

#: The random stream of the global test set's order (beside ``seed``): drawing it
#: changes no other draw.
TEST_ORDER_STREAM = 0x54455354  # "TEST": apart from the rounds' sampling streams [seed, round]


@dataclass
class Tables:
    """What a source read, in the columns its task is built from: the training table
    and, when the source has one, a test table of its own (else a seeded share of the
    training table is held out). ``origin`` and ``test_origin`` say where each came
    from, as errors name it; ``class_names`` are given when the labels are already
    class ids (a hub ``ClassLabel``, WordNet's categories)."""

    train: Columns
    origin: str
    test: Columns | None = None
    test_origin: str = ""
    class_names: list[str] | None = None
    text_column: str = "text"
    label_column: str = "label"


def build_corpus(tables: Tables, cfg: DataConfig, seed: int) -> Corpus:
    """The corpus of what a source read (see the module docstring)."""
    table, test, origin, test_origin = tables.train, tables.test, tables.origin, tables.test_origin
    text_col, label_col, names = tables.text_column, tables.label_column, tables.class_names
    rng = np.random.default_rng(seed)
    known_ids = names is not None
    own_test = test is not None
    if test is None:  # a seeded held-out share: the classes are those of the whole table
        order = rng.permutation(len(table[text_col]))
        n_test = max(1, int(round(cfg.test_fraction * len(order))))
        test_idx, train_idx = np.sort(order[:n_test]), np.sort(order[n_test:])
        test = {k: [v[i] for i in test_idx] for k, v in table.items()}
        table = {k: [v[i] for i in train_idx] for k, v in table.items()}
        test_origin = f"{origin} (held-out share)"
        if names is None:
            names = class_names_of(table[label_col] + test[label_col])
    else:  # a test set of its own: its labels map onto the training classes
        classification = cfg.task == "classification"
        if classification:
            check_columns(test, test_origin, cfg, groups=False)
        if names is None and not classification:  # domains, entity sets: the test set may have others
            names = class_names_of(table[label_col] + test[label_col])
        elif names is None:
            names = class_names_of(table[label_col])
            test = known_labels_only(test, label_col, names, test_origin, cfg.unseen_test_labels)
    train_labels = encode_labels(table[label_col], names, origin, known_ids)
    test_labels = encode_labels(test[label_col], names, test_origin, known_ids)
    keep = _subsample(len(train_labels), cfg.max_samples, rng)
    # a test set of its own is drawn from its rows in an order of their content (the same
    # rows, listed in any order, give the same test set); every test set is then scored
    # in a seeded random order
    listed = _content_order(test) if own_test else np.arange(len(test_labels))
    keep_test = listed[_subsample(len(test_labels), cfg.max_test_samples, rng)]
    keep_test = keep_test[np.random.default_rng([seed, TEST_ORDER_STREAM]).permutation(len(keep_test))]
    group_col = cfg.group_by
    if group_col and group_col not in table:
        raise DataError(f"{origin}: no column {group_col!r} (data.group_column; columns: {sorted(table)})")
    return Corpus(
        train_texts=[table[text_col][i] for i in keep],
        train_labels=train_labels[keep],
        test_texts=[test[text_col][i] for i in keep_test],
        test_labels=test_labels[keep_test],
        class_names=names,
        train_groups=np.asarray(table[group_col], dtype=object)[keep] if group_col else None,
        **_task_fields(cfg.task, table, test, keep, keep_test),
    )


def _task_fields(task: str, table: Columns, test: Columns, keep: np.ndarray, keep_test: np.ndarray) -> dict:
    """The corpus fields of ``task`` besides texts and labels, for the kept rows."""
    if task == "causal_lm":
        return {
            "train_responses": [table["response"][i] for i in keep],
            "test_responses": [test["response"][i] for i in keep_test],
        }
    if task == "token_classification":
        tag_names = tag_names_of(table["tags"] + test["tags"])
        tag_id = {t: i for i, t in enumerate(tag_names)}
        return {
            "tag_names": tag_names,
            "train_tags": [[tag_id[t] for t in table["tags"][i]] for i in keep],
            "test_tags": [[tag_id[t] for t in test["tags"][i]] for i in keep_test],
        }
    if task == "extractive_qa":
        return {
            "train_contexts": [table["context"][i] for i in keep],
            "test_contexts": [test["context"][i] for i in keep_test],
            "train_answers": [_answers(table, i) for i in keep],
            "test_answers": [_answers(test, i) for i in keep_test],
        }
    return {}


def _answers(table: Columns, row: int) -> list[tuple[str, int]]:
    return list(zip(table["answers"][row], table["answer_starts"][row], strict=True))


def encode_labels(values: list[Any], names: list[str], origin: str, known_ids: bool) -> np.ndarray:
    """Label ids for ``values``: range-checked ids (``known_ids``) or indices into ``names``."""
    if known_ids:  # already integer ids with known names (hub ClassLabel)
        ids = np.asarray(values, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= len(names)))
        if bad.size:
            raise DataError(f"{place(origin, bad[0])}: label {ids[bad[0]]} outside 0..{len(names) - 1}")
        return ids
    index = {n: i for i, n in enumerate(names)}
    return np.asarray([index[label_key(v)] for v in values], dtype=np.int64)


def known_labels_only(test: Columns, label_col: str, names: list[str], origin: str, unseen: str) -> Columns:
    """The test rows whose label is one of the training classes ``names``. A row with
    another label is an error naming ``origin`` and the row (``unseen: error``), or is left
    out, with the count logged (``unseen: drop``)."""
    known = set(names)
    keep = [label_key(v) in known for v in test[label_col]]
    if all(keep):
        return test
    row = keep.index(False)
    if unseen == "error":
        raise DataError(
            f"{place(origin, row)}: label {label_key(test[label_col][row])!r} never occurs in "
            f"the training data ({len(names)} classes, e.g. {names[:3]}); set data.unseen_test_labels: drop "
            "to leave such rows out"
        )
    dropped = len(keep) - sum(keep)
    if dropped == len(keep):
        raise DataError(
            f"{origin}: none of its {len(keep)} rows has a label that occurs in the training data"
        )
    unseen_labels = sorted({label_key(v) for v, k in zip(test[label_col], keep, strict=True) if not k})
    log.warning(
        "%s: dropped %d of %d test rows whose label never occurs in the training data (%s)",
        origin, dropped, len(keep), ", ".join(unseen_labels[:5]) + (" ..." if len(unseen_labels) > 5 else ""),
    )  # fmt: skip
    return {k: [x for x, k_ in zip(v, keep, strict=True) if k_] for k, v in test.items()}


def _content_order(table: Columns) -> np.ndarray:
    """``table``'s row indices sorted by the rows' content (every column's value): the
    same rows listed in any order come out in the same order of content."""
    columns = sorted(table)
    key = [tuple(repr(table[c][i]) for c in columns) for i in range(len(table[columns[0]]))]
    return np.asarray(sorted(range(len(key)), key=key.__getitem__), dtype=np.int64)


def _subsample(n: int, cap: int | None, rng: np.random.Generator) -> np.ndarray:
    if cap is None or cap >= n:
        return np.arange(n)
    return np.sort(rng.choice(n, size=cap, replace=False))
