"""FedFT: FedAvg with every parameter trainable and shared (full fine-tuning baseline)."""

from typing import Literal

from fedpeft.methods.base import MethodConfig
from fedpeft.methods.fedavg import FedAvgPeft


class FedFTConfig(MethodConfig):
    """Full fine-tuning under FedAvg. Paper: FeDeRA (Yan et al., 2024), sec. 5.1 baselines."""

    name: Literal["fedft"] = "fedft"


class FedFT(FedAvgPeft):
    name = "fedft"
    config_cls = FedFTConfig
    kind = "full"
