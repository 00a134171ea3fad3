"""Linear centred kernel alignment (CKA; Kornblith et al., 2019) between two sets of
representations of the same ``n`` inputs.

``CKA(X, Y) = HSIC(K, L) / sqrt(HSIC(K, K) HSIC(L, L))`` with ``K = X X^T``,
``L = Y Y^T``, ``HSIC(K, L) = tr(K C L C) / (n - 1)^2`` and ``C = I - 11^T / n`` (the
FedMCP paper's eqs. 3-4). For linear kernels ``tr(K C L C) = ||Xc^T Yc||_F^2`` with
``Xc = C X`` the column-centred ``X``, and the ``(n - 1)^2`` cancels, so no ``n x n``
matrix is formed. Rows may carry weights 0 or 1 (a client cohort's padded rows): a
row of weight 0 takes no part, exactly as if it were absent.
"""

from __future__ import annotations

import torch


def linear_cka(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Linear CKA of ``x`` ``(n, h1)`` and ``y`` ``(n, h2)``, in [0, 1]; ``weight`` ``(n,)``
    of 0s and 1s leaves the rows of weight 0 out. Pure tensor code (it vmaps)."""
    if weight is None:
        weight = torch.ones(x.shape[0], dtype=x.dtype, device=x.device)
    w = weight.to(x.dtype).unsqueeze(1)
    count = w.sum().clamp_min(1.0)
    xc = (x - (x * w).sum(0) / count) * w
    yc = (y - (y * w).sum(0) / count) * w
    cross = (xc.T @ yc).square().sum()
    norms = (xc.T @ xc).square().sum() * (yc.T @ yc).square().sum()
    # clamped before the root: a batch with no spread (one real row) gives 0, not 0/0 or an infinite gradient
    return cross / norms.clamp_min(1e-30).sqrt()
