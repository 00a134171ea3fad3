"""FDLoRA: a personal and a global LoRA per client, an outer optimiser, and AdaFusion.

The options of ``method.name: fdlora``; the method itself is :mod:`fedpeft.methods.fdlora`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("fdlora", order=130)
class FDLoRAConfig(MethodConfig):
    """Personal + global LoRA, outer Nesterov SGD, AdaFusion. Paper: FDLoRA, Algorithm 1."""

    name: Literal["fdlora"] = "fdlora"
    head: Literal["shared"] = Field(
        "shared",
        description="Each module has its own classifier: the global one is aggregated with the global "
        "LoRA, the personal one stays with the personal LoRA.",
    )
    lora: LoraSpec = Field(
        default_factory=LoraSpec, description="Both modules (the same rank: eq. 7 needs it)."
    )
    personal_steps: int | None = Field(
        None, ge=1, description="Stage 1: steps training the personal LoRA (None: one round's local steps)."
    )
    global_init: Literal["personal_mean", "fresh"] = Field(
        "personal_mean",
        description="theta_s^0: the mean of the clients' stage-1 personal LoRAs, uploaded in round 1 (the "
        "paper), or the initial LoRA (nothing personal is ever sent; round 1 trains both stages).",
    )
    sync_every: int | Literal["rounds", "never"] = Field(
        "rounds",
        description="H: a client's personal LoRA takes its trained global LoRA every H outer steps; "
        "'rounds': H = T (the last round), 'never': H = infinity (personal frozen after stage 1).",
    )
    outer_lr: float = Field(1e-3, gt=0, description="The outer optimiser's learning rate (paper: 1e-3).")
    outer_momentum: float = Field(0.5, ge=0, lt=1, description="Its momentum (paper: 0.5).")
    nesterov: bool = Field(True, description="Nesterov momentum (the paper's OuterOpt); False: heavy ball.")
    fusion: Literal["adafusion", "random", "average", "sum", "personal", "global"] = Field(
        "adafusion", description="How a client's two modules become its model (see the module docstring)."
    )
    fusion_examples: int = Field(5, ge=1, description="AdaFusion: the few local training examples scored.")
    fusion_budget: int = Field(
        5, ge=1, description="AdaFusion: loss evaluations of the gradient-free search."
    )
    fusion_l1: float = Field(0.05, ge=0, description="AdaFusion: lambda of the L1 penalty on w.")
    fusion_bound: float = Field(1.5, gt=0, description="AdaFusion: each weight is searched in [-b, b].")
    compare_fusions: bool = Field(False, description="Also score every other fusion (local_<fusion>).")
    average: Literal["uniform", "examples"] = Field(
        "uniform",
        description="How the server averages the clients' modules (theta_s^0 and Delta): uniform, "
        "mean_i over the round's clients (the paper's Algorithm 1), or weighted by their examples (FedAvg).",
    )
