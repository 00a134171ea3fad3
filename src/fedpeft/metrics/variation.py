"""Update variation between consecutive global states (FeDeRA paper, sec. 4.2).

For a matrix ``W`` with columns ``w^n``: magnitude ``m^n = ||w^n||_2`` and direction
``d^n = w^n / m^n``. Between two states ``W1, W2`` of the same matrix:

    magnitude variation  = mean_n |m1^n - m2^n|
    direction variation  = mean_n (1 - cos(d1^n, d2^n))

Columns are those of the tensor as stored by torch (``(out, in)``: one column per
input feature). A zero column has no direction; it counts as orthogonal to anything
(cosine 0), which is what LoRA's zero-initialised ``B`` gives in its first round.
"""

from __future__ import annotations

import re

import torch


def variation(w1: torch.Tensor, w2: torch.Tensor) -> tuple[float, float]:
    """``(magnitude variation, direction variation)`` between two states of one matrix."""
    if w1.shape != w2.shape or w1.dim() != 2:
        raise ValueError(f"need two matrices of one shape, got {tuple(w1.shape)} and {tuple(w2.shape)}")
    w1, w2 = w1.double(), w2.double()
    m1, m2 = w1.norm(dim=0), w2.norm(dim=0)
    magnitude = (m1 - m2).abs().mean()
    cos = torch.nn.functional.cosine_similarity(w1, w2, dim=0, eps=1e-30)
    cos = torch.where((m1 == 0) | (m2 == 0), torch.zeros_like(cos), cos)
    return float(magnitude), float((1 - cos).mean())


def short_name(name: str) -> str:
    """``...encoder.layer.3.attention.self.query.lora_A.default.weight`` -> ``3.query.A``;
    Fed-SB's ``...lora_B.default.latent.weight`` -> ``3.query.R`` and its fixed
    ``...lora_B.default.base.weight`` -> ``3.query.B``."""
    match = re.search(r"layers?\.(\d+)\..*?(\w+)\.lora_([AB])\.[^.]+\.(latent\.)?", name)
    if not match:
        return name
    layer, module, factor, latent = match.groups()
    return f"{layer}.{module}.{'R' if latent else factor}"


def lora_variations(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """``{layer.module.A|B: [magnitude, direction]}`` for every LoRA matrix in both states."""
    out = {}
    for name, w in new.items():
        if ("lora_A" in name or "lora_B" in name) and w.dim() == 2 and name in prev:
            out[short_name(name)] = list(variation(prev[name], w))
    return out
