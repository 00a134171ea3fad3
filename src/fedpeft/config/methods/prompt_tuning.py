"""Prompt tuning under FedAvg: a soft prompt (+ head) trained and averaged.

The options of ``method.name: prompt_tuning``; the method itself is :mod:`fedpeft.methods.prompt_tuning`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedpeft.config.methods.base import MethodConfig
from fedpeft.config.methods.registry import register_method_config
from fedpeft.config.methods.specs import PromptSpec


@register_method_config("prompt_tuning", order=50)
class PromptTuningConfig(MethodConfig):
    """A soft prompt under FedAvg. Paper: Lester et al. (2021), a C2A baseline."""

    name: Literal["prompt_tuning"] = "prompt_tuning"
    prompt: PromptSpec = Field(default_factory=PromptSpec)
