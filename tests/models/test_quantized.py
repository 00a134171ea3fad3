"""Quantised frozen backbones (issue 36, item 1): bitsandbytes' NF4 and int8 on the CPU,
a tiny random decoder. The adapters train while the quantised base stays as it was, a
cohort trains folded (or one client at a time), and the exported adapter loads onto a base quantised
the same way, with HF PEFT as with fedpeft."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedpeft.config import ConfigError
from fedpeft.experiment import build, make_engine, run
from fedpeft.report.results import read_records
from tests.helpers.configs import lm_config


def quantised(model) -> dict[str, torch.Tensor]:
    """The quantised weights (bitsandbytes stores them as integer tensors), by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.is_floating_point()}


@pytest.mark.parametrize(
    "quantization, layer",
    [
        pytest.param(q, layer, marks=pytest.mark.slow)
        for q, layer in (("nf4", "Linear4bit"), ("int8", "Linear8bitLt"))
    ],
)
def test_a_quantised_base_stays_while_its_adapters_train(
    tiny_config, tiny_decoder, tmp_path, quantization, layer
):
    cfg = lm_config(tiny_config, tiny_decoder, **{"model.quantization": quantization, "train.rounds": 2})
    setup = build(cfg)
    linears = {type(m).__name__ for m in setup.model.modules()}
    assert layer in linears
    base = quantised(setup.model)
    assert base  # the projections' weights are stored quantised
    initial = dict(setup.initial)
    run(cfg, setup=setup)
    trained = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    assert any("lora_B" in n and not torch.equal(t, initial[n]) for n, t in trained.items())
    after = quantised(setup.model)
    assert after.keys() == base.keys() and all(torch.equal(after[n], base[n]) for n in base)
    assert all(p.dtype == torch.float32 for n, p in setup.model.named_parameters() if p.requires_grad)
    info = json.loads((cfg.output_dir / "adapter" / "fedpeft_model.json").read_text())
    assert info["quantization"] == quantization


