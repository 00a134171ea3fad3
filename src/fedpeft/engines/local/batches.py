"""A cohort's batches: every sampled client's steps, padded, stacked on a leading client
axis and cut on the device; and the stacking of per-client tensor dicts.

Clients of a cohort differ in data: each step's batches are padded to the cohort's widest
and longest (padded rows weigh 0 in the loss, padded tokens are masked), and a client
that has taken all its steps has no batch (the loop leaves its tensors as they are).
"""

from __future__ import annotations

import numpy as np
import torch

from fedpeft.data.task import IGNORE, Draw, Encoded
from fedpeft.engines.local.jobs import StepInput, Tensors
from fedpeft.models.causal import scored_counts


class CohortBatches:
    """A cohort's batches for a run of steps, stacked on a leading client axis and cut on
    the device. ``plans[c][k]``: client ``c``'s draws (:class:`~fedpeft.data.task.Draw`)
    for step ``k``, one per batch of a step; a plan shorter than the longest: the client
    has finished. Each batch of a step is padded to the cohort's most rows and longest
    row: a padded row has weight 0 and no real token; a draw's ``extras`` are stacked as
    they are (a finished client's are zeros).

    Everything about the shapes is worked out here, once, on the CPU: the cohort's data
    goes into one pool per tensor (each client's rows, then one padding row), every
    batch becomes indices into it and a width, and the indices cross to the device in one
    copy. :meth:`step` then cuts a step's batches with one gather per tensor: no loop over
    the clients, no host-device synchronisation."""

    def __init__(self, plans: list[list[tuple[Draw, ...]]], device: torch.device):
        self.clients, self.device = len(plans), device
        sources: dict[int, Encoded] = {}
        for plan in plans:
            for draws in plan:
                for draw in draws:
                    sources.setdefault(id(draw.data), draw.data)
        parts = list(sources.values())
        offsets = dict(zip(sources, np.cumsum([0] + [len(d) for d in parts]).tolist(), strict=False))
        self._pool(parts)
        lengths = torch.cat([d.lengths.cpu() for d in parts] + [torch.zeros(1, dtype=torch.long)])
        pad = len(lengths) - 1
        zero = torch.zeros(1, dtype=torch.long)  # token labels: each row's scored positions
        counts = (
            torch.cat([scored_counts(d.labels).cpu() for d in parts] + [zero]) if self.per_token else None
        )
        # each step's batches: (rows, width, where its indices start)
        self.shapes: list[list[tuple[int, int, int]]] = []
        #: each step's batches' SCORED count K (token labels): the most of any client, at least 1
        self.scored: list[list[int]] = []
        index, extras, at = [], [], 0
        for k in range(max(len(plan) for plan in plans)):
            draws = [plan[k] if k < len(plan) else None for plan in plans]
            live = next(d for d in draws if d is not None)
            shapes, scored = [], []
            for j in range(len(live)):
                rows = max(len(d[j].rows) for d in draws if d is not None)
                rows_of = torch.full((self.clients, rows), pad, dtype=torch.long)
                for c, d in enumerate(draws):
                    if d is not None:
                        rows_of[c, : len(d[j].rows)] = d[j].rows + offsets[id(d[j].data)]
                shapes.append((rows, int(lengths[rows_of].max()), at))
                if counts is not None:
                    scored.append(max(int(counts[rows_of].sum(1).max()), 1))
                index.append(rows_of.flatten())
                at += rows_of.numel()
            self.shapes.append(shapes)
            self.scored.append(scored)
            extras.append([_stacked_extras(draws, j) for j in range(len(live))])
        self.index = torch.cat(index).to(device)
        #: ``extras[j][key]``: batch j's extra ``key`` at every step, ``(steps, C, ...)``
        self.extras = [
            {key: torch.stack([e[j][key] for e in extras]).to(device) for key in extras[0][j]}
            for j in range(len(extras[0]))
        ]

    def _pool(self, parts: list[Encoded]) -> None:
        """The cohort's rows, then a padding row (no token, label 0 or :data:`IGNORE`), on the device."""
        width = max(d.ids.shape[1] for d in parts)
        self.per_token = parts[0].labels.dim() == 2

        def pooled(tensors: list[torch.Tensor], fill: int) -> torch.Tensor:
            shape = (1, width) if tensors[0].dim() == 2 else (1,)
            padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) if t.dim() == 2 else t
                      for t in tensors]  # fmt: skip
            return torch.cat(
                [t.to(self.device) for t in padded] + [torch.full(shape, fill, device=self.device)]
            )

        self.ids = pooled([d.ids for d in parts], 0)
        self.lengths = pooled([d.lengths for d in parts], 0)
        self.labels = pooled([d.labels for d in parts], IGNORE if self.per_token else 0)
        self.real = torch.ones(len(self.lengths), device=self.device)
        self.real[-1] = 0.0
        self.positions = torch.arange(width, device=self.device)

    def __len__(self) -> int:
        return len(self.shapes)

    def step(self, k: int) -> StepInput:
        """Step ``k``'s batches, each ``(C, rows, ...)``."""
        out = []
        for j, (rows, width, at) in enumerate(self.shapes[k]):
            index = self.index[at : at + self.clients * rows].view(self.clients, rows)
            batch = {
                "input_ids": self.ids[:, :width][index],
                "attention_mask": (self.positions[:width] < self.lengths[index].unsqueeze(-1)).long(),
                "labels": self.labels[:, :width][index] if self.per_token else self.labels[index],
                "weight": self.real[index],
            }
            out.append(batch | {key: t[k] for key, t in self.extras[j].items()})
        return tuple(out)


def _stacked_extras(draws: list[tuple[Draw, ...] | None], j: int) -> Tensors:
    """The extras of batch ``j`` of a step's draws, stacked over the clients (a finished
    client's, None: zeros)."""
    first = next(d for d in draws if d is not None)[j].extras
    return {
        key: torch.stack([d[j].extras[key] if d is not None else torch.zeros_like(t) for d in draws])
        for key, t in first.items()
    }


def stack(states: list[Tensors], device: torch.device) -> Tensors:
    """Per-client tensor dicts (same names, same shapes) as one dict of ``(C, ...)`` tensors."""
    return {n: torch.stack([s[n] for s in states]).to(device) for n in states[0]} if states else {}


def unstack(stacked: Tensors, count: int) -> list[Tensors]:
    """The inverse of :func:`stack`, back on the CPU (what leaves a model is device-free)."""
    cpu = {n: t.detach().to("cpu") for n, t in stacked.items()}
    return [{n: t[c].clone() for n, t in cpu.items()} for c in range(count)]
