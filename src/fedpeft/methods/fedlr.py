"""FedLR (HOMLoRA): FedAvg over LoRA on query and value, the same rank on every client."""

from typing import Literal

from pydantic import Field

from fedpeft.methods.base import MethodConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import LoraSpec


class FedLRConfig(MethodConfig):
    """LoRA under FedAvg. Paper: FeDeRA (Yan et al., 2024), sec. 5.1; HOMLoRA in PF2LoRA."""

    name: Literal["fedlr"] = "fedlr"
    lora: LoraSpec = Field(default_factory=LoraSpec)


class FedLR(FedAvgPeft):
    dora = True
    name = "fedlr"
    config_cls = FedLRConfig
    kind = "lora"
