"""PF2LoRA: the hypergradient through the lower-level step, checked against brute force."""

import torch
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

from fedpeft.experiment import build
from fedpeft.methods.pf2lora import bilevel_step


def _unrolled(loss_with, upper_names, lower, lower_lr):
    """F(upper) = f(upper, lower - lower_lr * grad_lower f(upper, lower)), written out directly."""

    def f(upper_values):
        over = dict(zip(upper_names, upper_values, strict=True))
        loss = loss_with(over)
        g = torch.autograd.grad(loss, list(lower.values()), create_graph=True)
        stepped = {k: v - lower_lr * gi for (k, v), gi in zip(lower.items(), g, strict=True)}
        return loss_with({**over, **stepped})

    return f


def test_hypergradient_matches_finite_differences_and_the_hvp_formula():
    # Prepare: y = (W0 + B A + D C) x on random data, float64
    torch.manual_seed(0)
    x, y = torch.randn(20, 5, dtype=torch.float64), torch.randn(20, 4, dtype=torch.float64)
    w0 = torch.randn(4, 5, dtype=torch.float64)
    p = {
        n: torch.randn(*s, dtype=torch.float64, requires_grad=True) * 0.5
        for n, s in {"A": (3, 5), "B": (4, 3), "C": (1, 5), "D": (4, 1)}.items()
    }
    p = {n: v.detach().requires_grad_() for n, v in p.items()}

    def loss_with(over):
        q = {**p, **over}
        w = w0 + q["B"] @ q["A"] + q["D"] @ q["C"]
        return ((x @ w.T - y) ** 2).mean()

    upper, lower, eta = {"A": p["A"], "B": p["B"]}, {"C": p["C"], "D": p["D"]}, 0.05
    # Execute: the pure function, on detached values (as in a vmapped cohort)
    detached = lambda d: {n: v.detach() for n, v in d.items()}  # noqa: E731
    loss, hyper, g_low = bilevel_step(loss_with, detached(upper), detached(lower), eta)
    stepped = {k: v.detach() - eta * g_low[k] for k, v in lower.items()}
    hyper = list(hyper.values())
    # Assert 1: central finite differences of the unrolled objective, every coordinate
    F = _unrolled(loss_with, list(upper), lower, eta)
    eps = 1e-6
    for i, (name, value) in enumerate(upper.items()):
        fd = torch.zeros_like(value)
        for idx in range(value.numel()):
            bump = torch.zeros(value.numel(), dtype=torch.float64)
            bump[idx] = eps
            bump = bump.view_as(value)
            vals = [v.detach() for v in upper.values()]
            plus = [v + bump if j == i else v for j, v in enumerate(vals)]
            minus = [v - bump if j == i else v for j, v in enumerate(vals)]
            fd.view(-1)[idx] = (F(plus) - F(minus)) / (2 * eps)
        torch.testing.assert_close(hyper[i], fd, rtol=1e-6, atol=1e-8, msg=name)
    # Assert 2: the formula grad_AB f(AB, CD') - eta * H_{AB,CD} grad_CD f(AB, CD')
    lower_new = {k: v.detach().requires_grad_() for k, v in stepped.items()}
    up_new = [v.detach().requires_grad_() for v in upper.values()]
    l2 = loss_with({**dict(zip(upper, up_new, strict=True)), **lower_new})
    g_ab = torch.autograd.grad(l2, up_new, retain_graph=True)
    g_cd = torch.autograd.grad(l2, list(lower_new.values()))
    l1 = loss_with({})
    g1 = torch.autograd.grad(l1, list(lower.values()), create_graph=True)
    hvp = torch.autograd.grad(g1, list(upper.values()), grad_outputs=g_cd)  # H_{AB,CD} . v
    for h, ga, hv in zip(hyper, g_ab, hvp, strict=True):
        torch.testing.assert_close(h, ga - eta * hv, rtol=1e-10, atol=1e-12)
    # the lower level's gradient is the plain one at the step's start
    g_plain = torch.autograd.grad(loss_with({}), list(lower.values()))
    for k, g in zip(lower, g_plain, strict=True):
        torch.testing.assert_close(g_low[k], g)
    assert loss > 0


