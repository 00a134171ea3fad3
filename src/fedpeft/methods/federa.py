"""FeDeRA: federated LoRA initialised from the SVD of the pretrained weights.

Paper: Yan et al., "FeDeRA: Efficient Fine-tuning of Language Models in Federated
Learning Leveraging Weight Decomposition", 2024, sec. 4.1 (eqs. 6-10); docs/federa.md.

LoRA on query and value, with ``A, B`` taken from the truncated SVD of each pretrained
weight (``fedpeft.peft.svd_init``) and the frozen weight replaced by the residual
``W_res = W0 - (beta / r) B A``, so the model's output at round 0 is the pretrained
model's. FedAvg then aggregates ``A``, ``B`` and the head.

Export: an adapter holding only ``A, B`` would compute ``W0 + s B A`` on the pretrained
backbone, counting the principal part twice; the export therefore adds the term
``-s B0 A0`` (a rank-2r adapter), so that loaded onto the pretrained backbone it is the
trained model (``lora_terms``).

Federated detail the paper leaves open: singular vectors are defined up to sign and
machines may disagree, so clients must not decompose on their own. The server
decomposes once (``init_server``, timed) and keeps the initial ``A, B`` as the *join
message*; each client, at first contact, derives its residual from that message
(``join``). Every client therefore starts bit-identical.
"""

from __future__ import annotations

import time

import torch

from fedpeft.config.methods.federa import FeDeRAConfig
from fedpeft.methods.base import ServerState, Tensors, read_tensors
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method
from fedpeft.peft.lora import LoraTerm, lora_layers
from fedpeft.peft.svd_init import residual, svd_factors

_JOIN = "join."


@register_method(FeDeRAConfig)
class FeDeRA(FedAvgPeft):
    kind = "lora"
    refuses = {"dora": ""}

    # ----- messages: the initial A0, B0 sent once; a client derives its residual weights from them
    def join_message(self, server: ServerState) -> Tensors:
        return {k.removeprefix(_JOIN): v for k, v in server.extras.items() if k.startswith(_JOIN)}

    def join(self, model, message: Tensors) -> None:
        self.principal = message  # the initial A0, B0, which the export folds back in
        with torch.no_grad():
            for name, layer in lora_layers(model).items():
                base = layer.get_base_layer()
                a = message[f"{name}.lora_A.default.weight"].to(base.weight.device)
                b = message[f"{name}.lora_B.default.weight"].to(base.weight.device)
                base.weight.copy_(residual(pretrained_weight(layer), a, b, layer.scaling["default"]))

    # ----- server: decompose once
    def init_server(self, model) -> ServerState:
        start = time.perf_counter()
        initial: Tensors = {}
        with torch.no_grad():
            for name, layer in lora_layers(model).items():
                a, b = svd_factors(pretrained_weight(layer), layer.r["default"])
                layer.lora_A["default"].weight.copy_(a)
                layer.lora_B["default"].weight.copy_(b)
                initial[f"{name}.lora_A.default.weight"] = a.to("cpu", copy=True)
                initial[f"{name}.lora_B.default.weight"] = b.to("cpu", copy=True)
        self.setup_info = {"time_decompose": time.perf_counter() - start}
        extras = {_JOIN + k: v for k, v in initial.items()}
        return ServerState(read_tensors(model, self.shared_names), extras)

    # ----- export: the trained model on the *pretrained* backbone
    def lora_terms(self, model, tensors: Tensors) -> dict[str, list[LoraTerm]]:
        """``s B A`` and ``-s B0 A0``: on ``W0`` they give ``W_res + s B A``, the trained layer
        (the export's adapter has rank 2r: ``A' = [A; A0]``, ``B' = [B, -B0]``)."""
        terms = super().lora_terms(model, tensors)
        for name, layer in lora_layers(model).items():
            a0 = self.principal[f"{name}.lora_A.default.weight"]
            b0 = self.principal[f"{name}.lora_B.default.weight"]
            terms[name].append((-layer.scaling["default"], a0, b0))
        return terms


def pretrained_weight(layer: torch.nn.Module) -> torch.Tensor:
    """The layer's original ``W0``, kept aside the first time its weight becomes a residual,
    so that decomposing or joining again (a resumed or repeated run) starts from ``W0``."""
    base = layer.get_base_layer()
    if not hasattr(base, "_fedpeft_w0"):
        base._fedpeft_w0 = base.weight.detach().clone()
    return base._fedpeft_w0
