"""Fed-SB: LoRA-SB's ``W0 + s B R A`` with ``B`` and ``A`` fixed and shared, only the
``r x r`` matrix ``R`` (and the head) trained and averaged: exact, ``r^2`` numbers per module.

The options of ``method.name: fedsb``; the method itself is :mod:`fedpeft.methods.fedsb`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


def lora_sb() -> LoraSpec:
    return LoraSpec(r=64, alpha=64)


@register_method_config("fedsb", order=300)
class FedSBConfig(MethodConfig):
    """Only LoRA-SB's ``r x r`` matrix trained and averaged. Paper: Fed-SB (Singhal et al., 2025)."""

    name: Literal["fedsb"] = "fedsb"
    lora: LoraSpec = Field(
        default_factory=lora_sb,
        description="rank r of B R A (default 64: R costs r^2 a module) and alpha (the authors: alpha = r).",
    )
    init_samples: int = Field(
        170, ge=1, description="Examples the setup round sums gradients over, all its clients together."
    )
    init_lr: float = Field(
        1e-4,
        gt=0,
        description="lr0 of the approximated first step -lr0 sign(G) (Adam's first step is lr sign(g)): a "
        "full fine-tuning rate, not R's (the authors: their schedule's first-step rate).",
    )
