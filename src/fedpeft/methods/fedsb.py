"""Fed-SB: LoRA-SB's ``W0 + s B R A`` with ``B`` and ``A`` fixed and shared, only the
``r x r`` matrix ``R`` (and the head) trained and averaged: exact, ``r^2`` numbers per module.

Papers: Singhal, Ponkshe et al., "Fed-SB: A Silver Bullet for Extreme Communication
Efficiency and Performance in (Private) Federated LoRA Fine-Tuning", 2025 (arXiv
2502.15436), on LoRA-SB (Ponkshe, Singhal et al., arXiv 2411.19557); docs/lora_family.md
states it, with where fedpeft departs (the authors' code was read for the initialisation).

**The initialisation** approximates full fine-tuning's first step: ``dW = -lr0 sign(G)``,
``G`` the sum over a few hundred training examples of the loss's gradient with respect to
each adapted module's full weight; its SVD gives ``B = U_r``, ``A = V_r^T`` and
``R = diag(S_r) / s``, so the model starts at ``W0 + (dW's best rank-r approximation)``
(``W0`` unchanged). The authors compute ``G`` on the pooled training set; a federation
has none, so fedpeft's **round 1 is a setup round**: each of its clients sends the sum of
its per-example gradients over ``ceil(init_samples / clients_per_round)`` of its shuffled
examples (a ``d_out x d_in`` matrix per module: counted as sent), the server sums them (the
pooled sum, over the round's clients) and decomposes. From round 2, clients train ``R``
and the head; ``B`` and ``A`` reach each client once, with its first round after the setup
(counted), and it keeps them (``own.*``). Since every client holds the same ``B`` and
``A``, ``mean_k B R_k A = B mean_k(R_k) A``: FedAvg of ``R`` is the exact mean update.

The module: PEFT's LoRA with its ``lora_B`` a :class:`LatentB`, ``B`` after a trained
``r x r`` linear ``R`` (``lora_B.default.latent.weight``); the export folds ``R`` into a
plain PEFT LoRA (``B R``, ``A``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedpeft.config import TrainConfig
from fedpeft.config.methods.fedsb import FedSBConfig
from fedpeft.data.task import make_batch
from fedpeft.engines.local import (
    OPT,
    OWN,
    GradientFn,
    Start,
    clip_factor,
    group_backprop,
    model_loss,
    noise_generator,
    norm,
    optimizer_state,
)
from fedpeft.methods.base import (
    ClientData,
    FitResult,
    Job,
    ServerState,
    Tensors,
    local_steps,
    read_tensors,
)
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method
from fedpeft.peft.lora import LoraTerm, lora_layers

#: the downlink's mark of the setup round: the examples each client sums gradients over
SETUP = "setup.samples"
#: a setup-round uplink entry: ``grad.<frozen weight's name>``, a client's gradient sum
GRAD = "grad."
#: the server's extras: client ``<cid>`` holds ``B`` and ``A``
HOLDS = "holds."


class LatentB(nn.Module):
    """``B R``: LoRA's fixed up-projection ``B`` after LoRA-SB's trained ``r x r`` latent
    mapping ``R`` (in PEFT's forward, ``lora_B(lora_A(x))`` = ``B R A x``)."""

    def __init__(self, up: nn.Linear):
        super().__init__()
        rank = up.in_features
        self.latent = nn.Linear(rank, rank, bias=False, dtype=up.weight.dtype, device=up.weight.device)
        nn.init.zeros_(self.latent.weight)
        self.base = up

    @property
    def weight(self) -> torch.Tensor:  # what code reading ``lora_B.weight`` (its dtype) finds
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(self.latent(x))


@register_method(FedSBConfig)
class FedSB(FedAvgPeft):
    kind = "lora"
    refuses = {
        "dora": "LoRA-SB's start (B, A from the SVD of the full-weight gradient) approximates a full "
        "fine-tuning step by a plain LoRA update; under DoRA's normalised direction it is not that "
        "approximation (neither paper defines one)",
        "server_step": "its first round is a setup round whose aggregate is an SVD, not a step",
        "robust": "its setup round sums the clients' gradients; another rule would not give LoRA-SB's start",
        "lossy_downlink": "each client keeps the fixed B and A it receives once for the rest of the run, so "
        "a rounded copy would differ from the server's for good and the global update B mean(R_k) A would no "
        "longer be the mean of the clients' updates",
        # the setup round's server sums the clients' messages: user-level DP noises that sum
        "user_dp": "",
        "secure_aggregation": "its first round is a setup round whose aggregate is an SVD of the clients' "
        "gradient sums",
    }

    # ----- messages: gradient sums up in the setup round (clipped and noised whole under
    # privacy.mode), the fixed B, A down once to each client
    def uplink_messages(self, received: Tensors) -> list[str]:
        return [GRAD + w for w in self.frozen] if SETUP in received else []

    def server_frozen_names(self) -> list[str]:
        return list(self.fixed)

    def uplink_like(self, rnd: int, shared: Tensors, received: Tensors) -> Tensors:
        if SETUP in received:  # the setup round: round 1, or the first that drew any client
            return {GRAD + w: torch.empty(shape) for w, shape in self.frozen.items()}
        return super().uplink_like(rnd, shared, received)

    def training_server(self, server: ServerState) -> ServerState:
        """Before the setup, a state of its shapes as after it (``B``, ``A`` and ``R``
        zero): the rounds that train ``R``, vmapped, not the setup's gradient sums."""
        if self.is_set_up(server):
            return server
        tensors, r = dict(server.tensors), self.cfg.lora.r
        for w, a, b, latent, _ in self.modules.values():
            d_out, d_in = self.frozen[w]
            tensors[b], tensors[a], tensors[latent] = (
                torch.zeros(d_out, r),
                torch.zeros(r, d_in),
                torch.zeros(r, r),
            )
        return ServerState(tensors, server.extras)

    def prepare(self, model) -> None:
        if any(not p.is_floating_point() for p in model.parameters()):
            raise ValueError(
                "method fedsb takes the gradient of the full frozen weights in its setup round, which a "
                "quantised backbone (model.quantization) cannot give: use model.quantization none"
            )
        super().prepare(model)
        #: per adapted module: its frozen weight's name, A's, B's, R's and LoRA's scale s
        self.modules = {}
        for name, layer in lora_layers(model).items():
            layer.lora_B["default"] = LatentB(layer.lora_B["default"])
            layer.lora_A["default"].weight.requires_grad_(False)
            layer.lora_B["default"].base.weight.requires_grad_(False)
            self.modules[name] = (
                f"{name}.base_layer.weight",
                f"{name}.lora_A.default.weight",
                f"{name}.lora_B.default.base.weight",
                f"{name}.lora_B.default.latent.weight",
                layer.scaling["default"],
            )
        self.split_trainable(model)
        self.fixed = [n for _, a, b, _, _ in self.modules.values() for n in (a, b)]
        self.frozen = {
            w: t.shape for w, t in read_tensors(model, [m[0] for m in self.modules.values()]).items()
        }
        #: the shared tensors as the model starts (R = 0), the state before the setup
        self.start = read_tensors(model, self.shared_names)

    def per_client_samples(self) -> int:
        return math.ceil(self.cfg.init_samples / max(self.train.clients_per_round, 1))

    # ----- privacy: the setup round is one more step
    def private_steps(self, n: int, train: TrainConfig) -> tuple[int, int]:
        """Under DP-SGD the setup is one more step (its round's clients take no other: a
        client is charged a round's steps and the setup's, whichever round it starts in)."""
        return local_steps(n, train), 1

    # ----- server
    def init_server(self, model) -> ServerState:
        """Before the setup: ``R`` at zero (no update), and no ``B``, ``A`` yet."""
        return ServerState(dict(self.start))

    def is_set_up(self, server: ServerState) -> bool:
        return all(n in server.tensors for n in self.fixed)

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """The setup's mark before the setup; then ``R`` and the head, and ``B``, ``A`` to a
        client that does not hold them yet."""
        if not self.is_set_up(server):
            return {SETUP: torch.tensor([float(self.per_client_samples())])}
        shared = {n: server.tensors[n] for n in self.shared_names}
        if f"{HOLDS}{cid}" in server.extras:
            return shared
        return {**shared, **{n: server.tensors[n] for n in self.fixed}}

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        if not self.is_set_up(server):
            return self.set_up(server, results)
        extras = {**server.extras, **{f"{HOLDS}{r.cid}": torch.ones(1) for r in results}}
        return ServerState({**server.tensors, **super().aggregate(server, results, rnd).tensors}, extras)

    def set_up(self, server: ServerState, results: list[FitResult]) -> ServerState:
        """LoRA-SB's start from the clients' gradient sums: per module, the SVD of
        ``-lr0 sign(sum_k G_k)``: ``B = U_r``, ``A = V_r^T``, ``R = diag(S_r) / s``."""
        tensors, r = dict(server.tensors), self.cfg.lora.r
        for w, a, b, latent, scale in self.modules.values():
            total = sum(res.uplink[GRAD + w].double() for res in results)
            u, s, vh = torch.linalg.svd(-self.cfg.init_lr * torch.sign(total), full_matrices=False)
            k = min(r, s.numel())  # a rank above min(d_out, d_in): the rest stays zero
            tensors[b], tensors[a], tensors[latent] = (
                torch.zeros(u.shape[0], r), torch.zeros(r, vh.shape[1]), torch.zeros(r, r)
            )  # fmt: skip
            tensors[b][:, :k], tensors[a][:k] = u[:, :k].float(), vh[:k].float()
            tensors[latent][:k, :k] = torch.diag(s[:k] / scale).float()
        return ServerState(tensors, server.extras)

    # ----- client
    def local_rounds(self, model, jobs: list[Job]) -> list[FitResult]:
        if any(SETUP in job.received for job in jobs):
            return [self.gradient_sums(model, job) for job in jobs]
        return super().local_rounds(model, jobs)

    def gradient_sums(self, model, job: Job) -> FitResult:
        """The setup round of one client: the sum of its per-example gradients of the loss
        with respect to each adapted module's full weight, over ``received[SETUP]`` of its
        examples (shuffled by its seed; dropout on, as the authors' ``model.train()``).
        Under DP-SGD (``privacy.mode: sample``) it is one DP-SGD step's sum instead: a batch
        of ``train.batch_size`` rows drawn as every DP-SGD step draws one, each row's
        gradient (all modules as one vector) clipped to ``privacy.clip``, plus
        ``N(0, (sigma clip)^2)`` noise."""
        data, n, dp = job.client.train, int(job.received[SETUP]), job.context.sample_dp
        rows = torch.randperm(len(data), generator=job.generator())[: min(dp.batch if dp else n, len(data))]
        if dp is not None:  # DP-SGD: one row at a time, each clipped; the sum noised below
            return self.private_gradient_sums(model, job, rows)
        return self.summed_gradients(model, job, rows)

    def private_gradient_sums(self, model, job: Job, rows: torch.Tensor) -> FitResult:
        """DP-SGD's setup step: per-row gradient sums clipped to ``clip``, summed, noised."""
        dp, losses = job.context.sample_dp, []
        total = {w: torch.zeros(shape) for w, shape in self.frozen.items()}
        for row in rows.split(1):
            result = self.summed_gradients(model, job, row)
            grads = {w: result.uplink[GRAD + w] for w in self.frozen}
            factor = clip_factor(norm(grads), dp.clip)
            for w, g in grads.items():
                total[w] += factor * g
            losses.append(result.metrics["loss"])
        if dp.sigma > 0:
            generator = noise_generator(job)
            for w in sorted(total):
                total[w] += dp.sigma * dp.clip * torch.randn(total[w].shape, generator=generator)
        return FitResult(
            uplink={GRAD + w: t for w, t in total.items()},
            personal=dict(job.personal),
            num_examples=len(rows),
            metrics={"steps": 0.0, "loss": sum(losses) / max(len(losses), 1)},
        )

    def summed_gradients(self, model, job: Job, rows: torch.Tensor) -> FitResult:
        """The full-weight gradients summed over ``rows`` of the client's data (in batches
        of ``train.batch_size``), as a setup round's result."""
        data, device = job.client.train, next(model.parameters()).device
        loss = model_loss(model)
        current = {**read_tensors(model, self.shared_names), **self.params_of(job.personal)}
        current = {n: t.to(device) for n, t in current.items()}
        weights = {
            w: t.to(device).requires_grad_(True) for w, t in read_tensors(model, list(self.frozen)).items()
        }
        total, summed = {w: torch.zeros(shape) for w, shape in self.frozen.items()}, 0.0
        was_training = model.training
        model.train()
        try:
            with torch.enable_grad():
                for start in range(0, len(rows), job.context.train.batch_size):
                    chunk = rows[start : start + job.context.train.batch_size]
                    batch = {k: v.to(device) for k, v in make_batch(data, chunk.to(data.ids.device)).items()}
                    value = loss({**current, **weights}, batch) * len(chunk)  # a sum
                    for w, g in zip(weights, torch.autograd.grad(value, list(weights.values())), strict=True):
                        total[w] += g.float().cpu()
                    summed += float(value.detach())
        finally:
            model.train(was_training)
        return FitResult(
            uplink={GRAD + w: t for w, t in total.items()},
            personal=dict(job.personal),
            num_examples=len(rows),
            metrics={"steps": 0.0, "loss": summed / max(len(rows), 1)},  # the loss it started from
        )

    def held(self, received: Tensors, personal: Tensors) -> Tensors:
        """``B`` and ``A`` as the client holds them: received now, or kept from before."""
        return {n: received[n] if n in received else personal[OWN + n] for n in self.fixed}

    def cohort_start(self, model, job: Job) -> Start:
        shared = {n: job.received[n] for n in self.shared_names}
        params = {**shared, **self.params_of(job.personal), **self.held(job.received, job.personal)}
        opt = optimizer_state(job.personal, {n: params[n] for n in self.optimised_names()}, job.context.train)
        return Start(params, opt, {}, local_steps(len(job.client.train), job.context.train))

    def step_gradients(self, model) -> GradientFn:
        return group_backprop(model, set(self.optimised_names()))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        kept = {OPT + k: v for k, v in opt.items()} if job.context.train.optimizer_state == "keep" else {}
        return FitResult(
            uplink={n: params[n] for n in self.shared_names},
            personal={
                **{n: params[n] for n in self.personal_names},
                **{OWN + n: params[n] for n in self.fixed},
                **kept,
            },
            num_examples=len(job.client.train),
            metrics=metrics,
        )

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        if SETUP in received:  # before the setup: the model as it starts (R = 0: no update)
            return {**self.start, **self.params_of(personal)}
        state = {n: received[n] for n in self.shared_names if n in received}
        return {**state, **self.params_of(personal), **self.held(received, personal)}

    # ----- export: one plain PEFT LoRA (B R, A)
    def lora_terms(self, model, tensors: Tensors) -> dict[str, list[LoraTerm]]:
        terms = {}
        for name, (_, a, b, latent, scale) in self.modules.items():
            if latent in tensors and a in tensors:
                terms[name] = [(scale, tensors[a], tensors[b] @ tensors[latent])]
        return terms
