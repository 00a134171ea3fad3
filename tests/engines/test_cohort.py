"""Client cohorts: many clients' local rounds in one vmapped computation.

Tolerance: float32, 1e-5 absolute on the tensors after a round (and 1e-5 relative on
losses). A cohort pads each step's batches to its widest and longest, so reductions
run over extra zeros in another order, and batched matrix products may use other
kernels; neither changes a value by more than float rounding over a few steps.

Except under Adam where a gradient is 0 or nearly: Adam's step ``lr m / sqrt(v)`` does
not shrink with the gradient (its first step is ``lr sign(g)``), so an element whose
gradient is at the level of float noise steps by up to ``lr`` in a direction the noise
picks, in each run: two runs stay within ``2 lr`` a step of each other, and only that
bound is the same either way. Such elements are few (a LoRA ``A`` entry whose input
feature and rank row barely meet; C2A's ``F_U``, ``S_U``, whose scaling the Frobenius
norm cancels): under Adam, at most 1 % of a tensor's elements may differ by more than
1e-5, and those by at most ``2 lr`` per step. A key bias, whose whole gradient is 0
(softmax ignores a shift of every score of a query alike), is held to that bound only.
Measured: C2A under Adam, all within 6.4e-6 (under SGD, 1e-9); FedKD on the tiny
decoder, one element of 1,024 of a mentor's ``lora_A`` off by 6.5e-5.

A client alone trains without ``vmap`` and with the model's own attention kernel (SDPA),
a cohort with eager attention: the same function, rounded differently. The comparisons
of a cohort with its clients alone run the lone clients with eager attention too, so
that only batching differs; :func:`test_a_lone_client_trains_with_its_own_attention_kernel`
compares the two kernels.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fedpeft.data.task import IGNORE, Draw, Encoded, take_steps
from fedpeft.engines.local import RoundContext, optimizer_init, predict_cohort
from fedpeft.engines.local.attention import eager_attention
from fedpeft.engines.local.batches import CohortBatches
from fedpeft.engines.local.optimizer import clip_gradients, optimizer_step
from fedpeft.experiment import build, make_engine, run
from fedpeft.methods import REGISTRY
from fedpeft.methods.base import Method, load_tensors, trainable_params
from fedpeft.metrics.classification import predict
from fedpeft.report.results import read_records
from tests.helpers.cohort import assert_cohort_equals_alone, jobs_after_round_one, round_jobs
from tests.helpers.configs import MIXED_RANKS

#: every registered method whose rounds all train (Fed-SB's first is a setup round, which
#: sums gradients one client at a time: the probe below starts it from a round as after it)
VECTORISED = [name for name, cls in REGISTRY.items() if cls.training_server is Method.training_server]
#: round 2 with late joiners, and what each scenario's clients differ in
LATE_JOINERS = {
    "fdlora": "stage 2 beside stage 1 + 2",
    "fedkd": "the update's factors down beside dense tensors",
    "pf2lora": "a personal adapter trained beside a fresh one",
    "fedlr": "FedAvg's plain round",
}
#: whole runs at two cohort sizes: one method that shares, one that shares nothing
WHOLE_RUNS = {"fedlr": "shares its adapters", "local": "shares nothing"}


@pytest.mark.parametrize("optimizer, wd", [("adamw", 0.0), ("adamw", 0.05), ("sgd", 0.01)])
def test_functional_optimizer_matches_torch(tiny_config, optimizer, wd):
    cfg = tiny_config(**{"train.optimizer": optimizer, "train.weight_decay": wd, "train.lr": 0.01}).train
    torch.manual_seed(0)
    params = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    live = {n: torch.nn.Parameter(t.clone()) for n, t in params.items()}
    if optimizer == "sgd":
        reference = torch.optim.SGD(list(live.values()), lr=cfg.lr, weight_decay=wd)
    else:
        reference = torch.optim.AdamW(list(live.values()), lr=cfg.lr, weight_decay=wd)
    state = optimizer_init(params, cfg)
    for _ in range(5):
        grads = {n: torch.randn_like(t) for n, t in params.items()}
        for n, p in live.items():
            p.grad = grads[n].clone()
        reference.step()
        params, state = optimizer_step(params, grads, state, cfg)
    for n, p in live.items():
        torch.testing.assert_close(params[n], p.detach(), atol=1e-6, rtol=1e-6)
    if optimizer == "adamw":
        torch.testing.assert_close(state["exp_avg_sq.a"], reference.state[live["a"]]["exp_avg_sq"])
        assert float(state["step.a"]) == float(reference.state[live["a"]]["step"]) == 5.0


class CountedOperations(TorchDispatchMode):
    """The operations that compute something (views left out) while active."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_an_optimizer_step_takes_as_many_operations_for_26_adapters_as_for_2(tiny_config, optimizer):
    """On a GPU each operation is a kernel launch, and an adapter's step is launch-bound:
    small tensors are stepped together (one concatenated vector), a large one alone."""
    cfg = tiny_config(**{"train.optimizer": optimizer}).train

    def operations(shapes: list[tuple]) -> list[str]:
        params = {f"t{i}": torch.randn(shape) for i, shape in enumerate(shapes)}
        grads, state = {n: torch.randn_like(t) for n, t in params.items()}, optimizer_init(params, cfg)
        with CountedOperations() as counted:
            optimizer_step(params, grads, state, cfg)
        return counted.ops

    two, many = operations([(8, 16)] * 2), operations([(8, 16)] * 26)
    assert many == two and len(two) < 30
    with_large = operations([(8, 16)] * 26 + [(300, 300)])
    assert len(two) < len(with_large) < 2 * len(two)


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_gradients_matches_clip_grad_norm(max_norm):
    torch.manual_seed(1)
    grads = {"a": torch.randn(3, 3), "b": torch.randn(7)}
    live = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(live, grads.values(), strict=True):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(live, max_norm)
    clipped = clip_gradients(grads, max_norm)
    for p, name in zip(live, grads, strict=True):
        torch.testing.assert_close(clipped[name], p.grad)


