"""HETLoRA: heterogeneous LoRA ranks across clients (a baseline of PF2LoRA).

Paper: Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
Models", EMNLP 2024; METHODS.md, PF2LoRA section. Four parts:

1. **Rank initialisation**: client ``i`` gets a fixed rank ``r_i`` in ``[r_min, r_max]``
   (a seeded uniform draw per client), the server keeps rank ``r_max``.
2. **Truncation on the way down**: client ``i`` receives ``B[:, :r_i]`` and ``A[:r_i, :]``
   (fewer bytes for smaller ranks).
3. **Local training with self-pruning**: the loss gets
   ``lambda * sum ||B[:, q:r_i]||_F ||A[q:r_i, :]||_F`` with ``q = floor(gamma r_i)``, which
   pushes the last ``r_i - q`` rank components towards zero; after training, if those
   components carry less than ``prune_ratio`` of the adapter norm
   (``sum ||B_tail|| ||A_tail|| < prune_ratio * sum ||B|| ||A||``), the client drops them:
   ``r_i <- q`` (never below ``r_min``), and sends the smaller matrices.
4. **Zero-padding and sparsity-weighted aggregation on the way up**: the server pads
   every client's ``A, B`` back to ``r_max`` and averages them with weights proportional
   to the Frobenius norm of the client's update ``||B_i A_i||`` (over all adapted
   matrices); the head is averaged by client size, as in FedAvg.

Reading of the paper where the extracted text is silent: the pruning test above (a norm
ratio, METHODS.md's "prunes columns whose norm falls below a ratio"), one prune step per
round at most, and the LoRA scale ``alpha / r_max`` for every client. Zero-padded rank
components stay exactly zero during local training (their gradients vanish because
both their ``A`` row and ``B`` column are zero), so a client trains exactly rank ``r_i``.
The current ranks are server state (``rank.<client>`` in its extras), updated from the
shapes of what clients send.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from fedpeft.data.task import take_steps
from fedpeft.methods.base import (
    ClientData,
    FitResult,
    MethodConfig,
    ServerState,
    Tensors,
    load_tensors,
    local_steps,
    make_optimizer,
    read_tensors,
    sgd_steps,
    weighted_mean,
)
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import LoraSpec


class HETLoRAConfig(MethodConfig):
    """Heterogeneous-rank LoRA. Paper: HETLoRA (Cho et al., 2024), PF2LoRA baselines."""

    name: Literal["hetlora"] = "hetlora"
    lora: LoraSpec = Field(default_factory=LoraSpec, description="lora.r is r_max, the server's rank.")
    r_min: int = Field(2, ge=1, description="Smallest client rank.")
    rank_seed: int = Field(0, ge=0, description="Seed of the per-client rank draw.")
    gamma: float = Field(0.9, gt=0, lt=1, description="Sparsity factor: a prune keeps floor(gamma r_i).")
    penalty: float = Field(1e-3, ge=0, description="lambda of the rank-tail regulariser.")
    prune_ratio: float = Field(0.1, gt=0, lt=1, description="Prune when the tail holds less than this share.")

    @model_validator(mode="after")
    def _ranks(self) -> HETLoRAConfig:
        if self.r_min > self.lora.r:
            raise ValueError(f"method.r_min: {self.r_min} exceeds r_max = method.lora.r = {self.lora.r}")
        return self


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


def update_norm(tensors: Tensors) -> float:
    """Frobenius norm of the client's whole update ``[B A]`` over its adapted modules."""
    return math.sqrt(sum(float((b @ a).pow(2).sum()) for a, b in pairs(tensors)))


def tail_penalty(mods: list[tuple[torch.Tensor, torch.Tensor]], rank: int, gamma: float) -> torch.Tensor:
    """``sum ||B[:, q:rank]||_F ||A[q:rank, :]||_F`` over ``(A, B)`` pairs, ``q = floor(gamma rank)``."""
    q = math.floor(gamma * rank)
    return sum(b[:, q:rank].norm() * a[q:rank].norm() for a, b in mods)


