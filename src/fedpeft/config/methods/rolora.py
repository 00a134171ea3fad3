"""RoLoRA: federated LoRA trained by alternating optimisation of ``B`` and ``A``.

The options of ``method.name: rolora``; the method itself is :mod:`fedpeft.methods.rolora`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("rolora", order=250)
class RoLoRAConfig(MethodConfig):
    """LoRA's ``B`` (odd rounds) and ``A`` (even rounds) trained and averaged in turn.
    Paper: RoLoRA (Chen et al., NeurIPS 2025)."""

    name: Literal["rolora"] = "rolora"
    lora: LoraSpec = Field(default_factory=LoraSpec)
