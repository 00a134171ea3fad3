"""FedAP: FedAvg over Houlsby adapters (after attention and after FFN of every layer)."""

from typing import Literal

from pydantic import Field

from fedpeft.methods.base import MethodConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import AdapterSpec


class FedAPConfig(MethodConfig):
    """Houlsby adapters under FedAvg. Paper: FeDeRA (Yan et al., 2024), sec. 5.1 baselines."""

    name: Literal["fedap"] = "fedap"
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)


class FedAP(FedAvgPeft):
    name = "fedap"
    config_cls = FedAPConfig
    kind = "adapter"
