"""FedMCP: a global and a private adapter per client, tied by a model-contrastive term.

Paper: "FedMCP: Parameter-Efficient Federated Learning with Model-Contrastive
Personalization" (sec. 3); docs/two_modules.md.

Every Houlsby site of the backbone holds two adapters (bottleneck 16), a *global* one
``g`` (aggregated) and a *private* one ``p`` (never leaves the client), both reading
the sub-layer's output; the site's output is their average
(:class:`fedpeft.peft.adapters.AdapterPair`). Two classifiers: ``g1`` (``head``) reads
the full model (both adapters), ``g2`` (``global_head``) the backbone with the global
adapter alone. Per batch:

- ``L_a`` = cross-entropy of ``g1`` on the full model;
- ``L_b`` = cross-entropy of ``g2`` on the global path;
- ``L_c``, the model-contrastive term, from mean-pooled last-layer representations of
  the batch: ``X`` through the client's global adapter, ``Y`` through its private
  adapter, ``Z`` through the average global adapter it received this round (frozen for
  the round). ``contrast: prose`` (default) is what the paper's text says, pull ``X``
  towards ``Z`` and push it away from ``Y``: ``L_c = CKA(X, Y) - CKA(X, Z)``;
  ``contrast: equation`` is the paper's eq. 5 as printed, ``CKA(X, Y) - CKA(Y, Z)``.
  ``CKA`` is linear CKA (:func:`fedpeft.metrics.cka.linear_cka`);
- loss ``(1 - gamma) L_a + gamma L_b + mu L_c`` (``gamma = 0.5``, ``mu = 0.05``).

Only the global adapter is sent; the server averages it uniformly (every client
counts the same, whatever its size). The private adapter and both heads are personal
(the paper does not share classifiers across tasks), so there is no one global model:
each client predicts with its full model and ``g1``.
"""

from __future__ import annotations

from fedpeft.config.methods.fedmcp import FedMCPConfig
from fedpeft.engines.local import (
    GradientFn,
    Job,
    Start,
    backprop,
    head_logits,
    model_features,
    model_scale,
)
from fedpeft.methods.base import FitResult, ServerState, Tensors
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method
from fedpeft.metrics.cka import linear_cka
from fedpeft.peft.adapters import AdapterPair, adapter_mode, add_adapters

GLOBAL_HEAD = "global_head."  # g2, the global path's classifier


@register_method(FedMCPConfig)
class FedMCP(FedAvgPeft):
    paper = "FedMCP"
    kind = "adapter"
    refuses = {
        **{
            task: "its two classifiers and contrastive term read a pooled representation, which only "
            "classification has"
            for task in ("causal_lm", "token_classification", "extractive_qa")
        },
        "secure_aggregation": "its server takes the uniform mean of the clients' adapters, not the "
        "example-weighted one",
    }

    def prepare(self, model) -> None:
        import torch

        add_adapters(model.backbone, self.cfg.adapter, model.backbone.config.model_type, kind=AdapterPair)
        head = model.head
        model.global_head = torch.nn.Linear(head.in_features, head.out_features).to(head.weight.dtype)
        for p in [*model.head.parameters(), *model.global_head.parameters()]:
            p.requires_grad_(True)
        self.split_trainable(model)

    def split_trainable(self, model) -> None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.shared_names = [n for n in names if ".adapter.shared." in n]
        self.personal_names = [n for n in names if n not in self.shared_names]

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        """The uniform average of the clients' global adapters."""
        return ServerState(self.mean([r.uplink for r in results], [1.0] * len(results)), server.extras)

    def global_state(self, server: ServerState) -> Tensors | None:
        return None  # the heads are personal: every client predicts with its own model

    # ----- the local step
    def cohort_start(self, model, job: Job) -> Start:
        """As FedAvg, plus the received global adapter as a constant: ``Z``'s adapter."""
        start = super().cohort_start(model, job)
        return Start(start.params, start.opt, dict(job.received), start.steps)

    def step_gradients(self, model) -> GradientFn:
        features, cfg = model_features(model), self.cfg

        def loss(params: Tensors, received: Tensors, batches):
            batch = batches[0]
            weight = batch.get("weight")
            full = features(params, batch)
            with adapter_mode(model, "global"):
                x = features(params, batch)
                z = features({**params, **received}, batch)  # constants: no gradient reaches them
            with adapter_mode(model, "private"):
                y = features(params, batch)
            loss_a = model.loss(head_logits(params, full), batch)
            loss_b = model.loss(head_logits(params, x, GLOBAL_HEAD), batch)
            anchor = x if cfg.contrast == "prose" else y
            loss_c = linear_cka(x, y, weight) - linear_cka(anchor, z, weight)
            return (1 - cfg.gamma) * loss_a + cfg.gamma * loss_b + cfg.mu * loss_c

        return backprop(loss, model_scale(model))
