"""FedLR (HOMLoRA): FedAvg over LoRA on query and value, the same rank on every client.

The options of ``method.name: fedlr``; the method itself is :mod:`fedpeft.methods.fedlr`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("fedlr", order=40)
class FedLRConfig(MethodConfig):
    """LoRA under FedAvg. Paper: FeDeRA (Yan et al., 2024), sec. 5.1; HOMLoRA in PF2LoRA."""

    name: Literal["fedlr"] = "fedlr"
    lora: LoraSpec = Field(default_factory=LoraSpec)
