"""Centralized: all clients' training data pooled into one model (upper reference).

The runner gives this method a single client holding the pooled data; a round takes
as many optimizer steps as the federated round it stands beside would take in all.
"""

from typing import Literal

from pydantic import Field

from fedpeft.methods.base import MethodConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import AdapterSpec, LoraSpec, Trainable


class CentralizedConfig(MethodConfig):
    """One model trained on the pooled data."""

    name: Literal["centralized"] = "centralized"
    trainable: Trainable = Field("lora", description="What the pooled model trains.")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)


class Centralized(FedAvgPeft):
    name = "centralized"
    config_cls = CentralizedConfig
    pooled = True

    def trainable_kind(self) -> Trainable:
        return self.cfg.trainable
