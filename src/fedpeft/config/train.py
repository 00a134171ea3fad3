"""The ``train`` section: the federated schedule and each client's local optimisation."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from fedpeft.config.common import Strict


class TrainConfig(BaseModel):
    """The federated schedule and each client's local optimisation."""

    model_config = Strict

    rounds: int = Field(20, ge=1, description="T, communication rounds.")
    clients_per_round: int = Field(10, ge=1, description="S, clients sampled each round.")
    client_sampling: Literal["fixed", "poisson"] = Field(
        "fixed",
        description="fixed: S clients drawn without replacement each round; poisson: each client takes "
        "part with probability S / num_clients, independently (S on average; DP's add/remove accounting).",
    )
    local_epochs: int = Field(1, ge=1, description="E, epochs over local data per round.")
    local_steps: int | None = Field(
        None, ge=1, description="K, local optimizer steps per round (overrides local_epochs)."
    )
    batch_size: int = Field(32, ge=1)
    lr: float = Field(5e-4, gt=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant",
        description="The clients' rate across rounds: constant (train.lr every round); cosine or linear: "
        "after train.warmup_rounds rising to train.lr, from train.lr in the first round after them down "
        "to train.lr_min in the last (the round's rate goes with its training message).",
    )
    warmup_rounds: int = Field(
        0, ge=0, description="Rounds whose rate rises linearly to train.lr (round k: lr k/W)."
    )
    lr_min: float = Field(0.0, ge=0, description="cosine, linear: the rate of the last round.")
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    optimizer_state: Literal["reset", "keep"] = Field(
        "reset",
        description="reset: a fresh optimizer every round (Adam's moments restart every I steps); "
        "keep: each client keeps its optimizer state between its rounds, as personal state (never sent).",
    )
    max_grad_norm: float | None = Field(1.0, gt=0)
    prox_mu: float = Field(
        0.0,
        ge=0,
        description="FedProx (Li et al. 2020): mu of the proximal term mu/2 ||w - w_received||^2 over "
        "the shared tensors, added to every method's local objective; 0: none.",
    )
    correction: Literal["none", "scaffold"] = Field(
        "none",
        description="scaffold: SCAFFOLD's drift correction (Karimireddy et al. 2020, option II): every local "
        "step of the shared tensors follows g - c_i + c, c the server's control and c_i the client's "
        "(personal state); both cross the network each round. Needs train.optimizer sgd.",
    )
    threads: int | None = Field(None, ge=1, description="torch CPU threads (None: default).")
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|mps|cuda(:\d+)?)$",
        description="Where models and batches live: auto (a GPU when there is one, else the CPU), "
        "cpu, cuda, cuda:N or mps. Not part of the run's identity: a run resumes on another device.",
    )
    cohort_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="Sampled clients trained (and scored) at once, stacked on a client axis over the one "
        "shared backbone (methods whose local step is vectorised; `fedpeft methods` says which). auto: on "
        "a GPU the most that fit its free memory, found by a probe; on a CPU 1 (batching clients gains "
        "nothing there). Not part of the run's identity: any size gives the same results to float rounding.",
    )
    cohort_mode: Literal["auto", "vmap", "folded"] = Field(
        "auto",
        description="How a cohort trains together: vmap (every operation batched over the client axis; "
        "fused attention falls back to eager), folded (the frozen backbone runs once on the cohort's "
        "batches folded into one, only the trained tensors per client; linear, LoRA, adapter and BitFit "
        "methods: `fedpeft methods` says which), auto (folded on a quantised backbone, which vmap cannot "
        "batch; on a GPU, where the method folds, the faster of the two in one timed step of each, "
        "recorded in round 1's setup; else vmap). Not part of the run's identity: the same results to "
        "float rounding.",
    )
    compile: bool = Field(
        False,
        description="Compile a folded cohort's forward and backward pass with torch.compile (fused kernels, "
        "fewer launches; the first steps of a run pay for the compilation, minutes on a CPU). Cohorts then "
        "train folded (cohort_mode auto or folded; a method that cannot fold is refused); a cohort of one "
        "client is not compiled. Not part of the run's identity: the same results to float rounding.",
    )
    client_memory_mb: float | None = Field(
        None,
        gt=0,
        description="RAM for clients' personal states (MiB; None: no limit); the least recently used "
        "spill to output_dir/clients/ and are read back when their client is sampled again.",
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Autocast precision of the forward pass; parameters and optimizer state stay "
        "float32 (fp16 adds loss scaling).",
    )
    memory_check: bool = Field(
        True,
        description="Before the first round (and on a resume), measure one local step and one scoring "
        "batch on the largest client's longest rows and refuse a run whose estimated peak exceeds the "
        "memory free (the env FEDPEFT_MEMORY_LIMIT_MB stands in for it), naming the keys that lower it; "
        "false skips the probe. Not part of the run's identity.",
    )
    on_corrupt_state: Literal["stop", "reset"] = Field(
        "stop",
        description="A client's stored personal state (output_dir/clients/) that is missing or does not "
        "match its checksum, found when a run resumes or when the client comes up: stop, a one-line error "
        "naming the client and the file; reset, that client starts again from the method's initial "
        "personal state, recorded as state_resets in metrics.jsonl. Not part of the run's identity.",
    )
