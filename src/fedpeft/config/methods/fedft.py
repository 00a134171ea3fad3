"""FedFT: FedAvg with every parameter trainable and shared (full fine-tuning baseline).

The options of ``method.name: fedft``; the method itself is :mod:`fedpeft.methods.fedft`.
"""

from __future__ import annotations

from typing import Literal

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config


@register_method_config("fedft", order=10)
class FedFTConfig(MethodConfig):
    """Full fine-tuning under FedAvg. Paper: FeDeRA (Yan et al., 2024), sec. 5.1 baselines."""

    name: Literal["fedft"] = "fedft"
