"""AdaMix adapters (Wang et al., EMNLP 2022): a mixture of adapter experts per site.

A site holds ``M`` down-projection experts and ``M`` up-projection experts
(:class:`ExpertLinear`: weights ``(M, out, in)``, biases ``(M, out)``). Which experts a
forward pass uses is the module's *mix*, a buffer of ``M`` weights per projection: the
projection applied is ``sum_m mix[m] W_m`` (and the same for the bias). A one-hot mix
routes through one expert (training); the uniform mix, the default the modules hold,
is the average of the experts' weights (inference: AdaMix's merged adapter). A
training step passes its routing in as mixes through ``functional_call`` (buffers, like
parameters, are replaced for the call), so the draw is data of the step, not global
random state, and a cohort of clients routes each its own way under ``vmap``.

``share_down`` / ``share_up`` keep a single expert for that projection (AdaMix's
"adaptation module sharing"; its released BERT recipe shares the up-projection).
Initialisation, as AdaMix's code (``deepcopy`` of one projection): every expert starts
as the same copy, down ``N(0, 0.01^2)``, up exactly 0, so the model starts as the
pretrained one; the routing makes them differ.
"""

from __future__ import annotations

import torch
from torch import nn

from fedpeft.config.methods.specs import AdaMixSpec
from fedpeft.peft.adapters import add_adapters


class ExpertLinear(nn.Module):
    """``M`` linear experts ``(in -> out)`` applied as their ``mix``-weighted combination."""

    def __init__(self, experts: int, in_features: int, out_features: int, zero: bool = False):
        super().__init__()
        one = torch.zeros(out_features, in_features)  # one projection, copied to every expert
        if not zero:
            nn.init.normal_(one, std=1e-2)
        self.weight = nn.Parameter(one.expand(experts, -1, -1).clone())  # (M, out, in), identical copies
        self.bias = nn.Parameter(torch.zeros(experts, out_features))
        self.register_buffer("mix", torch.full((experts,), 1.0 / experts), persistent=False)

    @property
    def experts(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = self.mix.to(self.weight.dtype)
        weight = torch.einsum("m,moi->oi", mix, self.weight)
        return nn.functional.linear(x, weight.to(x.dtype), (mix @ self.bias).to(x.dtype))


class AdaMixAdapter(nn.Module):
    """``h + up(act(down(h)))`` with expert mixtures for ``down`` and ``up``."""

    def __init__(self, dim: int, bottleneck: int, activation: str, spec: AdaMixSpec):
        super().__init__()
        self.down = ExpertLinear(1 if spec.share_down else spec.experts, dim, bottleneck)
        self.up = ExpertLinear(1 if spec.share_up else spec.experts, bottleneck, dim, zero=True)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "tanh": nn.Tanh()}[activation]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(self.act(self.down(h)))


def add_adamix(backbone: nn.Module, spec: AdaMixSpec, model_type: str) -> list[str]:
    """Insert AdaMix adapters at ``spec``'s sites of ``backbone``; returns the adapted
    module names (each site's adapter is ``<name>.adapter``)."""

    def adamix(dim: int, bottleneck: int, activation: str) -> AdaMixAdapter:
        return AdaMixAdapter(dim, bottleneck, activation, spec)

    return add_adapters(backbone, spec, model_type, kind=adamix)


def routed_mixes(route: torch.Tensor, sites: list[str], down: int, up: int, dtype: torch.dtype) -> dict:
    """The one-hot mixes of one forward pass, by buffer name: ``route`` ``(S, 2)`` holds each
    site's down and up expert (``sites``: the adapter modules' names in the model). Built
    by comparison, not indexing, so that ``vmap`` batches it."""
    pick_down = (route[:, 0, None] == torch.arange(down, device=route.device)).to(dtype)  # (S, down)
    pick_up = (route[:, 1, None] == torch.arange(up, device=route.device)).to(dtype)  # (S, up)
    out = {}
    for s, site in enumerate(sites):
        out[f"{site}.down.mix"] = pick_down[s]
        out[f"{site}.up.mix"] = pick_up[s]
    return out
