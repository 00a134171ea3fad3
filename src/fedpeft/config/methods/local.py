"""Local-only: every client trains alone; nothing is sent either way (lower reference).

The options of ``method.name: local``; the method itself is :mod:`fedpeft.methods.local`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec, LoraSpec, Trainable


@register_method_config("local", order=210)
class LocalConfig(MethodConfig):
    """Each client fine-tunes its own copy of the trainable tensors."""

    name: Literal["local"] = "local"
    trainable: Trainable = Field("lora", description="What each client trains.")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
