"""Tokenised examples, and batches cut from them padded to their longest.

Texts are tokenised a single time into one ``(N, max_length)`` id matrix plus each
row's true length. A batch takes its rows and keeps only the first
``max(lengths[rows])`` columns, so short texts never pay for padding.

Labels are one class per example ``(N,)`` (sequence classification) or one per token
``(N, L)`` (causal LM: the response's tokens, :data:`IGNORE` on the prompt and padding),
cut to the batch's width like the ids.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

#: The label of a token that no loss counts (a prompt or padding position).
IGNORE = -100


@dataclass
class Encoded:
    """Tokenised examples: ids ``(N, L)`` right-padded, lengths ``(N,)``, labels ``(N,)``
    or ``(N, L)``; for instruction data also each prompt's length ``(N,)`` (the prompt is
    ``ids[i, :prompt_lengths[i]]``, the response follows it); ``aux``: other per-row
    tensors a task's scoring needs (extractive QA: each feature's example and offsets)."""

    ids: torch.Tensor
    lengths: torch.Tensor
    labels: torch.Tensor
    prompt_lengths: torch.Tensor | None = None
    aux: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.labels)

    def fields(self) -> list[torch.Tensor]:
        """The tensors, in order (what crosses to a deployed node)."""
        return [self.ids, self.lengths, self.labels] + (
            [self.prompt_lengths] if self.prompt_lengths is not None else []
        )

    def _map(self, f) -> Encoded:
        return Encoded(*(f(t) for t in self.fields()), aux={k: f(v) for k, v in self.aux.items()})

    def subset(self, rows: np.ndarray | torch.Tensor) -> Encoded:
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.ids.device)
        return self._map(lambda t: t[rows])

    def examples(self, rows: np.ndarray | torch.Tensor) -> Encoded:
        """The rows of the corpus examples ``rows``: the same rows, except for extractive
        QA, where an example may have several features (context windows): all of them."""
        if "example_ids" not in self.aux:
            return self.subset(rows)
        wanted = torch.as_tensor(rows, dtype=torch.long, device=self.ids.device)
        return self.subset(torch.nonzero(torch.isin(self.aux["example_ids"], wanted)).flatten())

    def to(self, device: torch.device | str) -> Encoded:
        """The same examples on ``device`` (batches are then cut there)."""
        return self._map(lambda t: t.to(device))

    @staticmethod
    def concat(parts: list[Encoded]) -> Encoded:
        width = max(p.ids.shape[1] for p in parts)

        def widen(t: torch.Tensor, fill: int) -> torch.Tensor:
            pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]  # dim 1 is the token axis
            return torch.nn.functional.pad(t, pad, value=fill)

        ids = torch.cat([widen(p.ids, 0) for p in parts])
        labels = [p.labels if p.labels.dim() == 1 else widen(p.labels, IGNORE) for p in parts]
        prompts = [p.prompt_lengths for p in parts]
        aux = {
            k: torch.cat([v if v.dim() == 1 else widen(v, -1) for v in (p.aux[k] for p in parts)])
            for k in parts[0].aux
        }
        return Encoded(
            ids,
            torch.cat([p.lengths for p in parts]),
            torch.cat(labels),
            torch.cat(prompts) if all(q is not None for q in prompts) else None,
            aux,
        )


def encode(texts: list[str], labels: np.ndarray, tokenizer, max_length: int) -> Encoded:
    """Tokenise ``texts`` (truncated at ``max_length``) into an :class:`Encoded` set."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if not texts:  # a silo setting's (empty) global test set
        rows = []
    else:
        rows = tokenizer(list(texts), truncation=True, max_length=max_length, padding=False)["input_ids"]
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
    labels = data.labels[rows]
    return {
        "input_ids": data.ids[rows, :width],
        "attention_mask": mask.long(),
        "labels": labels if labels.dim() == 1 else labels[:, :width],
    }


#: Part ``r`` of ``n``: the share of an evaluation one of ``n`` ranks computes; the parts,
#: in rank order, make up the whole once (:func:`share_of`).
Part = tuple[int, int]
WHOLE: Part = (0, 1)


