"""FedMCP: linear CKA, the two adapter paths, the loss and what leaves a client."""

import pytest
import torch

from fedpeft.engines.local import head_logits, model_features
from fedpeft.experiment import build
from fedpeft.methods.base import FitResult, ServerState
from fedpeft.metrics.cka import linear_cka
from fedpeft.peft.adapters import AdapterPair, adapter_mode
from tests.helpers.cohort import step_inputs


def cka_by_the_formula(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The paper's eqs. 3-4 literally: kernels, centering matrix, traces."""
    n = x.shape[0]
    c = torch.eye(n, dtype=x.dtype) - torch.ones(n, n, dtype=x.dtype) / n
    k, l_ = x @ x.T, y @ y.T

    def hsic(a, b):
        return torch.trace(a @ c @ b @ c) / (n - 1) ** 2

    return hsic(k, l_) / torch.sqrt(hsic(k, k) * hsic(l_, l_))


def test_linear_cka_matches_the_formula_and_its_invariances():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    y = x @ torch.randn(5, 7, generator=gen, dtype=torch.float64) + 0.5 * torch.randn(
        12, 7, generator=gen, dtype=torch.float64
    )
    value = linear_cka(x, y)
    torch.testing.assert_close(value, cka_by_the_formula(x, y))
    assert 0 < value < 1
    torch.testing.assert_close(linear_cka(x, x), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(linear_cka(3.7 * x, y), value)  # isotropic scaling
    q, _ = torch.linalg.qr(torch.randn(7, 7, generator=gen, dtype=torch.float64))
    torch.testing.assert_close(linear_cka(x, y @ q), value)  # orthogonal transform
    torch.testing.assert_close(linear_cka(x + 4.0, y), value)  # centring: a shift changes nothing
    torch.testing.assert_close(linear_cka(y, x), value)  # symmetric


def test_linear_cka_leaves_rows_of_weight_zero_out():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)
    padded_x = torch.cat([x, torch.randn(3, 4, generator=gen)])
    padded_y = torch.cat([y, torch.randn(3, 3, generator=gen)])
    weight = torch.tensor([1.0] * 6 + [0.0] * 3)
    torch.testing.assert_close(linear_cka(padded_x, padded_y, weight), linear_cka(x, y))


def test_linear_cka_of_one_row_is_zero_with_a_finite_gradient():
    x = torch.randn(1, 4, requires_grad=True)
    value = linear_cka(x, torch.randn(1, 4))
    value.backward()
    assert value == 0 and torch.isfinite(x.grad).all()


@pytest.fixture
def fedmcp(tiny_config):
    return build(tiny_config(method={"name": "fedmcp", "gamma": 0.3, "mu": 0.5}))


def test_the_modes_route_through_the_named_adapters(fedmcp):
    model = fedmcp.model
    pair = next(m for m in model.modules() if isinstance(m, AdapterPair))
    with torch.no_grad():  # make the two adapters differ from the identity and from each other
        pair.shared.up.bias.fill_(1.0)
        pair.private.up.bias.fill_(-3.0)
    h = torch.randn(2, pair.shared.up.out_features)
    torch.testing.assert_close(pair(h), (pair.shared(h) + pair.private(h)) / 2)
    with adapter_mode(model, "global"):
        torch.testing.assert_close(pair(h), pair.shared(h))
    with adapter_mode(model, "private"):
        torch.testing.assert_close(pair(h), pair.private(h))
    assert pair.mode == "both"  # restored
    with pytest.raises(ValueError, match="adapter mode"), adapter_mode(model, "neither"):
        pass


def test_only_the_global_adapter_is_shared(fedmcp):
    method = fedmcp.method
    assert method.shared_names and all(".adapter.shared." in n for n in method.shared_names)
    personal = set(method.personal_names)
    assert any(".adapter.private." in n for n in personal)
    assert {"head.weight", "head.bias", "global_head.weight", "global_head.bias"} <= personal
    job = _job(fedmcp)
    (result,) = method.fit_cohort(fedmcp.model, [job])
    assert set(result.uplink) == set(method.shared_names)
    assert set(result.personal) == personal


def _job(setup, cid=0, seed=5):
    from fedpeft.engines.local import Job, RoundContext

    server = setup.method.init_server(setup.model)
    personal = setup.method.init_client(setup.model, setup.initial, setup.clients[cid])
    return Job(
        dict(server.tensors), personal, setup.clients[cid], seed, context=RoundContext(setup.method.train)
    )


def test_the_loss_is_the_papers_combination(fedmcp):
    """The step's loss, rebuilt by hand from its three terms on perturbed tensors
    (so that the paths, the received adapter and the heads all differ)."""
    model, method, cfg = fedmcp.model, fedmcp.method, fedmcp.method.cfg
    job = _job(fedmcp)
    gen = torch.Generator().manual_seed(0)
    start = method.cohort_start(model, job)
    params = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in start.params.items()}
    received = start.consts
    batch = next(iter(step_inputs(method, job.client, 1, job.generator())))[0]
    value, grads = method.step_gradients(model)(params, received, (batch,))

    features = model_features(model)
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        full = features(params, batch)
        with adapter_mode(model, "global"):
            x = features(params, batch)
            z = features({**params, **received}, batch)
        with adapter_mode(model, "private"):
            y = features(params, batch)
        loss_a = ce(head_logits(params, full), batch["labels"])
        loss_b = ce(head_logits(params, x, "global_head."), batch["labels"])
        loss_c = cka_by_the_formula(x.double(), y.double()) - cka_by_the_formula(x.double(), z.double())
    expected = (1 - cfg.gamma) * loss_a + cfg.gamma * loss_b + cfg.mu * loss_c.float()
    torch.testing.assert_close(value, expected, atol=1e-5, rtol=1e-5)
    assert set(grads) == set(params)  # received (Z's adapter) is a constant: no gradient of it
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_contrast_equation_anchors_on_the_private_path(tiny_config):
    prose = build(tiny_config(method={"name": "fedmcp", "gamma": 0.0, "mu": 1.0}))
    job = _job(prose)
    gen = torch.Generator().manual_seed(2)
    start = prose.method.cohort_start(prose.model, job)
    params = {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in start.params.items()}
    batch = next(iter(step_inputs(prose.method, job.client, 1, job.generator())))[0]
    v_prose, _ = prose.method.step_gradients(prose.model)(params, start.consts, (batch,))
    prose.method.cfg = prose.method.cfg.model_copy(update={"contrast": "equation"})
    v_eq, _ = prose.method.step_gradients(prose.model)(params, start.consts, (batch,))
    features = model_features(prose.model)
    with torch.no_grad():
        with adapter_mode(prose.model, "global"):
            x = features(params, batch)
            z = features({**params, **start.consts}, batch)
        with adapter_mode(prose.model, "private"):
            y = features(params, batch)
    torch.testing.assert_close(v_eq - v_prose, linear_cka(x, z) - linear_cka(y, z), atol=1e-5, rtol=1e-4)


def test_the_server_averages_global_adapters_uniformly(fedmcp):
    method = fedmcp.method
    name = method.shared_names[0]
    results = [
        FitResult(
            {n: torch.full_like(t, v) for n, t in method.init_server(fedmcp.model).tensors.items()}, {}, size
        )
        for v, size in ((1.0, 10), (4.0, 1000))
    ]
    new = method.aggregate(ServerState({}), results, 1)
    assert torch.all(new.tensors[name] == 2.5)  # (1 + 4) / 2, not weighted by 10 : 1000
    assert method.global_state(new) is None
