"""The cross-silo multi-task setting: one client per data set, its own label space and head."""

import json

import numpy as np
import pytest
import torch

from fedpeft.config import ConfigError, load_config, parse_config
from fedpeft.data.conll import dominant_entity_type
from fedpeft.experiment import build, run
from fedpeft.methods.base import MASKED_BIAS

SILOS = [
    {"name": "nouns", "source": "wordnet", "wordnet_pos": ["noun"]},
    {"name": "verbs", "source": "wordnet", "wordnet_pos": ["verb"]},
    {"name": "pos", "source": "wordnet", "wordnet_labels": "pos"},
]


def scored_by_hand(cfg, setup) -> list[tuple[float, np.ndarray]]:
    """Each client's local-test accuracy and predictions, recomputed from the run's
    checkpoint with the method's own ``eval_state`` and a plain arg-max."""
    from fedpeft.engines.checkpoint import load_checkpoint
    from fedpeft.experiment import fingerprint
    from fedpeft.methods.base import load_tensors
    from fedpeft.metrics.classification import predict

    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    method, model, out = setup.method, setup.model, []
    for client in setup.clients:
        personal = ckpt.personal.get(client.cid) or method.init_client(model, setup.initial, client)
        load_tensors(
            model, method.eval_state(model, method.downlink(ckpt.server, client.cid), personal, client)
        )
        preds = predict(model, client.test, 64)
        out.append((float(np.mean(preds == client.test.labels.numpy())), preds))
    return out


def assert_scored_in_own_label_space(cfg, setup, summary) -> None:
    """The run's per-client scores are the clients' own models' on their own test splits,
    and every prediction is a class of the client's own silo."""
    by_hand = scored_by_hand(cfg, setup)
    reported = [c["accuracy"] for c in summary["final_local_by_client"]]
    assert reported == pytest.approx([acc for acc, _ in by_hand], abs=1e-9)
    assert summary["final_local"]["accuracy_mean"] == pytest.approx(np.mean(reported), abs=1e-9)
    for (_, preds), space in zip(by_hand, setup.corpus.label_spaces, strict=True):
        assert len(preds) and set(preds.tolist()) <= set(space.tolist())


@pytest.fixture
def silo_config(tiny_config):
    def make(**overrides):
        common = {"data.silos": SILOS, "data.max_samples": 50, "train.clients_per_round": 3}
        return tiny_config(partition={}, **common, **overrides)

    return make


def test_silos_imply_one_client_each_all_per_round_and_6_2_2(silo_config):
    cfg = parse_config({"data": {"silos": SILOS}})
    assert (cfg.partition.scheme, cfg.partition.num_clients, cfg.partition.val_fraction) == (
        "natural",
        3,
        0.2,
    )
    assert cfg.train.clients_per_round == 3
    with pytest.raises(ConfigError, match="partition.num_clients 5: .* one client per silo"):
        parse_config({"data": {"silos": SILOS}, "partition": {"num_clients": 5}})
    with pytest.raises(ConfigError, match="silo names must be unique"):
        parse_config({"data": {"silos": [SILOS[0], SILOS[0]]}})
    with pytest.raises(ConfigError, match="classification, not causal_lm"):
        parse_config({"data": {"silos": SILOS, "task": "causal_lm"}})
    assert load_config("cross_silo").data.silos[3].source == "conll2003"  # the built-in example


def test_each_silo_is_one_client_with_its_own_label_space(silo_config):
    setup = build(silo_config(method={"name": "fedmcp"}))
    corpus, clients = setup.corpus, setup.clients
    assert len(clients) == 3 and len(setup.global_test) == 0
    names = corpus.class_names
    assert sum(n.startswith("nouns:noun.") for n in names) == 26  # the noun categories only
    assert sum(n.startswith("verbs:verb.") for n in names) == 15
    assert [n for n in names if n.startswith("pos:")] == ["pos:noun", "pos:verb", "pos:adj", "pos:adv"]
    for client, space, silo in zip(clients, corpus.label_spaces, SILOS, strict=True):
        assert all(names[c].startswith(silo["name"] + ":") for c in space)
        for split in (client.train, client.val, client.test):
            assert set(split.labels.tolist()) <= set(space.tolist())
        sizes = len(client.train), len(client.val), len(client.test)
        assert sum(sizes) == 50 and sizes == (30, 10, 10)  # balanced to 50 each, 6:2:2


def test_a_client_predicts_and_learns_only_its_own_classes(silo_config):
    cfg = silo_config(method={"name": "fedap", "head": "personal"}, **{"train.rounds": 1})
    setup = build(cfg)
    summary = run(cfg, setup=setup)
    from fedpeft.engines.checkpoint import load_checkpoint
    from fedpeft.experiment import fingerprint

    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    for cid, state in ckpt.personal.items():
        space = setup.corpus.label_spaces[cid]
        outside = np.setdiff1d(np.arange(len(setup.corpus.class_names)), space)
        bias, weight = state["head.bias"], state["head.weight"]
        assert torch.all(bias[outside] <= MASKED_BIAS * 0.99)  # masked (weight decay shrinks it a little)
        torch.testing.assert_close(weight[outside], setup.initial["head.weight"][outside])  # never trained
        assert not torch.equal(weight[space], setup.initial["head.weight"][space])
    assert summary["final_global"] is None
    assert_scored_in_own_label_space(cfg, setup, summary)
    assert set(summary["final_val"]) >= {"accuracy_mean", "accuracy_p10"}
    assert len(summary["final_local_by_client"]) == 3
    records = [json.loads(line) for line in (cfg.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert "global" not in records[-1] and "val" in records[-1]


def test_a_shared_head_across_tasks_is_refused(silo_config):
    with pytest.raises(ConfigError, match=r"across tasks.*method\.head: personal"):
        build(silo_config(method={"name": "fedap"}))


def test_fedmcp_runs_on_silos(silo_config):
    cfg = silo_config(method={"name": "fedmcp"}, **{"train.rounds": 2})
    setup = build(cfg)
    summary = run(cfg, setup=setup)
    assert summary["rounds"] == 2
    assert_scored_in_own_label_space(cfg, setup, summary)


def test_dominant_entity_type():
    assert dominant_entity_type(["O", "B-PER", "I-PER", "B-LOC"]) == "PER"
    assert dominant_entity_type(["B-LOC", "B-PER"]) == "PER"  # a tie: the earlier class
    assert dominant_entity_type(["O", "O"]) == "none"
    assert dominant_entity_type(["I-ORG", "B-MISC"]) == "ORG"
