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

# The shared helpers (tests/helpers/) assert too: rewrite them as pytest rewrites tests.
pytest.register_assert_rewrite("tests.helpers")

from tests.helpers.configs import TINY, TINY_CHAT_TEMPLATE  # noqa: E402

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


@pytest.fixture
def forget_nodes():
    """Nodes live in the ClientApp module's cache; drop them (and their models) after each
    test. Modules that run a fake federation (tests/helpers/flower.py) use it for every test."""
    yield
    from fedpeft.flower import apps

    apps._nodes.clear()
