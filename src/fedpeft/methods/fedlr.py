"""FedLR (HOMLoRA): FedAvg over LoRA on query and value, the same rank on every client."""

from fedpeft.config.methods.fedlr import FedLRConfig
from fedpeft.methods.fedavg import FedAvgPeft


class FedLR(FedAvgPeft):
    name = "fedlr"
    config_cls = FedLRConfig
    kind = "lora"
    refuses = {"dora": ""}
