"""FeDeRA: federated LoRA initialised from the SVD of the pretrained weights.

Paper: Yan et al., "FeDeRA: Efficient Fine-tuning of Language Models in Federated
Learning Leveraging Weight Decomposition", 2024, sec. 4.1 (eqs. 6-10); METHODS.md.

LoRA on query and value, with ``A, B`` taken from the truncated SVD of each pretrained
weight (``fedpeft.peft.svd_init``) and the frozen weight replaced by the residual
``W_res = W0 - (beta / r) B A``, so the model's output at round 0 is the pretrained
model's. FedAvg then aggregates ``A``, ``B`` and the head.

Federated detail the paper leaves open: singular vectors are defined up to sign and
machines may disagree, so clients must not decompose on their own. The server
decomposes once (``init_server``, timed) and keeps the initial ``A, B`` as the *join
message*; each client, at first contact, derives its residual from that message
(``join``). Every client therefore starts bit-identical.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from pydantic import Field

from fedpeft.methods.base import MethodConfig, ServerState, Tensors, read_tensors
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import LoraSpec
from fedpeft.peft.svd_init import residual, svd_factors

_JOIN = "join."


class FeDeRAConfig(MethodConfig):
    """LoRA with SVD initialisation under FedAvg. Paper: FeDeRA (Yan et al., 2024)."""

    name: Literal["federa"] = "federa"
    lora: LoraSpec = Field(
        default_factory=lambda: LoraSpec(r=8, alpha=8),
        description="Rank r and beta (= lora.alpha); the paper uses beta = r, i.e. scale 1.",
    )


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{module name: PEFT LoRA layer}`` for every LoRA-adapted linear of ``model``."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


class FeDeRA(FedAvgPeft):
    name = "federa"
    config_cls = FeDeRAConfig
    kind = "lora"

    # ----- server: decompose once
    def init_server(self, model) -> ServerState:
        start = time.perf_counter()
        initial: Tensors = {}
        with torch.no_grad():
            for name, layer in lora_layers(model).items():
                a, b = svd_factors(pretrained_weight(layer), layer.r["default"])
                layer.lora_A["default"].weight.copy_(a)
                layer.lora_B["default"].weight.copy_(b)
                initial[f"{name}.lora_A.default.weight"] = a.clone()
                initial[f"{name}.lora_B.default.weight"] = b.clone()
        self.setup_info = {"time_decompose": time.perf_counter() - start}
        extras = {_JOIN + k: v for k, v in initial.items()}
        return ServerState(read_tensors(model, self.shared_names), extras)

    def join_message(self, server: ServerState) -> Tensors:
        return {k.removeprefix(_JOIN): v for k, v in server.extras.items() if k.startswith(_JOIN)}

    # ----- client: derive the residual from what the server sent
    def join(self, model, message: Tensors) -> None:
        with torch.no_grad():
            for name, layer in lora_layers(model).items():
                a = message[f"{name}.lora_A.default.weight"]
                b = message[f"{name}.lora_B.default.weight"]
                base = layer.get_base_layer()
                base.weight.copy_(residual(pretrained_weight(layer), a, b, layer.scaling["default"]))


def pretrained_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's original ``W0``, kept aside the first time its weight becomes a residual,
    so that decomposing or joining again (a resumed or repeated run) starts from ``W0``."""
    base = layer.get_base_layer()
    if not hasattr(base, "_fedpeft_w0"):
        base._fedpeft_w0 = base.weight.detach().clone()
    return base._fedpeft_w0
