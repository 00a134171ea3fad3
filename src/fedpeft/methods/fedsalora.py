"""FedSA-LoRA: LoRA's ``A`` shared and averaged, ``B`` personal.

Paper: Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated
Learning", ICLR 2025 (docs/lora_family.md states it, with where fedpeft departs).

The paper finds that the ``A`` matrices learn what is common to the clients and the
``B`` matrices what is particular to each, so only ``A`` is sent and averaged (FedAvg,
weights ``|D_i|``) and every client keeps its own ``B``, never sent. Both start as LoRA
does (``A`` Kaiming-uniform, the same for all; ``B`` zero). The authors' configuration
keeps the classifier on each client too, which is this method's default
(``method.head: personal``); with ``head: shared`` the head is averaged with ``A``.
There is no single global model: each client predicts with the shared ``A`` and its own
``B`` (and head).
"""

from __future__ import annotations

from pathlib import Path

from fedpeft.config.methods.fedsalora import FedSALoRAConfig
from fedpeft.methods.base import Method, Tensors
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


@register_method(FedSALoRAConfig)
class FedSALoRA(FedAvgPeft):
    kind = "lora"
    refuses = {"dora": ""}  # DoRA's magnitudes: shared and averaged, as A is

    def split_trainable(self, model) -> None:
        """Every ``B`` personal, and the head with ``head: personal`` (a causal LM has none:
        its LM head is frozen); the rest (every ``A``, and DoRA's magnitudes) shared."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        own = [n for n in names if ".lora_B." in n or (self.cfg.head == "personal" and n.startswith("head."))]
        self.personal_names = own
        self.shared_names = [n for n in names if n not in own]

    def export(self, model, tensors: Tensors, out_dir: Path) -> Path:
        """A client's model (its ``A``, ``B`` and head): a HF PEFT adapter; the global part
        (the averaged ``A`` alone, not a model): its tensors, which ``fedpeft.load_export``
        loads only with ``partial=True``, naming the ``B`` it lacks."""
        if any(".lora_B." in n for n in tensors):
            return super().export(model, tensors, out_dir)
        return Method.export(self, model, tensors, out_dir)
