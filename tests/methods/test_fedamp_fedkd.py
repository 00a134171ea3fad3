"""FedAMP and FedKD (the FDLoRA paper's personalised baselines): their math by hand, and
what crosses the network.

FedAMP: the attention weights ``xi`` and cloud models for known client models, the
proximal gradient, what the server keeps. FedKD: the SVD compression of updates (exact at
``T = 1``, the fewest singular values reaching ``T`` below), the bytes of the factor
uplink, the mentor never leaving its client, the synchronised compressed downlink, and
the adaptive mutual-distillation loss against a hand computation.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from fedpeft.data.task import IGNORE, take_steps
from fedpeft.engines.checkpoint import load_checkpoint
from fedpeft.engines.local import RoundContext
from fedpeft.experiment import build, fingerprint, run
from fedpeft.methods.base import FitResult, Job, ServerState, tensor_bytes
from fedpeft.methods.fedamp import attention_weights, cloud_model, flatten, unflatten
from fedpeft.methods.fedkd import hidden_states, kl_of_log_probs, log_probs, mutual_loss, transformer_layers
from fedpeft.peft.svd import compress, decompress, kept_rank, truncated_svd

# ---------------------------------------------------------------- FedAMP


def perturbed_like(tensors: dict, scale: float = 0.05, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: t + scale * torch.randn(t.shape, generator=g) for n, t in tensors.items()}


def test_fedamp_weights_and_cloud_models_by_hand():
    # Prepare: three clients' flattened models, alpha_k = 0.5, sigma = 2
    w = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0]])
    alpha, sigma = 0.5, 2.0
    a_prime = lambda x: math.exp(-x / sigma) / sigma  # noqa: E731  A(x) = 1 - exp(-x / sigma)
    # squared distances: |w0-w1|^2 = 1, |w0-w2|^2 = 4, |w1-w2|^2 = 5
    expected = [
        [None, alpha * a_prime(1), alpha * a_prime(4)],
        [alpha * a_prime(1), None, alpha * a_prime(5)],
        [alpha * a_prime(4), alpha * a_prime(5), None],
    ]
    for i, row in enumerate(expected):
        row[i] = 1 - sum(x for x in row if x is not None)
    # Execute / Assert
    for i in range(3):
        xi = attention_weights(w, i, alpha, sigma)
        assert xi.tolist() == pytest.approx(expected[i], rel=1e-12)
        assert float(xi.sum()) == pytest.approx(1.0, abs=1e-12)
        u = sum(expected[i][j] * w[j].double() for j in range(3))
        torch.testing.assert_close(cloud_model(w, i, alpha, sigma), u.float())
    # identical clients: u_i = w_i whatever the weights
    same = torch.tensor([[0.3, -1.2, 2.0]] * 3)
    for i in range(3):
        torch.testing.assert_close(cloud_model(same, i, alpha, sigma), same[i])
    # far-apart clients barely attend to each other: u_i is (almost) w_i
    far = torch.tensor([[0.0], [100.0], [-100.0]])
    assert attention_weights(far, 0, alpha, sigma)[0] == pytest.approx(1.0, abs=1e-12)


def test_fedamp_server_keeps_uploads_and_personalises_the_downlink(tiny_config):
    cfg = tiny_config(method={"name": "fedamp", "alpha_k": 0.5, "sigma": 2.0}, **{"partition.num_clients": 4})
    setup = build(cfg)
    method = setup.method
    server = method.init_server(setup.model)
    assert method.downlink(server, 0) is server.tensors  # before any upload: the initial model
    # three clients upload known models
    g = torch.Generator().manual_seed(0)
    models = {cid: {n: t + 0.1 * torch.randn(t.shape, generator=g) for n, t in server.tensors.items()}
              for cid in (0, 1, 3)}  # fmt: skip
    results = [FitResult(m, {}, 10 * (cid + 1), cid=cid) for cid, m in models.items()]
    server = method.aggregate(server, results, 1)
    assert sorted(server.extras) == ["w.0", "w.1", "w.3"]  # one vector per client that uploaded
    flat = torch.stack([flatten(models[c], method.shared_names) for c in (0, 1, 3)])
    for i, cid in enumerate((0, 1, 3)):
        expected = unflatten(cloud_model(flat, i, 0.5, 2.0), server.tensors)
        received = method.downlink(server, cid)
        for n in method.shared_names:
            torch.testing.assert_close(received[n], expected[n])
    # a client that has not uploaded gets the (unweighted) mean of the uploads
    mean = unflatten(flat.mean(0), server.tensors)
    for n in method.shared_names:
        torch.testing.assert_close(method.downlink(server, 2)[n], mean[n])
    # a new upload replaces the client's previous one
    server = method.aggregate(server, [FitResult(models[3], {}, 1, cid=0)], 2)
    torch.testing.assert_close(server.extras["w.0"], flatten(models[3], method.shared_names))
    assert len(server.extras) == 3
    # alpha_k (clients - 1) / sigma > 1 lets a self-weight go negative: the server refuses
    method.cfg = method.cfg.model_copy(update={"sigma": 1e4, "alpha_k": 1e5})
    refused = r"method\.alpha_k = 100000 and method\.sigma = 10000 .* xi_ii = -28\.9"
    with pytest.raises(ValueError, match=refused):
        method.aggregate(server, [FitResult(models[1], {}, 1, cid=2)], 3)


def test_fedamp_cloud_models_are_formed_once_per_server_state(tiny_config, monkeypatch):
    """The engine asks for a downlink per evaluated client: the attention weights over the
    uploads are computed at aggregation, not again for every downlink."""
    import fedpeft.methods.fedamp as fedamp

    setup = build(tiny_config(method={"name": "fedamp"}, **{"partition.num_clients": 4}))
    method = setup.method
    server = method.init_server(setup.model)
    results = [FitResult(perturbed_like(server.tensors, seed=c), {}, 10, cid=c) for c in range(4)]
    calls, real = [], fedamp.attention_weights
    monkeypatch.setattr(fedamp, "attention_weights", lambda *a: calls.append(1) or real(*a))
    server = method.aggregate(server, results, 1)
    assert len(calls) == 4  # one row per uploaded client
    first = [method.downlink(server, c) for c in range(4)]
    assert len(calls) == 4
    # a server state from elsewhere (a checkpoint): formed again, once, and the same
    again = ServerState(dict(server.tensors), dict(server.extras))
    assert all(torch.equal(method.downlink(again, c)[n], first[c][n]) for c in range(4) for n in first[c])
    assert len(calls) == 8


def test_fedamp_local_round_starts_from_the_clients_own_model(tiny_config):
    """A client that has trained starts its local steps from its own ``w_i`` (the
    received ``u_i`` is only the proximal anchor): with ``lam: 0`` its round is
    Local-only's from ``w_i``."""
    over = {"train.local_steps": 3}
    setup = build(tiny_config(method={"name": "fedamp", "lam": 0.0}, **over))
    local = build(tiny_config(method={"name": "local"}, **over))
    method, client = setup.method, setup.clients[1]
    own = perturbed_like(setup.initial, seed=1)  # w_i from an earlier round
    cloud = perturbed_like(setup.initial, seed=2)  # u_i
    job = Job(
        cloud, {"own." + n: t for n, t in own.items()}, client, 5, 2, context=RoundContext(method.train)
    )
    start = method.cohort_start(setup.model, job)
    assert all(torch.equal(start.params[n], own[n]) for n in own)
    assert all(torch.equal(start.consts[n], cloud[n]) for n in cloud)
    (result,) = method.fit_cohort(setup.model, [job])
    (alone,) = local.method.fit_cohort(
        local.model, [replace(job, received={}, personal=own, client=local.clients[1])]
    )
    for n, t in alone.personal.items():
        torch.testing.assert_close(result.uplink[n], t, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(result.personal["own." + n], t, atol=1e-6, rtol=1e-5)


def test_fedamp_proximal_gradient(tiny_config):
    """The local objective's gradient is the task gradient plus ``lam / alpha_k (w - u)``
    on the sent tensors (none on a personal head)."""
    cfg = tiny_config(method={"name": "fedamp", "alpha_k": 0.5, "lam": 2.0, "head": "personal"})
    setup = build(cfg)
    method, model = setup.method, setup.model
    gradients = method.step_gradients(model)
    g = torch.Generator().manual_seed(1)
    w = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in setup.initial.items()}
    u = {n: w[n] + 0.2 * torch.randn(w[n].shape, generator=g) for n in method.shared_names}
    batch = next(take_steps(setup.clients[0].train, 8, 1, torch.Generator().manual_seed(0)))
    model.eval()
    loss_u, grads_u = gradients(w, u, (batch,))
    loss_w, grads_w = gradients(w, {n: w[n] for n in u}, (batch,))  # anchor = w: no penalty
    coef = 2.0 / 0.5
    assert float(loss_u - loss_w) == pytest.approx(
        coef / 2 * sum(float(((w[n] - u[n]) ** 2).sum()) for n in u)
    )
    for n in method.shared_names:
        torch.testing.assert_close(grads_u[n] - grads_w[n], coef * (w[n] - u[n]), atol=1e-5, rtol=1e-4)
    for n in method.personal_names:
        torch.testing.assert_close(grads_u[n], grads_w[n])


