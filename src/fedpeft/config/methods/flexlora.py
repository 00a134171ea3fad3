"""FlexLoRA: clients of any rank; the server averages their full updates ``B_k A_k`` and
hands each client the truncated SVD of that mean at its own rank.

The options of ``method.name: flexlora``; the method itself is :mod:`fedpeft.methods.flexlora`.
"""

from __future__ import annotations

from typing import Literal

from fedpeft.config.methods.lora_ranks import RankedLoraConfig
from fedpeft.config.methods.registry import register_method_config


@register_method_config("flexlora", order=270)
class FlexLoRAConfig(RankedLoraConfig):
    """Clients of any rank, the server's SVD of their mean update. Paper: FlexLoRA (Bai et
    al., NeurIPS 2024)."""

    name: Literal["flexlora"] = "flexlora"
