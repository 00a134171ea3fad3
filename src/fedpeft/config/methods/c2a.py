"""C2A: Client-Customized Adaptation, adapters generated per client by a hypernetwork.

The options of ``method.name: c2a``; the method itself is :mod:`fedpeft.methods.c2a`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec, HyperSpec


@register_method_config("c2a", order=140)
class C2AConfig(MethodConfig):
    """Hypernetwork-generated Houlsby adapters under FedAvg. Paper: C2A (Kim et al., 2023)."""

    name: Literal["c2a"] = "c2a"
    hyper: HyperSpec = Field(default_factory=HyperSpec)
    adapter: AdapterSpec = Field(
        default_factory=lambda: AdapterSpec(bottleneck=16),
        description="Sites and rank r of the generated adapters (paper: r 16, GELU); the activation is GELU.",
    )
