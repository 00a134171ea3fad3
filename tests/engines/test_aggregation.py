"""FedAvg aggregation is the exact size-weighted mean; byte accounting is numel * element size."""

import torch

from fedpeft.config import TrainConfig
from fedpeft.methods.base import FitResult, ServerState, tensor_bytes, weighted_mean
from fedpeft.methods.fedlr import FedLR, FedLRConfig


def test_weighted_mean_hand_computed():
    # Prepare
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.0]])}
    b = {"w": torch.tensor([4.0, -1.0]), "b": torch.tensor([[3.0]])}
    # Execute
    out = weighted_mean([a, b], [1, 2])
    # Assert: (1*[1,2] + 2*[4,-1]) / 3 = [3, 0]; (0 + 6) / 3 = 2
    assert torch.equal(out["w"], torch.tensor([3.0, 0.0]))
    assert torch.equal(out["b"], torch.tensor([[2.0]]))
    assert out["w"].dtype == torch.float32


def test_aggregate_weights_by_client_size():
    method = FedLR(FedLRConfig(), TrainConfig())
    results = [
        FitResult({"x": torch.tensor([10.0])}, {}, num_examples=30),
        FitResult({"x": torch.tensor([0.0])}, {}, num_examples=10),
        FitResult({"x": torch.tensor([2.0])}, {}, num_examples=60),
    ]
    server = method.aggregate(ServerState({"x": torch.tensor([5.0])}), results, rnd=1)
    expected = torch.tensor([(10 * 30 + 0 * 10 + 2 * 60) / 100], dtype=torch.float32)  # 4.2
    assert torch.equal(server.tensors["x"], expected)


def test_tensor_bytes():
    t = {
        "a": torch.zeros(3, 4),
        "b": torch.zeros(5, dtype=torch.float16),
        "c": torch.zeros(2, dtype=torch.int64),
    }
    assert tensor_bytes(t) == 3 * 4 * 4 + 5 * 2 + 2 * 8
    assert tensor_bytes({}) == 0
