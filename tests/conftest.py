"""Shared fixtures: a tiny BERT backbone on disk and tiny experiment configs.

The tiny backbone is a randomly initialised 2-layer BERT (hidden 32) saved with the
bundled MiniLM tokenizer, so tests exercise the real loading path in seconds.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fedpeft.config import ExperimentConfig, parse_config, set_dotted

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine a
# second spinning OpenMP thread turns microsecond matmuls into milliseconds.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_backbone(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer, BertConfig, BertModel

    from fedpeft.models.backbone import bundled_minilm_dir

    out = tmp_path_factory.mktemp("tiny-bert")
    tok = AutoTokenizer.from_pretrained(bundled_minilm_dir())
    cfg = BertConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


TINY = {
    "name": "tiny",
    "seed": 3,
    "data": {"source": "wordnet", "max_samples": 300, "max_test_samples": 60, "max_length": 16},
    "partition": {"scheme": "dirichlet", "num_clients": 4, "alpha": 0.5, "min_size": 10},
    "train": {"rounds": 2, "clients_per_round": 2, "local_steps": 2, "batch_size": 8, "lr": 0.01},
    "eval": {"every": 1, "batch_size": 64},
    "log": {"plots": False},  # drawing a tiny run's figures takes longer than training it
}


@pytest.fixture
def tiny_config(tiny_backbone, tmp_path):
    """``make(**dotted_overrides) -> ExperimentConfig`` for a seconds-long experiment."""

    def make(**overrides) -> ExperimentConfig:
        data = copy.deepcopy(TINY)
        data["model"] = {"backbone": str(tiny_backbone)}
        data["output_dir"] = str(tmp_path / "run")
        for key, value in overrides.items():
            set_dotted(data, key.replace("__", "."), value)
        return parse_config(data, "tiny")

    return make


#: A chat template for the tiny decoder (its tokenizer, MiniLM's, has none).
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} [SEP] {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory) -> Path:
    """A randomly initialised 2-layer Llama (hidden 32) with MiniLM's tokenizer, a chat
    template and ``[SEP]`` as its end of turn: the causal-LM path in seconds."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from fedpeft.models.backbone import bundled_minilm_dir

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(bundled_minilm_dir())
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.eos_token = "[SEP]"
    cfg = LlamaConfig(
        vocab_size=tok.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out
