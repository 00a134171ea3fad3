"""FDLoRA: the two stages, the outer optimiser, personal sync and AdaFusion."""

import copy

import pytest
import torch

from fedpeft.experiment import build, run
from fedpeft.methods.base import FitResult, Method, ServerState, weighted_mean
from fedpeft.methods.fdlora import OWN, fuse, outer_step
from fedpeft.report.results import read_records


def _random_like(tensors, seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=gen) for n, t in tensors.items()}


def test_outer_step_with_lr_1_and_no_momentum_is_fedavg_bit_for_bit(tiny_config):
    over = {"outer_lr": 1.0, "outer_momentum": 0.0, "average": "examples"}
    setup = build(tiny_config(method={"name": "fdlora", **over}))
    method = setup.method
    server = method.init_server(setup.model)
    server.extras["global_ready"] = torch.tensor(1.0)
    server = ServerState(_random_like(server.tensors, 0), server.extras)
    results = [FitResult(_random_like(server.tensors, s), {}, n) for s, n in ((1, 30), (2, 7), (3, 12))]
    outer = method.aggregate(server, results, 2)
    fedavg = Method.aggregate(method, server, results, 2)
    for name, value in fedavg.tensors.items():
        assert torch.equal(outer.tensors[name], value), name


@pytest.mark.parametrize("ready", [False, True])
def test_the_server_mean_is_uniform_over_clients_by_default(tiny_config, ready):
    """The paper's Algorithm 1 averages its clients uniformly (``mean_i``), for theta_s^0
    (round 1) and for Delta; sizes 30, 7 and 12 do not weigh in."""
    setup = build(tiny_config(method={"name": "fdlora", "outer_lr": 1.0, "outer_momentum": 0.0}))
    method = setup.method
    assert method.cfg.average == "uniform"
    server = method.init_server(setup.model)
    if ready:
        server.extras["global_ready"] = torch.tensor(1.0)
    server = ServerState(_random_like(server.tensors, 0), server.extras)
    results = [FitResult(_random_like(server.tensors, s), {}, n) for s, n in ((1, 30), (2, 7), (3, 12))]
    mean = method.aggregate(server, results, 2).tensors
    for name in server.tensors:
        plain = torch.stack([r.uplink[name].double() for r in results]).mean(0).float()
        torch.testing.assert_close(mean[name], plain, rtol=0, atol=1e-6)
        weighted = sum(r.uplink[name] * r.num_examples for r in results) / 49
        assert not torch.allclose(mean[name], weighted, atol=1e-3)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_is_torch_sgd_with_momentum(nesterov):
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen, dtype=torch.float64)}
    reference = torch.nn.Parameter(params["w"].clone())
    sgd = torch.optim.SGD([reference], lr=0.3, momentum=0.5, nesterov=nesterov)
    momentum = {"w": torch.zeros(4, 3, dtype=torch.float64)}
    for _ in range(3):
        mean = {"w": torch.randn(4, 3, generator=gen, dtype=torch.float64)}  # the clients' average
        reference.grad = (params["w"] - mean["w"]).clone()  # Delta: the outer gradient
        params, momentum = outer_step(params, mean, momentum, 0.3, 0.5, nesterov)
        sgd.step()
    torch.testing.assert_close(params["w"], reference.detach(), rtol=0, atol=1e-14)


def test_fusion_with_one_and_zero_is_one_module_exactly():
    personal, global_ = _random_like({"a": torch.zeros(3, 5)}, 1), _random_like({"a": torch.zeros(3, 5)}, 2)
    assert torch.equal(fuse(personal, global_, 1.0, 0.0)["a"], personal["a"])
    assert torch.equal(fuse(personal, global_, 0.0, 1.0)["a"], global_["a"])
    torch.testing.assert_close(fuse(personal, global_, 0.5, 0.5)["a"], (personal["a"] + global_["a"]) / 2)


def _recorded(method):
    """Every job (as received) and result of ``method``'s local rounds, in order."""
    seen = []
    real = method.fit_cohort

    def fit_cohort(model, jobs):
        before = [copy.copy(job) for job in jobs]
        results = real(model, jobs)
        seen.extend(zip(before, results, strict=True))
        return results

    method.fit_cohort = fit_cohort
    return seen


