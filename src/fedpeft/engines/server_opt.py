"""Server optimisers: the step the server takes after a method has aggregated (issue 32).

A method's ``aggregate`` proposes new shared tensors (FedAvg: the clients' weighted
mean). A server optimiser treats the change as a pseudo-gradient and takes its own
step from the previous tensors ``x`` (Reddi et al., "Adaptive Federated Optimization",
ICLR 2021, Algorithm 2; Hsu et al. 2019 for FedAvgM):

    D = aggregated - x                                 the pseudo-gradient
    fedavg      x += lr D                                (lr 1: the aggregate itself)
    fedavgm     v = momentum v + D;  x += lr v
    fedadagrad  v = v + D^2                              }
    fedyogi     v = v - (1 - b2) D^2 sign(v - D^2)       } with m = b1 m + (1 - b1) D
    fedadam     v = b2 v + (1 - b2) D^2                  } and x += lr m / (sqrt(v) + tau)

``m`` starts at 0 and the adaptive ``v`` at ``tau^2`` (the paper's ``v_{-1} >= tau^2``);
FedAvgM's ``v`` at 0. No bias correction, as in the paper. Arithmetic in float64, state
kept in each tensor's dtype (float32 for a half-precision one) in the server's extras
(``server_opt.m.<name>``, ``server_opt.v.<name>``): checkpointed with the server, resumed exactly, never sent
(a downlink carries the server's tensors, not its extras). The engines (in-process and
Flower) call :func:`server_step` after ``Method.aggregate``, the same function, and hand
the method its results through :func:`as_weighted` (``server.weighting``).
"""

from __future__ import annotations

import dataclasses

import torch

from fedpeft.config import ServerConfig
from fedpeft.methods.base import FitResult, ServerState, Tensors

PREFIX = "server_opt."
ADAPTIVE = ("fedadam", "fedyogi", "fedadagrad")


def is_plain(cfg: ServerConfig) -> bool:
    """Whether the server takes the method's aggregate as it is (FedAvg at rate 1)."""
    return cfg.optimizer == "fedavg" and cfg.rate == 1.0


def as_weighted(cfg: ServerConfig, results: list[FitResult]) -> list[FitResult]:
    """The results a method aggregates: as they are, or with ``server.weighting: uniform``
    each counting as one example (a method's mean weighs by ``num_examples``)."""
    if cfg.weighting == "examples":
        return results
    return [dataclasses.replace(r, num_examples=1) for r in results]


def server_step(cfg: ServerConfig, previous: ServerState, aggregated: ServerState) -> ServerState:
    """The new server state: ``aggregated`` with each shared floating-point tensor that
    ``previous`` also holds (same shape) replaced by the optimiser's step from it; the
    optimiser's state in the extras. Other tensors are taken as aggregated."""
    if is_plain(cfg):
        return aggregated
    tensors, extras = dict(aggregated.tensors), dict(aggregated.extras)
    for name, new in aggregated.tensors.items():
        old = previous.tensors.get(name)
        if old is None or old.shape != new.shape or not new.is_floating_point():
            continue
        x = old.double()
        state = {k: previous.extras.get(f"{PREFIX}{k}.{name}") for k in ("m", "v")}
        step, state = _step(
            cfg, new.double() - x, {k: None if v is None else v.double() for k, v in state.items()}
        )
        tensors[name] = (x + cfg.rate * step).to(new.dtype)
        kept = torch.promote_types(new.dtype, torch.float32)  # a half-precision model's state in float32
        extras.update({f"{PREFIX}{k}.{name}": v.to(kept) for k, v in state.items()})
    return ServerState(tensors, extras)


def _step(
    cfg: ServerConfig, d: torch.Tensor, state: dict[str, torch.Tensor | None]
) -> tuple[torch.Tensor, Tensors]:
    """The direction ``x`` moves along (before ``lr``) and the new state, in float64."""
    if cfg.optimizer == "fedavg":
        return d, {}
    if cfg.optimizer == "fedavgm":
        v = d if state["v"] is None else cfg.momentum * state["v"] + d
        return v, {"v": v}
    b1, b2 = cfg.betas
    m = torch.zeros_like(d) if state["m"] is None else state["m"]
    v = torch.full_like(d, cfg.tau**2) if state["v"] is None else state["v"]
    m = b1 * m + (1 - b1) * d
    square = d * d
    if cfg.optimizer == "fedadagrad":
        v = v + square
    elif cfg.optimizer == "fedyogi":
        v = v - (1 - b2) * square * torch.sign(v - square)
    else:  # fedadam
        v = b2 * v + (1 - b2) * square
    return m / (v.sqrt() + cfg.tau), {"m": m, "v": v}
