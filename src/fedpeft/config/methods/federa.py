"""FeDeRA: federated LoRA initialised from the SVD of the pretrained weights.

The options of ``method.name: federa``; the method itself is :mod:`fedpeft.methods.federa`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("federa", order=80)
class FeDeRAConfig(MethodConfig):
    """LoRA with SVD initialisation under FedAvg. Paper: FeDeRA (Yan et al., 2024)."""

    name: Literal["federa"] = "federa"
    lora: LoraSpec = Field(
        default_factory=lambda: LoraSpec(r=8, alpha=8),
        description="Rank r and beta (= lora.alpha); the paper uses beta = r, i.e. scale 1.",
    )