def share_of(count: int, part: Part) -> slice:
    """Part ``part`` of ``count`` consecutive items: a contiguous slice."""
    r, n = part
    return slice(count * r // n, count * (r + 1) // n)


def eval_batches(
    lengths: torch.Tensor, batch_size: int, batch_tokens: int | None = None
) -> Iterator[torch.Tensor]:
    """The rows of an evaluation pass, in order, cut into consecutive batches (row indices
    on the CPU) sized by tokens as well as rows: a batch takes the next row while it has
    fewer than ``batch_size`` rows and, padded to its longest row (``lengths``), stays
    within ``batch_tokens`` tokens (None: no budget); a row longer than the budget is a
    batch of its own. Rows of at most ``batch_tokens // batch_size`` tokens always make
    full batches of ``batch_size`` rows."""
    rows = lengths.tolist()
    start = 0
    while start < len(rows):
        end, longest = start + 1, rows[start]
        while end < len(rows) and end - start < batch_size:
            wider = max(longest, rows[end])
            if batch_tokens is not None and (end - start + 1) * wider > batch_tokens:
                break
            end, longest = end + 1, wider
        yield torch.arange(start, end)
        start = end


def iter_batches(
    data: Encoded, batch_size: int, generator: torch.Generator | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """One pass over ``data`` in batches; shuffled when a generator is given."""
    n = len(data)
    order = torch.randperm(n, generator=generator) if generator is not None else torch.arange(n)
    for start in range(0, n, batch_size):
        yield make_batch(data, order[start : start + batch_size])


def take_rows(n: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Exactly ``steps`` shuffled batches of row indices (on the CPU) of ``n`` rows,
    reshuffling at the end of each pass."""
    if n == 0 and steps > 0:
        raise ValueError("no rows to draw batches from")
    done = 0
    while done < steps:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            yield order[start : start + batch_size]
            done += 1
            if done == steps:
                return


def take_steps(
    data: Encoded, batch_size: int, steps: int, generator: torch.Generator
) -> Iterator[dict[str, torch.Tensor]]:
    """Exactly ``steps`` shuffled batches, reshuffling at the end of each pass."""
    return (make_batch(data, rows) for rows in take_rows(len(data), batch_size, steps, generator))


@dataclass(frozen=True)
class Draw:
    """A batch as a method draws it, before it is cut: rows of ``data`` (indices, on the
    CPU) and the tensors a method draws with them (``extras``, e.g. AdaMix's routing, of
    one shape for every client). The cohort engine cuts a whole round's draws of all its
    clients at once (:class:`fedpeft.engines.local.batches.CohortBatches`); :meth:`batch` cuts
    this one on its own."""

    data: Encoded
    rows: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def batch(self) -> dict[str, torch.Tensor]:
        device = self.data.ids.device
        return {**make_batch(self.data, self.rows), **{k: v.to(device) for k, v in self.extras.items()}}

    def halves(self) -> tuple[Draw, Draw]:
        """The first and the second half of the rows (the first has the smaller half)."""
        half = len(self.rows) // 2
        return Draw(self.data, self.rows[:half], self.extras), Draw(self.data, self.rows[half:], self.extras)


def sample_draws(data: Encoded, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[Draw]:
    """``steps`` batches, each ``batch_size`` rows (all of them, with fewer) drawn uniformly
    without replacement, independently of the other steps: the sampling that DP-SGD's
    accountant (sampling without replacement) assumes, where :func:`take_draws` deals
    out passes over the data."""
    n = len(data)
    if n == 0 and steps > 0:
        raise ValueError("no rows to draw batches from")
    for _ in range(steps):
        yield Draw(data, torch.randperm(n, generator=generator)[:batch_size])


def take_draws(data: Encoded, batch_size: int, steps: int, generator: torch.Generator) -> Iterator[Draw]:
    """:func:`take_steps`'s batches, as draws."""
    return (Draw(data, rows) for rows in take_rows(len(data), batch_size, steps, generator))
