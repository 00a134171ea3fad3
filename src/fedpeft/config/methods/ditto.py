"""Ditto: a global model by FedAvg and a personal model pulled towards it.

The options of ``method.name: ditto``; the method itself is :mod:`fedpeft.methods.ditto`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec, LoraSpec, Trainable


@register_method_config("ditto", order=150)
class DittoConfig(MethodConfig):
    """Global model by FedAvg + a personal model regularised towards it. Paper: Ditto (Li et al., 2021)."""

    name: Literal["ditto"] = "ditto"
    trainable: Trainable = Field("lora", description="What both models train (the head always).")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
    lam: float = Field(
        1.0, ge=0, description="lambda: v minimises F_i(v) + lambda/2 ||v - w^t||^2 (0: v trains alone)."
    )
    personal_init: Literal["initial", "received"] = Field(
        "initial",
        description="Where the personal model v starts: the initial model w^0 (the paper), or the first "
        "global model the client receives.",
    )
