"""A hand-written multi-LoRA training step: the yardstick issue 64 measures the engine by.

The issue quotes a short script that trains many clients' LoRA on one shared frozen
encoder faster than fedpeft's engine. This is such a step, written for
``gpu_throughput.py``'s one job (FedLR: LoRA on query and value, a classification head of
each client's own, on a BERT) and nothing else, so that the engine and the yardstick are
timed side by side on the same device in one run:

- the frozen layers run once on the C clients' batches folded into one ``(C x B, L)``
  batch, with PyTorch's fused attention (``scaled_dot_product_attention``) and a
  key-padding mask;
- each client's LoRA factors and head act on its own rows by batched matmul over the
  client axis (``bmm`` / ``baddbmm``);
- the step: per-client gradient clipping and torch's AdamW (fused on a GPU) over the
  stacked tensors, which is elementwise, so every client's slice steps as its own
  optimizer would.

No sampling, no client state, no federation, no generality: what is left is the least a
step of this job must do. For each client it computes what the plain loop
(:func:`plain_loop.plain_steps`: one client, autograd, ``torch.optim.AdamW``, clipping)
computes (``tests/benchmarks/test_multilora.py``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

F = nn.functional


class MultiLoRA:
    """``clients`` copies of ``initial`` (a FedLR model's trained tensors, by the model's
    parameter names) trained at once on ``model``'s frozen BERT."""

    def __init__(self, model: nn.Module, initial: dict[str, torch.Tensor], clients: int, lr: float,
                 max_grad_norm: float | None):  # fmt: skip
        self.model, self.bert = model, model.backbone.base_model.model
        self.max_grad_norm = max_grad_norm
        self.params = {n: t.detach().expand(clients, *t.shape).clone() for n, t in initial.items()}
        for t in self.params.values():
            t.requires_grad_(True)
        fused = next(iter(initial.values())).is_cuda
        self.optimizer = torch.optim.AdamW(list(self.params.values()), lr=lr, weight_decay=0.0, fused=fused)
        self.prefix = {id(m): name for name, m in model.named_modules()}

    def adapted(self, layer: nn.Module, x: torch.Tensor, clients: int) -> torch.Tensor:
        """A LoRA-wrapped linear (peft's ``lora.Linear``) on ``x`` ``(C x B, L, H)``: the
        frozen base once, each client's ``B A`` on its own rows."""
        name = self.prefix[id(layer)]
        a = self.params[f"{name}.lora_A.default.weight"]  # (C, r, H)
        b = self.params[f"{name}.lora_B.default.weight"]  # (C, H, r)
        rows = x.reshape(clients, -1, x.shape[-1])
        low = torch.bmm(torch.bmm(rows, a.transpose(1, 2)), b.transpose(1, 2))
        return layer.base_layer(x) + layer.scaling["default"] * low.view_as(x)

    def logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Each client's logits ``(C, B, K)`` for its batch ``ids``, ``mask`` ``(C, B, L)``."""
        clients, rows, width = ids.shape
        x = self.bert.embeddings(input_ids=ids.reshape(-1, width))
        keep = mask.reshape(-1, 1, 1, width).bool()
        heads = self.bert.config.num_attention_heads
        size = x.shape[-1] // heads

        def split(t):
            return t.view(-1, width, heads, size).transpose(1, 2)

        for layer in self.bert.encoder.layer:
            att = layer.attention.self
            q, k, v = self.adapted(att.query, x, clients), att.key(x), self.adapted(att.value, x, clients)
            context = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=keep)
            x = layer.attention.output(context.transpose(1, 2).reshape(x.shape), x)
            x = layer.output(layer.intermediate(x), x)
        weights = mask.reshape(-1, width, 1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        w, b = self.params["head.weight"], self.params["head.bias"]
        return torch.baddbmm(b.unsqueeze(1), pooled.view(clients, rows, -1).to(w.dtype), w.transpose(1, 2))

    def step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """One local step of every client on its batch (``input_ids``, ``attention_mask``,
        ``labels``, each ``(C, B, ...)``); each client's loss ``(C,)``."""
        precision = self.model.precision
        ids = batch["input_ids"]
        autocast = torch.autocast(ids.device.type, dtype=precision) if precision else nullcontext()
        with autocast:
            logits = self.logits(ids, batch["attention_mask"])
        losses = F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), reduction="none")
        losses = losses.view(ids.shape[:2]).mean(1)
        params = list(self.params.values())
        grads = torch.autograd.grad(losses.sum(), params)
        if self.max_grad_norm:
            norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads]).sum(0).sqrt()
            scale = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            grads = [g * scale.view(-1, *[1] * (g.dim() - 1)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses.detach()


def stack(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The clients' batches of one step on a leading client axis, each padded (id 0, mask
    0) to the widest: a padded key gets no attention and a padded token no weight."""
    width = max(b["input_ids"].shape[1] for b in batches)

    def padded(key: str) -> torch.Tensor:
        return torch.stack([F.pad(b[key], (0, width - b[key].shape[1])) for b in batches])

    return {"input_ids": padded("input_ids"), "attention_mask": padded("attention_mask"),
            "labels": torch.stack([b["labels"] for b in batches])}  # fmt: skip
