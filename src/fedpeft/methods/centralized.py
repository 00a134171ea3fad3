"""Centralized: all clients' training data pooled into one model (upper reference).

The runner gives this method a single client holding the pooled data; a round takes
as many optimizer steps as the federated round it stands beside would take in all.
"""

from typing import Literal

from pydantic import Field, field_validator

from fedpeft.methods.base import MethodConfig
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import AdapterSpec, LoraSpec, Trainable


class CentralizedConfig(MethodConfig):
    """One model trained on the pooled data."""

    name: Literal["centralized"] = "centralized"
    trainable: Trainable = Field("lora", description="What the pooled model trains.")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)

    @field_validator("head")
    @classmethod
    def _one_head(cls, head: str) -> str:
        if head != "shared":
            raise ValueError("method.head must be 'shared' for centralized: one pooled model has one head")
        return head


class Centralized(FedAvgPeft):
    name = "centralized"
    config_cls = CentralizedConfig
    pooled = True
    dora = True
    communicates = False  # the data, not the model, was moved: no per-round traffic
