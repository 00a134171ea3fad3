"""FedSA-LoRA: LoRA's ``A`` shared and averaged, ``B`` personal.

The options of ``method.name: fedsalora``; the method itself is :mod:`fedpeft.methods.fedsalora`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("fedsalora", order=240)
class FedSALoRAConfig(MethodConfig):
    """``A`` averaged, ``B`` (and by default the head) per client. Paper: FedSA-LoRA (Guo et
    al., ICLR 2025)."""

    name: Literal["fedsalora"] = "fedsalora"
    head: Literal["shared", "personal"] = Field(
        "personal", description="The classifier per client (the authors' setting) or averaged with A."
    )
    lora: LoraSpec = Field(default_factory=LoraSpec)
