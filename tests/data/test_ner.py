"""Token classification (NER): CoNLL reading, label alignment, entity-level scores, the
entity-set partition classes, and a run through `fedpeft run`."""

from __future__ import annotations

import pytest
import torch

from fedpeft.data.conll import (
    conll_dir,
    encode_words,
    entity_set_class,
    read_conll,
    tag_names_of,
    word_tags,
)
from fedpeft.data.sources import DataError
from fedpeft.data.task import IGNORE
from fedpeft.metrics.tagging import tagging_scores
from tests.helpers.configs import SENTENCES, ner_config, write_conll


@pytest.fixture
def tokenizer(tiny_backbone):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_backbone)


def test_read_conll_and_errors(tmp_path):
    path = write_conll(tmp_path / "a.conll", SENTENCES)
    assert read_conll(path) == [(list(w), list(t)) for w, t in SENTENCES]
    (tmp_path / "bad.conll").write_text("EU B-ORG\nrejects\n")
    with pytest.raises(DataError, match=r"bad.conll:2: expected a word and its tag"):
        read_conll(tmp_path / "bad.conll")
    (tmp_path / "tag.conll").write_text("EU ORG\n")
    with pytest.raises(DataError, match=r"tag.conll:1: tag 'ORG' is not O, B-<type> or I-<type>"):
        read_conll(tmp_path / "tag.conll")


def test_label_alignment_round_trip(tokenizer):
    """Each word's tag sits on its first sub-word only; reading the labelled positions
    back gives the word tags again, even for words split into several sub-words."""
    words = [["Blackburn", "unbelievably", "Brussels"], ["EU", "x"]]
    tags = [[1, 0, 3], [2, 0]]
    assert len(tokenizer.tokenize("unbelievably")) > 1  # a word of several sub-words
    data = encode_words(words, tags, tokenizer, max_length=32)
    assert word_tags(data.labels) == tags
    enc = tokenizer(words[0], is_split_into_words=True)
    firsts = [i for i, w in enumerate(enc.word_ids()) if w is not None and w != enc.word_ids()[i - 1]]
    assert torch.nonzero(data.labels[0] != IGNORE).flatten().tolist() == firsts
    assert data.labels[0, 0] == IGNORE  # [CLS]
    # truncation drops the words that do not fit, with their tags
    short = encode_words(words, tags, tokenizer, max_length=4)
    assert word_tags(short.labels)[0] == tags[0][: len(word_tags(short.labels)[0])]


def test_tagging_scores_by_hand():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "O"]]
    # PER found; LOC typed as ORG (wrong entity); ORG missed; one spurious MISC
    pred = [["B-PER", "I-PER", "O", "B-ORG"], ["O", "B-MISC"]]
    s = tagging_scores(pred, gold)
    # 3 gold entities, 3 predicted, 1 right: P = R = F1 = 1/3; 3 of 6 words right
    assert s["entity_precision"] == pytest.approx(100 / 3)
    assert s["entity_recall"] == pytest.approx(100 / 3)
    assert s["entity_f1"] == pytest.approx(100 / 3)
    assert s["word_accuracy"] == pytest.approx(50)
    # a partial span is no match: B-PER O for B-PER I-PER
    assert tagging_scores([["B-PER", "O"]], [["B-PER", "I-PER"]])["entity_f1"] == 0


def test_entity_set_classes_and_tag_names():
    assert [entity_set_class(t) for _, t in SENTENCES] == ["MISC+ORG", "LOC+PER", "none"]
    assert tag_names_of([t for _, t in SENTENCES] + [["I-ORG"]]) == [
        "O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG", "B-PER", "I-PER",
    ]  # fmt: skip


def test_ner_runs_through_fedpeft_run(tiny_config, tmp_path):
    """A hand-made CoNLL file, partitioned by entity set, trained and scored through the
    CLI: entity-level scores recorded globally and per client."""
    from typer.testing import CliRunner

    from fedpeft.cli import app
    from fedpeft.config import dump_config
    from fedpeft.report.results import read_records, read_summary

    path = write_conll(tmp_path / "train.conll", SENTENCES * 20)
    cfg = ner_config(tiny_config, path)
    (tmp_path / "ner.yaml").write_text(dump_config(cfg))
    res = CliRunner().invoke(app, ["run", str(tmp_path / "ner.yaml")])
    assert res.exit_code == 0, res.output
    last = read_records(cfg.output_dir)[-1]
    assert set(last["global"]) == {"entity_precision", "entity_recall", "entity_f1", "word_accuracy"}
    assert 0 <= last["global"]["entity_f1"] <= 100
    assert "entity_f1_mean" in last["local"]
    summary = read_summary(cfg.output_dir)
    assert summary["headline"] == "entity_f1"
    assert summary["class_names"] == ["LOC+PER", "MISC+ORG", "none"]  # the partition's classes


def test_ner_config_errors(tiny_config, tmp_path):
    from fedpeft.config import ConfigError

    with pytest.raises(ConfigError, match="the built-in NER corpus is conll2003"):
        tiny_config(**{"data.task": "token_classification"})  # wordnet source
    with pytest.raises(ConfigError, match="the built-in NER corpus is conll2003"):
        tiny_config(**{"data.source": "conll2003", "data.task": "causal_lm"})


@pytest.mark.integration
def test_conll2003_is_set_up():
    """scripts/setup.sh extracted the whole corpus (standard sentence counts)."""
    root = conll_dir()
    assert len(read_conll(root / "train.txt")) == 14041
    assert len(read_conll(root / "test.txt")) == 3453


@pytest.mark.parametrize("name", {"fedlr": "plain LoRA", "pf2lora": "a bilevel step a client"})
def test_ner_cohort_equals_one_at_a_time(tiny_config, tmp_path, name):
    """Per-token labels padded with the ignore label: a cohort trains each client as alone."""
    from fedpeft.experiment import build
    from tests.helpers.cohort import assert_cohort_equals_alone

    cfg = ner_config(tiny_config, write_conll(tmp_path / "t.conll", SENTENCES * 20), method={"name": name},
                     **{"train.local_steps": None, "train.local_epochs": 1})  # fmt: skip
    setup = build(cfg)
    cids = list(range(len(setup.clients)))
    assert_cohort_equals_alone(setup, cids, name)
