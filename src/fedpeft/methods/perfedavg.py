"""Per-FedAvg-LoRA: model-agnostic meta-learning (MAML) over the LoRA adapter.

Paper: Fallah et al., "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", 2020; the LoRA variant is a baseline of PF2LoRA
(docs/personalized.md). The federation looks for a common adapter that does well *after one local
SGD step*. One local step on two mini-batches ``D1, D2``:

    theta'  = theta - alpha * grad L(theta; D1)                  (inner, adaptation)
    theta  <- theta - beta * d/dtheta L(theta'; D2)               (outer: train.optimizer, train.lr)

``order: 2`` differentiates through the inner step (``(I - alpha H) grad L(theta'; D2)``,
one Hessian-vector product by autograd); ``order: 1`` is the first-order variant
(``grad L(theta'; D2)``, ignoring the inner step's dependence on ``theta``). The server
averages ``theta`` (LoRA + head) like FedAvg. Evaluation is personalised: each client
first takes one adaptation step ``theta - alpha * grad L(theta; D)`` on a batch of its own
training data, then tests. The global model's score is reported beside it, unadapted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import grad, grad_and_value

from fedpeft.config.methods.perfedavg import PerFedAvgConfig
from fedpeft.data.task import make_batch, take_draws
from fedpeft.engines.local import GradientFn, Job, model_inputs, model_loss, prepare_step
from fedpeft.methods.base import ClientData, Tensors, load_tensors
from fedpeft.methods.capabilities import OWN_BATCHES, OWN_GRADIENTS
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


def maml_grads(
    loss: Callable[[Tensors, dict], torch.Tensor],
    params: Tensors,
    batch1: dict,
    batch2: dict,
    inner_lr: float,
    order: int,
) -> tuple[torch.Tensor, Tensors]:
    """The outer loss ``L(theta'; batch2)``, ``theta' = theta - inner_lr * grad L(theta;
    batch1)``, and its gradient with respect to each tensor of ``params``, as a pure
    function (``torch.func``, so it vmaps over clients). ``order: 1`` treats ``theta'`` as
    a leaf, giving ``grad L(theta'; batch2)``; ``order: 2`` differentiates through the
    inner step. ``loss(tensors, batch)`` is the batch loss with ``tensors`` in place."""

    def outer(theta: Tensors) -> torch.Tensor:
        g = grad(lambda t: loss(t, batch1))(theta)
        if order == 1:
            g = {n: t.detach() for n, t in g.items()}
        return loss({n: t - inner_lr * g[n] for n, t in theta.items()}, batch2)

    grads, value = grad_and_value(outer)(params)
    return value, grads


@register_method(PerFedAvgConfig)
class PerFedAvg(FedAvgPeft):
    refuses = {"fp16": OWN_GRADIENTS, "sample_dp": OWN_BATCHES}  # no loss scaling; (D1, D2) a step
    higher_order = True  # a gradient of a gradient
    kind = "lora"

    def _trainable(self, model) -> dict[str, torch.nn.Parameter]:
        """The meta-learned parameters: the shared ones and a personal head, if any."""
        names = set(self.shared_names) | set(self.personal_names)
        return {n: p for n, p in model.named_parameters() if n in names}

    # ----- the local step, as pure functions (vectorised over a cohort by the engine)
    def step_draws(self, job: Job, steps: int, generator: torch.Generator):
        return self.batch_pairs(job.client, job.context.train.batch_size, steps, generator)

    def step_gradients(self, model) -> GradientFn:
        """The MAML gradient of the step's ``(D1, D2)`` (:func:`maml_grads`)."""
        loss, cfg = model_loss(model), self.cfg

        def gradients(params: Tensors, consts: Tensors, batches):
            return maml_grads(loss, params, *batches, cfg.inner_lr, cfg.order)

        return gradients

    def batch_pairs(self, client: ClientData, size: int, steps: int, generator: torch.Generator):
        """``(D1, D2)`` for each step: two batches of ``size`` (``train.batch_size``: the
        paper's Per-FedAvg), or with ``split_batch`` the two halves of one batch, so that a
        step sees as many examples as another method's step. A one-row batch (the end of a
        pass over ``n = 1 mod batch_size`` examples) cannot be halved and is skipped."""
        if not self.cfg.split_batch:
            draws = take_draws(client.train, size, 2 * steps, generator)
            for _ in range(steps):
                yield next(draws), next(draws)
            return
        if len(client.train) < 2:
            raise ValueError(
                f"method.split_batch: client {client.cid} has {len(client.train)} example(s), needs 2"
            )
        draws = (d for d in take_draws(client.train, size, 2 * steps, generator) if len(d.rows) >= 2)
        for _ in range(steps):
            yield next(draws).halves()

    def adapt_size(self) -> int:
        """Rows of the adaptation step: those of a training step's inner batch ``D1``."""
        return self.train.batch_size // 2 if self.cfg.split_batch else self.train.batch_size

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        """One adaptation step on a batch of the client's training data (seeded by the
        client id, so evaluation is reproducible), then the adapted tensors."""
        load_tensors(model, {**received, **self.params_of(personal)})
        rows = torch.randperm(len(client.train), generator=torch.Generator().manual_seed(client.cid))
        (batch,) = prepare_step(model, (make_batch(client.train, rows[: self.adapt_size()]),))
        params = self._trainable(model)
        model.eval()  # adapt without dropout noise
        args, kwargs = model_inputs(batch)
        loss = model.loss(model(*args, **kwargs), batch)
        grads = torch.autograd.grad(loss, list(params.values()))
        return {
            n: (p - self.cfg.inner_lr * g).detach().cpu()
            for (n, p), g in zip(params.items(), grads, strict=True)
        }
