"""FedAP: FedAvg over Houlsby adapters (after attention and after FFN of every layer)."""

from fedpeft.config.methods.fedap import FedAPConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


@register_method(FedAPConfig)
class FedAP(FedAvgPeft):
    kind = "adapter"
