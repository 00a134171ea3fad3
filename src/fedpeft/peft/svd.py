"""Truncated-SVD compression of updates (FedKD's dynamic gradient approximation).

An update (a dict of tensors) goes over the wire as its matrices' truncated SVDs: each
matrix ``M = U diag(s) V^T`` keeps the fewest leading singular values whose energy
``sum s_k^2`` reaches a share ``T`` of the total (:func:`kept_rank`), sent as the factors
``<name>.svd_u`` ``(m, k)``, ``<name>.svd_s`` ``(k,)``, ``<name>.svd_v`` ``(n, k)``. A
matrix whose factors would not be smaller than itself, and every tensor that is not a
matrix, goes as it is (``<name>.delta``). The receiver rebuilds ``U diag(s) V^T`` from
the factors it gets, so sender and receiver agree however the SVD chose its signs.
"""

from __future__ import annotations

import torch

from fedpeft.tensors import Tensors

SVD_U, SVD_S, SVD_V, DELTA = ".svd_u", ".svd_s", ".svd_v", ".delta"  # suffixes of what is sent
FACTORS = (SVD_U, SVD_S, SVD_V)


def kept_rank(sigma: torch.Tensor, energy: float) -> int:
    """The fewest leading singular values whose energy ``sum s_k^2`` reaches ``energy`` of
    the total (0 for a zero matrix)."""
    cum = sigma.double().square().cumsum(0)
    if len(cum) == 0 or cum[-1] == 0:
        return 0
    return min(int((cum < energy * cum[-1]).sum()) + 1, len(sigma))


def truncated_svd(matrix: torch.Tensor, energy: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U (m, k), s (k,), V (n, k))``, float32, with ``U diag(s) V^T`` the truncated SVD
    of ``matrix`` keeping :func:`kept_rank` components (computed in float64)."""
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    k = kept_rank(s, energy)
    return u[:, :k].float().contiguous(), s[:k].float().contiguous(), vh[:k].T.float().contiguous()


def reconstruct(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``U diag(s) V^T``."""
    return (u * s) @ v.T


def compress(update: Tensors, energy: float) -> Tensors:
    """What is sent for ``update``: each matrix as the factors of its truncated SVD keeping
    ``energy`` when they are smaller than it, every other tensor as it is."""
    out = {}
    for name, delta in update.items():
        factors = truncated_svd(delta, energy) if delta.dim() == 2 else ()
        if factors and sum(f.numel() for f in factors) < delta.numel():
            out.update(zip((name + k for k in FACTORS), factors, strict=True))
        else:
            out[name + DELTA] = delta
    return out


def decompress(sent: Tensors) -> Tensors | None:
    """The update :func:`compress` encoded, by parameter name; None for a malformed message."""
    out = {}
    for key, t in sent.items():
        if key.endswith(DELTA):
            out[key.removesuffix(DELTA)] = t
        elif key.endswith(SVD_U):
            name = key.removesuffix(SVD_U)
            s, v = sent.get(name + SVD_S), sent.get(name + SVD_V)
            if s is None or v is None or t.dim() != 2 or s.dim() != 1 or v.dim() != 2:
                return None
            if not t.shape[1] == s.shape[0] == v.shape[1]:
                return None
            out[name] = reconstruct(t, s, v)
        elif not key.endswith((SVD_S, SVD_V)):
            return None
    return out
