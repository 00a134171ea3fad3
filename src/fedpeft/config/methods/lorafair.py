"""LoRA-FAIR: FedAvg of LoRA's ``A`` and ``B`` plus a server-side correction of ``B``
that brings ``(B_bar + dB) A_bar`` nearest to the clients' mean update.

The options of ``method.name: lorafair``; the method itself is :mod:`fedpeft.methods.lorafair`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("lorafair", order=280)
class LoRAFAIRConfig(MethodConfig):
    """FedAvg of LoRA with the server's correction of ``B``. Paper: LoRA-FAIR (Bian et al.,
    ICCV 2025)."""

    name: Literal["lorafair"] = "lorafair"
    lora: LoraSpec = Field(default_factory=LoraSpec)
    similarity: Literal["cosine", "frobenius"] = Field(
        "cosine",
        description="The distance of (B_bar + dB) A_bar to the mean update: 1 - cosine (the paper's), or "
        "the squared Frobenius norm (a ridge regression, solved in closed form).",
    )
    lam: float = Field(0.01, ge=0, description="lambda, the weight of ||dB||_F^2 (the paper's 0.01).")
    max_iter: int = Field(100, ge=1, description="similarity cosine: L-BFGS iterations at most, per module.")
