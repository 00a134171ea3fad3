"""Folded cohorts: the frozen backbone runs once on every client's batch, folded into one.

``vmap`` (:mod:`fedpeft.engines.local.loop`) batches a cohort through every operation of the
model, which needs a batching rule for each kernel; quantised linears (bitsandbytes)
and fused attention (SDPA, flash) have none. A folded cohort needs none: the cohort's
batches ``(C, B, ...)`` are folded into one batch of ``C x B`` rows, client after client,
and the model runs on it once, with the stacked trained tensors ``(C, ...)`` in place of
its own. A frozen module sees an ordinary batch and runs its own kernel (a 4-bit matmul,
SDPA); only an operation that reads a trained tensor runs per client, as one batched
matmul over the client axis (:class:`ClientAxis`):

- ``F.linear`` with a stacked weight ``(C, out, in)`` (a LoRA factor, an adapter's
  projection, the classifier head) or bias ``(C, out)`` (BitFit): ``x`` viewed as
  ``(C, rows, in)``, ``bmm``;
- ``F.layer_norm`` with a stacked weight or bias ``(C, H)``: normalised as usual, then
  each client's scale and shift.

The clients' losses are independent, so the gradient of their sum with respect to the
stacked tensors holds each client's own gradient; the rest of a step (FedProx, clipping,
SCAFFOLD, the optimizer: :func:`~fedpeft.engines.local.step.apply_gradients`) is elementwise
per client and stays vmapped. A method folds when its local step is plain backprop of
the model's loss, plus a term of the client's tensors alone where it has one (HETLoRA's
rank-tail regulariser; its clients' ranks differ, padded to the server's and masked), with
respect to all or a group of its tensors (:class:`ModelLossGradients`), and every tensor it
trains is a linear's or layer norm's weight or bias (:func:`fold_refusal` says why not
otherwise: ``fedpeft methods`` lists it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode

from fedpeft.engines.local.gradients import ModelLossGradients, model_inputs, model_scale
from fedpeft.engines.local.jobs import Batch, RoundContext, StepInput, Tensors
from fedpeft.engines.local.step import apply_gradients
from fedpeft.models.causal import SCORED

if TYPE_CHECKING:
    from fedpeft.engines.local.hooks import LocalMethod

F = nn.functional
#: The number of clients of the folded forward pass under way (None: none).
FOLDED: ContextVar[int | None] = ContextVar("folded_clients", default=None)


class ClientAxis(TorchFunctionMode):
    """While active, a linear or layer norm whose weight or bias carries a leading client
    axis of ``clients`` runs each client's rows (the input's, client after client) with
    that client's tensors; every other operation runs as it is."""

    def __init__(self, clients: int):
        super().__init__()
        self.clients = clients

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return self.linear(*args, **kwargs)
        if func is F.layer_norm:
            return self.layer_norm(*args, **kwargs)
        return func(*args, **kwargs)

    def per_client(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``(C x rows, ..., H)`` as ``(C, rows x ..., H)``."""
        return x.reshape(self.clients, -1, x.shape[-1])

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        stacked_bias = bias is not None and bias.dim() == 2
        if weight.dim() == 2 and not stacked_bias:
            return F.linear(x, weight, bias)
        rows = self.per_client(x)
        out = torch.bmm(rows, weight.transpose(1, 2)) if weight.dim() == 3 else F.linear(rows, weight)
        if bias is not None:
            out = out + (bias.unsqueeze(1) if stacked_bias else bias)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def layer_norm(
        self,
        x: torch.Tensor,
        shape: list[int],
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        eps: float = 1e-5,
    ) -> torch.Tensor:
        stacked = [t is not None and t.dim() == len(shape) + 1 for t in (weight, bias)]
        if not any(stacked):
            return F.layer_norm(x, shape, weight, bias, eps)
        if len(shape) != 1:
            raise ValueError(f"a folded cohort's layer norm over {list(shape)}: only the last dimension")
        out = self.per_client(F.layer_norm(x, shape, None, None, eps))
        if weight is not None:
            out = out * (weight.unsqueeze(1) if stacked[0] else weight)
        if bias is not None:
            out = out + (bias.unsqueeze(1) if stacked[1] else bias)
        return out.reshape(x.shape)


def fold_refusal(method: LocalMethod, model: nn.Module) -> str:
    """Why ``method`` (prepared on ``model``) cannot train in folded cohorts; "" when it can."""
    own = f"method {method.name} takes its own gradients"
    try:
        gradients = method.step_gradients(model)
    except RuntimeError as err:  # picked within its own round (RoLoRA's half, FedRep's phase)
        return f"{own} ({err})"
    if not isinstance(gradients, ModelLossGradients):
        return f"{own} (not plain backprop of the model's loss)"
    modules = dict(model.named_modules())
    for name in [*method.shared_names, *method.personal_names]:
        owner, _, attr = name.rpartition(".")
        module = modules.get(owner)
        if not (isinstance(module, nn.Linear | nn.LayerNorm) and attr in ("weight", "bias")):
            kind = type(module).__name__ if module is not None else "no module"
            return (
                f"method {method.name} trains {name} ({kind}), which is not a linear's or layer "
                "norm's weight or bias"
            )
    return ""


def fold(batch: Batch) -> Batch:
    """A cohort's batch ``(C, B, ...)`` as one of ``C x B`` rows, client after client; its
    :data:`SCORED` positions ``(C, K)`` (flat in each client's ``B x L`` tokens) as flat
    positions ``(C x K,)`` in the folded batch (a padding position, -1, stays -1)."""
    out = {k: v.flatten(0, 1) for k, v in batch.items() if k != SCORED}
    if SCORED in batch:
        scored, tokens = batch[SCORED], batch["input_ids"][0].numel()
        offsets = torch.arange(scored.shape[0], device=scored.device).unsqueeze(1) * tokens
        out[SCORED] = torch.where(scored >= 0, scored + offsets, -1).flatten()
    return out


def cohort_outputs(model: nn.Module, stacked: Tensors, batch: Batch) -> torch.Tensor:
    """The model's outputs for each client ``(C, B, ...)`` (``(C, K, V)`` at a causal LM's
    scored positions): ``batch`` ``(C, B, ...)`` folded, run once with the stacked tensors
    ``(C, ...)`` in place of the model's."""
    clients = batch["input_ids"].shape[0]
    args, kwargs = model_inputs(fold(batch))
    with ClientAxis(clients):
        out = functional_call(model, stacked, args, kwargs)
    return out.unflatten(0, (clients, -1))


@contextmanager
def folded_pass(clients: int) -> Iterator[None]:
    """:data:`FOLDED` set for the duration (a checkpointed layer's recomputation in the
    backward pass reads it); outside any compiled code, which cannot trace a ``ContextVar``."""
    token = FOLDED.set(clients)
    try:
        yield
    finally:
        FOLDED.reset(token)


def folded_gradients(
    model: nn.Module,
    stacked: Tensors,
    batch: Batch,
    scale: float = 1.0,
    penalty: Callable[[Tensors, Tensors], torch.Tensor] | None = None,
    consts: Tensors | None = None,
):
    """Each client's loss ``(C,)`` and its gradients (stacked, ``(C, ...)``) with respect to
    its tensors in ``stacked``: one backward pass of the sum of the clients' losses
    (``scale`` times it, divided back: float16's loss scale), each plus its
    ``penalty(tensors, consts)`` when given (a :class:`ModelLossGradients`' penalty)."""
    leaves = {n: t.detach().requires_grad_(True) for n, t in stacked.items()}
    losses = vmap(model.loss)(cohort_outputs(model, leaves, batch), batch)
    if penalty is not None:
        losses = losses + vmap(penalty)(leaves, consts)
    grads = torch.autograd.grad(losses.sum() * scale, list(leaves.values()), allow_unused=True)
    pairs = zip(leaves.items(), grads, strict=True)
    out = {n: torch.zeros_like(t) if g is None else g for (n, t), g in pairs}
    return losses.detach(), {n: g / scale for n, g in out.items()} if scale != 1.0 else out


@cache
def compiled_gradients():
    """:func:`folded_gradients` compiled by ``torch.compile`` (``train.compile``), once per
    process; its shapes are dynamic, so a new cohort size or batch width does not compile
    it again (a new model does: the compiled code is guarded on it). Python floats (a
    method's settings, as HETLoRA's penalty weight) compile as constants: as symbols,
    inductor cannot multiply a tensor by them."""
    compiled = torch.compile(folded_gradients, dynamic=True)

    def gradients(*args):
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args)

    return gradients


def folded_step(method: LocalMethod, model: nn.Module, context: RoundContext):
    """A cohort's local step (:func:`~fedpeft.engines.local.step.local_step`'s signature, every
    input stacked ``(C, ...)``) by folding: the gradients of all clients in one forward and
    backward pass of the model (compiled with ``train.compile``), then each client's
    update, vmapped."""
    if refusal := fold_refusal(method, model) or (context.sample_dp and "privacy.mode sample"):
        raise ValueError(f"a folded cohort: {refusal}")
    apply, scale = vmap(apply_gradients(method, model, context)), model_scale(model)
    objective = method.step_gradients(model)  # a ModelLossGradients (fold_refusal)
    optimised = set(method.optimised_names())
    if objective.group is not None:
        optimised &= objective.group
    gradients = compiled_gradients() if context.train.compile else folded_gradients

    def step(params, opt, consts, batches: StepInput, anchor, correction, noise):
        (batch,) = batches
        with folded_pass(batch["input_ids"].shape[0]):
            losses, grads = gradients(model, params, batch, scale, objective.penalty, consts)
        grads = {n: g for n, g in grads.items() if n in optimised}
        return apply(params, opt, losses, grads, anchor, correction)

    return step