def test_stacked_batches_pad_rows_and_tokens():
    one = Encoded(torch.tensor([[5, 6, 7], [3, 0, 0]]), torch.tensor([3, 1]), torch.tensor([2, 4]))
    two = Encoded(torch.tensor([[8, 0], [9, 4]]), torch.tensor([1, 2]), torch.tensor([0, 1]))
    plans = [
        [(Draw(one, torch.tensor([0])),), (Draw(one, torch.tensor([1])),)],
        [(Draw(two, torch.tensor([0, 1])),)],
        [],
    ]
    batches = CohortBatches(plans, torch.device("cpu"))
    (batch,) = batches.step(0)
    assert len(batches) == 2 and batch["input_ids"].shape == (3, 2, 3)
    assert batch["weight"].tolist() == [[1, 0], [1, 1], [0, 0]]
    assert batch["attention_mask"].tolist() == [[[1, 1, 1], [0, 0, 0]], [[1, 0, 0], [1, 1, 0]], [[0] * 3] * 2]
    assert batch["labels"].tolist() == [[2, 0], [0, 1], [0, 0]]
    assert batch["input_ids"][:, :, :2].tolist() == [[[5, 6], [0, 0]], [[8, 0], [9, 4]], [[0, 0], [0, 0]]]
    (later,) = batches.step(1)  # one client left: one row, as wide as its row
    assert later["input_ids"].tolist() == [[[3]], [[0]], [[0]]] and later["weight"].tolist() == [
        [1],
        [0],
        [0],
    ]


def test_token_labels_pad_with_ignore_and_each_batch_is_cut_as_alone():
    ids, lengths = torch.arange(1, 13).view(3, 4), torch.tensor([4, 2, 3])
    inside = torch.arange(4) < lengths.unsqueeze(1)  # a token label past a row's end is IGNORE
    data = Encoded(ids, lengths, torch.where(inside & (ids % 2 == 0), ids, IGNORE))
    draws = [Draw(data, torch.tensor([2, 1])), Draw(data, torch.tensor([0]))]
    batches = CohortBatches([[(draws[0],)], [(draws[1],)]], torch.device("cpu"))
    (batch,) = batches.step(0)
    alone = draws[0].batch()  # the first client's batch cut on its own: 3 wide
    torch.testing.assert_close(batch["input_ids"][0, :, :3], alone["input_ids"])
    torch.testing.assert_close(batch["labels"][0, :, :3], alone["labels"])
    assert (batch["labels"][0, :, 3] == IGNORE).all()  # the cohort's extra column
    assert batch["labels"][1, 1].tolist() == [IGNORE] * 4  # a padded row


