"""Houlsby bottleneck adapters (Houlsby et al., 2019), the FedAP baseline's module.

An adapter sits on the output of a sub-layer's projection, before its residual
and layer norm: ``h -> h + up(act(down(h)))``. With ``up`` zero-initialised the
adapted model starts exactly at the pretrained one. Houlsby places two per
layer: after the attention output projection and after the feed-forward output
projection. HF PEFT has no Houlsby adapter, so it is written here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fedpeft.config.methods.specs import AdapterSpec

# Sites per architecture (model_type -> regexes over module names).
HOULSBY_SITES: dict[str, tuple[str, ...]] = {
    "bert": (r"layer\.\d+\.attention\.output\.dense$", r"layer\.\d+\.output\.dense$"),
    "llama": (r"layers\.\d+\.self_attn\.o_proj$", r"layers\.\d+\.mlp\.down_proj$"),
}


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
        # in h's dtype: a float32 adapter on a bfloat16 backbone leaves its stream bfloat16
        return h + self.up(self.act(self.down(h))).to(h.dtype)


class AdaptedLinear(nn.Module):
    """A frozen linear projection followed by an adapter on its output."""

    def __init__(self, base: nn.Linear, adapter: Adapter):
        super().__init__()
        self.base = base
        self.adapter = adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(self.base(x))


class AdapterPair(nn.Module):
    """FedMCP's two adapters at one site, a global one (``shared``, aggregated) and a
    private one, both reading the sub-layer output ``h``. ``mode`` picks what leaves
    the site: ``both`` the average of the two adapters' outputs,
    ``(g(h) + p(h)) / 2 = h + (up_g(..) + up_p(..)) / 2``; ``global`` or ``private`` one
    adapter's output alone.
    Set it for a forward pass with :func:`adapter_mode`."""

    MODES = ("both", "global", "private")

    def __init__(self, dim: int, bottleneck: int, activation: str = "gelu"):
        super().__init__()
        self.shared = Adapter(dim, bottleneck, activation)
        self.private = Adapter(dim, bottleneck, activation)
        self.mode = "both"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.mode == "global":
            return self.shared(h)
        if self.mode == "private":
            return self.private(h)
        return (self.shared(h) + self.private(h)) / 2


@contextmanager
def adapter_mode(model: nn.Module, mode: str) -> Iterator[None]:
    """Every :class:`AdapterPair` of ``model`` in ``mode`` for the duration (then ``both``)."""
    if mode not in AdapterPair.MODES:
        raise ValueError(f"adapter mode {mode!r}: expected one of {AdapterPair.MODES}")
    pairs = [m for m in model.modules() if isinstance(m, AdapterPair)]
    for pair in pairs:
        pair.mode = mode
    try:
        yield
    finally:
        for pair in pairs:
            pair.mode = "both"


def add_adapters(
    model: nn.Module, spec: AdapterSpec, model_type: str, kind: type[nn.Module] = Adapter
) -> list[str]:
    """Insert adapters (``kind``: one :class:`Adapter`, or an :class:`AdapterPair`) at the
    configured sites of ``model``; returns the adapted module names."""
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
        adapter = kind(linear.out_features, spec.bottleneck, spec.activation)
        # the projection's float type; float32 beside a quantised one (its weight is stored as integers)
        adapter.to(dtype=linear.weight.dtype if linear.weight.is_floating_point() else torch.float32)
        setattr(parent, child, AdaptedLinear(linear, adapter))
    return [name for name, _ in targets]