def pruned_rank(
    mods: list[tuple[torch.Tensor, torch.Tensor]], rank: int, gamma: float, r_min: int, ratio: float
) -> int:
    """``floor(gamma rank)`` if the tail components hold less than ``ratio`` of the adapter
    norm (and that stays >= r_min), else ``rank``."""
    q = math.floor(gamma * rank)
    if q < r_min or q == rank:
        return rank
    tail = float(tail_penalty(mods, rank, gamma))
    full = sum(float(b[:, :rank].norm() * a[:rank].norm()) for a, b in mods)
    return q if full > 0 and tail < ratio * full else rank


def sparsity_weighted_mean(padded: list[Tensors], norms: list[float]) -> Tensors:
    """The LoRA tensors averaged with weights ``||B_i A_i|| / sum_j ||B_j A_j||``."""
    if sum(norms) <= 0:  # nothing learned yet anywhere: a plain mean
        norms = [1.0] * len(norms)
    return weighted_mean(padded, norms)


class HETLoRA(FedAvgPeft):
    name = "hetlora"
    config_cls = HETLoRAConfig
    kind = "lora"

    def initial_rank(self, cid: int) -> int:
        rng = np.random.default_rng([self.cfg.rank_seed, cid])
        return int(rng.integers(self.cfg.r_min, self.cfg.lora.r + 1))

    def rank(self, server: ServerState, cid: int) -> int:
        key = f"rank.{cid}"
        return int(server.extras[key]) if key in server.extras else self.initial_rank(cid)

    # ----- server
    def downlink(self, server: ServerState, cid: int) -> Tensors:
        return truncate(server.tensors, self.rank(server, cid))

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        r_max = self.cfg.lora.r
        lora = [pad({n: t for n, t in r.uplink.items() if is_a(n) or is_b(n)}, r_max) for r in results]
        rest = [{n: t for n, t in r.uplink.items() if not (is_a(n) or is_b(n))} for r in results]
        tensors = sparsity_weighted_mean(lora, [update_norm(s) for s in lora])
        if rest[0]:
            tensors.update(weighted_mean(rest, [r.num_examples for r in results]))
        extras = dict(server.extras)
        for r in results:
            extras[f"rank.{r.cid}"] = torch.tensor(rank_of(r.uplink))
        return ServerState(tensors, extras)

    # ----- client
    def penalty(self, model, rank: int):
        """``lambda * sum ||B[:, q:r]|| ||A[q:r, :]||`` over the adapted modules, q = floor(gamma r)."""
        params = dict(model.named_parameters())
        mods = [(params[n], params[n.replace(".lora_A.", ".lora_B.")]) for n in self.shared_names if is_a(n)]
        if self.cfg.penalty == 0 or math.floor(self.cfg.gamma * rank) == rank:
            return None
        return lambda: self.cfg.penalty * tail_penalty(mods, rank, self.cfg.gamma)

    def pruned_rank(self, tensors: Tensors, rank: int) -> int:
        return pruned_rank(pairs(tensors), rank, self.cfg.gamma, self.cfg.r_min, self.cfg.prune_ratio)

    def readout(self, result: FitResult) -> dict[str, float]:
        return {"rank": float(rank_of(result.uplink))}

    def fit(
        self, model, received: Tensors, personal: Tensors, client: ClientData, generator: torch.Generator
    ) -> FitResult:
        rank = rank_of(received)
        load_tensors(model, {**pad(received, self.cfg.lora.r), **personal})
        params = [p for p in model.parameters() if p.requires_grad]
        steps = local_steps(len(client.train), self.train)
        batches = take_steps(client.train, self.train.batch_size, steps, generator)
        opt = make_optimizer(params, self.train)
        total = sgd_steps(model, batches, opt, params, self.train.max_grad_norm, self.penalty(model, rank))
        trained = read_tensors(model, self.shared_names)
        new_rank = self.pruned_rank(trained, rank)
        return FitResult(
            uplink=truncate(trained, new_rank),
            personal=read_tensors(model, self.personal_names),
            num_examples=len(client.train),
            metrics={"loss": total / steps, "steps": float(steps), "rank": float(new_rank)},
        )

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        """The client's model: the global adapter truncated to its rank."""
        return {**pad(received, self.cfg.lora.r), **personal}
