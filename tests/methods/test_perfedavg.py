"""Per-FedAvg-LoRA: first- and second-order MAML gradients, and one-step personalised evaluation."""

import pytest
import torch

from fedpeft.data.task import take_rows
from fedpeft.experiment import build, run
from fedpeft.methods.perfedavg import maml_grads
from fedpeft.report.results import read_records


def _problem():
    torch.manual_seed(1)
    x1, y1 = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    x2, y2 = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    params = {"w": w}

    def loss_at(over, batch):
        v = over.get("w", w)
        x, y = batch
        return (torch.tanh(x @ v) - y).pow(2).mean()  # non-quadratic: the Hessian depends on w

    return params, loss_at, (x1, y1), (x2, y2)


def test_second_order_gradient_equals_finite_differences_of_the_unrolled_loss():
    params, loss_at, b1, b2 = _problem()
    alpha = 0.3
    _, grads = maml_grads(loss_at, params, b1, b2, alpha, order=2)
    grad = grads["w"]

    def unrolled(w):
        w = w.detach().requires_grad_()
        (g,) = torch.autograd.grad(loss_at({"w": w}, b1), [w])
        return loss_at({"w": w - alpha * g}, b2)

    eps, w0 = 1e-6, params["w"].detach()
    fd = torch.stack(
        [
            (unrolled(w0 + eps * e) - unrolled(w0 - eps * e)) / (2 * eps)
            for e in torch.eye(3, dtype=torch.float64)
        ]
    )
    torch.testing.assert_close(grad, fd.detach(), rtol=1e-6, atol=1e-9)


def test_first_order_gradient_is_the_gradient_at_the_adapted_point():
    params, loss_at, b1, b2 = _problem()
    alpha = 0.3
    grad1 = maml_grads(loss_at, params, b1, b2, alpha, order=1)[1]["w"]
    grad2 = maml_grads(loss_at, params, b1, b2, alpha, order=2)[1]["w"]
    w = params["w"]
    (g,) = torch.autograd.grad(loss_at({}, b1), [w])
    adapted = (w - alpha * g).detach().requires_grad_()
    (expected,) = torch.autograd.grad(loss_at({"w": adapted}, b2), [adapted])
    torch.testing.assert_close(grad1, expected)
    assert not torch.allclose(grad1, grad2)  # the orders really differ


def test_perfedavg_runs_with_personalised_evaluation(tiny_config):
    """Each client is scored after one plain gradient step (``inner_lr``) from the global
    model on a batch of its own training data, drawn by its id; the global model as it is."""
    import numpy as np

    from fedpeft.data.task import make_batch
    from fedpeft.engines.checkpoint import load_checkpoint
    from fedpeft.experiment import fingerprint
    from fedpeft.methods.base import load_tensors, trainable_params
    from fedpeft.metrics.classification import predict

    cfg = tiny_config(**{"method": {"name": "perfedavg", "order": 2, "lora": {"r": 2}}})
    setup = build(cfg)
    run(cfg, setup=setup)
    last = read_records(cfg.output_dir)[-1]
    assert last["clients_evaluated"] == cfg.partition.num_clients
    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    method, model, accuracy = setup.method, setup.model, []
    for client in setup.clients:
        personal = ckpt.personal.get(client.cid) or method.init_client(model, setup.initial, client)
        start = {**method.downlink(ckpt.server, client.cid), **method.params_of(personal)}
        load_tensors(model, start)
        rows = torch.randperm(len(client.train), generator=torch.Generator().manual_seed(client.cid))
        batch = make_batch(client.train, rows[: method.adapt_size()])
        model.eval()
        params = trainable_params(model)
        loss = torch.nn.functional.cross_entropy(model(**batch), batch["labels"])
        grads = torch.autograd.grad(loss, list(params.values()))
        adapted = {
            n: (p - method.cfg.inner_lr * g).detach() for (n, p), g in zip(params.items(), grads, strict=True)
        }
        assert max(float((adapted[n] - start[n]).abs().max()) for n in adapted) > 1e-6  # it adapted
        load_tensors(model, adapted)
        accuracy.append(float(np.mean(predict(model, client.test, 64) == client.test.labels.numpy())))
    assert last["local"]["accuracy_mean"] == pytest.approx(np.mean(accuracy), abs=1e-9)
    load_tensors(model, method.global_state(ckpt.server))
    on_global = float(np.mean(predict(model, setup.global_test, 64) == setup.global_test.labels.numpy()))
    assert last["global"]["accuracy"] == pytest.approx(on_global, abs=1e-9)


