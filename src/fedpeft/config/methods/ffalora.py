"""FFA-LoRA: federated LoRA with ``A`` frozen at its random initialisation.

The options of ``method.name: ffalora``; the method itself is :mod:`fedpeft.methods.ffalora`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("ffalora", order=230)
class FFALoRAConfig(MethodConfig):
    """LoRA with ``A`` frozen, ``B`` trained and averaged. Paper: FFA-LoRA (Sun et al., ICLR 2024)."""

    name: Literal["ffalora"] = "ffalora"
    lora: LoraSpec = Field(default_factory=LoraSpec)
