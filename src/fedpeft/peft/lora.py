"""LoRA via HF PEFT: ``h = W0 x + (alpha / r) B A x`` on the target projections.

Thin on purpose: HF PEFT's LoRA layer already implements the formula with
``A`` random (Kaiming-uniform) and ``B = 0``, so the model starts at the pretrained one.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class LoraSpec(BaseModel):
    """Options of a LoRA module (Hu et al., 2022)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1, description="Rank r of B A.")
    alpha: float = Field(16.0, gt=0, description="Scale numerator: the update is (alpha / r) B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch input.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["query", "value"],
        description="Module names to adapt (query/value as in the papers; q_proj/v_proj for Llama).",
    )


def default_targets(model_type: str, targets: list[str]) -> list[str]:
    """Map the papers' query/value names onto a decoder's q_proj/v_proj when needed."""
    if model_type in ("llama", "mistral", "qwen2") and targets == ["query", "value"]:
        return ["q_proj", "v_proj"]
    return targets


def add_lora(backbone: nn.Module, spec: LoraSpec) -> nn.Module:
    """The backbone wrapped as a ``peft.PeftModel`` with LoRA on ``spec.target_modules``."""
    from peft import LoraConfig, get_peft_model

    targets = default_targets(getattr(backbone.config, "model_type", ""), spec.target_modules)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets)
    try:
        return get_peft_model(backbone, config)
    except ValueError as err:
        raise ValueError(f"method.lora.target_modules {targets}: {err}") from err
