"""Heterogeneous LoRA ranks: one setting (``method.ranks``) for every method that lets
clients train different ranks (HETLoRA, FlexLoRA, FLoRA), so that they compare on the
same clients with the same ranks.

A client of rank ``r_k`` holds the model's LoRA modules at the server's rank ``r_max =
method.lora.r`` with its components ``r_k..r_max-1`` zero: those get no gradient (both
their ``A`` row and ``B`` column are zero), so the client trains rank ``r_k`` exactly, and
clients of different ranks share one cohort (their ranks masked inside ``r_max``).

``method.ranks`` is either

- a list: client ``i`` has rank ``ranks[i mod len(ranks)]`` (a list as long as the
  federation gives each client its own; ``[2, 4, 8, 16]`` puts a quarter of the clients
  at each), or
- a seeded draw: ``{uniform: [lo, hi]}`` (an integer in ``lo..hi``, HETLoRA's draw) or
  ``{choice: [2, 4, 8, 16]}`` (one of the listed), per client, seeded by the
  experiment's seed, the draw's ``seed`` and the client's id.
"""

from __future__ import annotations

import numpy as np
import torch

# the config side of method.ranks, re-exported from here where it was first defined
from fedpeft.config.methods.lora_ranks import LoraRanks, RankDraw, RankedLoraConfig, check_ranks  # noqa: F401
from fedpeft.engines.local import OPT
from fedpeft.methods.base import Tensors


def client_rank(ranks: LoraRanks, cid: int, seed: int, r_max: int) -> int:
    """Client ``cid``'s rank under ``ranks`` (``seed``: the experiment's)."""
    if ranks is None:
        return r_max
    if isinstance(ranks, list):
        return int(ranks[cid % len(ranks)])
    rng = np.random.default_rng([seed, ranks.seed, cid])
    if ranks.uniform is not None:
        return int(rng.integers(ranks.uniform[0], ranks.uniform[1] + 1))
    return int(ranks.choice[rng.integers(len(ranks.choice))])


# ----- LoRA factors of a rank inside r_max
def is_a(name: str) -> bool:
    return ".lora_A." in name


def is_b(name: str) -> bool:
    return ".lora_B." in name


def truncate(tensors: Tensors, rank: int) -> Tensors:
    """The first ``rank`` components: ``A[:rank, :]`` and ``B[:, :rank]``; other tensors as they are."""
    return {
        n: t[:rank].clone() if is_a(n) else t[:, :rank].clone() if is_b(n) else t for n, t in tensors.items()
    }


def pad(tensors: Tensors, r_max: int) -> Tensors:
    """Zero-pad every ``A`` (rows) and ``B`` (columns) to rank ``r_max``."""
    out = {}
    for n, t in tensors.items():
        if is_a(n):
            t = torch.cat([t, t.new_zeros(r_max - t.shape[0], t.shape[1])])
        elif is_b(n):
            t = torch.cat([t, t.new_zeros(t.shape[0], r_max - t.shape[1])], dim=1)
        out[n] = t
    return out


def rank_of(tensors: Tensors) -> int:
    return next(t.shape[0] for n, t in tensors.items() if is_a(n))


def pairs(tensors: Tensors) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(A, B)`` of every adapted module."""
    return [(t, tensors[n.replace(".lora_A.", ".lora_B.")]) for n, t in tensors.items() if is_a(n)]


def mask_components(state: Tensors, rank: int) -> Tensors:
    """``opt.*`` entries of LoRA tensors with the rank components from ``rank`` on set to
    zero (a kept Adam moment must not move a zero-padded or pruned component); others as
    they are."""
    out = {}
    for n, t in state.items():
        if n.startswith(OPT) and t.dim() == 2 and is_a(n):
            t = torch.cat([t[:rank], t.new_zeros(t.shape[0] - rank, t.shape[1])])
        elif n.startswith(OPT) and t.dim() == 2 and is_b(n):
            t = torch.cat([t[:, :rank], t.new_zeros(t.shape[0], t.shape[1] - rank)], dim=1)
        out[n] = t
    return out


def padded_uplink(uplink: Tensors, r_max: int) -> Tensors:
    """A client's update of rank ``r_k`` zero-padded to ``r_max``: the shapes of the
    server's state, which a networked server checks it against. A malformed one (no or
    misshapen ``A``/``B``, ranks that differ or exceed ``r_max``) comes back as it is, for
    that check to refuse."""
    lora = [(n, t) for n, t in uplink.items() if is_a(n) or is_b(n)]
    if not lora or any(t.dim() != 2 for _, t in lora):
        return uplink
    ranks = {t.shape[0] if is_a(n) else t.shape[1] for n, t in lora}
    if len(ranks) != 1 or ranks.pop() > r_max:  # one rank for all, at most r_max
        return uplink
    return pad(uplink, r_max)
