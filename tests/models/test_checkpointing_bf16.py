"""Gradient checkpointing and a bfloat16 backbone (issue 36, item 1), on tiny random models.

Checkpointing recomputes each layer's activations in the backward pass: the same
gradients, so the same round to float rounding, alone and in a (folded) cohort. A
bfloat16 backbone stores its frozen weights in bfloat16 and computes under bfloat16
autocast; what trains stays float32."""

from __future__ import annotations

import copy

import pytest
import torch

from fedpeft.config import ConfigError
from fedpeft.experiment import build, half_precision_tensors, make_engine, run
from fedpeft.models.backbone import checkpointed_layers
from fedpeft.report.results import read_records
from tests.helpers.cohort import round_jobs
from tests.helpers.configs import lm_config


def counting_checkpoints(model) -> list[int]:
    """Count every checkpointed call of ``model``'s layers (a list that grows by one each)."""
    calls: list[int] = []
    for layer in checkpointed_layers(model):
        inner = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, inner=inner, **k: calls.append(1) or inner(*a, **k)
    return calls


def assert_same_round(got, want, where: str) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.metrics["loss"] == pytest.approx(w.metrics["loss"], rel=1e-5)
        for name in w.uplink:
            torch.testing.assert_close(
                g.uplink[name],
                w.uplink[name],
                atol=1e-5,
                rtol=1e-4,
                msg=lambda m, n=name: f"{where} {n}: {m}",
            )


@pytest.mark.parametrize("clients", [1, 3])
def test_a_checkpointed_decoder_trains_the_same_round(tiny_config, tiny_decoder, clients):
    """A cohort of one (plain autograd) and of three (folded, as auto picks with
    checkpointing) get the rounds they get without checkpointing, and every layer's
    forward pass of every step ran checkpointed."""
    over = {
        "train.local_steps": 3,
        "train.optimizer": "sgd",
        "train.lr": 0.5,
    }  # SGD: no noise-driven elements
    plain = build(lm_config(tiny_config, tiny_decoder, **over))
    checkpointed = build(
        lm_config(tiny_config, tiny_decoder, **over, **{"model.gradient_checkpointing": True})
    )
    layers = checkpointed_layers(checkpointed.model)
    assert len(layers) == 2 and not checkpointed_layers(plain.model)
    cids = list(range(clients))
    want = plain.method.fit_cohort(plain.model, round_jobs(plain, cids))
    calls = counting_checkpoints(checkpointed.model)
    got = checkpointed.method.fit_cohort(checkpointed.model, round_jobs(checkpointed, cids))
    assert len(calls) == 3 * len(layers)  # 3 steps, the cohort's clients folded into one pass
    assert not any(layer.training for layer in layers)  # back in the model's mode after the steps
    assert_same_round(got, want, f"checkpointed cohort of {clients}")


def test_a_checkpointed_classifier_folds_its_cohorts_and_refuses_vmap(tiny_config):
    over = {"model.gradient_checkpointing": True, "train.cohort_size": 2, "train.local_steps": 2,
            "train.optimizer": "sgd"}  # fmt: skip
    cfg = tiny_config(method={"name": "fedap"}, **over)
    setup = build(cfg)
    assert make_engine(setup, None).cohort_size == 2
    jobs = round_jobs(setup, [0, 1])
    together = setup.method.fit_cohort(setup.model, copy.deepcopy(jobs))
    alone = [setup.method.fit_cohort(setup.model, [job])[0] for job in copy.deepcopy(jobs)]
    assert_same_round(together, alone, "fedap folded")
    with pytest.raises(ConfigError, match=r"train\.cohort_mode vmap: model\.gradient_checkpointing"):
        make_engine(
            build(tiny_config(**{"model.gradient_checkpointing": True, "train.cohort_mode": "vmap"})), None
        )
    with pytest.raises(ConfigError, match=r"folded with model\.gradient_checkpointing"):
        make_engine(
            build(tiny_config(method={"name": "c2a"}, **{"model.gradient_checkpointing": True,
                                                          "train.cohort_size": 2})),
            None,
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"privacy\.mode sample: .*model\.gradient_checkpointing"):
        tiny_config(
            **{"model.gradient_checkpointing": True, "privacy": {"mode": "sample", "noise_multiplier": 1.0}}
        )


@pytest.mark.parametrize(
    "name",
    ["fedlr", pytest.param("fedap", marks=pytest.mark.slow), pytest.param("fedbf", marks=pytest.mark.slow)],
)
def test_a_bfloat16_backbone_trains_float32_tensors_under_bf16_autocast(tiny_config, tmp_path, name):
    """``model.dtype: bfloat16``: the frozen weights stay bfloat16, the trained ones (LoRA,
    adapters, BitFit's own biases, the head) and the optimizer state float32, and the
    run's losses follow the float32 run's (bfloat16 keeps 8 bits of mantissa: within 5 %)."""
    over = {"train.rounds": 2, "eval.every": 2}
    half = tiny_config(method={"name": name}, **over, **{"model.dtype": "bfloat16"})
    setup = build(half)
    frozen = {p.dtype for p in half_precision_tensors(setup.model)}
    trained = {p.dtype for p in setup.model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    # what stays float32 of the frozen backbone: only a layer norm's weight whose bias trains
    kept = [n for n, p in setup.model.named_parameters() if not p.requires_grad and p.dtype == torch.float32]
    assert all(n.endswith("LayerNorm.weight") for n in kept) and (name == "fedbf") == bool(kept)
    assert setup.model.precision == torch.bfloat16
    assert all(t.dtype == torch.float32 for t in setup.initial.values())
    run(half, setup=setup)
    full = tiny_config(method={"name": name}, **over, output_dir=str(tmp_path / "fp32"))
    run(full)
    ours, theirs = read_records(half.output_dir), read_records(full.output_dir)
    for a, b in zip(ours, theirs, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=0.05)
