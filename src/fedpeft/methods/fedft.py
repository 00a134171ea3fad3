"""FedFT: FedAvg with every parameter trainable and shared (full fine-tuning baseline)."""

from fedpeft.config.methods.fedft import FedFTConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


@register_method(FedFTConfig)
class FedFT(FedAvgPeft):
    kind = "full"