def test_a_lone_client_trains_with_its_own_attention_kernel(tiny_config, monkeypatch):
    """A cohort of one is not vmapped and keeps the model's SDPA attention (a cohort's is
    eager, which vmap batches): the same round to float rounding, on the same batches."""
    setup = build(tiny_config(**{"train.local_steps": 4}))
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    (job,) = round_jobs(setup, [1])
    (own,) = setup.method.fit_cohort(setup.model, [copy.deepcopy(job)])
    layers = setup.model.backbone.config.num_hidden_layers
    assert len(calls) == 4 * layers  # every layer's forward pass of the 4 steps
    with eager_attention(setup.model):
        (eager,) = setup.method.fit_cohort(setup.model, [copy.deepcopy(job)])
    assert len(calls) == 4 * layers  # none more
    assert own.metrics["loss"] == pytest.approx(eager.metrics["loss"], rel=1e-5)
    for name in own.uplink:
        torch.testing.assert_close(own.uplink[name], eager.uplink[name], atol=1e-5, rtol=1e-4)


def test_functional_round_equals_autograd_with_torch_adamw(tiny_config):
    """The vmapped local round of one client is the imperative one: the same batches,
    autograd, ``clip_grad_norm_`` and ``torch.optim.AdamW``."""
    setup = build(tiny_config(**{"train.local_steps": 4}))
    model, method, train = setup.model, setup.method, setup.cfg.train
    (job,) = round_jobs(setup, [1])
    (result,) = method.fit_cohort(model, [job])

    load_tensors(model, {**job.received, **method.params_of(job.personal)})
    named = trainable_params(model)
    opt = torch.optim.AdamW(list(named.values()), lr=train.lr, weight_decay=train.weight_decay)
    model.eval()  # no dropout here: the same function as train mode
    for batch in take_steps(job.client.train, train.batch_size, 4, job.generator()):
        loss = torch.nn.functional.cross_entropy(model(**batch), batch["labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(named.values()), train.max_grad_norm)
        opt.step()
        opt.zero_grad()
    for name, p in named.items():
        torch.testing.assert_close(result.uplink[name], p.detach(), atol=1e-5, rtol=1e-4)
    assert result.metrics["steps"] == 4.0


@pytest.mark.parametrize("name", VECTORISED)
def test_cohort_equals_one_at_a_time(tiny_config, name):
    """Clients of different sizes (so different step counts, in epochs mode) trained as
    one cohort get the rounds they get alone; a client that finishes early stays put."""
    method = {"name": name, **MIXED_RANKS.get(name, {})}
    cfg = tiny_config(method=method, **{"train.local_steps": None, "train.local_epochs": 1,
                                         "train.optimizer_state": "keep"})  # fmt: skip
    setup = build(cfg)
    cids = list(range(len(setup.clients)))
    if name == "hetlora":  # masked ranks: clients of different ranks in one cohort
        assert len({setup.method.initial_rank(c) for c in cids}) > 1
    if name in MIXED_RANKS:
        assert len({setup.method.rank(c) for c in cids}) > 1
    if name != "centralized":
        sizes = [len(setup.clients[c].train) for c in cids]
        assert len({-(-s // cfg.train.batch_size) for s in sizes}) > 1, (
            "want clients with different step counts"
        )
    assert_cohort_equals_alone(setup, cids, name)


def test_fedprox_cohort_equals_one_at_a_time_and_autograd(tiny_config):
    """FedProx (``train.prox_mu``): a cohort gets each client's lone round, and a lone round
    is the imperative one with ``mu/2 ||w - w_received||^2`` over the shared tensors
    added to the loss (autograd, ``clip_grad_norm_``, ``torch.optim.SGD``)."""
    mu = 0.5
    over = {"train.local_steps": None, "train.local_epochs": 1, "train.prox_mu": mu, "train.optimizer": "sgd",
            "train.lr": 0.5}  # fmt: skip
    setup = build(tiny_config(method={"name": "fedlr", "head": "personal"}, **over))
    cids = list(range(len(setup.clients)))
    assert_cohort_equals_alone(setup, cids, "fedlr+fedprox")

    model, method, train = setup.model, setup.method, setup.cfg.train
    (job,) = round_jobs(setup, [1])
    (result,) = method.fit_cohort(model, [copy.deepcopy(job)])
    load_tensors(model, {**job.received, **method.params_of(job.personal)})
    named = trainable_params(model)
    anchor = {n: named[n].detach().clone() for n in method.shared_names}
    opt = torch.optim.SGD(list(named.values()), lr=train.lr)
    for batch in take_steps(
        job.client.train, train.batch_size, int(result.metrics["steps"]), job.generator()
    ):
        loss = torch.nn.functional.cross_entropy(model(**batch), batch["labels"])
        loss = loss + mu / 2 * sum(((named[n] - a) ** 2).sum() for n, a in anchor.items())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(named.values()), train.max_grad_norm)
        opt.step()
        opt.zero_grad()
    for name in method.shared_names:
        torch.testing.assert_close(result.uplink[name], named[name].detach(), atol=1e-5, rtol=1e-4)
    without = RoundContext(job.context.train.model_copy(update={"prox_mu": 0.0}))
    (plain,) = method.fit_cohort(model, [dataclasses.replace(copy.deepcopy(job), context=without)])
    moved = max((result.uplink[n] - plain.uplink[n]).abs().max().item() for n in method.shared_names)
    assert moved > 1e-4  # the proximal term did pull


def test_c2a_authors_code_readings_cohort_equals_one_at_a_time(tiny_config):
    """C2A with every authors'-code option (slice norms, generator and adapter biases, the
    viewed down-projection, mean-pooled context): the vectorised cohort gets each client's
    lone round (SGD, as for C2A above)."""
    hyper = {"normalise_scope": "slice", "generator_bias": True, "tie": "view", "adapter_bias": True,
             "context_pool": "mean"}  # fmt: skip
    train = {"train.local_steps": None, "train.local_epochs": 1, "train.optimizer": "sgd"}
    cfg = tiny_config(method={"name": "c2a", "hyper": hyper}, **train)
    setup = build(cfg)
    assert_cohort_equals_alone(setup, list(range(len(setup.clients))), "c2a")


@pytest.mark.parametrize("name", LATE_JOINERS)
def test_a_later_round_with_late_joiners_cohort_equals_one_at_a_time(tiny_config, name):
    """Round 2 of clients that trained in round 1 beside clients that join late: FDLoRA's
    stage 2 beside stage 1 + 2, FedKD's compressed downlink (the update's factors) beside
    a dense one; each client gets the round it gets alone."""
    setup, cids, jobs, trained = jobs_after_round_one(tiny_config(method={"name": name}))
    method = setup.method
    if name == "fdlora":  # the late joiners still have no personal module: stage 1 first
        assert {c for c, j in zip(cids, jobs, strict=True) if method.has_personal(j.personal)} == trained
    if name == "fedkd":  # the round-1 clients get the update's factors, the others dense tensors
        factored = {c for c, j in zip(cids, jobs, strict=True) if set(j.received) != set(method.shared_names)}
        assert factored == trained
    assert_cohort_equals_alone(setup, cids, name, jobs)


@pytest.mark.parametrize("name", WHOLE_RUNS)
def test_whole_runs_agree_whatever_the_cohort_size(tiny_config, tmp_path, name):
    common = {"method": {"name": name}, "train.clients_per_round": 4, "train.rounds": 3}
    one = tiny_config(**common, **{"train.cohort_size": 1}, output_dir=str(tmp_path / "one"))
    many = tiny_config(**common, **{"train.cohort_size": 3}, output_dir=str(tmp_path / "many"))
    run(one), run(many)
    a, b = read_records(one.output_dir), read_records(many.output_dir)
    for ra, rb in zip(a, b, strict=True):
        assert ra["clients"] == rb["clients"] and ra["cum_bytes"] == rb["cum_bytes"]
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["local"]["accuracy_mean"] == pytest.approx(rb["local"]["accuracy_mean"], abs=1e-9)


def test_active_dropout_trains_clients_one_by_one_reproducibly(tiny_config):
    """With dropout the draws depend on the layout, so a cohort splits into ones (each
    seeded as alone) and gives exactly the one-at-a-time results."""
    setup = build(tiny_config(**{"model.dropout": 0.1}))
    jobs = round_jobs(setup, [0, 1, 2])
    together = setup.method.fit_cohort(setup.model, copy.deepcopy(jobs))
    alone = [setup.method.fit_cohort(setup.model, [job])[0] for job in jobs]
    for a, b in zip(alone, together, strict=True):
        for key in a.uplink:
            assert torch.equal(a.uplink[key], b.uplink[key])


def test_vectorised_evaluation_equals_one_model_at_a_time(tiny_config):
    """Clients' own models scored together (each on its own test split, and all on the
    global test set) predict what each model predicts alone."""
    setup = build(tiny_config(method={"name": "local"}))
    model, clients = setup.model, setup.clients[:3]
    states = []
    for i, _ in enumerate(clients):
        g = torch.Generator().manual_seed(i)
        states.append({n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in setup.initial.items()})
    own = predict_cohort(model, states, [c.test for c in clients], batch_size=16)
    on_global = predict_cohort(model, states, setup.global_test, batch_size=16)
    for state, client, p_own, p_global in zip(states, clients, own, on_global, strict=True):
        load_tensors(model, state)
        assert np.array_equal(predict(model, client.test, 16), p_own)
        assert np.array_equal(predict(model, setup.global_test, 16), p_global)
    assert len({tuple(p) for p in on_global}) > 1  # different models, different predictions


def test_fitting_cohort_size_from_probed_costs():
    from fedpeft.engines.memory import fitting_cohort

    # 10 GiB free, 80 % usable: (8 GiB - 1 GiB fixed) / 0.5 GiB per client = 14 clients
    gib = 2**30
    assert fitting_cohort(10 * gib, 1 * gib, 0.5 * gib, limit=100) == 14
    assert fitting_cohort(10 * gib, 1 * gib, 0.5 * gib, limit=8) == 8  # never more than sampled
    assert fitting_cohort(1 * gib, 2 * gib, 0.5 * gib, limit=8) == 1  # never fewer than one
    assert fitting_cohort(1 * gib, 0, 0, limit=8) == 8  # no per-client cost measured


def test_auto_cohort_size_is_one_on_a_cpu(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.cohort_size": "auto", "train.device": "cpu"}, output_dir=str(tmp_path))
    summary = run(cfg)
    assert cfg.train.cohort_size == "auto"
    records = read_records(cfg.output_dir)
    assert records[0]["setup"]["cohort_size"] == 1.0 and summary["device"] == "cpu"
    with pytest.raises(Exception, match="cohort_size"):
        tiny_config(**{"train.cohort_size": 0})


@pytest.mark.parametrize("name", REGISTRY)
def test_the_cohort_probe_runs_every_vectorised_method_from_its_first_state(tiny_config, name):
    """``train.cohort_size: auto`` measures (on a GPU) one training step and one scoring
    batch of cohorts of 1 and 4 clients, in a round that trains, from the server's first
    state: Fed-SB's is its setup round's, which trains nothing and sends a mark (no model
    tensor) down, so the probe measures a round as after it, vmapped. Here on the CPU,
    each measured run is run and counted in place of measuring its peak memory."""
    from fedpeft.engines.memory import cohort_peaks

    setup = build(tiny_config(method={"name": name, **MIXED_RANKS.get(name, {})}))
    engine = make_engine(setup, None)
    server = engine.method.init_server(engine.model)
    engine.method.join(engine.model, engine.method.join_message(server))
    train, before = engine.method.train, {n: t.clone() for n, t in engine.model.state_dict().items()}
    outputs = []

    def measure(run) -> int:
        outputs.append(run())
        return len(outputs)

    assert cohort_peaks(engine, server, measure) == (2, 4)
    steps = [out for out in outputs[::2]]  # step, score, step, score
    assert [len(results) for results in steps] == [1, 4]
    for result in steps[1]:  # a training round's messages, not a setup round's gradient sums
        assert not any(n.startswith("grad.") for n in result.uplink)
        if name not in VECTORISED:  # a setup round first (Fed-SB's): measured as after it
            assert set(result.uplink) == set(engine.method.shared_names)  # R and the head
    assert engine.method.train == train  # the probe's one-step copy, not the run's method
    after = engine.model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())  # the model as it was
