"""PF2LoRA: two-level LoRA solved as a bilevel problem (personalised federated fine-tuning).

The options of ``method.name: pf2lora``; the method itself is :mod:`fedpeft.methods.pf2lora`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("pf2lora", order=90)
class PF2LoRAConfig(MethodConfig):
    """Common LoRA (shared) + client LoRA (personal), bilevel. Paper: PF2LoRA, Algorithm 1."""

    name: Literal["pf2lora"] = "pf2lora"
    lora: LoraSpec = Field(default_factory=LoraSpec, description="The common adapter (A, B).")
    client_rank: int = Field(2, ge=1, description="r2, rank of the client adapter (C_i, D_i).")
    client_alpha: float = Field(4.0, gt=0, description="alpha2: the client update is (alpha2/r2) D C.")
    lower_lr: float = Field(0.1, gt=0, description="eta_low, SGD step of the lower level.")
    bilevel: bool = Field(True, description="False: plain gradients for both adapters (ablation).")
    rank_tol: float = Field(
        0.01, gt=0, lt=1, description="Effective rank: singular values above rank_tol * the largest."
    )
