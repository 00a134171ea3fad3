"""Options common to every method: ``method.name`` and ``method.head``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class MethodConfig(BaseModel):
    """Options common to every method; each method subclasses this with its own."""

    model_config = ConfigDict(extra="forbid")

    name: str
    head: Literal["shared", "personal"] = Field(
        "shared", description="Whether the classification head is aggregated or kept per client."
    )
