"""Extractive QA: SQuAD files, context windows with a stride, span labels, EM/F1 with
SQuAD's normalisation, span decoding, the built-in WordNet QA set, and a whole run."""

from __future__ import annotations

import json

import pytest
import torch

from fedpeft.data.qa import END, START, encode_qa, read_squad, wordnet_qa
from fedpeft.data.sources import DataError
from fedpeft.data.task import IGNORE
from fedpeft.metrics.qa import qa_scores, token_f1
from fedpeft.metrics.scorers import SpanScorer

CONTEXT = (
    "The lighthouse stood on a rock. Its keeper, Ada Lovelace, lit the lamp every night. "
    "Ships passed safely around the rocky cape for many years."
)


@pytest.fixture
def tokenizer(tiny_backbone):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_backbone)


@pytest.mark.parametrize(
    ("pred", "golds", "em", "f1"),
    [
        ("Ada Lovelace", ["Ada Lovelace"], 100, 100),
        ("the keeper Ada Lovelace.", ["Ada Lovelace"], 0, 100 * 2 * (2 / 3) * 1 / (2 / 3 + 1)),  # P 2/3, R 1
        ("An Ada!", ["ada"], 100, 100),  # article, punctuation, case
        ("Lovelace", ["Ada Lovelace", "Lovelace"], 100, 100),  # best over gold answers
        ("rock", ["Ada Lovelace"], 0, 0),
    ],
)
def test_em_and_f1_by_hand(pred, golds, em, f1):
    s = qa_scores([pred], [golds])
    assert s["exact_match"] == pytest.approx(em)
    assert s["f1"] == pytest.approx(f1)


def test_token_f1_counts_repeated_words_once_each():
    # pred "a a b" vs ref "a b b": common = min counts: a 1, b 1 -> 2; P = R = 2/3
    assert token_f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert token_f1("", "") == 1.0 and token_f1("the", "x") == 0.0  # "the" normalises to nothing


