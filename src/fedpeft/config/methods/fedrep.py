"""FedRep: a shared representation and a personal head, trained one after the other.

The options of ``method.name: fedrep``; the method itself is :mod:`fedpeft.methods.fedrep`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec, LoraSpec, Trainable


@register_method_config("fedrep", order=170)
class FedRepConfig(MethodConfig):
    """Shared body, personal head, trained head first then body. Paper: FedRep (Collins et al., 2021)."""

    name: Literal["fedrep"] = "fedrep"
    head: Literal["personal"] = Field(
        "personal", description="Always personal: FedRep's head never leaves the client."
    )
    trainable: Trainable = Field("lora", description="The shared body: what the body phase trains.")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
    head_epochs: int = Field(10, ge=1, description="Epochs of the head phase (body frozen) each round.")
    head_steps: int | None = Field(
        None, ge=1, description="Steps of the head phase each round (overrides head_epochs)."
    )
