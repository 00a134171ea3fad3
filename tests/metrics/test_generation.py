"""Generation scores against values computed by hand from each metric's definition."""

from __future__ import annotations

import math

import pytest

from fedpeft.metrics import generation as G


def test_bleu_by_hand():
    # Prepare: one differing last word; the n-gram precisions are 5/6, 4/5, 3/4, 2/3 and
    # the lengths are equal (no brevity penalty), so BLEU = (5/6 * 4/5 * 3/4 * 2/3) ** (1/4).
    s = G.generation_scores(["a b c d e f"], ["a b c d e g"])
    # Assert
    assert s["bleu"] == pytest.approx(100 * (1 / 3) ** 0.25, abs=1e-6)


def test_chrf_by_hand():
    # character 1-, 2-, 3-grams of "abc" vs "abd": matches 2/3, 1/2, 0/1 both ways; chrF
    # averages precision and recall over the orders present, F-beta (beta 2) of equal P
    # and R is that value: (2/3 + 1/2 + 0) / 3 = 7/18.
    assert G.generation_scores(["abc"], ["abd"])["chrf"] == pytest.approx(100 * 7 / 18, abs=1e-6)


def test_ter_by_hand():
    # one substitution over three reference words
    assert G.generation_scores(["a b c"], ["a b d"])["ter"] == pytest.approx(100 / 3, abs=1e-6)


def test_rouge_l_by_hand():
    # LCS of "a b c d" and "a c b d" has 3 words: P = R = F = 3/4
    assert G.rouge_l("a b c d", "a c b d") == pytest.approx(0.75)
    assert G.rouge_l("the cats", "the cat") == pytest.approx(1.0)  # Porter stemming


def test_meteor_by_hand():
    # all four words matched in one chunk: Fmean = 1, penalty 0.5 * (1/4)^3
    assert G.meteor("a small dog barks", "a small dog barks") == pytest.approx(1 - 0.5 / 64)
    # "barked"/"barks" match on their stem; "little"/"small" do not: 3 of 4 words in 2
    # chunks, P = R = 3/4, Fmean = 10PR / (R + 9P) = 3/4, penalty 0.5 * (2/3)^3
    expected = 0.75 * (1 - 0.5 * (2 / 3) ** 3)
    assert G.meteor("a little dog barked", "a small dog barks") == pytest.approx(expected)
    # WordNet synonyms (car, auto: one synset) count as matches: 2 of 2 in one chunk. (NLTK
    # looks synonyms up after stemming, so "little" -> "littl" above finds none.)
    assert G.meteor("the car", "the auto") == pytest.approx(1 - 0.5 / 8)


@pytest.mark.parametrize(
    ("pred", "ref", "hit"),
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0),  # case, punctuation, article
        ("  an   apple ", "apple", 1.0),  # whitespace and "an"
        ("theory", "the ory", 0.0),  # "the" is removed only as a word
        ("Paris, France", "Paris", 0.0),
    ],
)
def test_exact_match_normalisation(pred, ref, hit):
    assert G.exact_match(pred, ref) == hit


def test_scores_of_identical_texts_and_empty_input():
    s = G.generation_scores(["a dog is an animal", "to run fast"], ["a dog is an animal", "to run fast"])
    assert s["bleu"] == pytest.approx(100)
    assert s["chrf"] == pytest.approx(100)
    assert s["ter"] == pytest.approx(0)
    assert s["rouge_l"] == pytest.approx(100)
    assert s["exact_match"] == pytest.approx(100)
    assert all(math.isnan(v) for v in G.generation_scores([], []).values())
    with pytest.raises(ValueError, match="1 predictions for 2 references"):
        G.generation_scores(["x"], ["x", "y"])
