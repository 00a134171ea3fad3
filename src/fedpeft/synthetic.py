"""The PF2LoRA paper's synthetic example (sec. 5): two clients, multivariate linear regression
``y = (W0 + dW_i) x`` whose true updates ``dW_i`` have different ranks.

``dW_i = G + E_i``: a common part ``G`` of rank ``common_rank`` and a client part ``E_i`` of
rank ``extra_ranks[i]``, built on mutually orthogonal singular directions (as the paper
makes the common part orthogonal to the clients' own). Client ``i``'s true rank is
``common_rank + extra_ranks[i]``.

Both algorithms run on full-batch gradients with the very building blocks of the
methods: :func:`fedpeft.methods.pf2lora.bilevel_step` for PF2LoRA, and HETLoRA's
truncation, tail penalty, self-pruning, zero-padding and sparsity-weighted mean. The
effective rank of a client's learned update is the number of its singular values above
``rank_tol`` times the largest (:func:`fedpeft.methods.pf2lora.effective_rank`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fedpeft.methods.hetlora import (
    pad,
    pruned_rank,
    sparsity_weighted_mean,
    tail_penalty,
    truncate,
    update_norm,
)
from fedpeft.methods.pf2lora import bilevel_step, effective_rank

A, B = "w.lora_A.w", "w.lora_B.w"


@dataclass
class Client:
    x_train: torch.Tensor  # (n, d)
    y_train: torch.Tensor  # (n, d)
    x_test: torch.Tensor
    y_test: torch.Tensor
    true_update: torch.Tensor  # dW_i (d, d)


@dataclass
class Problem:
    w0: torch.Tensor
    clients: list[Client]
    true_ranks: list[int]


@dataclass
class History:
    test_loss: list[list[float]] = field(default_factory=list)  # per round, per client
    ranks: list[list[int]] = field(default_factory=list)  # per round, per client
    distance: list[list[float]] = field(default_factory=list)  # ||learned dW_i - true dW_i||_F


def make_problem(
    d: int = 10, n: int = 1000, common_rank: int = 2, extra_ranks: tuple[int, ...] = (2, 0), seed: int = 0
) -> Problem:
    """Data for each client: 1,000 samples, the first 700 for training (as in the paper)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))

    def part(start: int, rank: int) -> torch.Tensor:
        scales = (
            torch.linspace(2.0, 1.0, rank, dtype=torch.float64)
            if rank
            else torch.zeros(0, dtype=torch.float64)
        )
        return u[:, start : start + rank] @ torch.diag(scales) @ v[:, start : start + rank].T

    w0 = torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5
    common, start, clients = part(0, common_rank), common_rank, []
    for extra in extra_ranks:
        true = common + part(start, extra)
        start += extra
        x = torch.randn(n, d, generator=g, dtype=torch.float64)
        y = x @ (w0 + true).T
        cut = int(0.7 * n)
        clients.append(Client(x[:cut], y[:cut], x[cut:], y[cut:], true))
    return Problem(w0, clients, [common_rank + e for e in extra_ranks])


