"""Each client's predictions in one vmapped (or, on a quantised backbone, folded) pass:
what the engine scores a cohort's models with."""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
from torch.func import functional_call, vmap

from fedpeft.data.task import Draw, Encoded, eval_batches
from fedpeft.engines.local.attention import eager_attention
from fedpeft.engines.local.batches import CohortBatches, stack
from fedpeft.engines.local.folding import cohort_outputs
from fedpeft.engines.local.gradients import quantised
from fedpeft.engines.local.jobs import Tensors


@torch.no_grad()
def predict_cohort(
    model: torch.nn.Module,
    states: list[Tensors],
    data: Encoded | list[Encoded],
    batch_size: int,
    batch_tokens: int | None = None,
) -> list[np.ndarray]:
    """Arg-max predictions of each client's model (``states[c]`` in place of the model's
    trainable tensors) on its own examples (``data[c]``) or, given one :class:`Encoded`,
    on those same examples for every client; the clients' forward passes run vmapped.
    Each client's examples are cut into batches of at most ``batch_size`` rows and
    ``batch_tokens`` tokens (:func:`fedpeft.data.task.eval_batches`)."""
    device = next(model.parameters()).device
    stacked = stack(states, device)

    def forward(params: Tensors, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (ids, mask)).argmax(-1)

    model.eval()
    shared = isinstance(data, Encoded)  # the same batches for every client: broadcast, not copied
    sets = [data] if shared else data
    plans = [
        [(Draw(d, rows),) for rows in eval_batches(d.lengths.cpu(), batch_size, batch_tokens)] for d in sets
    ]
    counts = [[len(draws[0].rows) for draws in plan] for plan in plans]
    out: list[list[torch.Tensor]] = [[] for _ in states]  # on the device until the end
    if any(plans):
        batches = CohortBatches(plans, device)
        batched = vmap(forward, in_dims=(0, None, None) if shared else 0)
        folded = len(states) > 1 and quantised(model)  # vmap cannot batch quantised kernels
        with nullcontext() if folded else eager_attention(model):
            for k in range(len(batches)):
                (batch,) = batches.step(k)
                ids, mask = batch["input_ids"], batch["attention_mask"]
                if folded:
                    wide = {"input_ids": ids, "attention_mask": mask}
                    if shared:  # the one batch, for every client
                        wide = {k: t[:1].expand(len(states), *t.shape[1:]) for k, t in wide.items()}
                    preds = cohort_outputs(model, stacked, wide).argmax(-1)
                elif shared:
                    preds = batched(stacked, ids[0], mask[0])
                else:
                    preds = batched(stacked, ids, mask)
                for c in range(len(states)):
                    rows = counts[0 if shared else c]
                    if k < len(rows):
                        out[c].append(preds[c, : rows[k]])
    sizes = [sum(len(p) for p in preds) for preds in out]
    flat = (
        torch.cat([p for preds in out for p in preds]).cpu()
        if any(sizes)
        else torch.zeros(0, dtype=torch.long)
    )
    return [part.numpy() for part in flat.split(sizes)]
