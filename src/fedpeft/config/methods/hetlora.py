"""HETLoRA: heterogeneous LoRA ranks across clients (a baseline of PF2LoRA).

The options of ``method.name: hetlora``; the method itself is :mod:`fedpeft.methods.hetlora`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.lora_ranks import LoraRanks, RankDraw, check_ranks
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import LoraSpec


@register_method_config("hetlora", order=110)
class HETLoRAConfig(MethodConfig):
    """Heterogeneous-rank LoRA. Paper: HETLoRA (Cho et al., 2024), PF2LoRA baselines."""

    name: Literal["hetlora"] = "hetlora"
    lora: LoraSpec = Field(default_factory=LoraSpec, description="lora.r is r_max, the server's rank.")
    r_min: int = Field(2, ge=1, description="Smallest client rank (and the floor of self-pruning).")
    rank_seed: int = Field(0, ge=0, description="Seed of the per-client rank draw.")
    ranks: LoraRanks = Field(
        None,
        description="The clients' ranks (fedpeft.methods.lora_ranks: a list repeated over the clients, or "
        "{uniform: [lo, hi]} / {choice: [...]} drawn per client); default: uniform in r_min..lora.r, "
        "seeded by rank_seed.",
    )
    gamma: float = Field(0.9, gt=0, lt=1, description="Sparsity factor: a prune keeps floor(gamma r_i).")
    penalty: float = Field(1e-3, ge=0, description="lambda of the rank-tail regulariser.")
    prune_rule: Literal["mean", "share"] = Field(
        "mean",
        description="mean: prune when the tail's mean component energy is under prune_ratio times the "
        "kept components' mean; share: when the tail holds under prune_ratio of the total energy.",
    )
    prune_ratio: float = Field(0.1, gt=0, lt=1, description="Threshold of the pruning rule.")
    personal_model: Literal["own", "global"] = Field(
        "own",
        description="The client model scored as personalised: its own last trained adapter (own), or "
        "the global adapter truncated to its rank (global); the other is reported as local_<other>.",
    )

    @model_validator(mode="after")
    def _ranks(self) -> HETLoRAConfig:
        if self.r_min > self.lora.r:
            raise ValueError(f"method.r_min: {self.r_min} exceeds r_max = method.lora.r = {self.lora.r}")
        check_ranks(self.ranks, self.lora.r)
        return self

    def rank_draw(self) -> LoraRanks:
        """``ranks``, or the paper's uniform draw in ``r_min..r_max`` when not given."""
        return (
            self.ranks
            if self.ranks is not None
            else RankDraw(uniform=(self.r_min, self.lora.r), seed=self.rank_seed)
        )
