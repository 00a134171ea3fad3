"""FedBF: FedAvg over the bias terms and the head (BitFit, Ben Zaken et al., 2022)."""

from fedpeft.config.methods.fedbf import FedBFConfig
from fedpeft.methods.fedavg import FedAvgPeft


class FedBF(FedAvgPeft):
    name = "fedbf"
    config_cls = FedBFConfig
    kind = "bitfit"