def test_stage_one_then_the_mean_then_outer_steps_and_sync(tiny_config):
    cfg = tiny_config(
        method={"name": "fdlora", "sync_every": 2, "outer_lr": 0.7, "personal_steps": 3},
        **{"train.rounds": 4, "partition.num_clients": 3, "train.clients_per_round": 3},
    )
    setup = build(cfg)
    seen = _recorded(setup.method)
    run(cfg, setup=setup)
    names = setup.method.shared_names
    round1 = seen[:3]
    assert all(job.received == {} for job, _ in round1)  # no global module yet: local learning only
    assert all(r.metrics["steps"] == 3 for _, r in round1)
    for _, result in round1:  # round 1 uploads theta_p (the paper's initialisation), keeps it
        assert all(torch.equal(result.uplink[n], result.personal[OWN + n]) for n in names)
    # round 2 starts from the mean of the round-1 uploads
    # the paper's plain mean over the clients (method.average: uniform), not by their sizes
    mean = weighted_mean([r.uplink for _, r in round1], [1] * len(round1))
    for job, _ in seen[3:6]:
        assert all(torch.equal(job.received[n], mean[n]) for n in names)
    # H = 2: outer step t = round - 1; round 2 (t = 1) keeps theta_p, round 3 (t = 2) syncs it
    for (job, result), rnd in zip(seen[3:9], [2] * 3 + [3] * 3, strict=True):
        own = {n: result.personal[OWN + n] for n in names}
        if rnd == 3:
            assert all(torch.equal(own[n], result.uplink[n]) for n in names)
        else:
            assert all(torch.equal(own[n], job.personal[OWN + n]) for n in names)
            assert any(not torch.equal(own[n], result.uplink[n]) for n in names)


def test_never_sync_keeps_the_stage_one_module(tiny_config):
    cfg = tiny_config(method={"name": "fdlora", "sync_every": "never"},
                      **{"train.rounds": 3, "partition.num_clients": 2,
                         "train.clients_per_round": 2})  # fmt: skip
    setup = build(cfg)
    seen = _recorded(setup.method)
    run(cfg, setup=setup)
    first = {r.cid if r.cid >= 0 else i: r.personal for i, (_, r) in enumerate(seen[:2])}
    for job, result in seen[2:]:
        cid = job.client.cid
        assert all(torch.equal(result.personal[k], first[cid][k]) for k in first[cid] if k.startswith(OWN))


def test_fresh_global_init_never_uploads_a_personal_module(tiny_config):
    cfg = tiny_config(method={"name": "fdlora", "global_init": "fresh"}, **{"train.rounds": 2})
    setup = build(cfg)
    seen = _recorded(setup.method)
    run(cfg, setup=setup)
    for job, result in seen:
        assert job.received  # a global module from round 1
        own = [result.personal[OWN + n] for n in setup.method.shared_names]
        sent = [result.uplink[n] for n in setup.method.shared_names]
        if job.rnd == 1:  # theta_p learned in stage 1, then stage 2 from the fresh module: different
            assert any(not torch.equal(a, b) for a, b in zip(own, sent, strict=True))


def test_adafusion_is_seeded_bounded_and_the_fusions_are_compared(tiny_config):
    cfg = tiny_config(method={"name": "fdlora", "compare_fusions": True, "fusion_budget": 8},
                      **{"train.rounds": 2, "partition.num_clients": 2,
                         "train.clients_per_round": 2})  # fmt: skip
    setup = build(cfg)
    run(cfg, setup=setup)
    last = read_records(cfg.output_dir)[-1]
    for kind in ("random", "average", "sum", "personal", "global"):
        assert f"local_{kind}" in last and 0 <= last[f"local_{kind}"]["accuracy_mean"] <= 1
    method, client = setup.method, setup.clients[0]
    theta_p = _random_like(method.start, 3)
    theta_s = _random_like(method.start, 4)
    w = method.fusion_weights(setup.model, "adafusion", theta_p, theta_s, client)
    assert w == method.fusion_weights(setup.model, "adafusion", theta_p, theta_s, client)
    assert all(abs(x) <= method.cfg.fusion_bound for x in w)
    # AdaFusion's weights do at least as well on its own objective (Eq. 8) as its start
    # (0.5, 0.5), recomputed here on the same examples it draws
    import numpy as np

    from fedpeft.data.task import make_batch
    from fedpeft.engines.local import model_loss

    rng = np.random.default_rng([method.seed, client.cid])
    rows = torch.as_tensor(rng.permutation(len(client.train))[: method.cfg.fusion_examples])
    batch, loss = make_batch(client.train, rows), model_loss(setup.model)

    def objective(w1, w2):
        with torch.no_grad():
            fused_loss = float(loss(fuse(theta_p, theta_s, w1, w2), batch))
        return fused_loss + method.cfg.fusion_l1 * (abs(w1) + abs(w2))

    assert objective(*w) <= objective(0.5, 0.5)
    assert objective(*w) < objective(0.5, 0.5) - 1e-3  # random modules: the start is far from best
    r1 = method.fusion_weights(setup.model, "random", theta_p, theta_s, client)
    assert all(0 <= x <= 1 for x in r1) and r1 != method.fusion_weights(
        setup.model, "random", theta_p, theta_s, setup.clients[1]
    )
