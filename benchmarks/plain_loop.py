"""The plain training loop that engine-overhead benchmarks compare fedpeft with: one
``torch.optim.AdamW`` over the model's trainable parameters, cross-entropy, clipping, no
federation around it."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def plain_optimizer(model: torch.nn.Module, lr: float) -> tuple[torch.optim.Optimizer, list[torch.Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0), params


def plain_steps(model, batches: Iterable[dict], opt: torch.optim.Optimizer, params, max_grad_norm) -> None:
    model.train()
    for batch in batches:
        torch.nn.functional.cross_entropy(model(**batch), batch["labels"]).backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
