"""FedAP: FedAvg over Houlsby adapters (after attention and after FFN of every layer)."""

from fedpeft.config.methods.fedap import FedAPConfig
from fedpeft.methods.fedavg import FedAvgPeft


class FedAP(FedAvgPeft):
    name = "fedap"
    config_cls = FedAPConfig
    kind = "adapter"
