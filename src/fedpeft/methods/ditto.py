"""Ditto: a global model by FedAvg and a personal model pulled towards it.

Paper: Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021 (Algorithm 1); one of the personalised baselines beside
FedRep and FedRoD (docs/two_modules.md).

Each client holds two copies of the trainable tensors (LoRA, adapters, BitFit biases or
every weight: ``trainable``, plus the head):

- the **global model** ``w`` (shared): the server averages it as in FedAvg; locally it takes
  plain steps on the client's loss ``F_i(w)``;
- the **personal model** ``v_i`` (kept under ``own.<parameter name>`` entries of the
  personal state, never sent): it takes steps on ``F_i(v) + lambda/2 ||v - w^t||^2``, where
  ``w^t`` is the global model the client received this round, a constant of the round.

Each batch gives one step of each model, as in the official code
(github.com/litian96/ditto, ``flearn/trainers_MTL/ditto.py``: per batch, a step of the
personal model on its penalised gradient, then one of the global model). Here the two
steps are one joint pure step (:meth:`Ditto.step_gradients`): the gradient of
``F_i(w) + F_i(v) + lambda/2 ||v - w^t||^2`` with respect to both models, which is
``grad F_i(w)`` for ``w`` and ``grad F_i(v) + lambda (v - w^t)`` for ``v``, then each
model's gradients clipped to ``train.max_grad_norm`` on their own (:meth:`Ditto.clip_group`)
and ``train.optimizer`` on both. AdamW and SGD update every tensor from its own gradient
and state, so the joint step is two separate optimizers with the same settings, one per
model: neither model's step depends on the other's (but in float16 a step whose gradients
overflow is skipped for both). A client is scored with ``v`` (:meth:`Ditto.eval_state`);
its copy of the global model is scored beside it as ``local_global``.

Readings and choices:

- **Same steps for both models.** Algorithm 1 lets the personal solver take its own number
  of steps ``s``; here ``w`` and ``v`` step together, one step each per batch, with the
  same optimizer settings (``train``). The paper's solver is SGD; AdamW (the default
  ``train.optimizer``) sees the penalised gradient above.
- **lambda** (``lam``, default 1). The paper selects lambda per device on validation
  data, from {0.1, 1, 2} without attacks (from {0.05, 0.1, 0.2} under strong attacks), with
  a fixed 0.1 or 1 for devices with few validation examples; the official scripts for
  clean data run a fixed ``--lam=1`` (``run_fashion_clean_ditto_lam1.sh``,
  ``run_vehicle_clean_ditto_lam1.sh``). fedpeft has one lambda for all clients. ``lam: 0``
  is Local-only training of ``v`` next to FedAvg; a large ``lam`` keeps ``v`` at ``w^t``.
- **Where v starts** (``personal_init``). ``initial`` (default): every ``v_i`` starts as the
  initial model ``w^0`` (Algorithm 1 takes the ``v_i^0`` as an input; fedpeft takes ``w^0``
  for all), so a client never sampled is scored with the untrained initial model.
  ``received``: ``v_i`` starts as the first global model the client receives, and a client
  that has not trained is scored with the global model.
- **head: personal** keeps the head of ``w`` on the client too (never sent); ``w^t`` is then
  the received global tensors plus the client's own ``w``-head at the start of the round.
  ``v`` always holds a head of its own.
- **Reported loss**: the personal model's ``F_i(v)`` on the step's batch (without the
  penalty), the loss of the model the client predicts with.
- Ephemeral state: one optimizer state over both models (per tensor, so two optimizers'
  worth), reset every round or kept with ``train.optimizer_state: keep`` (``opt.*``
  entries; ``v``'s under ``opt.<key>.own.*``).
"""

from __future__ import annotations

import torch

from fedpeft.config.methods.ditto import DittoConfig
from fedpeft.engines.local import (
    OWN,
    GradientFn,
    Start,
    StepInput,
    backprop_reporting,
    model_loss,
    model_scale,
    optimizer_state,
)
from fedpeft.methods.base import ClientData, FitResult, Job, Tensors, local_steps
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method

