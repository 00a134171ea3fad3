"""One client's local step as a pure function, what the cohort loop runs for a whole
cohort: the method's gradients (DP-SGD's under ``privacy.mode: sample``), then FedProx's
pull, clipping, SCAFFOLD's correction and the optimizer step (:func:`apply_gradients`).

    step(params, opt, consts, batches, anchor, correction, noise) -> (params, opt, loss)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedpeft.engines.local.dp import private_gradients
from fedpeft.engines.local.gradients import model_scale
from fedpeft.engines.local.jobs import RoundContext, StepInput, Tensors
from fedpeft.engines.local.optimizer import clip_gradients, optimizer_step

if TYPE_CHECKING:
    from fedpeft.engines.local.hooks import LocalMethod


def local_step(method: LocalMethod, model: torch.nn.Module, context: RoundContext):
    """One client's local step in round ``context`` as a pure function (what
    ``loop.run_cohort`` vmaps): the method's gradients (DP-SGD's, under ``privacy.mode:
    sample``), then :func:`apply_gradients`."""
    gradients, dp = method.step_gradients(model), context.sample_dp
    apply = apply_gradients(method, model, context)

    def step(
        params: Tensors,
        opt: Tensors,
        consts: Tensors,
        batches: StepInput,
        anchor: Tensors,
        correction: Tensors,
        noise: Tensors,
    ):
        if dp is not None:
            loss, grads = private_gradients(gradients, dp, params, consts, batches, noise)
        else:
            loss, grads = gradients(params, consts, batches)
        return apply(params, opt, loss, grads, anchor, correction)

    return step


def apply_gradients(method: LocalMethod, model: torch.nn.Module, context: RoundContext):
    """``apply(params, opt, loss, grads, anchor, correction) -> (params, opt, loss)``:
    what one client's local step does with its gradients, as a pure function. With FedProx
    (Li et al. 2020; ``train.prox_mu``), the gradient of ``mu/2 ||w - anchor||^2`` over the
    shared tensors joins the method's gradient before clipping; the loss reported stays
    the method's. With SCAFFOLD (``train.correction``), ``correction`` (``c - c_i`` per
    shared tensor) is added to the clipped gradient, so the step follows ``g - c_i + c``
    (clipping bounds the stochastic gradient, not the drift estimate). Then the optimizer
    step (``context.train``: the round's rate), and plain SGD at the method's own rate on
    :meth:`Method.sgd_rates`'s tensors."""
    cfg, skip_overflow = context.train, model_scale(model) != 1.0
    mu, rates = cfg.prox_mu, method.sgd_rates()

    def apply(
        params: Tensors,
        opt: Tensors,
        loss: torch.Tensor,
        grads: Tensors,
        anchor: Tensors,
        correction: Tensors,
    ):
        own = {n: params[n] - rates[n] * g for n, g in grads.items() if n in rates}
        stepped = {n: g for n, g in grads.items() if n not in rates}
        if anchor:
            stepped = {n: g + mu * (params[n] - anchor[n]) if n in anchor else g for n, g in stepped.items()}
        clipped = {}
        for group in clip_groups(method, stepped):  # each model of a client clipped on its own
            clipped.update(clip_gradients(group, cfg.max_grad_norm))
        if correction:
            clipped = {n: g + correction[n] if n in correction else g for n, g in clipped.items()}
        updated, new_opt = optimizer_step(params, clipped, opt, cfg)
        new_params = {**params, **updated, **own}
        if skip_overflow:  # float16: a step with an overflowed gradient changes nothing
            finite = torch.stack([torch.isfinite(g).all() for g in grads.values()]).all()
            new_params = {n: torch.where(finite, t, params[n]) for n, t in new_params.items()}
            new_opt = {n: torch.where(finite, t, opt[n]) for n, t in new_opt.items()}
        return new_params, new_opt, loss

    return apply


def clip_groups(method: LocalMethod, grads: Tensors) -> list[Tensors]:
    """``grads`` split by :meth:`Method.clip_group`: the gradients clipped together (as
    one ``clip_grad_norm_`` call would), in a fixed order."""
    groups: dict[str, Tensors] = {}
    for name, g in grads.items():
        groups.setdefault(method.clip_group(name), {})[name] = g
    return [groups[k] for k in sorted(groups)]


def without_client_axis(tensors: Tensors) -> Tensors:
    """A cohort of one's stacked tensors ``(1, ...)`` as its client's own: a cohort of one
    trains without ``vmap`` (which costs a little on every operation, and loops over the
    client for kernels it has no batching rule for, SDPA), its tensors without the client
    axis from the round's first step to its last."""
    return {n: t[0] for n, t in tensors.items()}


def with_client_axis(tensors: Tensors) -> Tensors:
    """:func:`without_client_axis` undone."""
    return {n: t.unsqueeze(0) for n, t in tensors.items()}
