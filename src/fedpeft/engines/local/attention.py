"""The attention kernel a cohort runs with: Hugging Face's eager (plain-matmul) attention
where ``vmap`` batches the clients, the model's own fused kernel for a cohort of one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fedpeft.engines.local.hooks import LocalMethod
    from fedpeft.engines.local.jobs import RoundContext


@contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[None]:
    """Hugging Face's plain-matmul attention for the duration: ``vmap`` batches it, while
    the fused SDPA kernels have no batching rule and would loop over the clients."""
    config = getattr(getattr(model, "backbone", None), "config", None)
    if config is None:
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = before


def training_attention(model: torch.nn.Module, method: LocalMethod, clients: int, context: RoundContext):
    """The attention a cohort trains with: eager (:func:`eager_attention`), which ``vmap``
    batches, except for a cohort of one (not vmapped: ``loop.run_cohort``), which keeps the
    model's own kernel (SDPA: faster, and without the ``(heads, L, L)`` weights eager
    attention holds per layer for the backward pass) when the method takes no gradient of
    a gradient (fused kernels have no second derivative) and no gradient per example
    (DP-SGD vmaps over the rows)."""
    alone = clients == 1 and not method.higher_order and context.sample_dp is None
    return nullcontext() if alone else eager_attention(model)
