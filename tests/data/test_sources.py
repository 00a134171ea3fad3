"""Data sources (WordNet, files, hub) and batching that pads only to the longest row."""

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from fedpeft.config import DataConfig
from fedpeft.data.sources import DataError, load_corpus
from fedpeft.data.task import encode, iter_batches, make_batch
from fedpeft.data.wordnet import LEXNAMES, definition_of, read_glosses


def test_wordnet_corpus_has_45_lexicographer_classes():
    data = read_glosses()
    assert len(LEXNAMES) == 45
    assert len(data["text"]) > 100_000
    assert set(data["label"]) == set(LEXNAMES)
    assert set(data["pos"]) == {"noun", "verb", "adj", "adv"}
    assert '"' not in "".join(data["text"][:1000])  # usage examples are stripped


def test_definition_of_drops_examples():
    assert definition_of('move fast; "He ran to the store"; "run home" ') == "move fast"
    assert definition_of("a thing") == "a thing"


def test_wordnet_missing_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="wordnet-base"):
        read_glosses(tmp_path)


@pytest.fixture
def table():
    return pd.DataFrame(
        {
            "sentence": [f"text number {i}" for i in range(50)],
            "topic": ["a", "b", "c", "b", "a"] * 10,
            "org": ["x", "y"] * 25,
        }
    )


@pytest.mark.parametrize("suffix", [".csv", ".jsonl", ".parquet"])
def test_file_sources(tmp_path: Path, table, suffix):
    path = tmp_path / f"data{suffix}"
    {
        ".csv": lambda: table.to_csv(path, index=False),
        ".jsonl": lambda: table.to_json(path, orient="records", lines=True),
        ".parquet": lambda: table.to_parquet(path),
    }[suffix]()
    cfg = DataConfig(
        source="file",
        path=path,
        text_column="sentence",
        label_column="topic",
        group_column="org",
        test_fraction=0.2,
    )
    corpus = load_corpus(cfg, seed=0)
    assert corpus.class_names == ["a", "b", "c"]
    assert len(corpus.train_texts) == 40 and len(corpus.test_texts) == 10
    assert set(corpus.train_texts).isdisjoint(corpus.test_texts)
    assert set(corpus.train_groups) == {"x", "y"}
    # seeded: the same split again, a different one for another seed
    assert load_corpus(cfg, seed=0).test_texts == corpus.test_texts
    assert load_corpus(cfg, seed=1).test_texts != corpus.test_texts


def test_missing_column_names_file_and_column(tmp_path, table):
    path = tmp_path / "d.csv"
    table.to_csv(path, index=False)
    cfg = DataConfig(source="file", path=path, text_column="text", label_column="topic")
    with pytest.raises(DataError, match=r"d\.csv: no column 'text'"):
        load_corpus(cfg, 0)


def test_bad_row_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"text": "fine", "label": 1}, {"text": "   ", "label": 0}, {"text": "ok", "label": 1}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"d\.jsonl, line 2: column 'text' is empty"):
        load_corpus(DataConfig(source="file", path=path), 0)


def test_a_csv_row_is_named_by_the_line_an_editor_shows(tmp_path):
    """Issue 35: the header is line 1, a blank line is skipped as the reader skips it, and a
    quoted text over two lines counts both: the bad row starts on line 6."""
    path = tmp_path / "d.csv"
    path.write_text('text,label\nfine,1\n\n"two\nlines",0\n"",1\n')
    with pytest.raises(DataError, match=r"d\.csv, line 6: column 'text' is empty"):
        load_corpus(DataConfig(source="file", path=path), 0)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "d.xlsx"
    path.write_text("x")
    with pytest.raises(DataError, match="unsupported file type"):
        load_corpus(DataConfig(source="file", path=path), 0)


def test_hub_source_calls_load_dataset_with_the_config(monkeypatch):
    import datasets

    calls = []

    def fake_load(hub_id, config, split):
        calls.append((hub_id, config, split))
        features = datasets.Features(
            {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])}
        )
        return datasets.Dataset.from_dict({"text": ["good", "bad", "fine"], "label": [1, 0, 1]}, features)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    cfg = DataConfig(source="hub", hub_id="someone/reviews", hub_config="en", test_split="test")
    corpus = load_corpus(cfg, 0)
    assert calls == [("someone/reviews", "en", "train"), ("someone/reviews", "en", "test")]
    assert corpus.class_names == ["neg", "pos"]
    assert corpus.test_labels.tolist() == [1, 0, 1]


def test_hub_source_offline_fails_naming_the_dataset(monkeypatch):
    """The real ``datasets.load_dataset`` path, up to the download (offline mode here)."""
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cfg = DataConfig(source="hub", hub_id="stanfordnlp/imdb")
    with pytest.raises(DataError, match="stanfordnlp/imdb"):
        load_corpus(cfg, 0)


class _Tok:
    """A whitespace tokenizer stand-in with the HF call signature."""

    pad_token_id = 0

    def __call__(self, texts, truncation, max_length, padding):
        return {"input_ids": [[7] * min(len(t.split()), max_length) for t in texts]}


def test_batches_pad_only_to_their_longest_row():
    texts = ["a", "a b", "a b c d e f g h i j", "a b c"]
    data = encode(texts, np.array([0, 1, 0, 1]), _Tok(), max_length=6)
    assert data.lengths.tolist() == [1, 2, 6, 3]  # truncated at max_length
    short = make_batch(data, torch.tensor([0, 1]))
    assert short["input_ids"].shape == (2, 2)
    assert short["attention_mask"].tolist() == [[1, 0], [1, 1]]
    long = make_batch(data, torch.tensor([2, 3]))
    assert long["input_ids"].shape == (2, 6)
    seen = torch.cat([b["labels"] for b in iter_batches(data, 3, torch.Generator().manual_seed(0))])
    assert sorted(seen.tolist()) == [0, 0, 1, 1]


