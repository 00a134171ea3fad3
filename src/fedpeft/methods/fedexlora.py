"""FedEx-LoRA: FedAvg of LoRA's ``A`` and ``B``, made exact by folding the residual into
the frozen weights.

Paper: Singhal, Ponkshe and Vepakomma, "FedEx-LoRA: Exact Aggregation for Federated and
Efficient Fine-Tuning of Foundation Models", ACL 2025 (docs/lora_family.md states it,
with where fedpeft departs).

The mean of the factors is not the mean of the updates: ``s B_bar A_bar`` misses
``s (sum_k p_k B_k A_k - B_bar A_bar)``. FedEx-LoRA averages ``A`` and ``B`` as FedAvg
does (weights ``p_k = |D_k| / sum |D|``) and adds that residual to every adapted
module's frozen weight, so that the global model's frozen weight plus ``s B_bar A_bar``
is exactly the frozen weight plus the clients' mean update. Clients start the next round
from ``A_bar, B_bar`` on the new frozen weight.

The frozen weight of each adapted module is therefore server state here (``<module>.
base_layer.weight`` beside the factors): checkpointed, handed to clients with the
factors every round once a residual has been folded (its bytes counted in the downlink,
as the residual's are in the paper; before the first aggregate every client holds the
pretrained weights, and nothing but the factors and the head goes down), entering a
client's step as a constant (no gradient), never sent back.
"""

from __future__ import annotations

import torch

from fedpeft.config.methods.fedexlora import FedExLoRAConfig
from fedpeft.engines.local import GradientFn, group_backprop
from fedpeft.methods.base import FitResult, ServerState, Tensors, read_tensors
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method
from fedpeft.peft.lora import LoraTerm, full_rank_terms, lora_layers


@register_method(FedExLoRAConfig)
class FedExLoRA(FedAvgPeft):
    kind = "lora"
    refuses = {
        "dora": "its exactness folds mean(B_k A_k) - mean(B_k) mean(A_k) into the frozen weight; under DoRA "
        "the model normalises W0 + s B A, so the folded model would not be the clients' mean",
        "server_step": "its aggregate folds the residual of the clients' products into the frozen weights; a "
        "server step on the factors would leave that residual stale",
        "robust": "its residual is of the clients' weighted mean; another rule would break the exactness",
        "secure_aggregation": "its residual is of the clients' products B_k A_k, which the mean of their "
        "factors does not give",
    }

    # ----- messages: the frozen weights the residuals are folded into, handed to clients with the
    # shared tensors
    def server_frozen_names(self) -> list[str]:
        return [w for w, _ in self.modules.values()]

    def prepare(self, model) -> None:
        if any(not p.is_floating_point() for p in model.parameters()):
            raise ValueError(
                "method fedexlora folds each round's residual into the frozen weights, which a quantised "
                "backbone (model.quantization) cannot hold: use model.quantization none"
            )
        super().prepare(model)
        layers = lora_layers(model)
        #: per adapted module: its frozen weight's name and LoRA's scale s
        self.modules = {
            name: (f"{name}.base_layer.weight", layer.scaling["default"]) for name, layer in layers.items()
        }
        frozen = read_tensors(model, [w for w, _ in self.modules.values()])
        self.pretrained = {n: t.float() for n, t in frozen.items()}  # W0, for the export

    # ----- the frozen weights as server state, a constant of every client's step
    def init_server(self, model) -> ServerState:
        return ServerState({**read_tensors(model, self.shared_names), **dict(self.pretrained)})

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """The factors and the head, and each frozen weight once a residual has moved it
        from the pretrained one that every client holds."""
        return {n: t for n, t in server.tensors.items() if n not in self._held(server)}

    def _held(self, server: ServerState) -> set[str]:
        """The frozen weights still at their pretrained values, compared once per server
        state (every client of a round gets the same; on a large model the comparison
        reads every adapted weight)."""
        if getattr(self, "_held_for", (None,))[0] is not server.tensors:
            held = {w for w, t in self.pretrained.items() if torch.equal(server.tensors[w].float(), t)}
            self._held_for = (server.tensors, held)
        return self._held_for[1]

    def step_gradients(self, model) -> GradientFn:
        return group_backprop(model, set(self.optimised_names()))

    # ----- the exact aggregate
    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        self._held_for = (None,)  # let the old state go: the next downlink compares the new one
        weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
        weights /= weights.sum()
        mean = self.mean([r.uplink for r in results], [r.num_examples for r in results])
        tensors = {**server.tensors, **mean}
        for name, (frozen, scale) in self.modules.items():
            a, b = f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight"
            exact = sum(
                w * r.uplink[b].double() @ r.uplink[a].double() for w, r in zip(weights, results, strict=True)
            )
            residual = scale * (exact - mean[b].double() @ mean[a].double())
            tensors[frozen] = (server.tensors[frozen].double() + residual).to(server.tensors[frozen].dtype)
        return ServerState(tensors, server.extras)

    # ----- export: the factors and the folded residuals, one PEFT adapter on W0
    def lora_terms(self, model, tensors: Tensors) -> dict[str, list[LoraTerm]]:
        """``s B A`` and, per module, the residuals folded so far, ``W - W0``, as a term of
        rank ``min(d_out, d_in)`` (its SVD, ``U S`` and ``V^T``), zero-padded to one rank
        for all modules (PEFT's adapter has one rank): on the pretrained backbone, the
        trained model."""
        terms = super().lora_terms(model, tensors)
        folded = {
            name: tensors[w].double() - self.pretrained[w].double() for name, (w, _) in self.modules.items()
        }
        for name, term in full_rank_terms(folded).items():
            terms[name].append(term)
        return terms
