"""MOON: model-contrastive federated learning (FedAvg with a representation-level loss).

Paper: Li, He, Song, "Model-Contrastive Federated Learning", CVPR 2021 (sec. 3, Algorithm 1);
a baseline of FedMCP (docs/two_modules.md).

FedAvg over the trainable tensors (LoRA, adapters, BitFit biases or every weight:
``trainable``; the head too, unless ``head: personal``), with the local loss

    l = CE(head(z), y) + mu * l_con,
    l_con = -log( exp(sim(z, z_glob)/tau) / (exp(sim(z, z_glob)/tau) + exp(sim(z, z_prev)/tau)) )

per example, ``sim`` the cosine similarity and

- ``z``: the representation of the model being trained,
- ``z_glob``: that of the global model the client received this round (frozen),
- ``z_prev``: that of the client's own model after its previous local round (frozen; kept
  under ``own.<parameter name>`` entries of its personal state, never sent).

It pulls the local representation towards the global model's and pushes it away from
the previous local model's. ``l_con`` is averaged over the batch's real rows (a cohort's
padded rows count for nothing).

Readings and choices:

- **The representation** ``z`` is the pooled representation the head reads
  (``TaskModel.forward(pooled=True)``). The paper adds a projection head (a 2-layer MLP)
  for it; fedpeft's classifiers have none, and adding one would train more than the PEFT
  tensors, so ``z`` is the classifier's input itself.
- **Before a client's first round** its previous local model is its untrained one, the
  initial model (:meth:`MOON.init_client`), as in the official code
  (github.com/QinbinLi/MOON, ``main.py``: after round 1 the model pool holds every
  client's network, trained or not, so a client joining later contrasts against its own
  untrained network). In round 1 every client receives the initial model, so
  ``z_prev = z_glob``, ``l_con = log 2`` and its gradient vanishes (up to float rounding):
  round 1 trains as FedAvg, as in the official code, whose pool is empty in round 1 (the
  positive pair alone: a constant loss of 0). A client first sampled later is pushed away
  from the initial model.
- **mu** (default 1) and **tau** (default 0.5): the paper tunes mu over {0.1, 1, 5, 10}
  and reports mu = 5 for CIFAR-10 and mu = 1 for CIFAR-100 and Tiny-ImageNet, with
  tau = 0.5 throughout; 1 is its choice on the larger label sets.
- **Model buffer**: one previous model (the official code's default ``model_buffer_size``).
- **Reported loss**: the whole local objective ``CE + mu * l_con``.
- Memory: each client keeps a copy of its representation tensors (``own.*``), and a step
  computes two extra frozen forward passes (global and previous models).
"""

from __future__ import annotations

import torch

from fedpeft.config.methods.moon import MOONConfig
from fedpeft.engines.local import (
    OWN,
    GradientFn,
    Start,
    StepInput,
    backprop,
    head_logits,
    model_features,
    model_scale,
    optimizer_state,
    row_mean,
)
from fedpeft.methods.base import ClientData, FitResult, Job, Tensors, local_steps
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method

GLOB, PREV = "glob.", "prev."  # step constants: the received global and the previous local model

CLASSIFICATION_ONLY = {
    "causal_lm": "MOON's contrastive loss compares pooled sentence representations that a classifier's "
    "head reads; a causal LM has no such representation (it predicts every token)",
    "token_classification": "MOON's contrastive loss compares one pooled representation per example; a "
    "tagger has one per token",
    "extractive_qa": "MOON's contrastive loss compares one pooled representation per example; span "
    "extraction reads one per token",
}


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float) -> torch.Tensor:
    """``l_con`` per row ``(B,)`` of representations ``(B, H)``:
    ``-log(e^{s_g/tau} / (e^{s_g/tau} + e^{s_p/tau}))`` with ``s_g = cos(z, z_glob)`` and
    ``s_p = cos(z, z_prev)``; in stable form ``softplus((s_p - s_g) / tau)``."""
    s_glob = torch.nn.functional.cosine_similarity(z, z_glob, dim=-1)
    s_prev = torch.nn.functional.cosine_similarity(z, z_prev, dim=-1)
    return torch.nn.functional.softplus((s_prev - s_glob) / tau)


@register_method(MOONConfig)
class MOON(FedAvgPeft):
    paper = "Li, He, Song: Model-Contrastive Federated Learning (CVPR 2021)"
    refuses = CLASSIFICATION_ONLY

    def body_names(self) -> list[str]:
        """The trainable tensors the representation depends on (all but the head)."""
        return [n for n in [*self.shared_names, *self.personal_names] if not n.startswith("head.")]

    def init_client(self, model, initial: Tensors, client: ClientData) -> Tensors:
        """FedAvg's personal state, and the untrained model as the previous local one
        (``own.*``, its representation tensors)."""
        state = super().init_client(model, initial, client)
        state.update({OWN + n: initial[n].clone() for n in self.body_names()})
        return state

    def cohort_start(self, model, job: Job) -> Start:
        """FedAvg's start, with the received global and the previous local representation
        tensors as constants of every step."""
        params = {**job.received, **self.params_of(job.personal)}
        opt = optimizer_state(job.personal, params, job.context.train)
        names = self.body_names()
        consts = {**{GLOB + n: params[n] for n in names}, **{PREV + n: job.personal[OWN + n] for n in names}}
        return Start(params, opt, consts, local_steps(len(job.client.train), job.context.train))

    def step_gradients(self, model) -> GradientFn:
        """Backprop of ``CE + mu * row_mean(l_con)`` on the step's batch."""
        features, names, cfg = model_features(model), self.body_names(), self.cfg

        def objective(params: Tensors, consts: Tensors, batches: StepInput) -> torch.Tensor:
            batch = batches[0]
            z = features(params, batch)
            ce = model.loss(head_logits(params, z), batch)
            z_glob = features({n: consts[GLOB + n] for n in names}, batch)
            z_prev = features({n: consts[PREV + n] for n in names}, batch)
            return ce + cfg.mu * row_mean(contrastive_loss(z, z_glob, z_prev, cfg.tau), batch)

        return backprop(objective, model_scale(model))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """FedAvg's result; the client keeps its trained representation tensors as next
        round's previous model."""
        result = super().cohort_finish(job, params, opt, metrics)
        result.personal.update({OWN + n: params[n] for n in self.body_names()})
        return result
