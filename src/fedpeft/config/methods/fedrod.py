"""FedRoD: a generic model trained with a balanced loss, plus a personal head on top.

The options of ``method.name: fedrod``; the method itself is :mod:`fedpeft.methods.fedrod`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec, LoraSpec, Trainable


@register_method_config("fedrod", order=180)
class FedRoDConfig(MethodConfig):
    """Generic model (balanced softmax) + personal head. Paper: FedRoD (Chen & Chao, ICLR 2022)."""

    name: Literal["fedrod"] = "fedrod"
    trainable: Trainable = Field("lora", description="The body of the generic model.")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
    prior_floor: float = Field(
        0.1,
        gt=0,
        description="Label count given to a class absent from a client's training data in its prior "
        "(balanced softmax takes log pi_c).",
    )
