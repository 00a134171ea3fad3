"""SVD initialisation of LoRA factors (FeDeRA, Yan et al. 2024, sec. 4.1, eqs. 6-10).

For a frozen weight ``W0`` stored as torch does, ``(out, in)`` with ``y = W0 x``:

    W0 = U diag(sigma) V^T
    A  = sqrt(sigma[:r]) * V[:, :r]^T     (r, in)
    B  = U[:, :r] * sqrt(sigma[:r])       (out, r)
    W_res = W0 - s * B A,   s = beta / r

so that ``W_res + s B A = W0``: the adapted layer's output at the start equals the
pretrained one. The paper takes ``beta = r`` (``s = 1``), where ``s B A`` is exactly the
rank-``r`` principal part of ``W0``. (HF PEFT's ``init_lora_weights="pissa"`` divides
``sigma`` by ``s`` instead, so that ``s B A`` is the principal part for every ``s``;
the two agree at ``s = 1``. fedpeft follows the paper's formula.)

Singular vectors are defined only up to sign (``u_i, v_i`` and ``-u_i, -v_i`` are both
valid), and machines may disagree; hence FeDeRA's server decomposes once and every
client derives ``W_res`` from the ``A, B`` it receives (:func:`residual`).
"""

from __future__ import annotations

import torch


def svd_factors(weight: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of rank ``r`` from the SVD of ``weight`` ``(out, in)``; at least float32 math."""
    if not 1 <= r <= min(weight.shape):
        raise ValueError(f"rank r={r} must be in [1, {min(weight.shape)}] for a {tuple(weight.shape)} weight")
    u, sigma, vh = torch.linalg.svd(_wide(weight.detach()), full_matrices=False)
    root = sigma[:r].sqrt()
    a = root[:, None] * vh[:r]  # (r, in)
    b = u[:, :r] * root[None, :]  # (out, r)
    return a.to(weight.dtype), b.to(weight.dtype)


def residual(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W0 - scale * B A``: the frozen part once ``A, B`` carry the principal components."""
    return (_wide(weight) - scale * (_wide(b) @ _wide(a))).to(weight.dtype)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 when it already is (half precision is too coarse for SVD)."""
    return t if t.dtype == torch.float64 else t.float()
