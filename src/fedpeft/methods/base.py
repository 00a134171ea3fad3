"""The one interface every method implements, and the FedAvg common ground it defaults to.

Methods never see an engine and engines never see a method's internals: what crosses
between them is plain data, ``dict[str, torch.Tensor]`` plus a few numbers, so the same
method runs in-process and over a network unchanged.

Every method splits a client's trainable tensors into three parts (each method's docs
page, e.g. docs/personalized.md, lists its shared and personal ones):

- **shared** (``self.shared_names``): sent to the server each round and aggregated;
- **personal** (``self.personal_names``): stays on the client for the whole run;
- **ephemeral**: optimizer state. With ``train.optimizer_state: reset`` (the default) it
  lives for one round of local training and is then dropped (a fresh optimizer each
  round); with ``keep`` each client keeps it in its personal state under ``opt.`` keys
  (never sent), so Adam's moments carry over from one round to the client's next.

A client's personal state may hold such private entries besides its personal
parameters (``opt.*``; HETLoRA's own adapter under ``own.*``): they never leave the client
and are never loaded into the model as parameters (:meth:`Method.params_of`).

A client's local round is written as pure functions (:meth:`Method.cohort_start`,
:meth:`Method.step_draws`, :meth:`Method.step_gradients`, :meth:`Method.cohort_finish`)
that the engine runs for a whole cohort of clients at once (``fedpeft.engines.local``);
a method overrides the ones its paper changes. A round of phases (FedRep's head then body)
overrides :meth:`Method.local_rounds`; :meth:`Method.fit_cohort` is the engines' entry,
never overridden.

A method is extended one way: by overriding these hooks, those of what crosses between
server and clients beside the shared tensors (:meth:`Method.join_message`, ...) included
(docs/architecture.md, "Adding a method"). Beside them, as data, is what the method does
not compose with (``refuses``, read by :mod:`fedpeft.methods.capabilities`).

The defaults below implement FedAvg over the shared tensors (FeDeRA paper, sec. 3.1):
the server sends its state, clients train ``E`` epochs or ``K`` steps, and the new
state is the mean of the returned ones weighted by ``|D_i|``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from fedpeft.config.methods.base import MethodConfig
from fedpeft.data.task import Draw, sample_draws, take_draws
from fedpeft.data.types import ClientData
from fedpeft.engines.local import (
    OPT,
    GradientFn,
    Job,
    ModelLossGradients,
    Start,
    optimizer_state,
    run_cohort,
)
from fedpeft.tensors import Tensors

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig
    from fedpeft.models.backbone import TaskModel


@dataclass
class FitResult:
    """What one client's local round produces."""

    uplink: Tensors  # sent to the server
    personal: Tensors  # kept on the client
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    cid: int = -1  # the client it came from (set by the engine, as a server would know)
    #: SCAFFOLD (``train.correction``): the update of the client's control, ``c_i+ - c_i``,
    #: sent beside the uplink (its new control stays in ``personal``); else empty
    control: Tensors = field(default_factory=dict)


@dataclass
class ServerState:
    """The server's state: the global shared tensors and any extra tensors (e.g. momentum)."""

    tensors: Tensors
    extras: Tensors = field(default_factory=dict)


# ---------------------------------------------------------------- tensor helpers


def read_tensors(model: torch.nn.Module, names: list[str]) -> Tensors:
    """Detached CPU copies of the named parameters: what leaves a model (uplinks, personal
    state, checkpoints) is device-independent."""
    params = dict(model.named_parameters())
    return {n: params[n].detach().to("cpu", copy=True) for n in names}


@torch.no_grad()
def load_tensors(model: torch.nn.Module, tensors: Tensors) -> None:
    """Copy tensors into the model's parameters of the same names, in place."""
    params = dict(model.named_parameters())
    for name, value in tensors.items():
        if name not in params:
            raise KeyError(f"tensor {name!r} names no parameter of the model")
        params[name].copy_(value)


