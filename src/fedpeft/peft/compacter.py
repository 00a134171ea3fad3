"""Compacter adapters (Karimi Mahabadi et al., NeurIPS 2021): Houlsby adapters whose
projections are low-rank PHM (parameterised hypercomplex multiplication) layers.

A PHM layer's weight ``W`` (``out x in``) is a sum of ``n`` Kronecker products,
``W = sum_{i=1..n} A_i (x) B_i``, with ``A_i`` (``n x n``) the "slow" weights, one
tensor ``(n, n, n)`` shared by every PHM layer of the model (down and up projections of
every adapter), and ``B_i`` (``out/n x in/n``) the "fast" weights of the layer, of low
rank: ``B_i = s_i t_i^T``, ``s_i`` (``out/n x k``), ``t_i`` (``k x in/n``), ``k = 1``
in Compacter. So a layer holds ``k (out + in) + out`` numbers (its factors and its
bias), and the model ``n^3`` more, once.

The adapter is a Houlsby one, ``h + up(act(down(h)))``, at the Houlsby sites (after
the attention output and after the feed-forward output of every layer;
:data:`fedpeft.peft.adapters.HOULSBY_SITES`); ``sites`` restricted to the feed-forward
output gives Compacter++'s placement.

Initialisation, after the reference code's (``phm_c_init: normal``,
``hypercomplex_nonlinearity: glorot-uniform``): ``A ~ N(0, rule_init_std^2)``, the
factors Glorot-uniform, biases 0; and, as every fedpeft adapter, the up-projection's
``s_i`` at zero, so that ``up`` is exactly 0 and the model starts as the pretrained one
(the reference code starts near it, ``A`` being tiny).
"""

from __future__ import annotations

import torch
from torch import nn

from fedpeft.config.methods.specs import CompacterSpec
from fedpeft.peft.adapters import add_adapters


def phm_weight(rule: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``sum_i A_i (x) (s_i t_i^T)``: ``rule`` ``(n, n, n)`` (``A_i = rule[i]``), ``left``
    ``(n, out/n, k)``, ``right`` ``(n, k, in/n)`` -> ``W`` ``(out, in)``. The Kronecker
    product's entry ``[a p + b, c q + d]`` is ``A[a, c] B[b, d]``."""
    fast = left @ right  # (n, p, q): B_i
    n, p, q = fast.shape
    return torch.einsum("iac,ibd->abcd", rule, fast).reshape(n * p, n * q)


class PHMLinear(nn.Module):
    """``x W^T + b`` with ``W`` a low-rank PHM weight (:func:`phm_weight`); ``rule`` is the
    model's one shared ``A`` (the same :class:`~torch.nn.Parameter` in every layer)."""

    def __init__(self, in_features: int, out_features: int, rule: nn.Parameter, rank: int, zero=False):
        super().__init__()
        n = rule.shape[0]
        for what, size in (("input", in_features), ("output", out_features)):
            if size % n:
                raise ValueError(
                    f"method.adapter.n: a PHM layer's {what} size {size} is not a multiple of n = {n} "
                    "(n must divide the hidden size and the bottleneck)"
                )
        self.rule = rule
        self.left = nn.Parameter(torch.empty(n, out_features // n, rank))
        self.right = nn.Parameter(torch.empty(n, rank, in_features // n))
        self.bias = nn.Parameter(torch.zeros(out_features))
        for i in range(n):
            nn.init.xavier_uniform_(self.left.data[i])
            nn.init.xavier_uniform_(self.right.data[i])
        if zero:
            nn.init.zeros_(self.left)

    def weight(self) -> torch.Tensor:
        return phm_weight(self.rule, self.left, self.right)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight().to(x.dtype), self.bias.to(x.dtype))


class CompacterAdapter(nn.Module):
    """``h + up(act(down(h)))`` with PHM projections; ``up`` starts at exactly 0."""

    def __init__(self, dim: int, bottleneck: int, activation: str, rule: nn.Parameter, rank: int):
        super().__init__()
        self.down = PHMLinear(dim, bottleneck, rule, rank)
        self.up = PHMLinear(bottleneck, dim, rule, rank, zero=True)
        self.act = {"gelu": nn.GELU(), "relu": nn.ReLU(), "tanh": nn.Tanh()}[activation]

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(self.act(self.down(h)))


def add_compacter(backbone: nn.Module, spec: CompacterSpec, model_type: str) -> nn.Parameter:
    """Insert Compacter adapters at ``spec``'s sites of ``backbone``; returns the shared
    ``A`` (``(n, n, n)``), one parameter held by every PHM layer."""
    rule = nn.Parameter(torch.randn(spec.n, spec.n, spec.n) * spec.rule_init_std)

    def compacter(dim: int, bottleneck: int, activation: str) -> CompacterAdapter:
        return CompacterAdapter(dim, bottleneck, activation, rule, spec.rank)

    add_adapters(backbone, spec, model_type, kind=compacter)
    return rule