ANCHOR = "anchor."  # step constants: the global model w^t received this round


def proximal(v: Tensors, anchor: Tensors) -> torch.Tensor:
    """``||v - anchor||^2`` summed over every tensor."""
    return sum(((t - anchor[n]) ** 2).sum() for n, t in v.items())


@register_method(DittoConfig)
class Ditto(FedAvgPeft):
    paper = (
        "Li, Hu, Beirami, Smith: Ditto: Fair and Robust Federated Learning Through Personalization "
        "(ICML 2021)"
    )

    def model_names(self) -> list[str]:
        """The tensors of one model (``w``'s names; ``v`` holds the same under ``own.``)."""
        return [*self.shared_names, *self.personal_names]

    # ----- client state
    def own_model(self, personal: Tensors) -> Tensors:
        """The personal model ``v`` kept in a personal state, by parameter name ({} if none yet)."""
        return {n.removeprefix(OWN): t for n, t in personal.items() if n.startswith(OWN)}

    def init_client(self, model, initial: Tensors, client: ClientData) -> Tensors:
        """Personal parameters of ``w`` (a personal head) and, with ``personal_init:
        initial``, ``v = w^0``."""
        state = {n: initial[n].clone() for n in self.personal_names}
        if self.cfg.personal_init == "initial":
            state.update({OWN + n: initial[n].clone() for n in self.model_names()})
        return state

    # ----- the local step, as pure functions (vectorised over a cohort by the engine)
    def optimised_names(self) -> list[str]:
        return [*self.model_names(), *(OWN + n for n in self.model_names())]

    def clip_group(self, name: str) -> str:
        """``w`` and ``v`` are clipped each on its own, as two optimizers would."""
        return "personal" if name.startswith(OWN) else "global"

    def cohort_start(self, model, job: Job) -> Start:
        """``w`` (received, plus its personal head) and ``v`` (kept, or ``w`` for a client's
        first round with ``personal_init: received``) trained side by side; ``w^t``, the
        ``w`` entering the round, a constant of every step."""
        w = {**job.received, **self.params_of(job.personal)}
        v = self.own_model(job.personal) or {n: t.clone() for n, t in w.items()}
        params = {**w, **{OWN + n: t for n, t in v.items()}}
        opt = optimizer_state(job.personal, params, job.context.train)
        consts = {ANCHOR + n: t for n, t in w.items()}
        return Start(params, opt, consts, local_steps(len(job.client.train), job.context.train))

    def step_gradients(self, model) -> GradientFn:
        """``grad F(w)`` for ``w`` and ``grad F(v) + lambda (v - w^t)`` for ``v``, from one
        backprop of ``F(w) + F(v) + lambda/2 ||v - w^t||^2``; reports ``F(v)``."""
        loss, names, lam = model_loss(model), self.model_names(), self.cfg.lam

        def objective(params: Tensors, consts: Tensors, batches: StepInput):
            batch = batches[0]
            w = {n: params[n] for n in names}
            v = {n: params[OWN + n] for n in names}
            anchor = {n: consts[ANCHOR + n] for n in names}
            personal = loss(v, batch)
            return loss(w, batch) + personal + lam / 2 * proximal(v, anchor), personal

        return backprop_reporting(objective, model_scale(model))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """``w`` up (its shared tensors); ``v`` (and a personal ``w``-head) stay."""
        result = super().cohort_finish(job, params, opt, metrics)
        result.personal.update({OWN + n: params[OWN + n] for n in self.model_names()})
        return result

    # ----- evaluation
    def global_copy(self, received: Tensors, personal: Tensors) -> Tensors:
        return {**received, **self.params_of(personal)}

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        """The personal model ``v`` (before it exists, with ``personal_init: received``:
        the global model the client would start it from)."""
        return self.own_model(personal) or self.global_copy(received, personal)

    def extra_eval_states(self, model, received: Tensors, personal: Tensors, client: ClientData) -> dict:
        """The client's copy of the global model ``w``, reported as ``local_global``."""
        return {"global": self.global_copy(received, personal)}