def squad(tmp_path, answers=None, start=None):
    start = CONTEXT.index("Ada Lovelace") if start is None else start
    gold = [{"text": "Ada Lovelace", "answer_start": start}] if answers is None else answers
    qa = {"id": "q1", "question": "Who kept the lighthouse?", "answers": gold}
    data = {"data": [{"title": "Lights", "paragraphs": [{"context": CONTEXT, "qas": [qa]}]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(data))
    return path


def test_read_squad_and_errors(tmp_path, caplog):
    table = read_squad(squad(tmp_path))
    assert table["answers"] == [["Ada Lovelace"]] and table["title"] == ["Lights"]
    with pytest.raises(DataError, match=r"qas\[0\]: answer 0 'Ada Lovelace' is not at character 3"):
        read_squad(squad(tmp_path, start=3))
    assert read_squad(squad(tmp_path, answers=[]))["question"] == []
    assert "1 questions without an answer" in caplog.text
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="not SQuAD-format JSON"):
        read_squad(tmp_path / "bad.json")


def test_windows_with_a_stride_and_span_labels_round_trip(tokenizer):
    """A context longer than a window is cut into overlapping windows; in each window
    that holds the whole answer the labelled span maps back (by character offsets) to
    exactly the answer; in the others the label points at the first token."""
    start = CONTEXT.index("Ada Lovelace")
    data = encode_qa(["Who kept the lighthouse?"], [CONTEXT], [start], ["Ada Lovelace"],
                     tokenizer, max_length=24, stride=6)  # fmt: skip
    assert len(data) > 2 and data.aux["example_ids"].tolist() == [0] * len(data)
    holding = 0
    for f in range(len(data)):
        labels = data.labels[f]
        n = int(data.lengths[f])
        assert (labels[n:] == IGNORE).all() and (labels[:n] != IGNORE).all()
        starts = torch.nonzero((labels == START) | (labels == START + END)).flatten().tolist()
        ends = torch.nonzero((labels == END) | (labels == START + END)).flatten().tolist()
        assert len(starts) == len(ends) == 1
        i, j = starts[0], ends[0]
        if i == 0:
            assert j == 0  # not in this window
            continue
        holding += 1
        offsets = data.aux["offsets"][f]
        assert CONTEXT[int(offsets[i, 0]) : int(offsets[j, 1])] == "Ada Lovelace"
    assert holding >= 1
    # consecutive windows share `stride` context tokens
    first, second = data.aux["offsets"][0], data.aux["offsets"][1]
    tail = [tuple(x) for x in first.tolist() if x[0] >= 0][-6:]
    head = [tuple(x) for x in second.tolist() if x[0] >= 0][:6]
    assert tail == head


def test_best_span_by_hand():
    scorer = SpanScorer(["alpha beta gamma"], [["beta"]], batch_size=4, max_answer_tokens=2)
    offsets = torch.tensor([[-1, -1], [0, 5], [6, 10], [11, 16]])  # [CLS] alpha beta gamma
    logits = torch.tensor([[9.0, 9.0], [0.0, 0.0], [3.0, 1.0], [0.0, 2.5]])
    # [CLS] is outside the context; beta..gamma scores 3 + 2.5, beta..beta 3 + 1
    assert scorer.best_span(logits, offsets, "alpha beta gamma") == (5.5, "beta gamma")
    scorer.max_answer_tokens = 1  # spans of one token only
    assert scorer.best_span(logits, offsets, "alpha beta gamma") == (4.0, "beta")


def test_wordnet_qa_answers_are_in_their_passages():
    from fedpeft.data.wordnet import read_glosses

    table = wordnet_qa(read_glosses())
    assert len(table["question"]) > 25000  # one per synset with a usage example holding its word
    for k in range(0, len(table["question"]), 997):
        (answer,), (start,) = table["answers"][k], table["answer_starts"][k]
        assert table["context"][k][start : start + len(answer)] == answer
        assert table["question"][k].startswith("Which word or phrase in the passage means")


def test_qa_runs_through_fedpeft_run(tiny_config, tmp_path):
    from typer.testing import CliRunner

    from fedpeft.cli import app
    from fedpeft.config import dump_config
    from fedpeft.report.results import read_records, read_summary

    cfg = tiny_config(**{"data.task": "extractive_qa", "data.max_length": 48, "data.stride": 16,
                         "data.max_samples": 120, "data.max_test_samples": 20})  # fmt: skip
    (tmp_path / "qa.yaml").write_text(dump_config(cfg))
    res = CliRunner().invoke(app, ["run", str(tmp_path / "qa.yaml")])
    assert res.exit_code == 0, res.output
    last = read_records(cfg.output_dir)[-1]
    assert set(last["global"]) == {"exact_match", "f1"}
    assert 0 <= last["global"]["f1"] <= 100 and "f1_mean" in last["local"]
    assert read_summary(cfg.output_dir)["headline"] == "f1"


@pytest.mark.slow  # 10-18 s: out of the default tier for its 10 minutes (CI's slow tier runs it)
@pytest.mark.integration
def test_question_clusters_become_the_partition_classes():
    """data.question_clusters: k-means over MiniLM sentence embeddings of the questions
    (the FeDeRA paper's SQuAD partition); seeded, so the same classes every time."""
    from fedpeft.config import DataConfig
    from fedpeft.data.sources import load_corpus

    cfg = DataConfig(task="extractive_qa", max_samples=150, max_test_samples=30, question_clusters=4)
    a, b = load_corpus(cfg, 0), load_corpus(cfg, 0)
    assert a.class_names == [f"cluster {c}" for c in range(4)]
    assert set(a.train_labels.tolist()) == {0, 1, 2, 3}
    assert (a.train_labels == b.train_labels).all() and (a.test_labels == b.test_labels).all()
    # a cluster groups questions about alike definitions: more alike than the corpus at large
    from sentence_transformers import SentenceTransformer

    from fedpeft.models.backbone import bundled_minilm_dir

    vectors = SentenceTransformer(str(bundled_minilm_dir()), device="cpu").encode(
        a.train_texts, normalize_embeddings=True
    )
    sims = vectors @ vectors.T
    same = a.train_labels[:, None] == a.train_labels[None, :]
    assert sims[same].mean() > sims[~same].mean()
