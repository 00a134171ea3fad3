"""C2A: the hypernetwork's generated adapters, its embeddings and its parameter count."""

from __future__ import annotations

import re

import pytest
import torch

from fedpeft.experiment import build
from fedpeft.methods.base import tensor_bytes
from fedpeft.peft.hyper import GeneratedAdapter, batch_context


def c2a_setup(tiny_config, **hyper):
    method = {"name": "c2a", "hyper": hyper} if hyper else {"name": "c2a"}
    setup = build(tiny_config(method=method))
    setup.model.eval()
    return setup


def batch_of(setup, rows: slice):
    from fedpeft.data.task import make_batch

    data = setup.clients[0].train
    return make_batch(data, torch.arange(len(data))[rows])


def layer_of(site: str) -> int:
    return int(re.search(r"layer\.(\d+)\.", site).group(1))


def generated(model, batch, labels=None) -> dict[str, torch.Tensor]:
    """Every site's generated ``U`` during one forward pass, by site name."""
    seen, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, GeneratedAdapter):

            def keep(mod, args, out, name=name):
                seen[name] = mod.hyper.adapter(mod.layer).detach().clone()

            handles.append(module.register_forward_hook(keep))
    with torch.no_grad():
        if labels is None:
            model(batch["input_ids"], batch["attention_mask"])
        else:
            with model.hyper.labelled(labels):
                model(batch["input_ids"], batch["attention_mask"])
    for h in handles:
        h.remove()
    return seen


def test_generated_adapter_shapes_per_layer(tiny_config):
    setup = c2a_setup(tiny_config)
    model = setup.model
    d, r = model.backbone.config.hidden_size, setup.cfg.method.adapter.bottleneck
    us = generated(model, batch_of(setup, slice(0, 8)))
    layers = model.backbone.config.num_hidden_layers
    assert len(us) == 2 * layers  # two Houlsby sites per layer
    assert all(u.shape == (d, r) for u in us.values())
    # both sites of a layer use the layer's one adapter; the layers' adapters differ
    by_layer = {}
    for name, u in us.items():
        by_layer.setdefault(layer_of(name), []).append(u)
    assert sorted(by_layer) == list(range(layers))
    for pair in by_layer.values():
        assert torch.equal(pair[0], pair[1])
    assert not torch.allclose(by_layer[0][0], by_layer[1][0])


def test_generated_weights_follow_labels_and_inputs_and_repeat_exactly(tiny_config):
    setup = c2a_setup(tiny_config)
    model = setup.model
    a, b = batch_of(setup, slice(0, 8)), batch_of(setup, slice(8, 16))
    first, again = generated(model, a), generated(model, a)
    assert all(torch.equal(first[k], again[k]) for k in first)  # identical batches, identical adapters
    other_input = generated(model, b)
    assert all(not torch.allclose(first[k], other_input[k]) for k in first)
    labels = torch.zeros(8, dtype=torch.long)
    with_labels = generated(model, a, labels)
    assert all(not torch.allclose(first[k], with_labels[k]) for k in first)  # uniform vs all class 0
    with_other_labels = generated(model, a, labels + 1)
    assert all(not torch.allclose(with_labels[k], with_other_labels[k]) for k in first)


def test_without_label_and_context_embeddings_adapters_are_per_layer_constants(tiny_config):
    setup = c2a_setup(tiny_config, label_embedding=False, context_embedding=False)
    model, hyper = setup.model, setup.model.hyper
    assert hyper.label is None and hyper.context is None
    a = generated(model, batch_of(setup, slice(0, 8)))
    b = generated(model, batch_of(setup, slice(8, 20)), torch.arange(12) % 3)
    w = hyper.weight().detach()
    for name, u in a.items():
        assert torch.equal(u, b[name])
        layer = layer_of(name)
        torch.testing.assert_close(u, w @ hyper.layers.weight[layer].detach())


def layer0_embedding_by_hand(model, batch, pool) -> torch.Tensor:
    """``I_0`` at inference: the embeddings' output (the hidden states entering layer 0)
    mean-pooled per example, L2-normalised, pooled over the batch by ``pool``, projected;
    plus the label embedding of the uniform distribution and ``E_0``."""
    hyper = model.hyper
    with torch.no_grad():
        h = model.backbone.embeddings(input_ids=batch["input_ids"])
        m = batch["attention_mask"].unsqueeze(-1).float()
        pooled = torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)
        context = hyper.context.weight @ pool(pooled) + hyper.context.bias
        c = hyper.num_classes
        label = hyper.label.weight @ torch.full((c,), 1 / c) + hyper.label.bias
        return label + context + hyper.layers.weight[0]


def test_client_embedding_is_the_papers_sum_at_layer_zero(tiny_config):
    """``U_0`` rebuilt by hand: the embeddings' output (the hidden states entering layer
    0) mean-pooled per example, L2-normalised, max-pooled over the batch, projected; plus
    the label embedding of the uniform distribution (no labels: inference) and ``E_0``;
    times ``norm_F(F_U S_U)``."""
    setup = c2a_setup(tiny_config)
    model, hyper = setup.model, setup.model.hyper
    batch = batch_of(setup, slice(0, 6))
    u0 = next(u for n, u in generated(model, batch).items() if ".layer.0." in n)
    emb = layer0_embedding_by_hand(model, batch, lambda pooled: pooled.max(0).values)
    with torch.no_grad():
        w = hyper.F_U @ hyper.S_U
        w = (w / w.norm()).reshape(hyper.dim, hyper.rank, -1)
        torch.testing.assert_close(u0, torch.einsum("drt,t->dr", w, emb), atol=1e-6, rtol=1e-5)
    assert torch.linalg.matrix_norm(hyper.weight().flatten(1)).item() == pytest.approx(1.0, abs=1e-6)


