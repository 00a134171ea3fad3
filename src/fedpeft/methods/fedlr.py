"""FedLR (HOMLoRA): FedAvg over LoRA on query and value, the same rank on every client."""

from fedpeft.config.methods.fedlr import FedLRConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


@register_method(FedLRConfig)
class FedLR(FedAvgPeft):
    kind = "lora"
    refuses = {"dora": ""}
