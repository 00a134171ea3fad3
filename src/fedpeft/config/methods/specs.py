"""The options of fedpeft's trainable modules (:mod:`fedpeft.peft`): LoRA, Houlsby adapters and
their AdaMix and Compacter variants, soft prompts, C2A's hypernetwork; shared by the
methods' configs, which hold them under ``method.lora``, ``method.adapter``, ...
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Trainable = Literal["full", "bitfit", "adapter", "lora"]


class LoraSpec(BaseModel):
    """Options of a LoRA module (Hu et al., 2022)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1, description="Rank r of B A.")
    alpha: float = Field(16.0, gt=0, description="Scale numerator: the update is (alpha / r) B A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA branch input.")
    use_dora: bool = Field(
        False,
        description="DoRA (Liu et al., ICML 2024; HF PEFT's): each adapted weight as a trained magnitude "
        "per output times the direction of W0 + s B A; for the LoRA methods it composes with (fedlr, "
        "federa, ffalora, fedsalora, rolora, lorafair, flexlora, hetlora, local, centralized; any other "
        "refuses it, saying why).",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["query", "value"],
        description="Module names to adapt; [query, value] (the papers'): the attention's query and "
        "value projections in every known family (q_proj/v_proj, Phi-3's qkv_proj, ...); [all-linear]: "
        "every linear layer.",
    )


class AdapterSpec(BaseModel):
    """Options of a Houlsby adapter."""

    model_config = ConfigDict(extra="forbid")

    bottleneck: int = Field(64, ge=1, description="Width r of the bottleneck.")
    activation: str = Field("gelu", pattern="^(gelu|relu|tanh)$")
    sites: list[str] | None = Field(
        None, description="Regexes of module names to adapt (None: Houlsby sites of the backbone)."
    )


class AdaMixSpec(AdapterSpec):
    """Options of AdaMix adapters (the Houlsby options plus the mixture's)."""

    bottleneck: int = Field(16, ge=1, description="Width r of each expert's bottleneck (C2A's adapters: 16).")
    experts: int = Field(4, ge=1, description="Number M of experts per projection and site (AdaMix: 4).")
    share_down: bool = Field(False, description="One down-projection for all experts (no routing there).")
    share_up: bool = Field(
        False, description="One up-projection for all experts (AdaMix's released BERT/RoBERTa recipe)."
    )


class CompacterSpec(AdapterSpec):
    """Options of Compacter adapters (the Houlsby options plus the PHM ones)."""

    bottleneck: int = Field(
        16, ge=1, description="Width r of the bottleneck (C2A's adapters: 16); a multiple of n."
    )
    n: int = Field(4, ge=1, description="Number n of Kronecker products (Compacter: 4); divides d and r.")
    rank: int = Field(1, ge=1, description="Rank k of each fast weight B_i = s_i t_i^T (Compacter: 1).")
    rule_init_std: float = Field(
        1e-4, gt=0, description="Standard deviation of the shared A_i at the start (reference code: 1e-4)."
    )


class PromptSpec(BaseModel):
    """Options of a soft prompt."""

    model_config = ConfigDict(extra="forbid")

    num_virtual_tokens: int = Field(
        20,
        ge=1,
        description="Number P of virtual tokens. C2A does not state it; its parameter share for prompt "
        "tuning (0.024 % of DistilBERT's 66M) is 20 x 768 values.",
    )
    init: Literal["sample_vocab", "uniform"] = Field(
        "sample_vocab",
        description="sample_vocab: each virtual token starts as the embedding of a random vocabulary "
        "token (HF PEFT's SAMPLE_VOCAB; Lester et al. sample from the 5,000 commonest tokens); "
        "uniform: U(-0.5, 0.5), Lester et al.'s random initialisation.",
    )


class HyperSpec(BaseModel):
    """Options of C2A's hypernetwork (paper defaults: t 8, s 64, r 16)."""

    model_config = ConfigDict(extra="forbid")

    embedding_dim: int = Field(8, ge=1, description="t, the size of the client embeddings.")
    factor_dim: int = Field(64, ge=1, description="s, the latent factor of the factorised hypernetwork.")
    label_embedding: bool = Field(True, description="Use the label embedding L (ablation: off).")
    context_embedding: bool = Field(True, description="Use the context embeddings F_l (ablation: off).")
    factorise: bool = Field(True, description="W_U = F_U S_U (ablation: one (d r) x t matrix).")
    normalise: bool = Field(True, description="Divide W_U by its Frobenius norm (ablation: off).")
    # the authors' code (yeachan-kr/c2a, blocks.py) where it departs from the paper's equations
    normalise_scope: Literal["matrix", "slice"] = Field(
        "matrix",
        description="'matrix': norm_F of the whole W_U (the paper); 'slice': each of its t "
        "(d x r) slices to unit norm (the authors' code).",
    )
    generator_bias: bool = Field(
        False,
        description="A zero-initialised (d x r) bias added to every slice of W_U before "
        "normalising (the authors' code; the paper has none).",
    )
    tie: Literal["transpose", "view"] = Field(
        "transpose",
        description="The down-projection: U^T (the paper) or U's entries read as an "
        "(r x d) matrix (the authors' code).",
    )
    adapter_bias: bool = Field(
        False, description="Two shared, zero-initialised adapter biases, r and d (the authors' code)."
    )
    context_pool: Literal["max", "mean"] = Field(
        "max",
        description="Pooling of the examples' contexts over the batch: max (the paper's "
        "equation 4) or mean (the authors' code).",
    )
