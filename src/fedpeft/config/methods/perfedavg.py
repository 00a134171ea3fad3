"""Per-FedAvg-LoRA: model-agnostic meta-learning (MAML) over the LoRA adapter.

The options of ``method.name: perfedavg``; the method itself is :mod:`fedpeft.methods.perfedavg`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("perfedavg", order=100)
class PerFedAvgConfig(MethodConfig):
    """MAML over LoRA under FedAvg. Paper: Per-FedAvg (Fallah et al., 2020), PF2LoRA baselines."""

    name: Literal["perfedavg"] = "perfedavg"
    lora: LoraSpec = Field(default_factory=LoraSpec)
    order: Literal[1, 2] = Field(1, description="1: first-order MAML; 2: through the inner step (HVP).")
    inner_lr: float = Field(0.3, gt=0, description="alpha, the adaptation step size (SGD).")
    split_batch: bool = Field(
        False,
        description="False: D1 and D2 are two batches of train.batch_size (the paper; twice the "
        "examples per step of other methods); True: the two halves of one batch (equal budgets).",
    )
