"""Compacter under FedAvg: Houlsby adapters with low-rank PHM projections (+ head).

The options of ``method.name: compacter``; the method itself is :mod:`fedpeft.methods.compacter`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import CompacterSpec


@register_method_config("compacter", order=60)
class CompacterConfig(MethodConfig):
    """Compacter adapters under FedAvg. Paper: Karimi Mahabadi et al. (2021), a C2A baseline."""

    name: Literal["compacter"] = "compacter"
    adapter: CompacterSpec = Field(default_factory=CompacterSpec)
