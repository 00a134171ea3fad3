"""Backbone loading: the bundled MiniLM end to end, the bundled GGUF decoder, and hub ids
tested up to the download."""

import pytest
import torch

from fedpeft.config import ModelConfig
from fedpeft.experiment import run
from fedpeft.models.backbone import BackboneError, build_model


@pytest.mark.integration
def test_bundled_minilm_federated_round(tiny_config):
    cfg = tiny_config(
        **{
            "model": {"backbone": "bundled-minilm"},
            "data.max_samples": 120,
            "data.max_test_samples": 20,
            "partition": {"scheme": "iid", "num_clients": 3, "min_size": 5},
            "train": {"rounds": 1, "clients_per_round": 2, "local_steps": 1, "batch_size": 4},
        }
    )
    summary = run(cfg)
    assert summary["params"]["total"] > 22_000_000  # the real all-MiniLM-L6-v2
    assert summary["params"]["trainable"] < 0.01 * summary["params"]["total"]
    assert summary["final_global"]["accuracy"] is not None


@pytest.mark.slow
def test_bundled_smollm2_gguf_loads_and_runs():
    model, tok = build_model(ModelConfig(backbone="bundled-smollm2", pooling="last"), num_labels=3, seed=0)
    assert model.backbone.config.model_type == "llama"
    assert tok.pad_token_id is not None
    batch = tok(["a gloss about animals", "to move fast"], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(batch["input_ids"], batch["attention_mask"])
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()


def test_hub_backbone_offline_fails_naming_the_id(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(BackboneError, match="nobody/no-such-model"):
        build_model(ModelConfig(backbone="nobody/no-such-model"), num_labels=2, seed=0)
