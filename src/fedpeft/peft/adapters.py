"""Houlsby bottleneck adapters (Houlsby et al., 2019), the FedAP baseline's module.

An adapter sits on the output of a sub-layer's projection, before its residual
and layer norm: ``h -> h + up(act(down(h)))``. With ``up`` zero-initialised the
adapted model starts exactly at the pretrained one. Houlsby places two per
layer: after the attention output projection and after the feed-forward output
projection. HF PEFT has no Houlsby adapter, so it is written here.
"""

from __future__ import annotations

import re

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

# Sites per architecture (model_type -> regexes over module names).
HOULSBY_SITES: dict[str, tuple[str, ...]] = {
    "bert": (r"layer\.\d+\.attention\.output\.dense$", r"layer\.\d+\.output\.dense$"),
    "llama": (r"layers\.\d+\.self_attn\.o_proj$", r"layers\.\d+\.mlp\.down_proj$"),
}


class AdapterSpec(BaseModel):
    """Options of a Houlsby adapter."""

    model_config = ConfigDict(extra="forbid")

    bottleneck: int = Field(64, ge=1, description="Width r of the bottleneck.")
    activation: str = Field("gelu", pattern="^(gelu|relu|tanh)$")
    sites: list[str] | None = Field(
        None, description="Regexes of module names to adapt (None: Houlsby sites of the backbone)."
    )


class Adapter(nn.Module):
    """``h + up(act(down(h)))`` with ``up`` starting at zero."""

    def __init__(self, dim: int, bottleneck: int, activation: str = "gelu"):
        super().__init__()
        self.down = nn.Linear(dim, bottleneck)
        self.up = nn.Linear(bottleneck, dim)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "tanh": nn.Tanh()}[activation]
        nn.init.normal_(self.down.weight, std=1e-2)
        nn.init.zeros_(self.down.bias)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(self.act(self.down(h)))


class AdaptedLinear(nn.Module):
    """A frozen linear projection followed by an adapter on its output."""

    def __init__(self, base: nn.Linear, adapter: Adapter):
        super().__init__()
        self.base = base
        self.adapter = adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.base(x))


def add_adapters(model: nn.Module, spec: AdapterSpec, model_type: str) -> list[str]:
    """Insert adapters at the configured sites of ``model``; returns the adapted module names."""
    patterns = spec.sites or HOULSBY_SITES.get(model_type)
    if not patterns:
        raise ValueError(
            f"method.adapter.sites: no default Houlsby sites for model type {model_type!r}; "
            "give regexes of the attention-output and FFN-output projections"
        )
    regexes = [re.compile(p) for p in patterns]
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and any(r.search(name) for r in regexes)
    ]
    if not targets:
        raise ValueError(f"method.adapter.sites: no linear module matches {list(patterns)}")
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        adapter = Adapter(linear.out_features, spec.bottleneck, spec.activation)
        adapter.to(dtype=linear.weight.dtype)
        setattr(parent, child, AdaptedLinear(linear, adapter))
    return [name for name, _ in targets]
