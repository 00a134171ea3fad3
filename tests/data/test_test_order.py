"""Scores that do not depend on the order of a test set (issue 30, item 1).

Every test set is scored in a seeded random order: the global test set (a test file's
rows first put in an order of their own content) and each client's local test split.
So an evaluation batch is a random draw of the test set, never a run of one label as a
sorted source lists them, and permuting a test file's rows changes no score: not a
batch-independent method's, and not C2A's, whose adapters depend on the batch."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedpeft.config import DataConfig
from fedpeft.data.sources import load_corpus
from fedpeft.data.task import make_batch
from fedpeft.experiment import build, run
from fedpeft.report.results import read_records

TOPICS = ["animal", "plant", "food", "tool", "place", "feeling"]


def _table(rows: int, seed: int) -> pd.DataFrame:
    """Made-up texts of six topics, listed sorted by topic (as WordNet lists its glosses)."""
    rng = np.random.default_rng(seed)
    topics = sorted(rng.choice(TOPICS, size=rows))
    texts = [f"{topic} note {i} {' '.join(rng.choice(TOPICS, size=3))}" for i, topic in enumerate(topics)]
    return pd.DataFrame({"text": texts, "label": topics})


def _runs_of_one_label(labels, size: int = 16) -> float:
    """The mean number of distinct labels in consecutive batches of ``size``."""
    return float(np.mean([len(set(labels[i : i + size])) for i in range(0, len(labels), size)]))


@pytest.fixture
def files(tmp_path):
    train, test, shuffled = tmp_path / "train.csv", tmp_path / "test.csv", tmp_path / "shuffled.csv"
    _table(240, seed=0).to_csv(train, index=False)
    sorted_test = _table(120, seed=1)
    sorted_test.to_csv(test, index=False)
    sorted_test.sample(frac=1.0, random_state=5).to_csv(shuffled, index=False)
    return train, test, shuffled


@pytest.mark.parametrize("cap", [None, 50])
def test_a_permuted_test_file_loads_as_the_same_test_set(files, cap):
    train, test, shuffled = files
    cfg = DataConfig(source="file", path=train, test_path=test, max_test_samples=cap)
    a = load_corpus(cfg, seed=3)
    b = load_corpus(cfg.model_copy(update={"test_path": shuffled}), seed=3)
    assert a.test_texts == b.test_texts and (a.test_labels == b.test_labels).all()
    assert len(a.test_texts) == (cap or 120)
    # a random draw of the labels, not the file's runs of one topic
    listed = pd.read_csv(test)["label"].tolist()
    assert _runs_of_one_label(listed) < 2.0 < _runs_of_one_label(a.test_labels.tolist())
    # and another seed, another order
    assert load_corpus(cfg, seed=4).test_texts != a.test_texts


def test_the_wordnet_test_sets_are_not_in_label_runs(tiny_config):
    setup = build(tiny_config(**{"data.max_test_samples": 160, "partition.local_test_fraction": 0.3}))
    labels = setup.global_test.labels.tolist()
    assert _runs_of_one_label(labels) > 4.0, labels[:32]
    for client in setup.clients:  # a client's local test split, in a seeded order of its own
        rows = setup.split.test[client.cid]
        assert len(rows) < 3 or not (np.diff(rows) > 0).all(), rows


def _spread(setup) -> None:
    """Trainable tensors drawn at a scale that makes a tiny model's predictions vary (at
    its initialisation C2A's generated adapters are near zero and every row gets one class)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in sorted(setup.model.named_parameters()):
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize("method", {"c2a": "pools context over a batch", "fedlr": "scores row by row"})
def test_permuting_a_test_files_rows_leaves_the_scores_unchanged(tiny_config, files, tmp_path, method):
    """C2A pools its adapters' context over the evaluation batch: scored on the sorted
    file's order its global scores differ from a random order's (checked first), and with
    the same rows in the same seeded order, whatever the file's order, they are the same
    to the last digit, as FedLR's are."""
    train, test, shuffled = files
    common = {
        "method": {"name": method},
        "data.source": "file",
        "data.path": str(train),
        "data.max_samples": None,
        "data.max_test_samples": None,
        "eval.batch_size": 16,
        "train.rounds": 2,
    }
    a = tiny_config(**common, **{"data.test_path": str(test)}, output_dir=str(tmp_path / "sorted"))
    b = tiny_config(**common, **{"data.test_path": str(shuffled)}, output_dir=str(tmp_path / "shuffled"))
    scores = []
    for cfg in (a, b):
        setup = build(cfg)
        _spread(setup)
        run(cfg, setup=setup)
        scores.append(([r["global"] for r in read_records(cfg.output_dir)], setup))
    (ra, setup_a), (rb, _) = scores
    assert ra == rb
    if method == "c2a":  # the order would have mattered: a row's logits depend on its batch
        model, data = setup_a.model.eval(), setup_a.global_test
        by_topic = torch.from_numpy(np.argsort(data.labels.cpu().numpy(), kind="stable"))
        pure, mixed = by_topic[:16], torch.cat([by_topic[:1], torch.arange(16, 31)])
        with torch.no_grad():
            logits = [
                model(**{k: v for k, v in make_batch(data, rows).items() if k != "labels"})
                for rows in (pure, mixed)
            ]
        assert not torch.equal(logits[0][0], logits[1][0])
