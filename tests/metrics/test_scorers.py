"""A score in parts (fedpeft.metrics.scorers): what the ranks of a run do with the global
test set, each predicting its part, gathered and scored once; the figures of one pass."""

from __future__ import annotations

import numpy as np
import pytest

from fedpeft.experiment import build
from fedpeft.metrics.scorers import SpanScorer, keep_best, scorer_for
from tests.helpers.configs import task_config


def parts_and_whole(setup, world: int) -> tuple[list, object, dict, dict]:
    """``world`` parts' predictions of the global test set, one pass's, and the scores of each."""
    cfg, test = setup.cfg, setup.global_test
    scorer = scorer_for(cfg.data.task, setup.tokenizer, cfg.eval, setup.corpus)
    parts = [scorer.predictions(setup.model, test, (r, world)) for r in range(world)]
    whole = scorer.predictions(setup.model, test)
    return parts, whole, scorer.from_predictions(parts, test), scorer.score(setup.model, test)


def joined(task: str, parts: list):
    """The parts' predictions as one pass's."""
    if task == "sequence_classification":
        return np.concatenate(parts).tolist()
    if task == "token_classification":
        return [p for part in parts for p in part[0]], [g for part in parts for g in part[1]]
    if task == "extractive_qa":  # each example's best span over the parts, as the scorer merges them
        best = {}
        for part in parts:
            for example, span in part.items():
                keep_best(best, example, span)
        return {e: best[e][1] for e in sorted(best)}
    return sum(p[0] for p in parts), sum(p[1] for p in parts), [t for p in parts for t in p[2]]


@pytest.mark.parametrize(
    "task", ["sequence_classification", "token_classification", "extractive_qa", "causal_lm"]
)
def test_a_score_in_three_parts_is_the_whole_score(task, tiny_config, tiny_decoder, tmp_path):
    over = {"eval.batch_size": 4, "eval.generation.samples": 12}  # a few batches in each part
    if task == "sequence_classification":
        cfg = tiny_config(**over)
    else:
        cfg = task_config(task, tiny_config, tiny_decoder, tmp_path, tmp_path / "out", **over)
    setup = build(cfg)
    if task == "extractive_qa":  # an example's features in two parts: its best span over both
        examples = setup.global_test.aux["example_ids"].tolist()
        cuts = [len(examples) * r // 3 for r in (1, 2)]
        assert any(examples[c - 1] == examples[c] for c in cuts), "want an example cut in two"
    parts, whole, parted_scores, whole_scores = parts_and_whole(setup, 3)
    work = {"token_classification": lambda p: p[0], "causal_lm": lambda p: p[2]}.get(task, lambda p: p)
    assert all(len(work(p)) for p in parts), "every part has some of the work"
    got, want = joined(task, parts), joined(task, [whole])
    if task == "causal_lm":  # summed likelihoods, generated responses
        assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=1e-6) and got[2] == want[2]
    else:
        assert got == want
    assert parted_scores == pytest.approx(whole_scores, rel=1e-6, nan_ok=True)
    assert len(whole_scores) >= 2


def test_sampled_generation_is_one_parts_work(tiny_config, tiny_decoder, tmp_path):
    """Sampled responses draw from one random stream through the batches in order: part 0
    generates them all, so the figures stay one pass's."""
    over = {"eval.batch_size": 4, "eval.generation.strategy": "sample", "eval.generation.samples": 6}
    setup = build(task_config("causal_lm", tiny_config, tiny_decoder, tmp_path, tmp_path / "out", **over))
    parts, whole, parted_scores, whole_scores = parts_and_whole(setup, 2)
    assert len(parts[0][2]) == 6 and parts[1][2] == [] and parts[0][2] == whole[2]
    assert parted_scores == pytest.approx(whole_scores, rel=1e-6, nan_ok=True)


def test_an_examples_best_span_is_the_best_over_the_parts_its_features_fell_in():
    """Example 0's features fell in two parts: the higher-scoring span wins, the earlier of
    two equal ones (as in one pass over the features in order)."""
    scorer = SpanScorer(["", ""], [["right"], ["first"]], batch_size=4, max_answer_tokens=8)
    parts = [{0: (1.0, "wrong"), 1: (2.0, "first")}, {0: (3.0, "right"), 1: (2.0, "second")}]
    assert scorer.from_predictions(parts, None) == {"exact_match": 100.0, "f1": 100.0}
    assert scorer.from_predictions(parts[::-1], None)["exact_match"] == 50.0  # "second" came first
