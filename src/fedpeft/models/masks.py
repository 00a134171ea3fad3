"""The attention mask every task model hands its backbone, prepared rather than left to
Hugging Face: its own mask code branches on the mask's values, which ``torch.func.vmap``
(client cohorts) cannot trace, while a prepared 4D additive mask is used as it is."""

from __future__ import annotations

import torch


def additive_mask(attention_mask: torch.Tensor, causal: bool, dtype: torch.dtype) -> torch.Tensor:
    """``(B, L)`` 0/1 -> ``(B, 1, L, L)``: 0 where a query may attend a key, a large
    negative number where not (a padded key; with ``causal`` also a later one). Half the
    dtype's minimum, so that adding a score cannot overflow to -inf (a query that may
    attend nothing, a padded row, then gets finite states, which no loss counts)."""
    width = attention_mask.shape[-1]
    keep = attention_mask[:, None, None, :].bool().expand(-1, 1, width, width)
    if causal:
        keep = keep & torch.ones(width, width, dtype=torch.bool, device=keep.device).tril()
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return bias.masked_fill(~keep, torch.finfo(dtype).min / 2)
