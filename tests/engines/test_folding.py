"""Folded cohorts (issue 36, item 2): the frozen backbone runs once on the cohort's
batches folded into one, only the trained tensors per client (``fedpeft.engines.local.folding``).

A folded cohort gives each client the round it gets alone, to float rounding: the same
tolerances as a vmapped cohort (``tests/engines/test_cohort.py``), on a tiny BERT classifier and
a tiny random Llama, and on that Llama quantised to NF4 (bitsandbytes' CPU kernels, which
vmap cannot batch) within the tolerance stated there."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fedpeft.config import ConfigError
from fedpeft.engines.local import CohortMode, RoundContext, cohort_mode, fold_refusal, predict_cohort
from fedpeft.engines.local.folding import ClientAxis, fold
from fedpeft.experiment import build, make_engine
from fedpeft.methods import REGISTRY
from fedpeft.methods.fedsb import SETUP
from fedpeft.models.causal import SCORED
from tests.helpers.cohort import assert_cohort_equals_alone, jobs_after_round_one, round_jobs
from tests.helpers.configs import MIXED_RANKS, lm_config

#: compiled and folded: plain backprop, and a penalty with a float weight
COMPILED = {"fedlr": "plain backprop", "hetlora": "its penalty, a float weight, compiled too"}


def test_a_stacked_linear_and_layer_norm_run_each_clients_rows_with_its_tensors():
    torch.manual_seed(0)
    clients, rows, width = 3, 4, 5
    x = torch.randn(clients * rows, 2, width)
    weight, bias = torch.randn(clients, 6, width), torch.randn(clients, 6)
    scale, shift = torch.randn(clients, width), torch.randn(clients, width)
    with ClientAxis(clients):
        linear = torch.nn.functional.linear(x, weight, bias)
        shared_weight = torch.nn.functional.linear(x, weight[0], bias)  # BitFit: only the bias stacked
        norm = torch.nn.functional.layer_norm(x, (width,), scale, shift)
        plain = torch.nn.functional.linear(x, weight[0])  # nothing stacked: as it is
    parts = x.view(clients, rows, 2, width)
    for c in range(clients):
        at = slice(c * rows, (c + 1) * rows)
        torch.testing.assert_close(linear[at], torch.nn.functional.linear(parts[c], weight[c], bias[c]))
        torch.testing.assert_close(
            shared_weight[at], torch.nn.functional.linear(parts[c], weight[0], bias[c])
        )
        torch.testing.assert_close(
            norm[at], torch.nn.functional.layer_norm(parts[c], (width,), scale[c], shift[c])
        )
    torch.testing.assert_close(plain, torch.nn.functional.linear(x, weight[0]))


def test_folding_offsets_each_clients_scored_positions_and_keeps_padding():
    ids = torch.zeros(2, 3, 4, dtype=torch.long)  # 2 clients x 3 rows x 4 tokens
    scored = torch.tensor([[0, 5, -1], [2, 11, 7]])
    folded = fold({"input_ids": ids, "attention_mask": ids, SCORED: scored})
    assert folded["input_ids"].shape == (6, 4)
    assert folded[SCORED].tolist() == [0, 5, -1, 14, 23, 19]


def test_the_plain_lora_method_folds(tiny_config):
    """FedAvg over LoRA (the first registered LoRA method that keeps every default hook of
    a client's round) folds: the equality below covers it, at least."""
    setup = build(tiny_config())
    assert fold_refusal(setup.method, setup.model) == ""


@pytest.mark.parametrize("name", REGISTRY)
def test_a_folded_cohort_equals_one_at_a_time_or_is_refused_saying_why(tiny_config, name):
    """Clients of different step counts, folded: each gets its round alone; a client that
    finishes early stays put. A method that cannot fold says why, and a folded run of it
    is refused."""
    cfg = tiny_config(method={"name": name, **MIXED_RANKS.get(name, {})},
                      **{"train.local_steps": None, "train.local_epochs": 1, "train.optimizer_state": "keep",
                         "train.cohort_mode": "folded"})  # fmt: skip
    setup = build(cfg)
    if why := fold_refusal(setup.method, setup.model):
        assert why.startswith(f"method {name} ")
        with pytest.raises(ConfigError, match=f"train.cohort_mode folded: method {name} "):
            make_engine(setup, None)
        return
    cids = list(range(len(setup.clients)))
    sizes = {-(-len(setup.clients[c].train) // cfg.train.batch_size) for c in cids}
    assert len(sizes) > 1, "want clients with different step counts"
    server = setup.method.init_server(setup.model)
    if setup.method.training_server(server) is not server:  # a setup round first (Fed-SB's): round 2
        setup, cids, jobs, _ = jobs_after_round_one(cfg)
        assert not any(SETUP in j.received for j in jobs)
        assert_cohort_equals_alone(setup, cids, name, jobs)
        return
    assert_cohort_equals_alone(setup, cids, name)


def test_a_folded_cohort_runs_the_models_own_attention_kernel(tiny_config, monkeypatch):
    """Folded, the backbone is not vmapped: SDPA runs once per layer and step for the whole
    cohort (vmap would loop it over the clients, so a vmapped cohort uses eager attention)."""
    setup = build(tiny_config(**{"train.local_steps": 2, "train.cohort_mode": "folded"}))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    counted = lambda *a, **k: calls.append(a[0].shape) or sdpa(*a, **k)  # noqa: E731
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    jobs = round_jobs(setup, [0, 1, 2])
    setup.method.fit_cohort(setup.model, jobs)
    layers = setup.model.backbone.config.num_hidden_layers
    assert len(calls) == 2 * layers
    assert calls[0][0] == 3 * setup.cfg.train.batch_size  # the three clients' rows, folded


def test_fedprox_and_scaffold_fold_too(tiny_config):
    """The update after the gradients (FedProx's pull, SCAFFOLD's correction, the optimizer)
    is each client's own, vmapped, in a folded cohort as in a vmapped one."""
    cfg = tiny_config(**{"train.local_steps": 3, "train.prox_mu": 0.5, "train.cohort_mode": "folded"})
    setup = build(cfg)
    assert_cohort_equals_alone(setup, [0, 1, 2], "fedlr+fedprox")
    cfg = tiny_config(**{"train.local_steps": 3, "train.optimizer": "sgd", "train.lr": 0.05,
                         "train.correction": "scaffold", "train.cohort_mode": "folded"})  # fmt: skip
    setup = build(cfg)
    jobs = round_jobs(setup, [0, 1, 2])
    control = {n: 0.01 * torch.ones_like(t) for n, t in jobs[0].received.items()}
    for job in jobs:
        job.control = copy.deepcopy(control)
    assert_cohort_equals_alone(setup, [0, 1, 2], "fedlr+scaffold", jobs=jobs)


def test_a_folded_causal_lm_cohort_equals_one_at_a_time(tiny_config, tiny_decoder):
    """A tiny random Llama with LoRA: the response-token loss at each client's scored
    positions, folded (its SCORED positions offset per client)."""
    setup = build(
        lm_config(tiny_config, tiny_decoder, **{"train.cohort_mode": "folded", "train.local_steps": 3})
    )
    assert_cohort_equals_alone(setup, [0, 1, 2], "fedlr causal_lm")


def test_a_quantised_decoder_trains_folded_cohorts(tiny_config, tiny_decoder):
    """NF4 (bitsandbytes' CPU kernels, which vmap cannot batch): ``cohort_mode: auto``
    folds, and each client gets its round alone to float rounding: the 4-bit matmul
    dequantises and multiplies the same numbers folded or not, but in different blocks,
    so the loss agrees to 1e-5 and the tensors to 1e-4 (Adam: as test_cohort says)."""
    cfg = lm_config(tiny_config, tiny_decoder, **{"model.quantization": "nf4", "train.cohort_size": 3,
                                                   "train.local_steps": 3})  # fmt: skip
    setup = build(cfg)
    engine = make_engine(setup, None)
    assert engine.cohort_size == 3
    assert_cohort_equals_alone(setup, [0, 1, 2], "fedlr nf4")


def test_a_quantised_classifier_scores_clients_folded(tiny_config):
    """Scoring a cohort of client models on a quantised backbone folds too (vmap cannot):
    the same predictions as each model alone."""
    setup = build(tiny_config(**{"model.quantization": "nf4"}))
    model, method = setup.model, setup.method
    server = method.init_server(model)
    states = []
    for shift in (0.0, 0.5, -0.5):
        state = {n: t + shift * torch.randn_like(t) for n, t in method.downlink(server, 0).items()}
        states.append(state)
    data = setup.clients[0].train
    together = predict_cohort(model, states, data, batch_size=8)
    for state, preds in zip(states, together, strict=True):
        (alone,) = predict_cohort(model, [state], data, batch_size=8)
        assert (preds == alone).all()
    assert not (together[1] == together[2]).all()  # the states differ, so do their predictions


def test_how_a_cohort_trains_is_decided_in_one_place(tiny_config):
    """``cohort_mode``: auto vmaps a plain backbone, folded folds a method that can, DP-SGD
    cannot fold (refused naming privacy.mode), and a cohort of jobs from two rounds is refused."""
    setup = build(tiny_config())
    method, model = setup.method, setup.model
    assert cohort_mode(method, model, "auto", dp_sgd=False) == CohortMode("vmap")
    assert cohort_mode(method, model, "vmap", dp_sgd=True).how == "vmap"
    assert cohort_mode(method, model, "folded", dp_sgd=False).how == "folded"
    with pytest.raises(ConfigError, match=r"train\.cohort_mode folded: privacy\.mode sample"):
        cohort_mode(method, model, "folded", dp_sgd=True)
    with pytest.raises(ConfigError, match=r"train\.cohort_mode folded: privacy\.mode sample"):
        make_engine(build(tiny_config(**{"train.cohort_mode": "folded", "privacy.mode": "sample",
                                         "privacy.noise_multiplier": 1.0})), None)  # fmt: skip
    a, b = round_jobs(setup, [0, 1])
    later = replace(b, context=RoundContext(b.context.train.model_copy(update={"lr": 0.5})))
    with pytest.raises(ValueError, match="different round contexts"):
        method.fit_cohort(model, [a, later])


@pytest.mark.parametrize("faster", ["vmap", "folded"])
def test_auto_takes_the_mode_whose_probed_step_is_faster(tiny_config, monkeypatch, faster):
    """``train.cohort_mode: auto`` on a GPU (here the CPU, let in) times one step of each
    mode; the faster one trains the run's rounds, and round 1 records why."""
    from fedpeft.engines import memory

    timed = []

    def seconds(probe, clients, mode, repeats=3):
        timed.append((clients, mode, len(probe.jobs(clients, probe.step_size, cohort_mode=mode))))
        return 1.0 if mode == faster else 2.0

    monkeypatch.setattr(memory, "TIMED_MODES_ON", ("cpu",))
    monkeypatch.setattr(memory._Probe, "seconds", seconds)
    cfg = tiny_config(**{"train.cohort_size": 3, "train.clients_per_round": 3, "train.rounds": 1,
                         "checkpoint": False})  # fmt: skip
    Path(cfg.output_dir).mkdir(parents=True)
    engine = make_engine(build(cfg), None)
    (record,) = engine.run()
    assert timed == [(3, "vmap", 3), (3, "folded", 3)]
    assert record["setup"]["cohort_mode"] == faster
    assert record["setup"]["cohort_step_" + faster] == 1.0
    assert engine.train.cohort_mode == faster
    assert engine.rounds.begin(2, engine.server).train.cohort_mode == faster


def test_auto_times_nothing_where_there_is_no_choice(tiny_config, monkeypatch):
    """A method that cannot fold, a mode asked for, or a cohort of one: no probe."""
    from fedpeft.engines import memory

    monkeypatch.setattr(memory, "TIMED_MODES_ON", ("cpu",))
    monkeypatch.setattr(memory._Probe, "seconds", lambda *a, **k: pytest.fail("timed"))
    for over in ({"method": {"name": "c2a"}}, {"train.cohort_mode": "vmap"}, {"train.cohort_size": 1}):
        cfg = tiny_config(**{"train.cohort_size": 3, "train.rounds": 1, "checkpoint": False, **over})
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        (record,) = make_engine(build(cfg), None).run()
        assert "cohort_mode" not in record.get("setup", {}), over


def test_a_probed_step_is_timed_in_the_mode_asked(tiny_config, monkeypatch):
    """The probe's real timing: each mode's step runs, in that mode, and takes some time."""
    from fedpeft.engines import memory
    from fedpeft.engines.local import loop

    modes = []
    real = loop.cohort_mode
    monkeypatch.setattr(loop, "cohort_mode", lambda *a, **k: modes.append(a[2]) or real(*a, **k))
    setup = build(tiny_config(**{"train.cohort_size": 3}))
    engine = make_engine(setup, None)
    probe = memory._Probe(engine, setup.method.init_server(setup.model))
    assert probe.seconds(3, "folded", repeats=1) > 0 and probe.seconds(3, "vmap", repeats=1) > 0
    assert modes == ["folded"] * 2 + ["vmap"] * 2


def test_compile_folds_and_refuses_what_cannot_be_compiled(tiny_config):
    """``train.compile`` compiles the folded pass: cohorts fold under ``auto``; vmap, a
    method that cannot fold and DP-SGD are refused naming train.compile; the run's
    identity (its fingerprint, which a resume checks) does not change with it."""
    from fedpeft.experiment import fingerprint

    setup = build(tiny_config())
    method, model = setup.method, setup.model
    folded = CohortMode("folded", "train.compile")
    assert cohort_mode(method, model, "auto", dp_sgd=False, compiled=True) == folded
    refused = r"train\.compile compiles folded cohorts"
    with pytest.raises(ConfigError, match=rf"^{refused}: use train\.cohort_mode folded or auto"):
        cohort_mode(method, model, "vmap", dp_sgd=False, compiled=True)
    with pytest.raises(ConfigError, match=rf"{refused}, and privacy\.mode sample"):
        cohort_mode(method, model, "auto", dp_sgd=True, compiled=True)
    with pytest.raises(ConfigError, match=rf"{refused}, and method c2a "):
        make_engine(build(tiny_config(method={"name": "c2a"}, **{"train.compile": True})), None)
    assert fingerprint(tiny_config(**{"train.compile": True})) == fingerprint(setup.cfg)


@pytest.mark.slow  # torch.compile of a tiny BERT's forward and backward: about a minute on 2 cores each
@pytest.mark.parametrize("name", COMPILED)
def test_a_compiled_folded_cohort_equals_one_at_a_time(tiny_config, name):
    from torch._dynamo.utils import counters

    method = {"name": name, **MIXED_RANKS.get(name, {})}
    setup = build(tiny_config(method=method, **{"train.local_steps": 3, "train.compile": True}))
    counters.clear()
    assert_cohort_equals_alone(setup, [0, 1, 2], f"{name} compiled")
    assert counters["stats"]["unique_graphs"] > 0  # it did compile