def _mse(problem: Problem, x: torch.Tensor, y: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    return (x @ (problem.w0 + update).T - y).pow(2).mean()


def _record(history: History, problem: Problem, updates: list[torch.Tensor], rank_tol: float) -> None:
    history.test_loss.append(
        [float(_mse(problem, c.x_test, c.y_test, u)) for c, u in zip(problem.clients, updates, strict=True)]
    )
    history.ranks.append([effective_rank(u, rank_tol) for u in updates])
    history.distance.append(
        [float((u - c.true_update).norm()) for c, u in zip(problem.clients, updates, strict=True)]
    )


def run_pf2lora(
    problem: Problem,
    r: int = 2,
    r2: int = 2,
    steps: int = 2000,
    interval: int = 10,
    upper_lr: float = 1e-2,
    lower_lr: float = 5e-2,
    rank_tol: float = 0.05,
    seed: int = 0,
) -> History:
    """PF2LoRA with a common adapter of rank ``r`` and client adapters of rank ``r2``."""
    g = torch.Generator().manual_seed(seed)
    d = problem.w0.shape[0]
    common = {
        A: 0.1 * torch.randn(r, d, generator=g, dtype=torch.float64),
        B: torch.zeros(d, r, dtype=torch.float64),
    }
    personal = [
        {
            "c": 0.1 * torch.randn(r2, d, generator=g, dtype=torch.float64),
            "d": torch.zeros(d, r2, dtype=torch.float64),
        }
        for _ in problem.clients
    ]
    history = History()
    for _ in range(steps // interval):
        states = []
        for client, own in zip(problem.clients, personal, strict=True):
            upper = {k: v.clone().requires_grad_() for k, v in common.items()}
            lower = {k: v.clone().requires_grad_() for k, v in own.items()}
            opt = torch.optim.AdamW(list(upper.values()), lr=upper_lr, weight_decay=0.0)
            for _ in range(interval):

                def loss_with(q, client=client):
                    return _mse(problem, client.x_train, client.y_train, q[B] @ q[A] + q["d"] @ q["c"])

                detached = {k: v.detach() for k, v in upper.items()}
                _, grads, g_low = bilevel_step(
                    loss_with, detached, {k: v.detach() for k, v in lower.items()}, lower_lr
                )
                for name, p in upper.items():
                    p.grad = grads[name]
                opt.step()
                with torch.no_grad():
                    for k, g in g_low.items():
                        lower[k].sub_(lower_lr * g)
            own.update({k: v.detach() for k, v in lower.items()})
            states.append({k: v.detach() for k, v in upper.items()})
        common = {k: sum(s[k] for s in states) / len(states) for k in common}
        updates = [common[B] @ common[A] + own["d"] @ own["c"] for own in personal]
        _record(history, problem, updates, rank_tol)
    return history


def run_hetlora(
    problem: Problem,
    ranks: tuple[int, ...] = (1, 4),
    r_max: int = 4,
    steps: int = 2000,
    interval: int = 10,
    lr: float = 1e-2,
    penalty: float = 1e-3,
    gamma: float = 0.9,
    prune_ratio: float = 0.1,
    rank_tol: float = 0.05,
    seed: int = 0,
) -> History:
    """HETLoRA with fixed initial client ranks ``ranks`` (one too small, as the paper's draw)."""
    g = torch.Generator().manual_seed(seed)
    d = problem.w0.shape[0]
    glob = {
        A: 0.1 * torch.randn(r_max, d, generator=g, dtype=torch.float64),
        B: torch.zeros(d, r_max, dtype=torch.float64),
    }
    client_ranks, history = list(ranks), History()
    for _ in range(steps // interval):
        states, norms = [], []
        for i, client in enumerate(problem.clients):
            local = {k: v.clone().requires_grad_() for k, v in truncate(glob, client_ranks[i]).items()}
            opt = torch.optim.AdamW(list(local.values()), lr=lr, weight_decay=0.0)
            for _ in range(interval):
                loss = _mse(problem, client.x_train, client.y_train, local[B] @ local[A])
                tail = torch.zeros(client_ranks[i], dtype=torch.float64)
                tail[math.floor(gamma * client_ranks[i]) :] = 1.0
                loss = loss + penalty * tail_penalty([(local[A], local[B])], tail)
                opt.zero_grad()
                loss.backward()
                opt.step()
            trained = {k: v.detach() for k, v in local.items()}
            client_ranks[i] = pruned_rank([(trained[A], trained[B])], client_ranks[i], gamma, 1, prune_ratio)
            padded = pad(truncate(trained, client_ranks[i]), r_max)
            states.append(padded)
            norms.append(update_norm(padded))
        glob = sparsity_weighted_mean(states, norms)
        updates = [truncate(glob, k)[B] @ truncate(glob, k)[A] for k in client_ranks]
        _record(history, problem, updates, rank_tol)
    return history
