"""FeDeRA: SVD initialisation, the residual, the server broadcast, and the variation metrics."""

import copy

import pytest
import torch

from fedpeft.experiment import build, run
from fedpeft.methods.federa import lora_layers
from fedpeft.metrics.variation import lora_variations, variation
from fedpeft.peft.svd_init import residual, svd_factors
from fedpeft.report.results import read_records


def test_factors_follow_the_svd_formula():
    # Prepare
    torch.manual_seed(0)
    w = torch.randn(6, 4, dtype=torch.float64)
    u, sigma, vh = torch.linalg.svd(w, full_matrices=False)
    # Execute
    a, b = svd_factors(w, r=2)
    # Assert: A = sqrt(sigma[:r]) V[:, :r]^T, B = U[:, :r] sqrt(sigma[:r])
    torch.testing.assert_close(a, torch.diag(sigma[:2].sqrt()) @ vh[:2], rtol=0, atol=1e-12)
    torch.testing.assert_close(b, u[:, :2] @ torch.diag(sigma[:2].sqrt()), rtol=0, atol=1e-12)
    # with scale 1, B A is the rank-2 principal part and the residual the rest
    torch.testing.assert_close(b @ a, u[:, :2] @ torch.diag(sigma[:2]) @ vh[:2], rtol=0, atol=1e-12)
    for scale in (1.0, 0.5, 2.0):
        torch.testing.assert_close(residual(w, a, b, scale) + scale * b @ a, w, rtol=0, atol=1e-12)


def test_rank_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="rank r=5"):
        svd_factors(torch.zeros(4, 3), 5)


@pytest.fixture
def federa_setup(tiny_config):
    cfg = tiny_config(**{"method": {"name": "federa", "lora": {"r": 4, "alpha": 4}}})
    return cfg, build(cfg)


def _logits(model, setup):
    model.eval()
    batch = {
        "input_ids": setup.global_test.ids[:16, :12],
        "attention_mask": torch.ones(16, 12, dtype=torch.long),
    }
    with torch.no_grad():
        return model(**batch)


def test_round0_logits_equal_the_pretrained_model(federa_setup, tiny_backbone):
    cfg, setup = federa_setup
    model, method = setup.model, setup.method
    # the pretrained model with the same head and no adapter
    from fedpeft.models.backbone import TaskModel, load_backbone

    body, _ = load_backbone(cfg.model)
    plain = TaskModel(body, setup.corpus.num_classes)
    plain.head.load_state_dict(model.head.state_dict())

    server = method.init_server(model)
    method.join(model, method.join_message(server))
    layers = lora_layers(model)
    assert len(layers) == 4  # query and value of 2 layers
    assert all(layer.lora_B["default"].weight.abs().sum() > 0 for layer in layers.values())  # not LoRA's B=0
    torch.testing.assert_close(_logits(model, setup), _logits(plain, setup), rtol=0, atol=2e-6)


def test_clients_with_flipped_signs_start_identical_after_the_broadcast(federa_setup):
    cfg, setup = federa_setup
    server_model = setup.model
    method = setup.method
    client1, client2 = copy.deepcopy(server_model), copy.deepcopy(server_model)
    # Each client decomposes on its own; client 2's machine returns flipped singular vectors.
    for name, layer in lora_layers(client1).items():
        a, b = svd_factors(layer.get_base_layer().weight, layer.r["default"])
        other = lora_layers(client2)[name]
        with torch.no_grad():
            layer.lora_A["default"].weight.copy_(a)
            layer.lora_B["default"].weight.copy_(b)
            other.lora_A["default"].weight.copy_(-a)  # (u, v) -> (-u, -v): an equally valid SVD
            other.lora_B["default"].weight.copy_(-b)
    before = [
        not torch.equal(p1, p2) for p1, p2 in zip(client1.parameters(), client2.parameters(), strict=True)
    ]
    assert any(before)  # they would start apart
    # The server decomposes once; both clients join from its broadcast and load the global state.
    server = method.init_server(server_model)
    for client in (client1, client2):
        method.join(client, method.join_message(server))
        from fedpeft.methods.base import load_tensors

        load_tensors(client, server.tensors)
    for (n, p1), p2 in zip(client1.named_parameters(), client2.parameters(), strict=True):
        assert torch.equal(p1, p2), n


def test_decomposition_time_and_variations_are_recorded(federa_setup):
    cfg, setup = federa_setup
    run(cfg, setup=setup)
    records = read_records(cfg.output_dir)
    assert records[0]["setup"]["time_decompose"] > 0
    variation_keys = set(records[0]["update_variation"])
    assert len(variation_keys) == 8  # A and B of query and value in 2 layers
    assert all(len(v) == 2 and v[0] >= 0 and 0 <= v[1] <= 2 for v in records[1]["update_variation"].values())


def test_variation_by_hand():
    # columns (3, 4) and (1, 0); then (0, 5) and (2, 0)
    w1 = torch.tensor([[3.0, 1.0], [4.0, 0.0]])
    w2 = torch.tensor([[0.0, 2.0], [5.0, 0.0]])
    magnitude, direction = variation(w1, w2)
    # magnitudes 5 -> 5 and 1 -> 2: mean |diff| = (0 + 1) / 2
    assert magnitude == pytest.approx(0.5)
    # cos((3,4),(0,5)) = 20/25 = 0.8, cos((1,0),(2,0)) = 1: mean(1 - cos) = (0.2 + 0) / 2
    assert direction == pytest.approx(0.1)
    # a zero column (LoRA's B at start) counts as orthogonal; an opposite one as 2
    assert variation(torch.zeros(2, 1), torch.ones(2, 1)) == pytest.approx((2**0.5, 1.0))
    assert variation(torch.ones(2, 1), -torch.ones(2, 1))[1] == pytest.approx(2.0)
    name = "backbone.base_model.model.encoder.layer.3.attention.self.value.lora_B.default.weight"
    out = lora_variations({name: w1, "head.weight": w1}, {name: w2, "head.weight": w2})
    assert out == {"3.value.B": [pytest.approx(0.5), pytest.approx(0.1)]}
