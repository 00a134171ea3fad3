"""AdaMix under FedAvg: a mixture of adapter experts per site, routed at random in
training, averaged for inference (+ head).

The options of ``method.name: adamix``; the method itself is :mod:`fedpeft.methods.adamix`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdaMixSpec


@register_method_config("adamix", order=70)
class AdaMixConfig(MethodConfig):
    """AdaMix adapters under FedAvg. Paper: Wang et al. (2022), a C2A baseline."""

    name: Literal["adamix"] = "adamix"
    adapter: AdaMixSpec = Field(default_factory=AdaMixSpec)
    consistency: float = Field(
        1.0,
        ge=0,
        description="Weight of the consistency term between two stochastically routed passes (AdaMix: 1 "
        "for classification); 0 drops the second pass.",
    )
