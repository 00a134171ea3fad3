"""What a client's local round is given and what it starts from, and the names they share.

A :class:`Job` is one client's round as the engine hands it over (what it received, what
it kept, its data and seed, and the round's settings: a :class:`RoundContext`); a
:class:`Start` is the state the method builds from it (``Method.cohort_start``). Tensors
cross as plain ``dict[str, torch.Tensor]``; the prefixes below mark the private entries
of a client's personal state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedpeft.tensors import Tensors

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig
    from fedpeft.data.types import ClientData

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


@dataclass(frozen=True)
class SampleDP:
    """Sample-level DP-SGD (``privacy.mode: sample``; Abadi et al. 2016): every step's
    batch is ``batch`` rows drawn without replacement, each row's gradient is clipped to
    ``clip`` (all of a client's trained tensors as one vector), and ``N(0, (sigma clip)^2)``
    is added to their sum, which is divided by the rows drawn: ``batch``, or all of a
    client's rows when it has fewer (a constant of the client's, public under replace-one
    neighbours, whose row counts are the same)."""

    clip: float
    sigma: float
    batch: int


@dataclass(frozen=True)
class RoundContext:
    """The settings of a round's local training, which the engine decides and every job
    of the round shares: ``train`` as this round trains (the clients' rate under
    ``train.lr_schedule``; a pooled reference's steps; a memory probe's one step) and
    DP-SGD's clip, noise and batch (``privacy.mode: sample``; None: plain steps). A
    method's hooks read them from the job they are given, never from the method: the
    in-process engine and a Flower node build one per round."""

    train: TrainConfig
    sample_dp: SampleDP | None = None


@dataclass
class Job:
    """One client's local round: what it received, what it kept, its data, its seed and
    the round's number (which a networked client learns from the server too); with
    SCAFFOLD (``train.correction``), the server's control ``c`` it received too; and the
    round's settings (``context``), which every job of a cohort shares."""

    received: Tensors
    personal: Tensors
    client: ClientData
    seed: int
    rnd: int = 0
    control: Tensors = field(default_factory=dict)
    context: RoundContext = field(kw_only=True)

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
