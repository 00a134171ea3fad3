"""What the data package hands on: a :class:`Corpus` (labelled texts, before tokenisation),
its tables' :data:`Columns`, a client's examples (:class:`ClientData`), and
:class:`DataError`, the error bad input fails with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from fedpeft.data.task import Encoded

Columns = dict[str, list[Any]]


class DataError(ValueError):
    """Input data that cannot be used; the message names the file, column or row."""


@dataclass
class Corpus:
    """A labelled corpus split into a training pool and a test set."""

    train_texts: list  # texts; for causal_lm prompts (lists of chat messages)
    train_labels: np.ndarray  # (N,) int64 in [0, num_classes): classes, or causal_lm domains
    test_texts: list
    test_labels: np.ndarray  # (N_test,) int64
    class_names: list[str]
    train_groups: np.ndarray | None = None  # (N,) values of data.group_column
    train_responses: list[str] | None = None  # causal_lm: what the model should answer
    test_responses: list[str] | None = None
    train_tags: list[list[int]] | None = None  # token_classification: each word's tag id
    test_tags: list[list[int]] | None = None
    tag_names: list[str] | None = None
    train_contexts: list[str] | None = None  # extractive_qa: passages (texts are the questions)
    test_contexts: list[str] | None = None
    train_answers: list[list[tuple[str, int]]] | None = None  # gold (text, start char) pairs
    test_answers: list[list[tuple[str, int]]] | None = None
    #: data.silos: per silo (= client, in order), the class ids of its own label space
    label_spaces: list[np.ndarray] | None = None

    @property
    def num_classes(self) -> int:
        return len(self.class_names)


@dataclass
class ClientData:
    """One client's examples: its training split, its local test split, optionally a
    validation split, and, in the cross-silo multi-task setting, the classes of its own
    label space (None: every class)."""

    cid: int
    train: Encoded
    test: Encoded
    val: Encoded | None = None
    classes: np.ndarray | None = None