@pytest.mark.parametrize("split", [False, True])
def test_split_batch_gives_equal_examples_per_step(split, tiny_config, monkeypatch):
    """The paper's step reads two batches of B; ``split_batch`` reads one batch of B in
    two halves, the examples per step of every other method."""
    from fedpeft.methods import perfedavg

    sizes = []
    real = perfedavg.maml_grads

    def spy(loss_at, params, batch1, batch2, *args):  # runs under vmap: logical shapes
        sizes.append((len(batch1["labels"]), len(batch2["labels"])))
        return real(loss_at, params, batch1, batch2, *args)

    monkeypatch.setattr(perfedavg, "maml_grads", spy)
    # (without the memory check, whose probe steps take fewer rows)
    over = {"train.rounds": 1, "train.memory_check": False}
    cfg = tiny_config(**{"method": {"name": "perfedavg", "split_batch": split}, **over})
    run(cfg)
    assert sizes and set(sizes) == ({(4, 4)} if split else {(8, 8)})
    setup = build(cfg)
    size = setup.cfg.train.batch_size
    pairs = setup.method.batch_pairs(setup.clients[0], size, 3, torch.Generator().manual_seed(0))
    size = setup.cfg.train.batch_size
    drawn = list(take_rows(len(setup.clients[0].train), size, 6, torch.Generator().manual_seed(0)))
    for k, (d1, d2) in enumerate(pairs):  # halves of one batch, or two batches in a row
        if split:
            assert torch.equal(torch.cat([d1.rows, d2.rows]), drawn[k]) and len(d1.rows) == size // 2
        else:
            assert torch.equal(d1.rows, drawn[2 * k]) and torch.equal(d2.rows, drawn[2 * k + 1])


def test_split_batch_never_halves_a_one_row_batch(tiny_config, monkeypatch):
    """A pass over n = 1 (mod B) examples ends in a one-row batch, whose halves would be
    empty and 1 row (a NaN loss): it is skipped, every step gets two non-empty halves."""
    cfg = tiny_config(**{"method": {"name": "perfedavg", "split_batch": True}, "train.batch_size": 4})
    setup = build(cfg)
    client = setup.clients[0]
    client.train = client.train.subset(torch.arange(9))  # batches of 4 + 4 + 1 per pass
    pairs = list(
        setup.method.batch_pairs(client, setup.cfg.train.batch_size, 7, torch.Generator().manual_seed(0))
    )
    assert len(pairs) == 7
    assert all(len(a.rows) == len(b.rows) == 2 for a, b in pairs)


@pytest.mark.parametrize("split", [False, True])
def test_adaptation_before_testing_uses_a_training_steps_inner_batch(split, tiny_config, monkeypatch):
    """The one step before testing is as large as training's inner step: a batch of B,
    or half of one with ``split_batch``."""
    from fedpeft.methods import perfedavg

    setup = build(tiny_config(**{"method": {"name": "perfedavg", "split_batch": split}}))
    method, model, client = setup.method, setup.model, setup.clients[0]
    rows = []
    real = perfedavg.make_batch

    def spy(data, index):
        rows.append(len(index))
        return real(data, index)

    monkeypatch.setattr(perfedavg, "make_batch", spy)
    method.eval_state(model, method.init_server(model).tensors, {}, client)
    assert rows == [4 if split else 8]
