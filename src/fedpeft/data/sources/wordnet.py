"""``data.source: wordnet``: the built-in WordNet 3.0 glosses (:mod:`fedpeft.data.wordnet`).

Classification: a gloss -> its lexicographer category (or, with ``data.wordnet_labels:
pos``, its part of speech). causal_lm: definition generation, a lemma and its part of
speech -> the gloss, the category its domain. extractive_qa: the built-in QA set of
:func:`fedpeft.data.qa.wordnet_qa`. No test set of its own: a seeded share is held out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpeft.data.instructions import definition_prompt
from fedpeft.data.qa import wordnet_qa
from fedpeft.data.sources.build import Tables
from fedpeft.data.sources.registry import source
from fedpeft.data.wordnet import LEXNAMES, read_glosses

if TYPE_CHECKING:
    from fedpeft.config import DataConfig

POS = ("noun", "verb", "adj", "adv")


@source("wordnet")
def read(cfg: DataConfig) -> Tables:
    """The glosses as columns ``text``, ``label`` (a class id), ``pos``, ``lexname``
    (``response`` for causal_lm), or the QA set."""
    table, origin = read_glosses(cfg.wordnet_dir), str(cfg.wordnet_dir)
    if cfg.task == "extractive_qa":  # its classes: the categories, as wordnet_qa labels them
        return Tables(wordnet_qa(table), origin, text_column="question")
    if cfg.wordnet_pos:  # only some parts of speech, and then only their categories
        rows = [i for i, p in enumerate(table["pos"]) if p in cfg.wordnet_pos]
        table = {k: [v[i] for i in rows] for k, v in table.items()}
    table["lexname"] = table["label"]
    lm = cfg.task == "causal_lm"
    if cfg.wordnet_labels == "pos" and not lm:
        names = [p for p in POS if p in set(table["pos"])]
        column = table["pos"]
    else:
        names = list(LEXNAMES) if not cfg.wordnet_pos else sorted(set(table["label"]), key=LEXNAMES.index)
        column = table["label"]
    class_id = {name: i for i, name in enumerate(names)}
    table["label"] = [class_id[v] for v in column]
    if lm:  # definition generation: lemma and part of speech -> gloss; the lexname is the domain
        table["response"] = table["text"]
        table["text"] = [definition_prompt(w, p) for w, p in zip(table["lemma"], table["pos"], strict=True)]
    return Tables(table, origin, class_names=names)
