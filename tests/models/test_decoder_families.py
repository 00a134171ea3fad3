"""Hub decoders by family (issue 36, item 4): a tiny random model of each family, saved
locally and loaded through fedpeft's own ``from_pretrained`` path (the download is the
only step not exercised), gets LoRA on its attention's query and value projections and
trains. The default tier checks the targets of every family; the slow tier trains each."""

from __future__ import annotations

import pytest
import torch

from fedpeft.experiment import build, run
from fedpeft.peft.lora import LoraSpec, add_lora, default_targets
from tests.helpers.configs import TINY_CHAT_TEMPLATE, lm_config

#: family -> (transformers config class, extra settings, its query/value modules)
FAMILIES = {
    "llama": ("LlamaConfig", {"num_key_value_heads": 2}, {"q_proj", "v_proj"}),
    "mistral": ("MistralConfig", {"num_key_value_heads": 2}, {"q_proj", "v_proj"}),
    "qwen2": ("Qwen2Config", {"num_key_value_heads": 2}, {"q_proj", "v_proj"}),
    "gemma": ("GemmaConfig", {"num_key_value_heads": 2, "head_dim": 8}, {"q_proj", "v_proj"}),
    "phi3": ("Phi3Config", {"num_key_value_heads": 2}, {"qkv_proj"}),
    "phi": ("PhiConfig", {}, {"q_proj", "v_proj"}),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    """Each family's tiny random decoder (2 layers, hidden 32) with MiniLM's tokenizer and
    a chat template, saved as a hub download would leave it."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedpeft.models.backbone import bundled_minilm_dir

    tok = AutoTokenizer.from_pretrained(bundled_minilm_dir())
    tok.chat_template, tok.eos_token = TINY_CHAT_TEMPLATE, "[SEP]"
    common = {"vocab_size": tok.vocab_size, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
              "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
              "tie_word_embeddings": True}  # fmt: skip
    out = {}
    for family, (config_cls, extra, _) in FAMILIES.items():
        path = tmp_path_factory.mktemp(f"tiny-{family}")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(
            getattr(transformers, config_cls)(**common, **extra)
        ).save_pretrained(path)
        tok.save_pretrained(path)
        out[family] = str(path)
    return out


def family_config(tiny_config, path: str, **over):
    """The causal-LM test config on ``path``; longer rows: a family's own tokenizer class
    (transformers picks it by the model type: Qwen2's, a generic one for Mistral and Phi-3)
    reads MiniLM's vocabulary with its own rules, which cut words finer."""
    return lm_config(tiny_config, path, **{"data.max_length": 96, **over})


def test_each_family_gets_lora_on_its_query_and_value(family_dirs, tiny_config):
    for family, (_, _, expected) in FAMILIES.items():
        setup = build(family_config(tiny_config, family_dirs[family]))
        config = setup.model.backbone.peft_config["default"]
        assert set(config.target_modules) == expected, family
        adapted = {
            n.split(".")[-4] for n, p in setup.model.named_parameters() if p.requires_grad and "lora_A" in n
        }
        assert adapted == expected, family


def test_all_linear_and_named_targets_and_an_unknown_family():
    assert default_targets("llama", ["all-linear"]) == "all-linear"
    assert default_targets("llama", ["k_proj"]) == ["k_proj"]
    assert default_targets("bert", ["query", "value"]) == ["query", "value"]
    assert default_targets("gpt_neox", ["query", "value"]) == ["query_key_value"]  # HF PEFT's own table
    with pytest.raises(ValueError, match=r"'mystery' model .*query and value"):
        default_targets("mystery", ["query", "value"])
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    tiny = LlamaForCausalLM(LlamaConfig(**shape))
    wrapped = add_lora(tiny, LoraSpec(target_modules=["all-linear"]))
    adapted = {n.split(".")[-4] for n, p in wrapped.named_parameters() if "lora_A" in n}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.slow  # six small federated runs
@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_family_trains_and_only_its_adapters_move(family_dirs, tiny_config, tmp_path, family):
    cfg = family_config(
        tiny_config, family_dirs[family], **{"train.rounds": 2, "output_dir": str(tmp_path / "run")}
    )
    setup = build(cfg)
    frozen = {n: p.detach().clone() for n, p in setup.model.named_parameters() if not p.requires_grad}
    initial = dict(setup.initial)
    run(cfg, setup=setup)
    trained = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    moved = [n for n, t in trained.items() if "lora_B" in n and not torch.equal(t, initial[n])]
    assert moved, family  # B starts at zero: the adapters learned something
    for name, p in setup.model.named_parameters():
        if name in frozen:
            assert torch.equal(p.detach(), frozen[name]), name  # the base never moves


def test_a_hub_id_goes_to_from_pretrained_as_it_is(tiny_config, monkeypatch):
    """``model.backbone: Qwen/Qwen2.5-0.5B-Instruct``: the id reaches transformers' own
    ``from_pretrained`` unchanged (the download, not possible here, is all that is left),
    and its failure is an error naming the backbone."""
    import transformers

    from fedpeft.models.backbone import BackboneError, load_backbone

    asked = []

    def offline(source, *args, **kwargs):
        asked.append(source)
        raise OSError("no network here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    cfg = tiny_config(**{"model.backbone": "Qwen/Qwen2.5-0.5B-Instruct", "data.task": "causal_lm"})
    with pytest.raises(BackboneError, match=r"model\.backbone 'Qwen/Qwen2\.5-0\.5B-Instruct': cannot load"):
        load_backbone(cfg.model, lm_head=True)
    assert asked == ["Qwen/Qwen2.5-0.5B-Instruct"]
