"""FFA-LoRA: federated LoRA with ``A`` frozen at its random initialisation.

Paper: Sun, Qin, Li and Ding, "Improving LoRA in Privacy-preserving Federated Learning",
ICLR 2024 (docs/lora_family.md states it precisely, with where fedpeft departs).

LoRA's update of a module is ``s B A``. Averaging ``A`` and ``B`` apart is not averaging
``B A`` (``mean(B_k) mean(A_k) != mean(B_k A_k)``); with ``A`` the same fixed matrix on
every client it is: ``mean(B_k) A = mean(B_k A)``, and only ``B`` (with the head) is
trained and sent, half of LoRA's bytes. ``A`` keeps LoRA's random (Kaiming-uniform)
initialisation, drawn once by the server and handed to every client in the join
message, so that clients on other machines hold the very same ``A``.
"""

from __future__ import annotations

import torch

from fedpeft.config.methods.ffalora import FFALoRAConfig
from fedpeft.methods.base import ServerState, Tensors, read_tensors
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method
from fedpeft.peft.lora import LoraTerm, lora_layers

_JOIN = "join."


def frozen_a_names(model) -> list[str]:
    """The parameter names of every LoRA ``A`` of ``model``."""
    return [
        f"{name}.lora_A.{adapter}.weight"
        for name, layer in lora_layers(model).items()
        for adapter in layer.lora_A
    ]


@register_method(FFALoRAConfig)
class FFALoRA(FedAvgPeft):
    kind = "lora"
    refuses = {"dora": ""}

    # ----- messages: the one A, drawn by the server, sent once and copied into each client's model
    def join_message(self, server: ServerState) -> Tensors:
        return {k.removeprefix(_JOIN): v for k, v in server.extras.items() if k.startswith(_JOIN)}

    def join(self, model, message: Tensors) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, a in message.items():
                params[name].copy_(a)

    def prepare(self, model) -> None:
        super().prepare(model)
        fixed = set(frozen_a_names(model))
        for name, p in model.named_parameters():
            if name in fixed:
                p.requires_grad_(False)
        self.split_trainable(model)

    # ----- the one A, drawn by the server, sent once
    def init_server(self, model) -> ServerState:
        fixed = read_tensors(model, frozen_a_names(model))
        return ServerState(read_tensors(model, self.shared_names), {_JOIN + k: v for k, v in fixed.items()})

    # ----- export: the frozen A beside the trained B
    def lora_terms(self, model, tensors: Tensors) -> dict[str, list[LoraTerm]]:
        return super().lora_terms(model, {**read_tensors(model, frozen_a_names(model)), **tensors})
