"""Losses and gradients of a local step, as pure functions of the trained tensors.

The model runs through ``functional_call`` with a client's tensors in place of its own
trainable ones (the frozen ones are the model's, shared), so the same function serves one
client or, under ``vmap``, a cohort. :func:`backprop` and its variants are what a method's
:meth:`Method.step_gradients` builds its gradient from; :func:`first_order_grad` takes
them, in functorch or, for a quantised or checkpointed backbone, in plain autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch.func import functional_call, vjp

from fedpeft.engines.local.jobs import Batch, GradientFn, StepInput, Tensors
from fedpeft.models.backbone import checkpointed_layers
from fedpeft.models.causal import SCORED

#: float16's loss scale: static (a dynamic scaler only grows after thousands of steps, more
#: than a round has); a step whose gradients overflow is skipped (``step.apply_gradients``).
LOSS_SCALE = 2.0**8


def model_inputs(batch: Batch) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
    """A batch's forward-pass arguments: ids and attention mask, and the positions whose
    prediction is scored when the batch names them (a causal LM's LM head runs there only:
    ``fedpeft.models.causal.SCORED``)."""
    return (batch["input_ids"], batch["attention_mask"]), ({SCORED: batch[SCORED]} if SCORED in batch else {})


def prepare_step(model: torch.nn.Module, batches: StepInput, scored: list[int] | None = None) -> StepInput:
    """A step's batches with what the model computes of them outside ``vmap`` (its
    ``prepare_batch``: a causal LM's scored positions, whose count depends on the data;
    ``scored``: that count for each batch, when worked out beforehand)."""
    prepare = getattr(model, "prepare_batch", None)
    if prepare is None:
        return batches
    return tuple(prepare(b, k) for b, k in zip(batches, scored or [None] * len(batches), strict=True))


def model_loss(model: torch.nn.Module) -> Callable[[Tensors, Batch], torch.Tensor]:
    """``loss(params, batch)``: the model's own loss (``model.loss``: a classifier's
    cross-entropy, a causal LM's over response tokens) with ``params`` in place of its own
    trainable tensors (the frozen ones are the model's, shared)."""

    def loss(params: Tensors, batch: Batch) -> torch.Tensor:
        args, kwargs = model_inputs(batch)
        return model.loss(functional_call(model, params, args, kwargs), batch)

    return loss


def model_features(model: torch.nn.Module) -> Callable[[Tensors, Batch], torch.Tensor]:
    """``features(params, batch)``: the pooled representation ``(B, H)`` a classifier's
    head reads (``TaskModel.forward(pooled=True)``), with ``params`` in place of the
    model's trainable tensors; what a method with its own heads or a representation
    loss (MOON, FedMCP, FedRoD) builds on. Apply a head with :func:`head_logits`."""

    def features(params: Tensors, batch: Batch) -> torch.Tensor:
        return functional_call(model, params, (batch["input_ids"], batch["attention_mask"]), {"pooled": True})

    return features


def head_logits(params: Tensors, features: torch.Tensor, prefix: str = "head.") -> torch.Tensor:
    """The logits of the linear head whose tensors ``params`` holds under ``prefix``
    (``head.weight``, ``head.bias``) on ``features``."""
    return torch.nn.functional.linear(features, params[prefix + "weight"], params[prefix + "bias"])


def row_mean(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The mean of per-row ``values`` ``(B,)`` over the batch's real rows: a cohort's
    padded rows (weight 0) count for nothing, so a client's loss is the one it has alone."""
    if "weight" not in batch:
        return values.mean()
    weight = batch["weight"]
    return (values * weight).sum() / weight.sum().clamp_min(1.0)


def model_scale(model: torch.nn.Module) -> float:
    """The loss scale of ``model``'s precision: :data:`LOSS_SCALE` in float16, else 1."""
    return LOSS_SCALE if getattr(model, "precision", None) == torch.float16 else 1.0


#: Set while a quantised or checkpointed backbone trains (``run_cohort``): gradients by
#: plain autograd (:func:`needs_plain_autograd`).
PLAIN_AUTOGRAD: ContextVar[bool] = ContextVar("plain_autograd", default=False)


def quantised(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds quantised weights (bitsandbytes stores them as integers)."""
    return any(not p.is_floating_point() for p in model.parameters())


def plain_autograd_reason(model: torch.nn.Module) -> str:
    """Why ``model``'s training steps run in plain autograd, outside functorch, naming the
    setting ("" when they do not): a quantised backbone (bitsandbytes has no functorch
    rules) or one that checkpoints its layers (``torch.utils.checkpoint`` cannot run under
    ``vjp`` or ``vmap``)."""
    integers = {p.dtype for p in model.parameters() if not p.is_floating_point()}
    if integers:  # bitsandbytes stores LLM.int8() weights as int8, 4-bit ones packed in uint8
        kind = "int8" if torch.int8 in integers else "nf4"
        return f"model.quantization {kind} (bitsandbytes' kernels cannot be vmapped)"
    if checkpointed_layers(model):
        return "model.gradient_checkpointing (checkpoints cannot be vmapped)"
    return ""


def needs_plain_autograd(model: torch.nn.Module) -> bool:
    """Whether ``model``'s training steps run in plain autograd (:func:`plain_autograd_reason`)."""
    return bool(plain_autograd_reason(model))


@contextmanager
def plain_autograd(enabled: bool) -> Iterator[None]:
    """:data:`PLAIN_AUTOGRAD` set to ``enabled`` for the duration."""
    token = PLAIN_AUTOGRAD.set(enabled)
    try:
        yield
    finally:
        PLAIN_AUTOGRAD.reset(token)


def first_order_grad(
    objective: Callable[[Tensors], tuple[torch.Tensor, torch.Tensor]], params: Tensors
) -> tuple[Tensors, torch.Tensor]:
    """The gradient of ``objective(params)[0]`` (a scalar) with respect to ``params``, and
    ``objective(params)[1]``: ``torch.func.grad`` with ``has_aux``, for a gradient nothing
    differentiates further (a local step's). ``torch.func.grad`` records its backward pass
    for higher derivatives and holds the forward pass's saved tensors until it returns,
    which doubles a step's memory; here the backward pass records nothing and frees them
    as it goes (``vjp``'s ``retain_graph``, ``create_graph`` False). Works under ``vmap``.
    For a quantised or checkpointed backbone (:data:`PLAIN_AUTOGRAD`, outside any functorch
    transform: a cohort of one) it is plain autograd, the same gradient, through which
    kernels that have no functorch rule (bitsandbytes' quantised matmuls) and checkpoints run."""
    if PLAIN_AUTOGRAD.get() and torch._C._functorch.maybe_current_level() is None:
        leaves = {n: t.detach().requires_grad_(True) for n, t in params.items()}
        value, aux = objective(leaves)
        grads = torch.autograd.grad(value, list(leaves.values()), allow_unused=True)
        pairs = zip(leaves.items(), grads, strict=True)
        return {n: torch.zeros_like(t) if g is None else g for (n, t), g in pairs}, aux
    value, pullback, aux = vjp(objective, params, has_aux=True)
    (grads,) = pullback(torch.ones_like(value), retain_graph=False, create_graph=False)
    return grads, aux


def backprop(loss: Callable[[Tensors, Tensors, StepInput], torch.Tensor], scale: float = 1.0) -> GradientFn:
    """The gradient of ``loss(params, consts, batches)`` with respect to every tensor of
    ``params``; taken of ``scale * loss`` and divided back, so that float16 gradients do
    not underflow."""

    def gradients(params: Tensors, consts: Tensors, batches: StepInput):
        def scaled(p: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
            value = loss(p, consts, batches)
            return value * scale, value

        grads, value = first_order_grad(scaled, params)
        return value, {n: g / scale for n, g in grads.items()} if scale != 1.0 else grads

    return gradients


@dataclass(frozen=True)
class ModelLossGradients:
    """A local step's gradients (a :data:`GradientFn`) that are :func:`backprop` of the
    model's own loss on the step's batch (:func:`model_loss`), plus ``penalty(params,
    consts)`` when given (a term of the client's tensors alone, HETLoRA's rank-tail
    regulariser), with respect to the tensors named in ``group`` (None: every one; the
    others enter as constants and get no gradient, nor any step: FedRep's phases, RoLoRA's
    halves). The model's outputs enter only through its loss, so a folded cohort computes
    this for all its clients in one pass (:mod:`~fedpeft.engines.local.folding` reads
    ``penalty`` and ``group``); any other gradient a method takes cannot fold."""

    model: torch.nn.Module
    penalty: Callable[[Tensors, Tensors], torch.Tensor] | None = None
    group: frozenset[str] | None = None

    def __call__(self, params: Tensors, consts: Tensors, batches: StepInput):
        loss, penalty = model_loss(self.model), self.penalty
        fixed = {} if self.group is None else {n: t for n, t in params.items() if n not in self.group}
        trained = {n: t for n, t in params.items() if n not in fixed}

        def objective(p: Tensors, c: Tensors, b: StepInput) -> torch.Tensor:
            whole = {**fixed, **p} if fixed else p
            value = loss(whole, b[0])
            return value if penalty is None else value + penalty(whole, c)

        return backprop(objective, model_scale(self.model))(trained, consts, batches)


def group_backprop(model: torch.nn.Module, group: set[str]) -> ModelLossGradients:
    """:func:`backprop` of the model's loss with respect to the tensors named in ``group``
    only (:class:`ModelLossGradients`): a method whose local round trains part of its
    tensors (FedRep's phases, RoLoRA's halves)."""
    return ModelLossGradients(model, group=frozenset(group))


def backprop_reporting(
    objective: Callable[[Tensors, Tensors, StepInput], tuple[torch.Tensor, torch.Tensor]], scale: float = 1.0
) -> GradientFn:
    """:func:`backprop` of an ``objective`` that returns ``(value to differentiate, value to
    report)``: the reported loss need not be the differentiated one (Ditto, FedRoD and
    FedKD sum the losses of two models but report that of the one the client predicts with)."""

    def gradients(params: Tensors, consts: Tensors, batches: StepInput):
        def scaled(p: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
            value, reported = objective(p, consts, batches)
            return value * scale, reported

        grads, reported = first_order_grad(scaled, params)
        return reported, {n: g / scale for n, g in grads.items()} if scale != 1.0 else grads

    return gradients
