"""FlexLoRA: clients of any rank; the server averages their full updates ``B_k A_k`` and
hands each client the truncated SVD of that mean at its own rank.

Paper: Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous
Tasks and Client Resources", NeurIPS 2024 (docs/lora_family.md states it, with where
fedpeft departs; the authors' code, FederatedScope's FlexLoRA branch, was read for the
aggregation).

A client ``k`` of rank ``r_k`` (``method.ranks``) trains LoRA from what it received and
sends ``A_k, B_k`` at its rank. The server forms the weighted mean of the clients' full
updates, ``dW = sum_k p_k s B_k A_k`` (``p_k = |D_k| / sum |D|``), which no client's rank
can hold, and keeps its best rank-``r_max`` approximation (Eckart-Young: the SVD's
leading terms), ``B = U_r S_r / s``, ``A = V_r^T``. Since the SVD orders its terms, the
first ``r_k`` of them are ``dW``'s best rank-``r_k`` approximation: that is what client
``k`` receives, and the LoRA it starts its next round from (its LoRA is its whole update
of the pretrained weight, not an increment). The head is averaged as in FedAvg.

The global model is the server's rank-``r_max`` approximation (what a client of the
largest rank receives); a PEFT LoRA adapter (a DoRA one under ``lora.use_dora``, whose
magnitudes are averaged as the head).
"""

from __future__ import annotations

import torch

from fedpeft.config.methods.flexlora import FlexLoRAConfig
from fedpeft.engines.local import OPT, Start, optimizer_state
from fedpeft.methods.base import FitResult, Job, ServerState, Tensors, local_steps
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.lora_ranks import (
    client_rank,
    is_a,
    is_b,
    mask_components,
    pad,
    padded_uplink,
    rank_of,
    truncate,
)
from fedpeft.methods.registry import register_method
from fedpeft.peft.lora import lora_layers


def best_factors(update: torch.Tensor, rank: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` of rank ``rank`` with ``scale * B A`` the best rank-``rank`` approximation
    of ``update`` (its SVD's leading terms): ``B = U_r S_r / scale``, ``A = V_r^T``; the
    components past ``update``'s own rank (fewer singular values) are zero."""
    u, s, vh = torch.linalg.svd(update, full_matrices=False)
    k = min(rank, s.numel())
    a = update.new_zeros(rank, update.shape[1])
    b = update.new_zeros(update.shape[0], rank)
    a[:k], b[:, :k] = vh[:k], u[:, :k] * s[:k] / scale
    return a, b


@register_method(FlexLoRAConfig)
class FlexLoRA(FedAvgPeft):
    kind = "lora"
    refuses = {
        "dora": "",  # DoRA's magnitudes: trained and averaged, as the head is
        "server_step": "its aggregate is an SVD of the clients' mean update; a step on its factors would "
        "mix bases",
        "robust": "its server takes the weighted mean of the clients' products B_k A_k, not of what they "
        "send",
        "secure_aggregation": "its server takes the weighted mean of the clients' products B_k A_k, not of "
        "what they send",
    }

    # ----- messages: an update of a client's own rank reaches the server's checks zero-padded
    def uplink_as_shared(self, uplink: Tensors) -> Tensors:
        return padded_uplink(uplink, self.cfg.lora.r)

    def prepare(self, model) -> None:
        super().prepare(model)
        #: per adapted module: the names of its A and B, and LoRA's scale s
        self.modules = {
            name: (f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight", layer.scaling["default"])
            for name, layer in lora_layers(model).items()
        }

    def rank(self, cid: int) -> int:
        return client_rank(self.cfg.ranks, cid, self.seed, self.cfg.lora.r)

    # ----- server
    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """The server's factors cut to client ``cid``'s rank: ``dW``'s best approximation at
        that rank (only those rows and columns travel)."""
        return truncate(server.tensors, self.rank(cid))

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
        weights /= weights.sum()
        uplinks = [pad(r.uplink, self.cfg.lora.r) for r in results]
        rest = [{n: t for n, t in u.items() if not (is_a(n) or is_b(n))} for u in uplinks]
        tensors = dict(server.tensors)
        if rest[0]:
            tensors.update(self.mean(rest, [r.num_examples for r in results]))
        for a, b, scale in self.modules.values():
            update = sum(
                w * scale * u[b].double() @ u[a].double() for w, u in zip(weights, uplinks, strict=True)
            )
            new_a, new_b = best_factors(update, self.cfg.lora.r, scale)
            tensors[a], tensors[b] = new_a.to(server.tensors[a].dtype), new_b.to(server.tensors[b].dtype)
        return ServerState(tensors, server.extras)

    # ----- client: its rank masked inside r_max (the padded components get no gradient)
    def cohort_start(self, model, job: Job) -> Start:
        rank = rank_of(job.received)
        params = {**pad(job.received, self.cfg.lora.r), **self.params_of(job.personal)}
        opt = optimizer_state(mask_components(job.personal, rank), params, job.context.train)
        return Start(params, opt, {}, local_steps(len(job.client.train), job.context.train))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        rank = rank_of(job.received)
        kept = {OPT + k: v for k, v in opt.items()} if job.context.train.optimizer_state == "keep" else {}
        return FitResult(
            uplink=truncate({n: params[n] for n in self.shared_names}, rank),
            personal={**{n: params[n] for n in self.personal_names}, **mask_components(kept, rank)},
            num_examples=len(job.client.train),
            metrics={**metrics, "rank": float(rank)},
        )

    def eval_state(self, model, received: Tensors, personal: Tensors, client) -> Tensors:
        """A client's model: what it received (``dW`` at its rank), zero-padded."""
        return {**pad(received, self.cfg.lora.r), **self.params_of(personal)}

    def readout(self, result: FitResult) -> dict[str, float]:
        return {"rank": float(rank_of(result.uplink))}
