"""FedBF: FedAvg over the bias terms and the head (BitFit, Ben Zaken et al., 2022)."""

from fedpeft.config.methods.fedbf import FedBFConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


@register_method(FedBFConfig)
class FedBF(FedAvgPeft):
    kind = "bitfit"
