"""FedAvg over a parameter-efficient subset of the model (FeDeRA paper, sec. 3.1).

The common ground of the FedAvg-family baselines: FedFT, FedBF, FedAP and FedLR differ
only in *what* is trainable (``kind``); everything trainable is shared and averaged
with weights ``|D_i|``. Each baseline is a module of its own declaring its config.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from safetensors.torch import save_file

from fedpeft.methods.base import Method, Tensors
from fedpeft.peft import AdapterSpec, LoraSpec, Trainable, make_trainable
from fedpeft.peft.lora import LoraTerm, dora_magnitudes, lora_terms, write_lora_adapter


class FedAvgPeft(Method):
    """FedAvg of the tensors that ``kind`` makes trainable."""

    kind: ClassVar[Trainable]

    def trainable_kind(self) -> Trainable:
        """What is trainable: the config's ``trainable`` where the method has that option
        (Ditto, MOON, Local-only...), else the class's ``kind``."""
        return getattr(self.cfg, "trainable", None) or self.kind

    def prepare(self, model) -> None:
        lora = getattr(self.cfg, "lora", LoraSpec())
        adapter = getattr(self.cfg, "adapter", AdapterSpec())
        make_trainable(model, self.trainable_kind(), lora, adapter)
        self.split_trainable(model)

    def lora_terms(self, model, tensors: Tensors) -> dict[str, list[LoraTerm]]:
        """Per adapted module, the ``(scale, A, B)`` terms of the model ``tensors`` describe
        on the *pretrained* backbone (FeDeRA adds its principal part, negated)."""
        return lora_terms(model, tensors)

    def export(self, model, tensors: Tensors, out_dir: Path) -> Path:
        """LoRA: one HF PEFT adapter directory that ``PeftModel.from_pretrained`` loads onto
        the pretrained backbone, plus ``head.safetensors`` when ``tensors`` hold the head
        (a personal head is left out of the global export); other kinds: the tensors as
        safetensors. Only what ``tensors`` holds is written: a method's other adapters
        (PF2LoRA's client adapter) never reach the global export."""
        if self.trainable_kind() != "lora":
            return super().export(model, tensors, out_dir)
        config = model.backbone.peft_config["default"]
        write_lora_adapter(config, self.lora_terms(model, tensors), out_dir, dora_magnitudes(model, tensors))
        head = {k.removeprefix("head."): v.contiguous() for k, v in tensors.items() if k.startswith("head.")}
        if head:
            save_file(head, str(out_dir / "head.safetensors"))
        return out_dir
