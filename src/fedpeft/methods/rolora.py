"""RoLoRA: federated LoRA trained by alternating optimisation of ``B`` and ``A``.

Paper: Chen et al., "Robust Federated Finetuning of LLMs via Alternating Optimization of
LoRA", NeurIPS 2025 (docs/lora_family.md states it, with where fedpeft departs).

Averaging ``A`` and ``B`` of a round apart is not averaging ``B A``; training only one of
them in a round is: with ``A`` fixed, ``mean(B_k) A = mean(B_k A)``, and likewise with
``B`` fixed. RoLoRA alternates: odd rounds train and average ``B`` with ``A`` frozen,
even rounds train and average ``A`` with ``B`` frozen (``B`` first: with ``B`` at its
zero start, ``A`` would get no gradient). Each round sends the half it trained, and the
classifier head (and DoRA's magnitudes), trained every round. The server keeps both halves; clients receive
both.
"""

from __future__ import annotations

from fedpeft.config.methods.rolora import RoLoRAConfig
from fedpeft.engines.local import GradientFn, carry_kept_state, group_backprop, optimizer_state
from fedpeft.methods.base import FitResult, Job, ServerState, Start, Tensors
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method


def half_of_round(rnd: int) -> str:
    """The LoRA factor round ``rnd`` trains: ``B`` in odd rounds (the first), ``A`` in even."""
    return "B" if rnd % 2 == 1 else "A"


def sent_names(shared_names: list[str], rnd: int) -> list[str]:
    """The shared tensors an update of round ``rnd`` carries: the round's half and the rest
    (the head, DoRA's magnitudes), not the other factor."""
    other = ".lora_A." if half_of_round(rnd) == "B" else ".lora_B."
    return [n for n in shared_names if other not in n]


@register_method(RoLoRAConfig)
class RoLoRA(FedAvgPeft):
    kind = "lora"
    refuses = {
        "dora": "",  # DoRA's magnitudes: trained and averaged every round, as the head is
        "server_step": "its rounds train A or B in turn; a server optimiser's momentum would move the half a "
        "round does not train",
        "correction": "its rounds train A or B in turn: a client's control of the other half would go stale",
        "secure_aggregation": "its rounds send A or B in turn; its server keeps the other half as it was",
    }

    def __init__(self, cfg, train, seed: int = 0):
        super().__init__(cfg, train, seed)
        self.half: str | None = None  # the factor the cohort loop is training

    # ----- messages: an update of the round's half of the adapter (and the head)
    def uplink_like(self, rnd: int, shared: Tensors, received: Tensors) -> Tensors:
        return {n: shared[n] for n in sent_names(self.shared_names, rnd)}

    # ----- the local round: the round's half (and the head)
    def local_rounds(self, model, jobs: list[Job]) -> list[FitResult]:
        try:
            self.half = half_of_round(jobs[0].rnd)
            return super().local_rounds(model, jobs)
        finally:
            self.half = None

    def optimised_names(self) -> list[str]:
        if self.half is None:
            raise RuntimeError(
                "rolora: a local round runs through RoLoRA.local_rounds (it picks the round's half)"
            )
        other = ".lora_A." if self.half == "B" else ".lora_B."
        return [n for n in [*self.shared_names, *self.personal_names] if other not in n]

    def cohort_start(self, model, job: Job) -> Start:
        start = super().cohort_start(model, job)
        params = start.params
        group = self.optimised_names()
        return Start(
            params,
            optimizer_state(job.personal, {n: params[n] for n in group}, job.context.train),
            {},
            start.steps,
        )

    def step_gradients(self, model) -> GradientFn:
        """Backprop with respect to the round's half and the head only: the other factor
        enters the loss as a constant and gets no gradient (nor any step)."""
        return group_backprop(model, set(self.optimised_names()))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """The round's half (and the head) as the uplink; a kept optimizer state of the
        other half carried along."""
        result = carry_kept_state(job, super().cohort_finish(job, params, opt, metrics))
        group = set(self.optimised_names())
        result.uplink = {n: t for n, t in result.uplink.items() if n in group}
        return result

    # ----- the server: the mean of the half that was sent, the other half as it was
    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        sent = self.mean([r.uplink for r in results], [r.num_examples for r in results])
        return ServerState({**server.tensors, **sent}, server.extras)