def test_fedamp_clients_keep_their_own_model_and_the_server_what_they_sent(tiny_config):
    cfg = tiny_config(method={"name": "fedamp", "head": "personal"}, **{"train.clients_per_round": 4})
    setup = build(cfg)
    run(cfg, setup=setup)
    method = setup.method
    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    shared_numel = sum(setup.initial[n].numel() for n in method.shared_names)
    assert set(ckpt.server.extras) == {f"w.{c}" for c in ckpt.personal}
    for cid, state in ckpt.personal.items():
        own = {n.removeprefix("own."): t for n, t in state.items() if n.startswith("own.")}
        assert set(own) == set(method.shared_names)  # its own w_i; the head is personal
        upload = ckpt.server.extras[f"w.{cid}"]
        assert upload.numel() == shared_numel  # what was sent: no personal head in it
        assert torch.equal(upload, flatten(own, method.shared_names))
        # the client is scored with its own model, not the cloud model it receives
        received = method.downlink(ckpt.server, cid)
        scored = method.eval_state(setup.model, received, state, setup.clients[cid])
        assert all(torch.equal(scored[n], own[n]) for n in own)
        assert any(not torch.equal(received[n], own[n]) for n in own)


# ---------------------------------------------------------------- FedKD: compression


def orthonormal(rows: int, cols: int, seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(
        torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    )
    return q


def test_svd_compression_exact_at_one_and_fewest_values_below():
    # Prepare: M = U diag(4, 3, 2, 1) V^T; energies 16, 9, 4, 1 of 30
    u, v = orthonormal(12, 4, 0), orthonormal(7, 4, 1)
    s = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    matrix = ((u * s) @ v.T).float()
    # threshold 1: every component, reconstructed to float tolerance
    fu, fs, fv = truncated_svd(matrix, 1.0)
    assert fu.shape == (12, 4) and fs.shape == (4,) and fv.shape == (7, 4)
    torch.testing.assert_close((fu * fs) @ fv.T, matrix, atol=1e-6, rtol=1e-5)
    # lower thresholds: the fewest leading values whose energy reaches T of 30
    for energy, k in [(16 / 30, 1), (25 / 30, 2), (29 / 30, 3)]:  # reaching T exactly is enough
        assert kept_rank(s, energy) == k, energy
    for energy, k in [(0.5, 1), (0.6, 2), (0.9, 3), (0.97, 4), (1.0, 4)]:
        assert kept_rank(s, energy) == k, energy
        fu, fs, fv = truncated_svd(matrix, energy)  # of the float32 matrix
        assert fs.shape == (k,)
        best = ((u[:, :k] * s[:k]) @ v[:, :k].T).float()  # Eckart-Young: the best rank-k approximation
        torch.testing.assert_close((fu * fs) @ fv.T, best, atol=1e-6, rtol=1e-5)
    assert kept_rank(torch.zeros(3), 0.9) == 0  # a zero update sends nothing


def test_compressed_update_round_trip_and_its_bytes():
    g = torch.Generator().manual_seed(2)
    low_rank = torch.randn(40, 2, generator=g) @ torch.randn(2, 30, generator=g)
    small, bias = torch.randn(3, 4, generator=g), torch.randn(40, generator=g)
    deltas = {"a.weight": low_rank, "b.weight": small, "a.bias": bias}
    sent = compress(deltas, 0.999)  # (float32 rounding leaves a rank-2 product tiny further singular values)
    # a matrix goes as factors when smaller (rank 2 of 40 x 30), dense when not (3 x 4), a bias dense
    factors = {"a.weight.svd_u", "a.weight.svd_s", "a.weight.svd_v"}
    assert set(sent) == factors | {"b.weight.delta", "a.bias.delta"}
    assert sent["a.weight.svd_s"].shape == (2,)
    assert tensor_bytes(sent) == 4 * ((40 * 2 + 2 + 30 * 2) + 3 * 4 + 40)
    back = decompress(sent)
    for n, t in deltas.items():
        torch.testing.assert_close(back[n], t, atol=1e-5, rtol=1e-5)
    assert decompress({"a.weight.svd_u": sent["a.weight.svd_u"]}) is None  # factors missing: refused


# ---------------------------------------------------------------- FedKD: the method


def fedkd_config(tiny_config, **method):
    return tiny_config(
        method={"name": "fedkd", **method}, **{"train.clients_per_round": 4, "train.rounds": 3}
    )


def test_fedkd_uplink_is_the_factors_of_the_mentee_update(tiny_config):
    """A client sends its mentee update as factors keeping ``T`` of each matrix's energy;
    the bytes the engine counts are the factors' and the dense tensors', below the dense
    update, and the server adds what they reconstruct. (``T = 1`` would send every LoRA
    matrix dense: its factors are larger than a full-rank ``r x d`` matrix.)"""
    cfg = tiny_config(method={"name": "fedkd", "energy": 0.9, "energy_end": None})
    setup = build(cfg)
    method, model = setup.method, setup.model
    server = method.init_server(model)
    client = setup.clients[0]
    job = Job(
        method.downlink(server, 0), method.init_client(model, setup.initial, client), client, 7,
        context=RoundContext(method.train),
    )  # fmt: skip
    (result,) = method.fit_cohort(model, [job])
    assert not any("mentor" in k for k in result.uplink)
    assert all(k.endswith((".svd_u", ".svd_s", ".svd_v", ".delta")) for k in result.uplink)
    assert any(k.endswith(".svd_u") for k in result.uplink)
    dense = sum(server.tensors[n].numel() * 4 for n in method.shared_names)
    assert tensor_bytes(result.uplink) < dense
    assert result.metrics["uplink_ratio"] == pytest.approx(tensor_bytes(result.uplink) / dense)
    # a known update through the client's finish: the server's reconstruction keeps at
    # least T of each matrix's energy, and the bytes are those of the factors
    received = method.base_mentee(job.received, job.personal)
    g = torch.Generator().manual_seed(5)

    def update_like(t: torch.Tensor) -> torch.Tensor:  # nearly rank 2 (a matrix), or a vector
        if t.dim() == 1:
            return 0.01 * torch.randn(t.shape, generator=g)
        low = torch.randn(t.shape[0], 2, generator=g) @ torch.randn(2, t.shape[1], generator=g)
        return 0.01 * low + 1e-4 * torch.randn(t.shape, generator=g)

    delta = {n: update_like(received[n]) for n in method.shared_names}
    params = {**received, **method.params_of(job.personal)}
    params.update({n: received[n] + d for n, d in delta.items()})
    known = method.cohort_finish(job, params, {}, {"loss": 0.0})
    update = method.uplink_as_shared(known.uplink)
    assert set(update) == set(method.shared_names)
    for n, d in delta.items():
        assert update[n].shape == d.shape
        if d.dim() == 2:
            u, s, v = (known.uplink[n + k] for k in (".svd_u", ".svd_s", ".svd_v"))
            assert s.shape == (kept_rank(torch.linalg.svdvals(d.double()), 0.9),)
            assert float((d - update[n]).square().sum()) <= (1 - 0.9) * float(d.square().sum()) + 1e-9
        else:
            torch.testing.assert_close(known.uplink[n + ".delta"], d)
    assert tensor_bytes(known.uplink) == sum(t.numel() * 4 for t in known.uplink.values())
    server2 = method.aggregate(server, [known], 1)
    for n in method.shared_names:  # one client: the global mentee moves by its reconstructed update
        torch.testing.assert_close(server2.tensors[n], received[n] + update[n])
    # the client keeps the mentee it trained from (to apply the next compressed global update to)
    assert all(torch.equal(known.personal["own." + n], received[n]) for n in method.shared_names)


def test_fedkd_mentor_stays_home_and_downlink_stays_in_sync(tiny_config):
    """Every client in every round: from round 2 on, clients receive the factors of the
    global update and rebuild exactly the server's global mentee; nothing of a mentor
    ever crosses, and every mentor trains."""
    cfg = fedkd_config(tiny_config)
    setup = build(cfg)
    method = setup.method
    mentor = [n for n in method.personal_names if ".mentor." in n or n.startswith("mentor_head.")]
    assert mentor and not any("mentor" in n for n in method.shared_names)
    messages, real = [], method.fit_cohort

    def fit_cohort(model, jobs):
        results = real(model, jobs)
        messages.extend((job.received, r.uplink) for job, r in zip(jobs, results, strict=True))
        return results

    method.fit_cohort = fit_cohort
    run(cfg, setup=setup)
    assert len(messages) == 12
    for down, up in messages:
        assert not any("mentor" in k for k in [*down, *up])
    dense = sum(setup.initial[n].numel() * 4 for n in method.shared_names)
    assert all(tensor_bytes(down) == dense for down, _ in messages[:4])  # round 1: dense
    assert all(tensor_bytes(down) < dense for down, _ in messages[4:])  # then the update's factors
    assert [float(down["version"]) for down, _ in messages[4::4]] == [1.0, 2.0]  # ... and their version
    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    assert not any("mentor" in k for k in [*ckpt.server.tensors, *ckpt.server.extras])
    for cid, state in ckpt.personal.items():
        rebuilt = method.base_mentee(method.downlink(ckpt.server, cid), state)
        assert all(torch.equal(rebuilt[n], ckpt.server.tensors[n]) for n in method.shared_names), cid
        assert any(not torch.equal(state[n], setup.initial[n]) for n in mentor), cid
    # a client that missed a round gets the global mentee dense
    assert all(t.dtype == torch.float32 for t in ckpt.server.extras.values())
    server = ServerState(ckpt.server.tensors, {**ckpt.server.extras, "synced.0": torch.tensor(0.0)})
    assert all(torch.equal(method.downlink(server, 0)[n], server.tensors[n]) for n in method.shared_names)


def test_fedkd_client_stays_in_sync_across_a_skipped_round(tiny_config):
    """A Flower server short of results skips aggregating a round: the clients that
    trained in it hold the current global mentee already, while the server takes them for
    one version behind and sends the latest update's factors again. The downlink's version
    tells them to keep their copy rather than apply the update twice."""
    setup = build(fedkd_config(tiny_config))
    model, method = setup.model, setup.method
    clients = setup.clients[:2]
    personal = {c.cid: method.init_client(model, setup.initial, c) for c in clients}
    server = method.init_server(model)

    def train(rnd: int) -> list:
        context = RoundContext(method.train)
        jobs = [
            Job(method.downlink(server, c.cid), personal[c.cid], c, rnd, rnd, context=context)
            for c in clients
        ]
        results = method.fit_cohort(model, jobs)
        for c, r in zip(clients, results, strict=True):
            r.cid, personal[c.cid] = c.cid, r.personal
        return results

    server = method.aggregate(server, train(1), 1)  # version 1
    train(2)  # round 2 skipped: no aggregation, the server still at version 1
    for c in clients:
        down = method.downlink(server, c.cid)
        assert any(k.endswith(".svd_u") for k in down) and float(down["version"]) == 1.0  # update 1 again
        assert float(personal[c.cid]["own.version"]) == 1.0  # ... which the client applied in round 2
        held = method.base_mentee(down, personal[c.cid])
        assert all(torch.equal(held[n], server.tensors[n]) for n in method.shared_names), c.cid
    server = method.aggregate(server, train(3), 3)  # version 2, in step again
    assert method.version(server) == 2.0
    for c in clients:
        held = method.base_mentee(method.downlink(server, c.cid), personal[c.cid])
        assert all(torch.equal(held[n], server.tensors[n]) for n in method.shared_names), c.cid
    # a client further behind cannot use the factors
    stale = {**personal[0], "own.version": torch.tensor(0.0)}
    with pytest.raises(RuntimeError, match=r"version 0; .*global mentee"):
        method.base_mentee(method.downlink(server, 0), stale)


def test_fedkd_energy_threshold_follows_the_jobs_round(tiny_config):
    """The client compresses its update with ``T_t`` of its job's round (``Job.rnd``)."""
    cfg = tiny_config(method={"name": "fedkd", "energy": 0.5, "energy_end": 0.99}, **{"train.rounds": 4})
    setup = build(cfg)
    method, client = setup.method, setup.clients[0]
    server = method.init_server(setup.model)
    g = torch.Generator().manual_seed(6)
    delta = {n: 0.01 * torch.randn(t.shape, generator=g) for n, t in server.tensors.items()}
    params = {**setup.initial, **{n: t + delta[n] for n, t in server.tensors.items()}}
    for rnd in (1, 4):
        personal = method.init_client(setup.model, setup.initial, client)
        job = Job(method.downlink(server, 0), personal, client, 0, rnd, context=RoundContext(method.train))
        sent = method.cohort_finish(job, params, {}, {}).uplink
        for n, d in delta.items():
            if n + ".svd_s" in sent:
                rank = kept_rank(torch.linalg.svdvals(d.double()), method.energy_at(rnd))
                assert sent[n + ".svd_s"].shape == (rank,), (rnd, n)
    assert method.energy_at(1) < method.energy_at(4) == 0.99


def test_fedkd_energy_schedule_and_config_errors(tiny_config):
    from fedpeft.config import ConfigError

    method = build(tiny_config(method={"name": "fedkd"}, **{"train.rounds": 4})).method
    assert [method.energy_at(t) for t in (1, 2, 4)] == pytest.approx([0.9575, 0.965, 0.98])
    for bad in ({"energy": 1.5}, {"energy_end": 0.0}, {"mentor_rank": 0}, {"surprise": 1}):
        with pytest.raises((ConfigError, ValueError)):
            tiny_config(method={"name": "fedkd", **bad})
    for bad in ({"sigma": 0.0}, {"alpha_k": -1.0}, {"lam": -0.1}):
        with pytest.raises((ConfigError, ValueError)):
            tiny_config(method={"name": "fedamp", **bad})


# ---------------------------------------------------------------- FedKD: distillation


def test_mutual_distillation_loss_by_hand(tiny_config):
    model = build(tiny_config(method={"name": "fedkd"})).model
    g = torch.Generator().manual_seed(3)
    logits_t = torch.randn(3, 4, generator=g, requires_grad=True)
    logits_s = torch.randn(3, 4, generator=g, requires_grad=True)
    batch = {"labels": torch.tensor([2, 0, 1]), "weight": torch.tensor([1.0, 1.0, 0.0])}  # row 3: padding
    p_t, p_s = logits_t.softmax(-1).detach(), logits_s.softmax(-1).detach()

    def ce(p, rows):
        return -sum(math.log(p[r, int(batch["labels"][r])]) for r in rows) / len(rows)

    def kl(p, q, rows):  # KL(p || q), per example, averaged
        return sum(float((p[r] * (p[r] / q[r]).log()).sum()) for r in rows) / len(rows)

    rows = [0, 1]
    task_t, task_s = ce(p_t, rows), ce(p_s, rows)
    expected = task_t + task_s + (kl(p_s, p_t, rows) + kl(p_t, p_s, rows)) / (task_t + task_s)
    total, lt, ls = mutual_loss(model, logits_t, logits_s, batch)
    assert float(lt) == pytest.approx(task_t, rel=1e-5) and float(ls) == pytest.approx(task_s, rel=1e-5)
    assert float(total) == pytest.approx(expected, rel=1e-5)
    # stop-gradient: the mentor's logits get the gradient of the mentor's loss alone
    (g_t,) = torch.autograd.grad(total, logits_t)
    kl = kl_of_log_probs(
        "rows", log_probs("rows", logits_s.detach(), batch), log_probs("rows", logits_t, batch), batch
    )
    mentor_only = model.loss(logits_t, batch) + kl / (task_t + task_s)
    (ref,) = torch.autograd.grad(mentor_only, logits_t)
    torch.testing.assert_close(g_t, ref)
    assert g_t[2].abs().sum() == 0  # the padded row counts for nothing
    # the authors' summed loss (nothing detached) differs
    summed, _, _ = mutual_loss(model, logits_t, logits_s, batch, stop_gradient=False)
    (g_sum,) = torch.autograd.grad(summed, logits_t)
    assert not torch.allclose(g_sum, g_t)
    # identical models distil nothing
    same, lt, ls = mutual_loss(model, logits_t, logits_t.detach().clone(), batch)
    assert float(same) == pytest.approx(float(lt + ls), abs=1e-6)


def test_distillation_kl_counts_response_tokens_only():
    """A causal LM's KL: over the vocabulary at the positions predicting response tokens."""
    g = torch.Generator().manual_seed(4)
    target, logits = torch.randn(1, 4, 5, generator=g), torch.randn(1, 4, 5, generator=g)
    batch = {"labels": torch.tensor([[IGNORE, IGNORE, 3, 1]])}  # positions 1 and 2 predict response tokens
    p, q = target.softmax(-1), logits.softmax(-1)
    by_hand = sum(float((p[0, t] * (p[0, t] / q[0, t]).log()).sum()) for t in (1, 2)) / 2
    kl = kl_of_log_probs("lm", log_probs("lm", target, batch), log_probs("lm", logits, batch), batch)
    assert float(kl) == pytest.approx(by_hand, rel=1e-5)


def test_hidden_states_are_each_layers_output(tiny_config):
    setup = build(tiny_config(method={"name": "fedkd"}))
    model = setup.model
    layers = transformer_layers(model)
    assert len(layers) == 2  # the tiny BERT's
    batch = next(take_steps(setup.clients[0].train, 4, 1, torch.Generator().manual_seed(0)))
    model.eval()
    with torch.no_grad(), hidden_states(layers) as states:
        model(batch["input_ids"], batch["attention_mask"])
    assert len(states) == 2 and states[0].shape[:2] == batch["input_ids"].shape
    with torch.no_grad():
        bias = model.attention_bias(batch["attention_mask"])
        last = model.backbone(input_ids=batch["input_ids"], attention_mask=bias)
    torch.testing.assert_close(states[-1], last.last_hidden_state)
    assert all(not h._forward_hooks for h in layers)  # the hooks are gone after the block


# ---------------------------------------------------------------- FedKD on the other tasks


def test_fedkd_cohorts_equal_one_at_a_time_on_instruction_tuning(tiny_config, tiny_decoder):
    """The tiny decoder (KL over the vocabulary at response tokens, hidden states of real
    tokens): clients trained as one cohort get the rounds they get alone. (Both methods'
    whole runs on it: ``tests/models/test_causal_lm.py``, which runs every registered method.)"""
    from tests.helpers.cohort import assert_cohort_equals_alone
    from tests.helpers.configs import lm_config

    cfg = lm_config(tiny_config, tiny_decoder, method={"name": "fedkd"},
                    **{"data.max_samples": 60, "train.local_steps": 2})  # fmt: skip
    setup = build(cfg)
    assert_cohort_equals_alone(setup, list(range(len(setup.clients))), "fedkd")


def test_fedkd_cohorts_equal_one_at_a_time_on_tagging(tiny_config, tmp_path):
    """Per-token KL over labelled tokens, padded with the ignore label."""
    from tests.helpers.cohort import assert_cohort_equals_alone
    from tests.helpers.configs import SENTENCES, ner_config, write_conll

    cfg = ner_config(tiny_config, write_conll(tmp_path / "t.conll", SENTENCES * 20), method={"name": "fedkd"},
                     **{"train.local_steps": None, "train.local_epochs": 1})  # fmt: skip
    setup = build(cfg)
    assert_cohort_equals_alone(setup, list(range(len(setup.clients))), "fedkd")


def test_fedkd_on_extractive_qa(tiny_config):
    """KL over the start and end positions of the span: clients trained as one cohort get
    the rounds they get alone, and a run scores both of a client's models (the mentor,
    its own; the mentee, shared) as models that differ."""
    from fedpeft.report.results import read_records
    from tests.helpers.cohort import assert_cohort_equals_alone

    cfg = tiny_config(method={"name": "fedkd"}, **{"data.task": "extractive_qa", "data.max_length": 48,
                      "data.stride": 16, "data.max_samples": 60, "data.max_test_samples": 10})  # fmt: skip
    setup = build(cfg)
    assert_cohort_equals_alone(setup, list(range(len(setup.clients))), "fedkd")
    run(cfg, setup=setup)
    last = read_records(cfg.output_dir)[-1]
    assert math.isfinite(last["loss"])
    mentor, mentee = last["local"], last["local_mentee"]
    assert 0 <= mentor["f1_mean"] <= 100 and 0 <= mentee["f1_mean"] <= 100
    assert mentor != mentee
