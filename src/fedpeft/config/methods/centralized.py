"""Centralized: all clients' training data pooled into one model (upper reference).

The options of ``method.name: centralized``; the method itself is :mod:`fedpeft.methods.centralized`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec, LoraSpec, Trainable


@register_method_config("centralized", order=220)
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
