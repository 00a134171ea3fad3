"""FedFT: FedAvg with every parameter trainable and shared (full fine-tuning baseline)."""

from fedpeft.config.methods.fedft import FedFTConfig
from fedpeft.methods.fedavg import FedAvgPeft


class FedFT(FedAvgPeft):
    name = "fedft"
    config_cls = FedFTConfig
    kind = "full"
