"""``data.source: conll2003``: the built-in CoNLL-2003 English corpus (:mod:`fedpeft.data.conll`).

``train.txt`` is the training pool and ``test.txt`` the global test set. Token
classification reads the words and their tags; classification reads a sentence as its
most frequent entity type (:data:`~fedpeft.data.conll.ENTITY_TYPE_CLASSES`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpeft.data.conll import ENTITY_TYPE_CLASSES, conll_dir, dominant_entity_type
from fedpeft.data.sources.build import Tables
from fedpeft.data.sources.registry import source
from fedpeft.data.sources.tasks import conll_table
from fedpeft.data.tables import check_columns
from fedpeft.data.types import Columns

if TYPE_CHECKING:
    from fedpeft.config import DataConfig


@source("conll2003")
def read(cfg: DataConfig) -> Tables:
    """The corpus's training and test files, for token classification or classification."""
    root = conll_dir()
    origin, test_origin = str(root / "train.txt"), str(root / "test.txt")
    table, test = conll_table(root / "train.txt"), conll_table(root / "test.txt")
    if cfg.task == "token_classification":
        return Tables(table, origin, test, test_origin)
    table, test = _entity_type_table(table), _entity_type_table(test)
    check_columns(table, origin, cfg)
    names = list(ENTITY_TYPE_CLASSES)
    return Tables(table, origin, test, test_origin, names, cfg.text_column, cfg.label_column)


def _entity_type_table(table: Columns) -> Columns:
    """A CoNLL table as sentence classification: ``text`` the sentence, ``label`` its
    most frequent entity type (:func:`fedpeft.data.conll.dominant_entity_type`)."""
    return {
        "text": [" ".join(words) for words in table["text"]],
        "label": [ENTITY_TYPE_CLASSES.index(dominant_entity_type(tags)) for tags in table["tags"]],
    }
