"""Data sources: a local file, a Hugging Face hub dataset, or a built-in corpus (WordNet,
CoNLL-2003), one module each, registered by name (:data:`SOURCES`).

Whatever the source, the result is a :class:`Corpus`: a training pool (which the
partition splits across clients) and a global test set, with integer labels and
their class names. For instruction tuning (``data.task: causal_lm``) the "texts" are
prompts (chat messages), each example has a response, and the labels are domains
(what a natural or Dirichlet partition splits on). Bad input fails with
:class:`DataError`, naming the file, the column or the row at fault.

A source reads its tables in the columns of ``data.task`` (``read(cfg) -> Tables``);
:func:`~fedpeft.data.sources.build.build_corpus` turns them into the corpus, the same
way for every source (held-out share, classes, subsamples, the test set's order).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpeft.data.clusters import cluster_questions
from fedpeft.data.sources import conll2003, file, hub, wordnet  # noqa: F401 (each registers its reader)
from fedpeft.data.sources.build import TEST_ORDER_STREAM, Tables, build_corpus
from fedpeft.data.sources.file import load_client_file
from fedpeft.data.sources.registry import SOURCES, source
from fedpeft.data.tables import class_names_of, place, read_table
from fedpeft.data.types import Corpus, DataError

if TYPE_CHECKING:
    from fedpeft.config import DataConfig

__all__ = [
    "SOURCES",
    "TEST_ORDER_STREAM",
    "Corpus",
    "DataError",
    "Tables",
    "class_names_of",
    "load_client_file",
    "load_corpus",
    "place",
    "read_table",
    "source",
]


def load_corpus(cfg: DataConfig, seed: int) -> Corpus:
    """Read the configured source and split it into training pool and global test set."""
    corpus = build_corpus(SOURCES[cfg.source](cfg), cfg, seed)
    if cfg.question_clusters:
        corpus = cluster_questions(corpus, cfg.question_clusters, seed)
    return corpus
