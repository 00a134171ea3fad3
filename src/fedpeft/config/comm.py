"""The ``comm`` section: how each direction's tensors are compressed on the network."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from fedpeft.config.common import Strict


class CodecConfig(BaseModel):
    """How one direction's tensors cross the network (``fedpeft.engines.compress``)."""

    model_config = Strict

    codec: Literal["none", "fp16", "bf16", "int8", "nf4", "topk", "randk"] = Field(
        "none",
        description="none: as they are; fp16, bf16: each value rounded; int8: blockwise absmax 8-bit; "
        "nf4: blockwise 4-bit NormalFloat; topk: the largest values with their positions; randk: values "
        "at positions drawn from a seed both ends know (the uplink only).",
    )
    block: Literal[64, 128, 256, 512, 1024, 2048, 4096] = Field(
        64, description="int8, nf4: values per block (one float32 absmax each)."
    )
    fraction: float = Field(
        0.01, gt=0, le=1, description="topk, randk: the share of each tensor's values sent."
    )
    error_feedback: bool | None = Field(
        None,
        description="The uplink carries what compression left out into the next round (a residual kept "
        "on the client); default: on for topk and randk, off otherwise.",
    )

    @model_validator(mode="before")
    @classmethod
    def _codec_alone(cls, data: Any) -> Any:
        return {"codec": data} if isinstance(data, str) else data


class CommConfig(BaseModel):
    """Compressed messages: the uplink's update and the downlink's tensors."""

    model_config = Strict

    uplink: CodecConfig = CodecConfig()
    downlink: CodecConfig = CodecConfig()

    @model_validator(mode="after")
    def _downlink_values(self) -> CommConfig:
        if self.downlink.codec in ("topk", "randk"):
            raise ValueError(
                f"comm.downlink {self.downlink.codec}: a sparsifier needs a reference both ends hold, and a "
                "client that missed rounds holds none; use fp16, bf16, int8 or nf4 on the downlink"
            )
        if self.downlink.error_feedback:
            raise ValueError("comm.downlink.error_feedback: the downlink sends values, not updates")
        return self
