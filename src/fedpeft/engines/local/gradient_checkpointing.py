"""Gradient checkpointing of a backbone trained through the local engine
(``model.gradient_checkpointing``).

A checkpointed layer recomputes its activations in the backward pass, after the forward
pass's ``functional_call`` (a client's tensors, or a cohort's stacked ones, in place of the
model's) and, in a folded pass, :class:`~fedpeft.engines.local.folding.ClientAxis` have
left; so the recomputation is given the tensors the layer held when it ran, and the
client axis again (:func:`checkpoint_contexts`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from fedpeft.engines.local.folding import FOLDED, ClientAxis
from fedpeft.models.backbone import BackboneError, checkpointed_layers


def enable_checkpointing(model: nn.Module) -> None:
    """Gradient checkpointing on every transformer layer of ``model`` (non-reentrant
    ``torch.utils.checkpoint``, recomputing with the tensors the forward pass ran with:
    :func:`checkpoint_contexts`). Set on the layers themselves rather than through
    ``gradient_checkpointing_enable``, which also hooks the embeddings to make their output
    require gradients (not needed without reentrant checkpoints). Hugging Face checkpoints
    a layer only while it is in training mode: the cohort engine sets that on these layers
    alone for its steps (:func:`checkpointing`), the rest of the model keeping its mode."""
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise BackboneError(
            f"model.gradient_checkpointing: {type(model).__name__}'s backbone has no layer that transformers "
            "can checkpoint"
        )
    for layer in layers:
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = functools.partial(
            checkpoint, use_reentrant=False, context_fn=functools.partial(checkpoint_contexts, layer)
        )


@contextmanager
def checkpointing(model: nn.Module) -> Iterator[None]:
    """The checkpointed layers of ``model`` in training mode for the duration, the rest as
    it is: Hugging Face checkpoints a layer only in training mode, and the engine's steps
    run in eval mode when no dropout is active (``model.gradient_checkpointing``)."""
    layers = [(layer, layer.training) for layer in checkpointed_layers(model)]
    for layer, _ in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer, before in layers:
            layer.training = before


def checkpoint_contexts(layer: nn.Module) -> tuple[AbstractContextManager, AbstractContextManager]:
    """``torch.utils.checkpoint``'s ``context_fn`` for ``layer``: the recomputation runs
    with the tensors the layer held when it ran (taken now, by reference) and, in a folded
    pass, under a :class:`ClientAxis` again."""
    held = [(m, n, t) for m in layer.modules() for n, t in m._parameters.items() if t is not None]
    clients = FOLDED.get()
    return nullcontext(), _as_in_forward(held, clients)


@contextmanager
def _as_in_forward(held: list[tuple[nn.Module, str, torch.Tensor]], clients: int | None) -> Iterator[None]:
    before = [(m, n, m._parameters[n]) for m, n, _ in held]
    for m, n, t in held:
        m._parameters[n] = t
    try:
        with ClientAxis(clients) if clients else nullcontext():
            yield
    finally:
        for m, n, t in before:
            m._parameters[n] = t