def tensor_bytes(tensors: Tensors) -> int:
    """Exact payload size of a tensor dict: sum of ``numel * element_size``."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


def weighted_mean(states: list[Tensors], weights: list[float]) -> Tensors:
    """``sum_i w_i x_i / sum_i w_i`` per tensor, accumulated in float64."""
    if not states:
        raise ValueError("weighted_mean of no states")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {weights}")
    out = {}
    for name, first in states[0].items():
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for state, w in zip(states, weights, strict=True):
            acc += state[name].to(torch.float64) * (w / total)
        out[name] = acc.to(first.dtype)
    return out


#: The bias of a classifier row outside a client's label space: such a class never wins
#: and, its softmax probability underflowing to exactly 0, never gets a gradient.
MASKED_BIAS = -1e4


def restrict_heads(state: Tensors, classes: np.ndarray | None) -> Tensors:
    """``state`` with every classifier bias (a tensor named ``*head.bias``) set to
    :data:`MASKED_BIAS` outside ``classes``: a client of the cross-silo setting predicts,
    and learns, its own silo's classes only; ``classes`` None: unchanged."""
    if classes is None:
        return state
    out = dict(state)
    keep = torch.as_tensor(classes, dtype=torch.long)
    for name, bias in state.items():
        if name.endswith("head.bias"):
            masked = torch.full_like(bias, MASKED_BIAS)
            masked[keep] = bias[keep]
            out[name] = masked
    return out


# ---------------------------------------------------------------- local training


def local_steps(n: int, cfg: TrainConfig) -> int:
    """Optimizer steps one client takes per round: ``K``, or ``E * ceil(n / B)``."""
    return cfg.local_steps or cfg.local_epochs * math.ceil(n / cfg.batch_size)


def trainable_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that require grad, by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------- the interface