def test_hypergradient_on_the_tiny_model_float64(tiny_config):
    """On the real two-level LoRA model: <hypergradient, V> equals the directional
    finite difference of the unrolled objective along a random direction V."""
    cfg = tiny_config(**{"method": {"name": "pf2lora", "lora": {"r": 2}, "client_rank": 1}})
    setup = build(cfg)
    model = setup.model.double()
    torch.manual_seed(0)
    with torch.no_grad():  # move off the B = 0 / D = 0 start so every term is active
        for n, prm in model.named_parameters():
            if "lora_" in n:
                prm.add_(0.1 * torch.randn_like(prm))
    params = dict(model.named_parameters())
    upper = {n: params[n] for n in setup.method.shared_names if "lora_" in n}
    lower = {n: params[n] for n in setup.method.personal_names}
    batch = {"input_ids": setup.global_test.ids[:6, :8], "attention_mask": torch.ones(6, 8, dtype=torch.long)}
    labels = setup.global_test.labels[:6]
    model.eval()

    def loss_with(over):
        logits = functional_call(model, over, (), batch) if over else model(**batch)
        return torch.nn.functional.cross_entropy(logits, labels)

    with sdpa_kernel(SDPBackend.MATH):
        detached = lambda d: {n: v.detach() for n, v in d.items()}  # noqa: E731
        _, hyper, _ = bilevel_step(loss_with, detached(upper), detached(lower), lower_lr=0.5)
        hyper = list(hyper.values())
        F = _unrolled(loss_with, list(upper), lower, 0.5)
        direction = [torch.randn_like(v) for v in upper.values()]
        eps = 1e-5
        base = [v.detach() for v in upper.values()]
        fd = (
            F([b + eps * d for b, d in zip(base, direction, strict=True)])
            - F([b - eps * d for b, d in zip(base, direction, strict=True)])
        ) / (2 * eps)
    analytic = sum((h * d).sum() for h, d in zip(hyper, direction, strict=True))
    torch.testing.assert_close(analytic, fd.detach(), rtol=1e-6, atol=1e-9)
    assert abs(float(analytic)) > 1e-6  # a real signal, not 0 == 0


def test_effective_rank_counts_singular_values_above_the_tolerance():
    from fedpeft.methods.pf2lora import effective_rank

    u, _ = torch.linalg.qr(torch.randn(6, 6, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    m = u[:, :3] @ torch.diag(torch.tensor([5.0, 1.0, 0.02], dtype=torch.float64)) @ v[:, :3].T
    # singular values 5, 1, 0.02: thresholds 0.005, 0.05, 1.5
    assert effective_rank(m, tol=0.001) == 3
    assert effective_rank(m, tol=0.01) == 2
    assert effective_rank(m, tol=0.3) == 1
    assert effective_rank(torch.zeros(3, 3), tol=0.01) == 0


def test_pf2lora_logs_each_clients_effective_rank(tiny_config):
    from fedpeft.experiment import run
    from fedpeft.report.results import read_records

    cfg = tiny_config(
        **{"method": {"name": "pf2lora", "lora": {"r": 2}, "client_rank": 1}, "log.plots": True}
    )
    run(cfg)
    records = read_records(cfg.output_dir)
    for r in records:
        assert set(r["client_readout"]) == {str(c) for c in r["clients"]}
        for readout in r["client_readout"].values():
            assert 1 <= readout["rank_min"] <= readout["rank_mean"] <= readout["rank_max"] <= 2 + 1
    assert "global" in records[-1] and "local" in records[-1]  # the common model and each client's own
    assert (cfg.output_dir / "client_readout.png").stat().st_size > 1000
