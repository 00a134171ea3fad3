"""FedAvg over a parameter-efficient subset of the model (FeDeRA paper, sec. 3.1).

The common ground of the FedAvg-family baselines: FedFT, FedBF, FedAP and FedLR differ
only in *what* is trainable (``kind``); everything trainable is shared and averaged
with weights ``|D_i|``. Each baseline is a module of its own declaring its config.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from safetensors.torch import save_file

from fedpeft.methods.base import Method, Tensors, load_tensors
from fedpeft.peft import AdapterSpec, LoraSpec, Trainable, make_trainable


class FedAvgPeft(Method):
    """FedAvg of the tensors that ``kind`` makes trainable."""

    kind: ClassVar[Trainable]

    def trainable_kind(self) -> Trainable:
        return self.kind

    def prepare(self, model) -> None:
        lora = getattr(self.cfg, "lora", LoraSpec())
        adapter = getattr(self.cfg, "adapter", AdapterSpec())
        make_trainable(model, self.trainable_kind(), lora, adapter)
        self.split_trainable(model)

    def export(self, model, tensors: Tensors, out_dir: Path) -> Path:
        """LoRA: an HF PEFT adapter directory (``PeftModel.from_pretrained`` loads it) plus
        ``head.safetensors``; other kinds: the trainable tensors as safetensors."""
        if self.trainable_kind() != "lora":
            return super().export(model, tensors, out_dir)
        load_tensors(model, tensors)
        out_dir.mkdir(parents=True, exist_ok=True)
        model.backbone.save_pretrained(str(out_dir))
        head = {k.removeprefix("head."): v.contiguous() for k, v in tensors.items() if k.startswith("head.")}
        if head:  # a personal head stays with its client
            save_file(head, str(out_dir / "head.safetensors"))
        return out_dir
