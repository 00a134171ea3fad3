"""``method.ranks``, the heterogeneous LoRA ranks of HETLoRA, FlexLoRA and FLoRA, and the
options FlexLoRA and FLoRA share (:class:`RankedLoraConfig`); what the ranks do:
:mod:`fedpeft.methods.lora_ranks`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.specs import LoraSpec


class RankDraw(BaseModel):
    """Each client's rank drawn at random, seeded (``uniform`` or ``choice``)."""

    model_config = ConfigDict(extra="forbid")

    uniform: tuple[int, int] | None = Field(None, description="[lo, hi]: a rank in lo..hi, uniformly.")
    choice: list[int] | None = Field(None, min_length=1, description="One of these ranks, uniformly.")
    seed: int = Field(0, ge=0, description="Seed of the draw (beside the experiment's seed).")

    @model_validator(mode="after")
    def _one_kind(self) -> RankDraw:
        if (self.uniform is None) == (self.choice is None):
            raise ValueError("give exactly one of uniform: [lo, hi] or choice: [r, ...]")
        if self.uniform is not None and not 1 <= self.uniform[0] <= self.uniform[1]:
            raise ValueError(f"uniform: {list(self.uniform)} is not [lo, hi] with 1 <= lo <= hi")
        return self

    def candidates(self) -> list[int]:
        return list(self.choice) if self.choice is not None else [self.uniform[0], self.uniform[1]]


#: ``method.ranks``: per-client ranks as a list (repeated over the clients), a seeded
#: draw, or None (every client at ``method.lora.r``)
LoraRanks = list[int] | RankDraw | None


def check_ranks(ranks: LoraRanks, r_max: int) -> None:
    """Refuse a rank outside ``1..r_max``, naming it (a pydantic validator calls this, so
    the error reaches the user as ``method.ranks...``)."""
    values = ranks.candidates() if isinstance(ranks, RankDraw) else list(ranks or [])
    if isinstance(ranks, list) and not ranks:
        raise ValueError("method.ranks: an empty list (give one rank per client, repeated over them)")
    for i, r in enumerate(values):
        if not 1 <= r <= r_max:
            raise ValueError(
                f"method.ranks: rank {r} (entry {i}) is outside 1..{r_max}; method.lora.r is the server's "
                f"r_max, the largest rank a client can have: raise it to at least {max(values)}"
            )


class RankedLoraConfig(MethodConfig):
    """The options of a LoRA method whose clients may train different ranks (FlexLoRA,
    FLoRA): ``lora.r`` is ``r_max`` and ``ranks`` each client's."""

    lora: LoraSpec = Field(default_factory=LoraSpec, description="lora.r is r_max, the largest rank.")
    ranks: LoraRanks = Field(
        None,
        description="The clients' ranks (a list repeated over the clients, or {uniform: [lo, hi]} / "
        "{choice: [...]} drawn per client); default: every client at lora.r.",
    )

    @model_validator(mode="after")
    def _ranks(self) -> RankedLoraConfig:
        check_ranks(self.ranks, self.lora.r)
        return self
