"""FedAP: FedAvg over Houlsby adapters (after attention and after FFN of every layer).

The options of ``method.name: fedap``; the method itself is :mod:`fedpeft.methods.fedap`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec


@register_method_config("fedap", order=30)
class FedAPConfig(MethodConfig):
    """Houlsby adapters under FedAvg. Paper: FeDeRA (Yan et al., 2024), sec. 5.1 baselines."""

    name: Literal["fedap"] = "fedap"
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