def test_numeric_labels_keep_numeric_order(tmp_path):
    path = tmp_path / "d.csv"
    pd.DataFrame({"text": [f"t{i}" for i in range(10)], "label": [0, 1, 2, 10, 11] * 2}).to_csv(
        path, index=False
    )
    corpus = load_corpus(DataConfig(source="file", path=path, test_fraction=0.5), 0)
    assert corpus.class_names == ["0", "1", "2", "10", "11"]
    texts = corpus.train_texts + corpus.test_texts
    labels = np.concatenate([corpus.train_labels, corpus.test_labels])
    for text, label in zip(texts, labels, strict=True):  # row i has label [0, 1, 2, 10, 11][i % 5]
        assert corpus.class_names[label] == str([0, 1, 2, 10, 11][int(text[1:]) % 5])


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_separate_test_file_maps_labels_onto_the_training_classes(tmp_path):
    # Prepare: the test file uses the labels in another order and only some of them
    train = _write_jsonl(
        tmp_path / "train.jsonl", [{"text": f"t{i}", "label": "abc"[i % 3]} for i in range(30)]
    )
    test = _write_jsonl(tmp_path / "test.jsonl", [{"text": "x", "label": "c"}, {"text": "y", "label": "a"}])

    # Execute
    corpus = load_corpus(DataConfig(source="file", path=train, test_path=test), seed=0)

    # Assert: all 30 rows train (no held-out share), the test rows keep their own labels
    assert corpus.class_names == ["a", "b", "c"]
    assert len(corpus.train_texts) == 30
    # (in the seeded order every test set is scored in)
    assert sorted(zip(corpus.test_texts, corpus.test_labels.tolist(), strict=True)) == [("x", 2), ("y", 0)]


def test_test_label_unseen_in_training_names_the_file_and_row(tmp_path):
    # Prepare
    train = _write_jsonl(tmp_path / "train.jsonl", [{"text": f"t{i}", "label": i % 2} for i in range(10)])
    rows = [{"text": "x", "label": 1}, {"text": "y", "label": 0}, {"text": "z", "label": 7}]
    test = _write_jsonl(tmp_path / "test.jsonl", rows)

    # Execute / Assert
    with pytest.raises(DataError, match=r"test\.jsonl, line 3: label '7' never occurs"):
        load_corpus(DataConfig(source="file", path=train, test_path=test), seed=0)


def test_unseen_test_labels_dropped_on_request_with_a_count(tmp_path, caplog):
    # Prepare
    train = _write_jsonl(tmp_path / "train.jsonl", [{"text": f"t{i}", "label": i % 2} for i in range(10)])
    rows = [
        {"text": "x", "label": 1},
        {"text": "y", "label": 5},
        {"text": "z", "label": 0},
        {"text": "w", "label": 5},
    ]
    test = _write_jsonl(tmp_path / "test.jsonl", rows)
    cfg = DataConfig(source="file", path=train, test_path=test, unseen_test_labels="drop")

    # Execute
    with caplog.at_level("WARNING"):
        corpus = load_corpus(cfg, seed=0)

    # Assert
    assert corpus.class_names == ["0", "1"]
    assert sorted(zip(corpus.test_texts, corpus.test_labels.tolist(), strict=True)) == [("x", 1), ("z", 0)]
    assert "test.jsonl: dropped 2 of 4 test rows" in caplog.text


def test_test_file_rows_are_checked_like_training_rows(tmp_path):
    # Prepare
    train = _write_jsonl(tmp_path / "train.jsonl", [{"text": f"t{i}", "label": i % 2} for i in range(10)])
    test = _write_jsonl(tmp_path / "test.jsonl", [{"text": "x", "label": 1}, {"text": "", "label": 0}])

    # Execute / Assert
    with pytest.raises(DataError, match=r"test\.jsonl, line 2: column 'text' is empty"):
        load_corpus(DataConfig(source="file", path=train, test_path=test), seed=0)


def test_test_path_config_errors_name_the_key(tmp_path):
    from pydantic import ValidationError

    train = _write_jsonl(tmp_path / "train.jsonl", [{"text": "t", "label": 0}])
    with pytest.raises(ValidationError, match="data.test_path: no such file"):
        DataConfig(source="file", path=train, test_path=tmp_path / "missing.csv")
    with pytest.raises(ValidationError, match="data.test_path is for data.source 'file'"):
        DataConfig(source="wordnet", test_path=train)


def test_hub_test_split_labels_map_onto_training_classes(monkeypatch):
    """A hub test split without class names: its labels map onto the training split's
    (before, a label only in the test split silently became a class of its own)."""
    import datasets

    splits = {"train": {"text": ["a", "b", "c"], "label": ["pos", "neg", "pos"]},
              "test": {"text": ["d", "e"], "label": ["neg", "neutral"]}}  # fmt: skip
    monkeypatch.setattr(
        datasets, "load_dataset", lambda hub_id, config, split: datasets.Dataset.from_dict(splits[split])
    )
    cfg = DataConfig(source="hub", hub_id="someone/reviews", test_split="test")

    with pytest.raises(DataError, match=r"someone/reviews\[test\]: row 1 .*label 'neutral'"):
        load_corpus(cfg, 0)
    corpus = load_corpus(cfg.model_copy(update={"unseen_test_labels": "drop"}), 0)
    assert corpus.class_names == ["neg", "pos"]
    assert corpus.test_labels.tolist() == [0]
