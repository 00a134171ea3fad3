"""Extractive-QA scores: exact match and token F1 after SQuAD's answer normalisation,
each the best over an example's gold answers, averaged over examples (0-100)."""

from __future__ import annotations

from collections import Counter

from fedpeft.metrics.generation import normalize_answer


def token_f1(prediction: str, reference: str) -> float:
    """F1 of the normalised words two answers share (as a multiset); two empty answers
    agree (1.0), an empty and a non-empty one do not (0.0)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_scores(predictions: list[str], answers: list[list[str]]) -> dict[str, float]:
    """``exact_match`` and ``f1``: per example the best over its gold answers."""
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} examples")
    if not predictions:
        return {"exact_match": float("nan"), "f1": float("nan")}
    em = [
        max(float(normalize_answer(p) == normalize_answer(a)) for a in gold)
        for p, gold in zip(predictions, answers, strict=True)
    ]
    f1 = [max(token_f1(p, a) for a in gold) for p, gold in zip(predictions, answers, strict=True)]
    return {"exact_match": 100 * sum(em) / len(em), "f1": 100 * sum(f1) / len(f1)}
