"""FedRep: a shared representation and a personal head, trained one after the other.

Paper: Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for
Personalized Federated Learning", ICML 2021 (Algorithm 1); a baseline of FedMCP and
FDLoRA (docs/two_modules.md).

The body (the PEFT tensors: LoRA, adapters, BitFit biases or every weight: ``trainable``)
is shared and averaged as in FedAvg; the head is always personal (it never leaves the
client). A client's local round has two phases:

1. **head phase**: ``head_steps`` steps (or ``head_epochs`` epochs) on the head alone, the
   body frozen;
2. **body phase**: the usual local schedule (``train.local_steps``, or
   ``train.local_epochs``) on the body alone, the freshly trained head frozen.

Each phase differentiates only its own group and has its own optimizer state, so the
other group's tensors do not move at all (AdamW's decoupled weight decay moves only the
tensors a phase steps). The round is two calls of the vectorised cohort loop
(:meth:`FedRep.local_rounds`): the second phase's jobs carry the first phase's results.
Batches of the two phases come from two seeded streams (the body phase's seed derived
from the round's). A client is scored with the received body and its own head; there is
no global model.

Readings and choices:

- **head_epochs** defaults to 10, the head epochs of the paper's experiments and of the
  official scripts (github.com/lgcollins/FedRep: ``models/Update.py`` trains
  ``local_ep - local_rep_ep`` head epochs, then ``local_rep_ep`` representation epochs;
  ``scripts/FedRep_*.sh`` run ``--local_ep 11 --local_rep_ep 1`` or ``--local_ep 15
  --local_rep_ep 5``, 10 head epochs either way; the bare defaults of ``utils/options.py``,
  ``local_ep`` 5 and ``local_rep_ep`` 1, would give 4). The body phase takes fedpeft's
  local schedule, the same budget as the other methods' rounds.
- Both phases use ``train.optimizer`` and ``train.lr``. With ``train.optimizer_state:
  keep`` each phase keeps its own state (``opt.*`` entries of the head and of the body
  tensors); with ``reset`` both start fresh every round.
- Metrics: ``loss`` is the body phase's (the loss of the client's model after its head
  phase), ``head_loss`` the head phase's; ``steps`` counts both phases, ``head_steps`` and
  ``body_steps`` each; ``tokens`` both phases'.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from fedpeft.config.methods.fedrep import FedRepConfig
from fedpeft.engines.local import (
    GradientFn,
    Start,
    carry_kept_state,
    derive_seed,
    group_backprop,
    optimizer_state,
    run_cohort,
)
from fedpeft.methods.base import FitResult, Job, Tensors, local_steps
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig

Phase = Literal["head", "body"]

HEAD_NEEDED = {
    "causal_lm": "FedRep personalises a classification head; a causal LM predicts with its own, frozen "
    "LM head",
    "token_classification": "FedRep is defined for a sequence classifier's head (docs/two_modules.md)",
    "extractive_qa": "FedRep is defined for a sequence classifier's head (docs/two_modules.md)",
}


@register_method(FedRepConfig)
class FedRep(FedAvgPeft):
    paper = (
        "Collins, Hassani, Mokhtari, Shakkottai: Exploiting Shared Representations for Personalized "
        "Federated Learning (ICML 2021)"
    )
    refuses = {
        **HEAD_NEEDED,
        "correction": "its round trains the head, then the body, in phases of their own lengths: no one step "
        "count K turns the body's move into its mean gradient",
    }

    def __init__(self, cfg, train, seed: int = 0):
        super().__init__(cfg, train, seed)
        self.phase: Phase | None = None  # the phase the cohort loop is running

    def head_steps(self, n: int, train: TrainConfig) -> int:
        """The head phase's steps for a client of ``n`` rows under ``train``'s batch size."""
        return self.cfg.head_steps or self.cfg.head_epochs * math.ceil(n / train.batch_size)

    def private_steps(self, n: int, train: TrainConfig) -> tuple[int, int]:
        """Both phases' steps every round: the head's DP-SGD steps shape the body's too."""
        return self.head_steps(n, train) + local_steps(n, train), 0

    # ----- the local round: two phases of the vectorised cohort loop
    def local_rounds(self, model, jobs: list[Job]) -> list[FitResult]:
        """Head phase, then body phase, each a :func:`run_cohort` over the whole cohort."""
        try:
            self.phase = "head"
            heads = run_cohort(model, self, jobs)
            self.phase = "body"
            body_jobs = [
                replace(job, received=h.uplink, personal=h.personal, seed=derive_seed(job.seed, 1))
                for job, h in zip(jobs, heads, strict=True)
            ]
            bodies = run_cohort(model, self, body_jobs)
        finally:
            self.phase = None
        for h, b in zip(heads, bodies, strict=True):
            b.metrics = {
                **b.metrics,
                "steps": h.metrics["steps"] + b.metrics["steps"],
                "head_steps": h.metrics["steps"],
                "body_steps": b.metrics["steps"],
                "head_loss": h.metrics["loss"],
                "tokens": h.metrics["tokens"] + b.metrics["tokens"],
                "time_step_head": h.metrics["time_step"],
            }
        return bodies

    def optimised_names(self) -> list[str]:
        """The current phase's group: the head, or the body."""
        if self.phase == "head":
            return list(self.personal_names)
        if self.phase == "body":
            return list(self.shared_names)
        raise RuntimeError("fedrep: a local round runs through FedRep.local_rounds (head phase, then body)")

    def cohort_start(self, model, job: Job) -> Start:
        """The received body and the client's head; the optimizer state of the phase's
        group only; the phase's number of steps."""
        params, train = {**job.received, **self.params_of(job.personal)}, job.context.train
        group = self.optimised_names()
        opt = optimizer_state(job.personal, {n: params[n] for n in group}, train)
        n = len(job.client.train)
        steps = self.head_steps(n, train) if self.phase == "head" else local_steps(n, train)
        return Start(params, opt, {}, steps)

    def step_gradients(self, model) -> GradientFn:
        """Backprop of the cross-entropy with respect to the phase's group only: the
        other group enters the loss as a constant and gets no gradient (nor any step)."""
        return group_backprop(model, set(self.optimised_names()))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """The phase's result, with the other phase's kept optimizer state carried along."""
        return carry_kept_state(job, super().cohort_finish(job, params, opt, metrics))