@pytest.mark.parametrize("quantization", ["nf4", "int8"])
def test_the_exported_adapter_loads_onto_a_base_quantised_the_same_way(
    tiny_config, tiny_decoder, quantization
):
    """The export of a run on a quantised base gives the trained model's logits, loaded by
    ``fedpeft.load_export`` and by HF PEFT onto a base quantised alike."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import fedpeft
    from fedpeft.methods.base import load_tensors
    from fedpeft.models.backbone import keep_4bit_layout, quantization_config

    cfg = lm_config(tiny_config, tiny_decoder, **{"model.quantization": quantization, "train.rounds": 1})
    setup = build(cfg)
    run(cfg, setup=setup)
    trained = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    lora_b = [n for n in trained if "lora_B" in n]
    assert lora_b and any(bool(trained[n].abs().sum() > 0) for n in lora_b)
    load_tensors(setup.model, trained)  # the run's own model (it trained and was scored), as trained
    adapter = cfg.output_dir / "adapter"
    base = AutoModelForCausalLM.from_pretrained(
        str(tiny_decoder), quantization_config=quantization_config(cfg.model), device_map={"": "cpu"}
    )
    keep_4bit_layout(base)  # as docs/tasks.md's PEFT recipe says (bitsandbytes' CPU repacking off)
    peft_model = PeftModel.from_pretrained(base, str(adapter)).eval()
    loaded = fedpeft.load_export(adapter)
    ids = torch.tensor([[5, 17, 99, 1000, 2000, 7]])
    setup.model.eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=ids).logits
        ours = loaded.model.backbone(input_ids=ids).logits
        run_model = setup.model.backbone(input_ids=ids).logits
    layer = {"nf4": "Linear4bit", "int8": "Linear8bitLt"}[quantization]
    assert layer in {type(m).__name__ for m in peft_model.modules()}
    torch.testing.assert_close(ours, run_model, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(theirs, run_model, rtol=1e-5, atol=1e-5)


def test_an_nf4_base_narrower_than_its_block_trains(tiny_config, tiny_decoder):
    """Every projection of the tiny decoder (hidden 32) is narrower than bitsandbytes'
    64-element block, which its CPU repacking cannot lay out ("shape '[32, 0]' is
    invalid"): the run trains and is scored all the same."""
    cfg = lm_config(tiny_config, tiny_decoder, **{"model.quantization": "nf4", "train.rounds": 2})
    setup = build(cfg)
    nf4 = [m for m in setup.model.modules() if type(m).__module__ == "bitsandbytes.nn.modules"]
    assert nf4 and all(type(m).__name__ == "Linear4bit" for m in nf4)
    assert any(m.in_features < m.weight.quant_state.blocksize for m in nf4)  # q, k, v, o, gate, up
    initial = dict(setup.initial)
    run(cfg, setup=setup)
    trained = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    assert any("lora_B" in n and not torch.equal(t, initial[n]) for n, t in trained.items())
    assert all(math.isfinite(r["loss"]) for r in read_records(cfg.output_dir))


def test_an_nf4_base_scores_as_it_trains_and_survives_its_state_dict(tiny_config, tiny_decoder):
    """Inference (eval, no gradients) computes the same logits as a training pass, and
    reading the model's ``state_dict`` (checkpoints, exports) leaves the base as it was:
    bitsandbytes' CPU repacking would do neither (``keep_4bit_layout``)."""
    cfg = lm_config(tiny_config, tiny_decoder, **{"model.quantization": "nf4", "data.max_length": 64})
    model = build(cfg).model
    ids = torch.tensor([[5, 17, 99, 1000, 2000, 7]])
    model.train()
    trained = model.backbone(input_ids=ids).logits.detach()
    model.eval()
    with torch.no_grad():
        scored = model.backbone(input_ids=ids).logits
        model.state_dict()
        again = model.backbone(input_ids=ids).logits
    torch.testing.assert_close(scored, trained, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(again, trained, rtol=1e-5, atol=1e-5)


def test_a_quantised_base_cohorts_only_methods_that_fold(tiny_config, tiny_decoder):
    """Cohorts on a quantised base train folded (tests/engines/test_folding.py); a method that
    cannot fold trains one client at a time, and a cohort size asked of it is refused."""
    over = {"model.quantization": "nf4", "train.cohort_size": 2}
    assert make_engine(build(lm_config(tiny_config, tiny_decoder, **over)), None).cohort_size == 2
    with pytest.raises(ConfigError, match=r"train\.cohort_size 2: .*folded.*model\.quantization nf4"):
        make_engine(build(lm_config(tiny_config, tiny_decoder, method={"name": "compacter"}, **over)), None)
    auto = {**over, "train.cohort_size": "auto"}
    engine = make_engine(
        build(lm_config(tiny_config, tiny_decoder, method={"name": "compacter"}, **auto)), None
    )
    assert engine.cohort_size == 1
    with pytest.raises(ConfigError, match=r"privacy\.mode sample: "):
        lm_config(
            tiny_config,
            tiny_decoder,
            **{"model.quantization": "int8", "privacy": {"mode": "sample", "noise_multiplier": 1.0}},
        )


def test_bitsandbytes_is_imported_only_by_a_run_that_quantises(tiny_config, tiny_decoder, tmp_path):
    """A run with ``model.quantization: none`` (LoRA through peft, which imports
    bitsandbytes wherever it finds it) neither imports bitsandbytes nor prints its CPU
    kernels warning; an NF4 run after it in the same process finds it and trains, its
    warning silenced as other libraries' are (no --verbose)."""
    import subprocess
    import sys

    from fedpeft.config import dump_config

    plain = tiny_config(output_dir=str(tmp_path / "plain"))
    nf4 = lm_config(tiny_config, tiny_decoder, **{"model.quantization": "nf4", "train.rounds": 1,
                                                  "output_dir": str(tmp_path / "nf4")})  # fmt: skip
    (tmp_path / "plain.yaml").write_text(dump_config(plain))
    (tmp_path / "nf4.yaml").write_text(dump_config(nf4))
    script = """
import sys
from typer.testing import CliRunner
from fedpeft.cli import app
for path, loud in zip(sys.argv[1:], (["--verbose"], [])):
    result = CliRunner().invoke(app, [*loud, "run", path])
    assert result.exit_code == 0, result.output
    print(result.output, file=sys.stderr)  # the command's stdout and stderr, as a terminal shows them
    print(f"after {path}: bitsandbytes imported: {sys.modules.get('bitsandbytes') is not None}",
          file=sys.stderr, flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "plain.yaml"), str(tmp_path / "nf4.yaml")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    plain_part, _, nf4_part = out.stderr.partition("plain.yaml: bitsandbytes imported: False")
    assert nf4_part, out.stderr[-3000:]  # the plain run ended without bitsandbytes
    assert "gemm_4bit" not in plain_part  # bitsandbytes' CPU warning (--verbose: nothing silenced)
    assert "nf4.yaml: bitsandbytes imported: True" in nf4_part
    assert "gemm_4bit" not in nf4_part  # without --verbose, not even where bitsandbytes is used


def test_the_flowertune_recipe_has_flowertunes_settings():
    from fedpeft.config import load_config

    cfg = load_config("flowertune")
    assert (cfg.model.backbone, cfg.model.quantization, cfg.data.task) == (
        "bundled-smollm2",
        "nf4",
        "causal_lm",
    )
    assert (cfg.partition.num_clients, cfg.train.clients_per_round, cfg.train.local_steps) == (20, 2, 10)
    assert (cfg.method.lora.r, cfg.method.lora.alpha, cfg.train.lr_schedule) == (32, 64, "cosine")


@pytest.mark.slow  # SmolLM2 in 4 bits on the CPU: a minute
def test_the_flowertune_recipes_adapter_loads_onto_the_4bit_base_with_peft(tmp_path):
    """The built-in recipe, cut short, on the bundled SmolLM2 in NF4: its global adapter
    loads with ``PeftModel.from_pretrained`` onto the base quantised the same way and gives
    ``fedpeft.load_export``'s logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import fedpeft
    from fedpeft.config import load_config
    from fedpeft.models.backbone import (
        SMOLLM2_GGUF,
        bundled_smollm2_dir,
        dequantised_gguf,
        keep_4bit_layout,
        quantization_config,
    )

    short = {"output_dir": str(tmp_path / "ft"), "train.rounds": 1, "train.local_steps": 2,
             "data.max_samples": 200, "data.max_test_samples": 8, "eval.generation.samples": 2,
             "eval.generation.max_new_tokens": 4}  # fmt: skip
    cfg = load_config("flowertune", short)
    run(cfg)
    base_dir = dequantised_gguf(str(bundled_smollm2_dir()), SMOLLM2_GGUF)
    base = AutoModelForCausalLM.from_pretrained(
        str(base_dir), quantization_config=quantization_config(cfg.model), device_map={"": "cpu"}
    )
    keep_4bit_layout(base)
    peft_model = PeftModel.from_pretrained(base, str(cfg.output_dir / "adapter")).eval()
    loaded = fedpeft.load_export(cfg.output_dir / "adapter")
    ids = torch.tensor([[1, 200, 3000, 45, 9, 77]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model.backbone(input_ids=ids).logits,
            peft_model(input_ids=ids).logits,
            rtol=1e-5,
            atol=1e-5,
        )
    records = read_records(cfg.output_dir)
    assert records[-1]["cum_bytes"] > 0 and "lr" in records[-1]
