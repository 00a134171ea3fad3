"""FedBF: FedAvg over the bias terms and the head (BitFit, Ben Zaken et al., 2022)."""

from typing import Literal

from fedpeft.methods.base import MethodConfig
from fedpeft.methods.fedavg import FedAvgPeft


class FedBFConfig(MethodConfig):
    """BitFit under FedAvg. Paper: FeDeRA (Yan et al., 2024), sec. 5.1 baselines."""

    name: Literal["fedbf"] = "fedbf"


class FedBF(FedAvgPeft):
    name = "fedbf"
    config_cls = FedBFConfig
    kind = "bitfit"