def test_site_applies_the_tied_adapter():
    """``A(h) = U GELU(U^T h) + h`` with the down-projection tied to ``U^T``."""
    from fedpeft.peft.hyper import Hypernetwork, HyperSpec

    hyper = Hypernetwork(dim=6, rank=3, num_layers=1, num_classes=4, spec=HyperSpec())
    u = torch.randn(6, 3)
    hyper._adapters = {0: u}
    h = torch.randn(2, 5, 6)
    out = GeneratedAdapter(hyper, 0)(h)
    expected = h + torch.einsum("dr,btr->btd", u, torch.nn.functional.gelu(torch.einsum("dr,btd->btr", u, h)))
    torch.testing.assert_close(out, expected)


def test_padded_rows_change_neither_context_nor_label_distribution():
    from fedpeft.peft.hyper import Hypernetwork, HyperSpec

    hidden = torch.randn(3, 4, 5)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    padded_hidden = torch.cat([hidden, 100 * torch.ones(2, 4, 5)])
    padded_mask = torch.cat([mask, torch.zeros(2, 4, dtype=torch.long)])
    torch.testing.assert_close(batch_context(padded_hidden, padded_mask), batch_context(hidden, mask))
    hyper = Hypernetwork(dim=5, rank=2, num_layers=1, num_classes=3, spec=HyperSpec())
    with hyper.labelled(torch.tensor([0, 2, 2, 1, 1]), torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0])):
        torch.testing.assert_close(hyper._labels, torch.tensor([1 / 3, 0.0, 2 / 3]))
    assert hyper._labels is None


@pytest.mark.parametrize("factorise", [True, False])
def test_parameter_counts_follow_the_formula(tiny_config, factorise):
    """Trainable = communicated = ``d s + s r t`` (factorised; else ``d r t``) + label
    projection ``C t + t`` + context projection ``d t + t`` + layer embeddings ``L t``
    + head ``d C + C``."""
    setup = c2a_setup(tiny_config, factorise=factorise, embedding_dim=4, factor_dim=16)
    model, method = setup.model, setup.method
    d, layers = model.backbone.config.hidden_size, model.backbone.config.num_hidden_layers
    r, t, s, c = setup.cfg.method.adapter.bottleneck, 4, 16, model.head.out_features
    generator = d * s + s * r * t if factorise else d * r * t
    expected = generator + (c * t + t) + (d * t + t) + layers * t + (d * c + c)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == expected
    server = method.init_server(model)
    assert tensor_bytes(method.downlink(server, 0)) == 4 * expected
    assert not method.personal_names
    # the adapters' weights are generated, never parameters: the backbone holds none
    assert not [n for n, p in model.backbone.named_parameters() if p.requires_grad]


AUTHORS_CODE = {"normalise_scope": "slice", "generator_bias": True, "tie": "view", "adapter_bias": True,
                "context_pool": "mean"}  # fmt: skip


def test_authors_code_options_generate_as_their_code_does(tiny_config):
    """The authors'-code readings: ``B_U`` added to every ``(d x r)`` slice of ``W_U``,
    each slice then of unit norm; ``U_0`` from the batch's *mean* context; and the site
    ``h + GELU(h U + b_r) V + b_d`` with ``V`` = ``U``'s entries read as ``r x d``."""
    setup = c2a_setup(tiny_config, **AUTHORS_CODE)
    model, hyper = setup.model, setup.model.hyper
    with torch.no_grad():  # move the zero-initialised biases off zero, so that they count
        hyper.B_U.normal_()
        for b in hyper.adapter_biases:
            b.normal_()
    d, r, t = hyper.dim, hyper.rank, hyper.spec.embedding_dim
    w = (hyper.F_U @ hyper.S_U).reshape(d, r, t) + hyper.B_U.unsqueeze(-1)
    expected_w = torch.stack([w[:, :, k] / w[:, :, k].norm() for k in range(t)], dim=-1)
    torch.testing.assert_close(hyper.weight(), expected_w)
    assert [hyper.weight()[:, :, k].norm().item() for k in range(t)] == pytest.approx([1.0] * t, abs=1e-5)

    batch = batch_of(setup, slice(0, 6))
    u0 = next(u for n, u in generated(model, batch).items() if ".layer.0." in n)
    emb = layer0_embedding_by_hand(model, batch, lambda pooled: pooled.mean(0))
    torch.testing.assert_close(u0, torch.einsum("drt,t->dr", expected_w, emb).detach(), atol=1e-6, rtol=1e-5)

    hyper._adapters = {0: u0}
    x = torch.randn(2, 5, d)
    b_r, b_d = hyper.adapter_biases
    manual = x + torch.nn.functional.gelu(x @ u0 + b_r) @ u0.reshape(r, d) + b_d
    torch.testing.assert_close(GeneratedAdapter(hyper, 0)(x), manual.detach())


def test_authors_code_options_add_their_parameters_to_what_is_sent(tiny_config):
    """``B_U`` (``d r``) and the two adapter biases (``r + d``) are trained and sent."""
    paper, code = c2a_setup(tiny_config), c2a_setup(tiny_config, **AUTHORS_CODE)
    d, r = paper.model.hyper.dim, paper.model.hyper.rank

    def sent(setup):
        return tensor_bytes(setup.method.downlink(setup.method.init_server(setup.model), 0)) // 4

    def trained(setup):
        return sum(p.numel() for p in setup.model.parameters() if p.requires_grad)

    assert trained(code) - trained(paper) == d * r + r + d
    assert sent(code) - sent(paper) == d * r + r + d
