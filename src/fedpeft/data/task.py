"""The sequence-classification task: tokenise once, then cut batches padded to their longest.

Texts are tokenised a single time into one ``(N, max_length)`` id matrix plus each
row's true length. A batch takes its rows and keeps only the first
``max(lengths[rows])`` columns, so short texts never pay for padding.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Encoded:
    """Tokenised examples: ids ``(N, L)`` right-padded, lengths ``(N,)``, labels ``(N,)``."""

    ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, rows: np.ndarray | torch.Tensor) -> Encoded:
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.ids.device)
        return Encoded(self.ids[rows], self.lengths[rows], self.labels[rows])

    def to(self, device: torch.device | str) -> Encoded:
        """The same examples on ``device`` (batches are then cut there)."""
        return Encoded(self.ids.to(device), self.lengths.to(device), self.labels.to(device))

    @staticmethod
    def concat(parts: list[Encoded]) -> Encoded:
        width = max(p.ids.shape[1] for p in parts)
        ids = [torch.nn.functional.pad(p.ids, (0, width - p.ids.shape[1])) for p in parts]
        return Encoded(
            torch.cat(ids),
            torch.cat([p.lengths for p in parts]),
            torch.cat([p.labels for p in parts]),
        )


def encode(texts: list[str], labels: np.ndarray, tokenizer, max_length: int) -> Encoded:
    """Tokenise ``texts`` (truncated at ``max_length``) into an :class:`Encoded` set."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    enc = tokenizer(list(texts), truncation=True, max_length=max_length, padding=False)
    rows = enc["input_ids"]
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    width = int(lengths.max()) if len(rows) else 1
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return Encoded(ids, lengths, torch.as_tensor(labels, dtype=torch.long))


def make_batch(data: Encoded, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows of ``data`` as model inputs, padded only to the longest row in the batch."""
    lengths = data.lengths[rows]
    width = int(lengths.max())
    mask = torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)  # (B, width)
    return {
        "input_ids": data.ids[rows, :width],
        "attention_mask": mask.long(),
        "labels": data.labels[rows],
    }


def iter_batches(
    data: Encoded, batch_size: int, generator: torch.Generator | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """One pass over ``data`` in batches; shuffled when a generator is given."""
    n = len(data)
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        yield make_batch(data, order[start : start + batch_size])


def take_steps(
    data: Encoded, batch_size: int, steps: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """Exactly ``steps`` shuffled batches, reshuffling at the end of each pass."""
    done = 0
    while done < steps:
        for batch in iter_batches(data, batch_size, generator):
            yield batch
            done += 1
            if done == steps:
                return
