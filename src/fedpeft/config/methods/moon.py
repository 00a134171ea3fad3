"""MOON: model-contrastive federated learning (FedAvg with a representation-level loss).

The options of ``method.name: moon``; the method itself is :mod:`fedpeft.methods.moon`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec, LoraSpec, Trainable


@register_method_config("moon", order=160)
class MOONConfig(MethodConfig):
    """FedAvg with a model-contrastive loss. Paper: MOON (Li, He, Song, CVPR 2021)."""

    name: Literal["moon"] = "moon"
    trainable: Trainable = Field("lora", description="What each client trains (the head always).")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
    mu: float = Field(1.0, ge=0, description="Weight of the model-contrastive loss (0: FedAvg).")
    tau: float = Field(0.5, gt=0, description="Temperature of the model-contrastive loss.")