class Method:
    """Base class: FedAvg over ``shared_names``; subclasses choose what is trainable."""

    #: ``method.name`` and the class of its options: given by the registration
    #: (:func:`fedpeft.methods.registry.register_method`), written in the config's leaf alone
    name: ClassVar[str]
    config_cls: ClassVar[type[MethodConfig]]
    paper: ClassVar[str] = ""
    #: Train on all clients' data pooled as one client (the Centralized reference): nothing
    #: crosses a network, so its bytes are recorded as 0.
    pooled: ClassVar[bool] = False
    #: True when the local step differentiates a gradient (a hypergradient, MAML's outer
    #: step): it needs attention kernels with second derivatives (``local.attention.training_attention``).
    higher_order: ClassVar[bool] = False
    #: What the method does not compose with, and why: feature -> reason ("" where it
    #: composes after all), read by :func:`fedpeft.methods.capabilities.refusal`, which
    #: names the features and their defaults.
    refuses: ClassVar[Mapping[str, str]] = {}

    def __init__(self, cfg: MethodConfig, train: TrainConfig, seed: int = 0):
        self.cfg = cfg
        #: the experiment's training settings, for what the method sets up; a round's own
        #: (its rate, what its engine changes for it) come with each job: ``job.context.train``
        self.train = train
        self.seed = seed  # the experiment's seed, for a method's own draws (HETLoRA's ranks)
        self.shared_names: list[str] = []
        self.personal_names: list[str] = []
        #: one-off figures of init_server (e.g. FeDeRA's decomposition time), recorded with round 1
        self.setup_info: dict[str, float] = {}
        #: ``(states, weights) -> state``: how this method's server combines its clients'
        #: uplinks where it takes their mean: ``server.aggregation``'s rule, given to
        #: ``fedpeft.methods.build_method`` (``fedpeft.engines.robust``)
        self.mean: Callable[[list[Tensors], list[float]], Tensors] = weighted_mean

    # ----- structure
    def prepare(self, model: TaskModel) -> None:
        """Add modules to ``model`` / unfreeze parameters, then split them (override)."""
        self.split_trainable(model)

    def split_trainable(self, model: TaskModel) -> None:
        """Trainable parameters are shared, except the head when ``head: personal``."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError(
                f"method {self.name}: nothing to train on this backbone (BitFit, for one, needs bias "
                "terms, which Llama-style decoders such as SmolLM2 do not have)"
            )
        if self.cfg.head == "personal" and getattr(model, "head", None) is None:
            raise ValueError(
                "method.head: personal: this task model has no classification head (a causal LM "
                "predicts with its own, frozen LM head)"
            )
        head = [n for n in names if n.startswith("head.")] if self.cfg.head == "personal" else []
        self.personal_names = head
        self.shared_names = [n for n in names if n not in head]

    # ----- server side
    def init_server(self, model: TaskModel) -> ServerState:
        return ServerState(read_tensors(model, self.shared_names))

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        return server.tensors

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        states = [r.uplink for r in results]
        return ServerState(self.mean(states, [r.num_examples for r in results]), server.extras)

    def global_state(self, server: ServerState) -> Tensors | None:
        """The tensors of the one global model, or None when there is none."""
        return server.tensors if not self.personal_names else None

    # ----- messages: what crosses beside the shared tensors, and the shapes a networked
    # server checks a client's update against (defaults: nothing beside the shared
    # tensors, every update of all of them)
    def join_message(self, server: ServerState) -> Tensors:
        """Tensors each client receives once, at first contact (FeDeRA's initial ``A, B``)."""
        return {}

    def join(self, model: TaskModel, message: Tensors) -> None:
        """Apply the join message to a client's (frozen) model; idempotent. Default: nothing."""

    def uplink_like(self, rnd: int, shared: Tensors, received: Tensors) -> Tensors:
        """The names, shapes and dtypes of the update of round ``rnd`` of a client that was
        sent ``received`` (what a networked server checks it against), given the shared
        tensors' (``shared``). Default: all of ``shared``; RoLoRA's rounds send half of
        them, Fed-SB's setup round (whichever round it falls in) sends others."""
        return {n: shared[n] for n in self.shared_names}

    def uplink_messages(self, received: Tensors) -> list[str]:
        """Tensors of the uplink of a client that received ``received`` that are messages of
        their own, not updates of a tensor it received (Fed-SB's setup round: its gradient
        sums); ``privacy.mode`` clips and noises each as an update from zero. Default: none."""
        return []

    def uplink_as_shared(self, uplink: Tensors) -> Tensors:
        """A client's update in the names and shapes of the shared state, which a networked
        server checks every update against (HETLoRA zero-pads a smaller rank); default: as is."""
        return uplink

    def server_frozen_names(self) -> list[str]:
        """Frozen tensors of the model that the server holds and hands to clients with the
        shared ones, and that change over a run (FedEx-LoRA's frozen weights, into which it
        folds residuals); they enter a client's step as constants and are never sent back.
        Default: none (the backbone never moves)."""
        return []

    def global_export_names(self) -> list[str]:
        """The server's tensors the global export is written from: the shared ones and
        :meth:`server_frozen_names`."""
        return [*self.shared_names, *self.server_frozen_names()]

    def training_server(self, server: ServerState) -> ServerState:
        """A server state of the rounds that train, for the memory probes to measure a
        round from: ``server`` itself (default), or, before a first round unlike the
        others (Fed-SB's setup round, which trains nothing), a state as after it."""
        return server

    # ----- client side
    def params_of(self, personal: Tensors) -> Tensors:
        """The personal *parameters* of a personal state (without ``opt.*`` and other
        private entries)."""
        return {n: personal[n] for n in self.personal_names}

    def init_client(self, model: TaskModel, initial: Tensors, client: ClientData) -> Tensors:
        """A client's personal state before it first trains (default: the initial values)."""
        return {n: initial[n].clone() for n in self.personal_names}

    def fit_cohort(self, model: TaskModel, jobs: list[Job]) -> list[FitResult]:
        """The engines' entry, never overridden: the local rounds of a cohort of clients (one
        client's: a cohort of one), one result per job, each marked with its client."""
        results = self.local_rounds(model, jobs)
        if len(results) != len(jobs):
            raise RuntimeError(f"method {self.name}: {len(results)} result(s) of {len(jobs)} local round(s)")
        for job, result in zip(jobs, results, strict=True):
            result.cid = job.client.cid
        return results

    def local_rounds(self, model: TaskModel, jobs: list[Job]) -> list[FitResult]:
        """A cohort's local rounds, in the order of ``jobs``: by default one run of the local
        engine's cohort loop (``fedpeft.engines.local.run_cohort``) over the pure functions
        below; a round of phases or stages runs it once for each (FedRep's head, then its
        body), or computes its results itself (Fed-SB's setup round)."""
        return run_cohort(model, self, jobs)

    # ----- the local round as pure functions (the engine vmaps them over a cohort)
    def cohort_start(self, model: TaskModel, job: Job) -> Start:
        """A client's tensors entering its round (everything it trains: what it received
        and its personal parameters), its optimizer state and its number of steps."""
        params = {**job.received, **self.params_of(job.personal)}
        opt = optimizer_state(job.personal, {n: params[n] for n in self.optimised_names()}, job.context.train)
        return Start(params, opt, {}, local_steps(len(job.client.train), job.context.train))

    def clip_group(self, name: str) -> str:
        """The gradient-clipping group of optimised tensor ``name`` (as its step names it):
        ``train.max_grad_norm`` bounds each group's norm on its own, as separate optimizers
        would for a method that trains separate models (Ditto's global and personal ones).
        Default: one group."""
        return ""

    def optimised_names(self) -> list[str]:
        """The tensors ``train.optimizer`` steps (default: every trainable one)."""
        return [*self.shared_names, *self.personal_names]

    def sgd_rates(self) -> dict[str, float]:
        """Tensors the method steps by plain SGD at a rate of its own, outside
        ``train.optimizer`` and ``train.max_grad_norm`` (name -> rate; PF2LoRA's lower
        level). Their gradients come with the step's others, so DP-SGD clips and noises
        them with the rest. Default: none."""
        return {}

    def private_steps(self, n: int, train: TrainConfig) -> tuple[int, int]:
        """``(every round, once more)``: the most local steps a client of ``n`` training rows
        takes in each round it trains in under ``train``, every phase counted, and the steps
        it takes on top in its first one (what sample-level DP-SGD's accountant charges it).
        Default: ``train``'s local steps, nothing on top."""
        return local_steps(n, train), 0

    def step_draws(self, job: Job, steps: int, generator: torch.Generator) -> Iterator[tuple[Draw, ...]]:
        """Each step's batches of ``job``'s client, as drawn (:class:`~fedpeft.data.task.Draw`:
        rows of its data, cut by the engine for a whole cohort at once): one shuffled batch
        of ``train.batch_size`` per step (DP-SGD: a batch drawn anew at every step)."""
        data, dp = job.client.train, job.context.sample_dp
        if dp is not None:  # DP-SGD: each batch drawn anew, as its accountant assumes
            return ((draw,) for draw in sample_draws(data, dp.batch, steps, generator))
        return ((draw,) for draw in take_draws(data, job.context.train.batch_size, steps, generator))

    def step_gradients(self, model: TaskModel) -> GradientFn:
        """``(params, consts, batches) -> (loss, grads)``, one client's gradients at a step
        as a pure function (of :meth:`optimised_names` and :meth:`sgd_rates`'s tensors): by
        default backprop of the model's loss on the step's batch, scaled by
        :data:`LOSS_SCALE` in float16. A method whose gradients are a
        :class:`~fedpeft.engines.local.gradients.ModelLossGradients` (this default, with a
        penalty or a group of its tensors) can train in folded cohorts."""
        return ModelLossGradients(model)

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """A client's result from its trained tensors and optimizer state (kept with
        ``train.optimizer_state: keep``)."""
        kept = {OPT + k: v for k, v in opt.items()} if job.context.train.optimizer_state == "keep" else {}
        return FitResult(
            uplink={n: params[n] for n in self.shared_names},
            personal={**{n: params[n] for n in self.personal_names}, **kept},
            num_examples=len(job.client.train),
            metrics=metrics,
        )

    def eval_state(
        self, model: TaskModel, received: Tensors, personal: Tensors, client: ClientData
    ) -> Tensors:
        """The tensors client ``client`` evaluates with, and its own model in a per-client
        export (default: received + personal parameters)."""
        return {**received, **self.params_of(personal)}

    def extra_eval_states(
        self, model: TaskModel, received: Tensors, personal: Tensors, client: ClientData
    ) -> dict[str, Tensors]:
        """Other models of client ``client`` scored on its local test split beside
        :meth:`eval_state`'s, by name (HETLoRA's truncated global adapter); default none.
        Each is reported as ``local_<name>``."""
        return {}

    def readout(self, result: FitResult) -> dict[str, float]:
        """Per-client figures logged each round after local training (PF2LoRA's effective
        rank); default: none."""
        return {}

    # ----- results
    def export(self, model: TaskModel, tensors: Tensors, out_dir: Path) -> Path:
        """Save ``tensors`` (the global model's shared tensors, or one client's whole model)
        under ``out_dir`` as safetensors; LoRA methods override this with an HF PEFT adapter."""
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "trainable.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        return path
