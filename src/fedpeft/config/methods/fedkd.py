"""FedKD: a local mentor and a shared mentee that teach each other, with SVD-compressed updates.

The options of ``method.name: fedkd``; the method itself is :mod:`fedpeft.methods.fedkd`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("fedkd", order=200)
class FedKDConfig(MethodConfig):
    """Local mentor + shared mentee, mutual distillation, SVD-compressed updates.
    Paper: FedKD (Wu et al., 2022)."""

    name: Literal["fedkd"] = "fedkd"
    lora: LoraSpec = Field(
        default_factory=LoraSpec, description="The mentee (shared): rank r, alpha, targets, dropout."
    )
    mentor_rank: int = Field(32, ge=1, description="Rank of the mentor (personal), on the mentee's targets.")
    mentor_alpha: float | None = Field(
        None,
        gt=0,
        description="The mentor's LoRA alpha (None: the mentee's scale alpha / r, i.e. alpha r_m / r).",
    )
    energy: float = Field(
        0.95,
        gt=0,
        le=1,
        description="T: the share of an update's energy (sum of s^2) its SVD keeps; T_start.",
    )
    energy_end: float | None = Field(
        0.98,
        gt=0,
        le=1,
        description="T_end: T rises linearly from energy to energy_end over train.rounds (None: T fixed).",
    )
    compress_downlink: bool = Field(
        True, description="Send the global update SVD-compressed too (clients that trained last round)."
    )
    hidden_distillation: bool = Field(
        True, description="Distil every transformer layer's hidden states (MSE) besides the predictions (KL)."
    )
    stop_gradient: bool = Field(
        True,
        description="Each model learns from the other's outputs as targets, the adaptive weight detached "
        "(false: the authors' code, the summed loss with nothing detached).",
    )
    personal_model: Literal["mentor", "mentee"] = Field(
        "mentor", description="The model a client predicts with; the other is scored as local_<other>."
    )
