"""Entity-level scores of predicted tag sequences (seqeval), and word accuracy.

An entity is a maximal B-/I- run of one type (IOB2; an I- tag after O or another type
starts an entity, as in the CoNLL evaluation script); precision, recall and F1 are
micro-averaged over all entities of all types, scaled to 0-100.
"""

from __future__ import annotations

import numpy as np

SCORES = ("entity_precision", "entity_recall", "entity_f1", "word_accuracy")


def tagging_scores(predicted: list[list[str]], gold: list[list[str]]) -> dict[str, float]:
    """``entity_precision``, ``entity_recall``, ``entity_f1`` and ``word_accuracy``."""
    from seqeval.metrics import f1_score, precision_score, recall_score

    if len(predicted) != len(gold) or any(len(p) != len(g) for p, g in zip(predicted, gold, strict=True)):
        raise ValueError("predicted and gold tags must have the same sentences and lengths")
    words = sum(len(g) for g in gold)
    if not words:
        return dict.fromkeys(SCORES, float("nan"))
    right = sum(int(np.sum(np.asarray(p) == np.asarray(g))) for p, g in zip(predicted, gold, strict=True))
    return {
        "entity_precision": 100 * float(precision_score(gold, predicted, zero_division=0)),
        "entity_recall": 100 * float(recall_score(gold, predicted, zero_division=0)),
        "entity_f1": 100 * float(f1_score(gold, predicted, zero_division=0)),
        "word_accuracy": 100 * right / words,
    }
