"""FedAMP: federated attentive message passing (a personalised baseline of FDLoRA).

The options of ``method.name: fedamp``; the method itself is :mod:`fedpeft.methods.fedamp`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import AdapterSpec, LoraSpec, Trainable


@register_method_config("fedamp", order=190)
class FedAMPConfig(MethodConfig):
    """Personalised cloud models by attentive message passing. Paper: FedAMP (Huang et al., 2021)."""

    name: Literal["fedamp"] = "fedamp"
    trainable: Trainable = Field("lora", description="What each client's model w_i trains (the head always).")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
    alpha_k: float = Field(
        1.0,
        gt=0,
        description="alpha_k, step size of the message-passing step: xi_ij = alpha_k A'(||w_i - w_j||^2); "
        "the proximal weight is lam / (2 alpha_k).",
    )
    sigma: float = Field(
        10.0,
        gt=0,
        description="sigma of A(x) = 1 - exp(-x / sigma): the squared distance at which attention fades; "
        "xi_ii >= 0 for any distances while alpha_k (uploaded clients - 1) / sigma <= 1.",
    )
    lam: float = Field(
        1.0, ge=0, description="lambda: the local objective is F_i(w) + lam / (2 alpha_k) ||w - u_i||^2."
    )
