"""What a client's local round is given and what it starts from, and the names they share.

A :class:`Job` is one client's round as the engine hands it over (what it received, what
it kept, its data and seed); a :class:`Start` is the state the method builds from it
(``Method.cohort_start``). Tensors cross as plain ``dict[str, torch.Tensor]``; the prefixes
below mark the private entries of a client's personal state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from fedpeft.methods.base import ClientData

Tensors = dict[str, torch.Tensor]
Batch = dict[str, torch.Tensor]
#: One local step's input for one client: one batch, or more (Per-FedAvg's D1, D2).
StepInput = tuple[Batch, ...]
#: ``(params, consts, batches) -> (loss, gradients)``: the gradients of the tensors the step
#: moves (``train.optimizer`` steps them, or SGD at a rate of the method's own:
#: :meth:`Method.sgd_rates`); the others stay as they are.
GradientFn = Callable[[Tensors, Tensors, StepInput], tuple[torch.Tensor, Tensors]]

OPT = "opt."  # personal keys of a kept optimizer state: opt.<state key>.<parameter name>
OWN = "own."  # personal keys of a client's private copy of a model: own.<parameter name>
#: personal keys of a client's SCAFFOLD control c_i: control.<shared tensor name> (``train.correction``)
CONTROL = "control."


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys: independent streams per round and client (the
    engine), or per stage of a client's round (a method's second phase)."""
    hi, lo = (int(x) for x in np.random.SeedSequence(list(keys)).generate_state(2, np.uint32))
    return ((hi << 32) | lo) & (2**63 - 1)


@dataclass
class Job:
    """One client's local round: what it received, what it kept, its data, its seed and
    the round's number (which a networked client learns from the server too); with
    SCAFFOLD (``train.correction``), the server's control ``c`` it received too."""

    received: Tensors
    personal: Tensors
    client: ClientData
    seed: int
    rnd: int = 0
    control: Tensors = field(default_factory=dict)

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


@dataclass
class Start:
    """A client's state entering the round: the tensors it trains, its optimizer state,
    constants of its step (HETLoRA's rank mask) and the number of steps it takes."""

    params: Tensors
    opt: Tensors
    consts: Tensors
    steps: int
