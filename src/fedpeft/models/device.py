"""Where a run computes (``train.device``) and in which precision (``train.precision``).

The device and the precision are the engine's choice, never a method's. A model and its
clients' data live on the device; what crosses to the server, into a personal state or
into a checkpoint is CPU float32 (``read_tensors``), so a run started on a GPU resumes on
a CPU and a Flower node picks its own device whatever the server's.

Precision is autocast over the model's forward pass: the trainable parameters (the
"master" tensors the optimizer updates) stay float32, the frozen weights are stored in
bfloat16 or float16 (nothing updates them), matrix products run in that dtype, and the
logits come back float32. float16 needs loss scaling against gradient underflow
(``fedpeft.engines.local.gradients.LOSS_SCALE``); bfloat16 has float32's exponent range
and needs none.
"""

from __future__ import annotations

import re

import torch

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


class DeviceError(ValueError):
    """A ``train.device`` this machine does not have; the message says what it has."""


def resolve_device(spec: str) -> torch.device:
    """The device ``spec`` names (``auto``: the first CUDA GPU, else Apple's MPS, else the
    CPU); an error naming ``train.device`` when this machine has no such device."""
    if not DEVICE_PATTERN.fullmatch(spec):
        raise DeviceError(f"train.device {spec!r}: expected auto, cpu, cuda, cuda:N or mps")
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index if device.index is not None else 0
        if index >= count:
            raise DeviceError(f"train.device {spec!r}: this machine has {count} CUDA device(s)")
        return torch.device("cuda", index)
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise DeviceError(f"train.device {spec!r}: Apple's MPS backend is not available here")
    return device


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``train.precision`` (None: plain float32)."""
    return PRECISIONS[precision]
