"""Trainable modules added to (or selected in) the frozen backbone.

``make_trainable`` is the single place that turns a kind of parameter-efficient
fine-tuning into requires-grad flags and inserted modules; methods call it in
``prepare``.
"""

from __future__ import annotations

from fedpeft.config.methods.specs import Trainable
from fedpeft.peft.adapters import AdapterSpec, add_adapters
from fedpeft.peft.lora import LoraSpec, add_lora

__all__ = ["AdapterSpec", "LoraSpec", "Trainable", "make_trainable"]


def make_trainable(model, kind: Trainable, lora: LoraSpec, adapter: AdapterSpec) -> None:
    """Make ``model`` (a task model) train ``kind``; a classification head is always
    trainable (a causal LM's own LM head stays frozen)."""
    model_type = getattr(model.backbone.config, "model_type", "")
    if kind == "full":
        for p in model.backbone.parameters():
            p.requires_grad_(True)
    elif kind == "bitfit":
        for name, p in model.backbone.named_parameters():
            p.requires_grad_(name.endswith("bias"))
    elif kind == "adapter":
        add_adapters(model.backbone, adapter, model_type)
    elif kind == "lora":
        model.backbone = add_lora(model.backbone, lora)
    else:  # pragma: no cover - the config's Literal rules this out
        raise ValueError(f"unknown trainable kind {kind!r}")
    head = getattr(model, "head", None)
    for p in head.parameters() if head is not None else []:
        p.requires_grad_(True)
