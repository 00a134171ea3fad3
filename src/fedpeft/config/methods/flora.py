"""FLoRA: clients of any rank; the server stacks their LoRA factors, so that the product of
the stacks is exactly the weighted sum of the clients' updates; every client merges it
into its frozen weights and starts a fresh LoRA each round.

The options of ``method.name: flora``; the method itself is :mod:`fedpeft.methods.flora`.
"""

from __future__ import annotations

from typing import Literal

from fedpeft.config.methods.lora_ranks import RankedLoraConfig
from fedpeft.config.methods.registry import register_method_config


@register_method_config("flora", order=290)
class FLoRAConfig(RankedLoraConfig):
    """Stacked LoRA factors merged into the frozen weights each round, clients of any rank.
    Paper: FLoRA (Wang et al., NeurIPS 2024)."""

    name: Literal["flora"] = "flora"
