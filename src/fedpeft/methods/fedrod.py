"""FedRoD: a generic model trained with a balanced loss, plus a personal head on top.

Paper: Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR 2022 (sec. 4); a baseline of FDLoRA (docs/two_modules.md).

The model gets a second linear head, the **personal head** ``p`` (``model.personal_head``,
added in :meth:`FedRoD.prepare`). Per client:

- **generic model** (shared, averaged as in FedAvg): the body (LoRA, adapters, BitFit
  biases or every weight: ``trainable``) and the generic head ``g`` (``head.*``), trained
  with the *balanced softmax* loss ``CE(g(z) + log pi_i, y)``, ``pi_i`` the client's label
  prior: the generic model learns class-balanced scores, undoing the client's label skew;
- **personal head** (personal, never sent): trained with plain cross-entropy on
  ``g(z).detach() + p(z.detach())``, so it gets no gradient into the body or the generic
  head, and those get none from it.

One local step backprops both losses at once (the two parts share no gradient path), and
each part's gradients are clipped to ``train.max_grad_norm`` on their own
(:meth:`FedRoD.clip_group`). The client's model predicts with ``g(z) + p(z)``; the global
model is the generic model alone.

Readings and choices:

- **The client's model as one classifier.** ``TaskModel`` predicts with its one head, and
  ``g(z) + p(z) = (W_g + W_p) z + (b_g + b_p)``, so the client's model (:meth:`eval_state`,
  and its export with ``export.personal``) is the generic model with the head
  ``head = g + p`` (the personal head's tensors come along; the forward pass does not read
  them). The generic model alone is scored beside it on the client's test split
  (``local_generic``).
- **The label prior** ``pi_i`` is the label frequency of the client's training split,
  ``pi_c ∝ max(n_c, prior_floor)``: a class the client never saw gets the count
  ``prior_floor`` (default 0.1, a tenth of an example, so it stays rarer than any class the
  client has, whatever its size) instead of ``log 0 = -inf``, which would also turn a
  cohort's padded rows into NaNs. A constant of the client's steps (``Start.consts``).
- **The personal head starts at zero**, so a client that has not trained predicts with the
  generic model.
- **head: personal** (an ablation; the paper shares the generic head) keeps the generic
  head on the client too: only the body is averaged and there is no global model.
- **Reported loss**: the cross-entropy of the client's model ``g + p`` on the step's batch.
- Ephemeral state: one optimizer state over all trainable tensors. AdamW and SGD update
  every tensor from its own gradient and state, and each part is clipped on its own, so
  this steps the two parts as two separate optimizers with the same settings would.
"""

from __future__ import annotations

import torch
from torch import nn

from fedpeft.config.methods.fedrod import FedRoDConfig
from fedpeft.engines.local import (
    Batch,
    GradientFn,
    Start,
    StepInput,
    backprop_reporting,
    head_logits,
    model_features,
    model_scale,
    optimizer_state,
    row_mean,
)
from fedpeft.methods.base import ClientData, Job, ServerState, Tensors, local_steps
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method

PERSONAL = "personal_head."  # parameter prefix of the personal head
LOG_PRIOR = "log_prior"  # step constant: the client's log label prior (C,)

HEAD_NEEDED = {
    "causal_lm": "FedRoD's generic and personal heads are classification heads over a pooled "
    "representation; a causal LM predicts with its own, frozen LM head",
    "token_classification": "FedRoD's balanced loss uses a client's prior over example labels; a tagger's "
    "labels are per token",
    "extractive_qa": "FedRoD's balanced loss uses a prior over class labels; span extraction has none",
}


def label_log_prior(labels: torch.Tensor, num_classes: int, floor: float) -> torch.Tensor:
    """``log pi`` ``(C,)`` with ``pi_c = max(n_c, floor) / sum_k max(n_k, floor)``, ``n_c``
    the count of label ``c`` in ``labels``."""
    counts = torch.bincount(labels.cpu().long(), minlength=num_classes).float()
    counts = counts.clamp_min(floor)
    return (counts / counts.sum()).log()


