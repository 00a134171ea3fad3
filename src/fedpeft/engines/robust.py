"""Robust aggregation (issue 32): rules that replace a method's mean of its clients' uplinks.

Pure functions of the clients' states (``server.aggregation``):

- ``mean``: the weighted mean (``weights``: examples, or 1 each; the default);
- ``median``: the coordinate-wise median (Yin et al. 2018; an even count takes the mean
  of the two middle values, as numpy does);
- ``trimmed_mean``: per coordinate, the mean after dropping the ``floor(trim * n)``
  smallest and as many largest values (Yin et al. 2018's beta = ``server.trim``);
- ``krum``: the one state whose ``n - f - 2`` nearest others (squared distance, all of a
  state's tensors flattened into one vector) are closest, ``f = server.byzantine``
  (Blanchard et al. 2017; needs ``n > 2f + 2``);
- ``multi_krum``: the plain mean of the ``n - f`` states with the best Krum scores.

Every client starts a round from the same shared tensors, so rules on states are the
same rules on updates: the median and trimmed mean are shift-invariant and Krum's
distances are differences of updates. Arithmetic in float64; results in each tensor's
dtype. A method that aggregates by the mean of its uplinks calls :attr:`Method.mean`,
which the engine sets to :func:`combiner`'s rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedpeft.config import ServerConfig
from fedpeft.methods.base import Tensors, weighted_mean
from fedpeft.tensors import Combine


def combiner(cfg: ServerConfig) -> Combine:
    """``combine(states, weights) -> state``: the rule ``server.aggregation`` names."""
    rule = cfg.aggregation
    if rule == "mean":
        return weighted_mean
    if rule == "median":
        return lambda states, weights: per_coordinate(states, median)
    if rule == "trimmed_mean":
        return lambda states, weights: per_coordinate(states, lambda x: trimmed_mean(x, cfg.trim))
    if rule == "krum":
        return lambda states, weights: {
            n: t.clone() for n, t in states[krum_scores(states, cfg.byzantine).argmin().item()].items()
        }
    return lambda states, weights: multi_krum(states, cfg.byzantine)


def per_coordinate(states: list[Tensors], rule: Callable[[torch.Tensor], torch.Tensor]) -> Tensors:
    """``rule`` over the client axis of each tensor, stacked ``(n, ...)`` in float64."""
    return {
        name: rule(torch.stack([s[name].double() for s in states])).to(first.dtype)
        for name, first in states[0].items()
    }


def median(x: torch.Tensor) -> torch.Tensor:
    """The median over axis 0; an even count: the mean of the two middle values."""
    ordered, n = x.sort(dim=0).values, len(x)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def trimmed_mean(x: torch.Tensor, trim: float) -> torch.Tensor:
    """The mean over axis 0 of what is left after dropping ``floor(trim * n)`` values at each end."""
    n = len(x)
    k = int(trim * n)
    if n - 2 * k < 1:
        raise ValueError(f"server.trim {trim:g}: trims all {n} updates of the round")
    return x.sort(dim=0).values[k : n - k].mean(0)


def flat(state: Tensors) -> torch.Tensor:
    return torch.cat([t.double().flatten() for _, t in sorted(state.items())])


def krum_scores(states: list[Tensors], byzantine: int) -> torch.Tensor:
    """Each state's Krum score: the sum of its squared distances to its ``n - f - 2``
    nearest other states."""
    n = len(states)
    if n <= 2 * byzantine + 2:
        raise ValueError(
            f"server.byzantine {byzantine}: Krum needs more than 2f + 2 = {2 * byzantine + 2} updates "
            f"in a round, got {n}"
        )
    vectors = torch.stack([flat(s) for s in states])
    distances = torch.cdist(vectors, vectors).square()
    nearest = distances.sort(dim=1).values[:, 1 : n - byzantine - 1]  # column 0: itself
    return nearest.sum(1)


def multi_krum(states: list[Tensors], byzantine: int) -> Tensors:
    """The plain mean of the ``n - f`` states of best Krum score."""
    chosen = krum_scores(states, byzantine).argsort()[: len(states) - byzantine].tolist()
    return weighted_mean([states[i] for i in sorted(chosen)], [1.0] * len(chosen))
