"""The ``eval`` section: when and how the model is scored, and how a causal LM generates."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from fedpeft.config.common import Strict


class GenerationConfig(BaseModel):
    """How a causal LM's responses are generated for scoring (Hugging Face ``generate``)."""

    model_config = Strict

    strategy: Literal["greedy", "beam", "sample"] = "greedy"
    num_beams: int = Field(4, ge=2, description="Beams (strategy: beam).")
    temperature: float = Field(0.7, gt=0, description="strategy: sample.")
    top_p: float = Field(0.9, gt=0, le=1, description="Nucleus sampling mass (strategy: sample).")
    seed: int = Field(0, ge=0, description="Seed of the sampling (strategy: sample).")
    max_new_tokens: int = Field(32, ge=1)
    samples: int | None = Field(
        32,
        ge=1,
        description="Examples generated per scored set (the global test set, each client's local test "
        "split): the first this many; perplexity uses all (None: generate for all).",
    )


class EvalConfig(BaseModel):
    """When and how the model is scored."""

    model_config = Strict

    every: int = Field(1, ge=1, description="Evaluate every this many rounds (and the last).")
    local: bool = Field(True, description="Also score each client on its local test split.")
    batch_size: int = Field(128, ge=1, description="Most rows in an evaluation batch.")
    batch_tokens: int = Field(
        16384,
        ge=1,
        description="Most tokens in an evaluation batch (its rows times its longest row; generation: "
        "prompts plus new tokens, times beams): a batch of long rows has fewer than eval.batch_size rows. "
        "The default keeps whole batches of 128 rows up to 128 tokens, and a causal LM's long rows within "
        "memory.",
    )
    generation: GenerationConfig = Field(default_factory=GenerationConfig, description="data.task causal_lm.")
    max_answer_tokens: int = Field(30, ge=1, description="extractive_qa: the longest answer span predicted.")
    drift: bool = Field(
        False,
        description="Client drift (the C2A paper's analysis, sec. 2.2 and 5.5): every round, the linear CKA "
        "between the logits of each sampled client's model after its local round and those of the global "
        "model it started the round from, on a fixed probe batch of the global test set; recorded as "
        "'drift' (per client and mean) and plotted in drift_vs_round.png. Classification only; skipped, "
        "with the reason recorded, for a method with no single global model.",
    )
    drift_probe: int = Field(
        64,
        ge=2,
        description="eval.drift: examples in the probe batch, drawn once (seeded by the experiment seed) "
        "from the global test set (all of it when it is smaller).",
    )
