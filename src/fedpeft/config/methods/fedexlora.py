"""FedEx-LoRA: FedAvg of LoRA's ``A`` and ``B``, made exact by folding the residual into
the frozen weights.

The options of ``method.name: fedexlora``; the method itself is :mod:`fedpeft.methods.fedexlora`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("fedexlora", order=260)
class FedExLoRAConfig(MethodConfig):
    """FedAvg of LoRA plus the residual folded into the frozen weights. Paper: FedEx-LoRA
    (Singhal et al., ACL 2025)."""

    name: Literal["fedexlora"] = "fedexlora"
    lora: LoraSpec = Field(default_factory=LoraSpec)