def balanced_softmax_loss(logits: torch.Tensor, log_prior: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The balanced softmax loss ``CE(logits + log pi, y)``, averaged over the batch's real rows."""
    losses = nn.functional.cross_entropy(logits + log_prior, batch["labels"], reduction="none")
    return row_mean(losses, batch)


@register_method(FedRoDConfig)
class FedRoD(FedAvgPeft):
    paper = (
        "Chen & Chao: On Bridging Generic and Personalized Federated Learning for Image Classification "
        "(ICLR 2022)"
    )
    refuses = HEAD_NEEDED

    def prepare(self, model) -> None:
        """The trainable body and generic head (``FedAvgPeft``), then the personal head: a
        linear layer like the generic head, at zero."""
        head = getattr(model, "head", None)
        if not isinstance(head, nn.Linear):
            raise ValueError("method fedrod: the task model has no linear classification head")
        super().prepare(model)
        model.personal_head = nn.Linear(
            head.in_features, head.out_features, device=head.weight.device, dtype=head.weight.dtype
        )
        nn.init.zeros_(model.personal_head.weight)
        nn.init.zeros_(model.personal_head.bias)
        self.split_trainable(model)
        self.zero_personal = {
            PERSONAL + n: torch.zeros(p.shape, dtype=p.dtype)
            for n, p in model.personal_head.named_parameters()
        }
        self.num_classes = head.out_features

    def split_trainable(self, model) -> None:
        """The personal head is personal; with ``head: personal`` the generic head too."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        personal = [n for n in names if n.startswith(PERSONAL)]
        if self.cfg.head == "personal":
            personal += [n for n in names if n.startswith("head.")]
        self.personal_names = personal
        self.shared_names = [n for n in names if n not in personal]

    def global_state(self, server: ServerState) -> Tensors | None:
        """The generic model (the personal head at zero), unless its head is personal."""
        if self.cfg.head == "personal":
            return None
        return {**server.tensors, **self.zero_personal}

    # ----- the local step, as pure functions (vectorised over a cohort by the engine)
    def clip_group(self, name: str) -> str:
        """The generic model (body and generic head) and the personal head are clipped
        each on its own."""
        return "personal" if name.startswith(PERSONAL) else "generic"

    def cohort_start(self, model, job: Job) -> Start:
        """FedAvg's start, with the client's log label prior as a constant of its steps."""
        params = {**job.received, **self.params_of(job.personal)}
        opt = optimizer_state(job.personal, params, job.context.train)
        prior = label_log_prior(job.client.train.labels, self.num_classes, self.cfg.prior_floor)
        return Start(params, opt, {LOG_PRIOR: prior}, local_steps(len(job.client.train), job.context.train))

    def step_gradients(self, model) -> GradientFn:
        """One backprop of ``BSM(g(z)) + CE(g(z).detach() + p(z.detach()))``; reports the
        second term, the client model's cross-entropy."""
        features = model_features(model)

        def objective(params: Tensors, consts: Tensors, batches: StepInput):
            batch = batches[0]
            z = features(params, batch)
            generic = head_logits(params, z)
            personal = head_logits(params, z.detach(), PERSONAL)
            client = model.loss(generic.detach() + personal, batch)
            return balanced_softmax_loss(generic, consts[LOG_PRIOR], batch) + client, client

        return backprop_reporting(objective, model_scale(model))

    # ----- evaluation
    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        """The client's model ``g + p`` as one classifier: the generic model with the head
        ``head = g + p`` (module docstring)."""
        state = {**received, **self.params_of(personal)}
        for part in ("weight", "bias"):
            state["head." + part] = state["head." + part] + state[PERSONAL + part]
        return state

    def extra_eval_states(self, model, received: Tensors, personal: Tensors, client: ClientData) -> dict:
        """The generic model alone on the client's test split (``local_generic``)."""
        return {"generic": {**received, **self.params_of(personal)}}
