"""The one interface every method implements, and the FedAvg common ground it defaults to.

Methods never see an engine and engines never see a method's internals: what crosses
between them is plain data, ``dict[str, torch.Tensor]`` plus a few numbers, so the same
method runs in-process and over a network unchanged.

Every method splits a client's trainable tensors into three parts (METHODS.md):

- **shared** (``self.shared_names``): sent to the server each round and aggregated;
- **personal** (``self.personal_names``): stays on the client for the whole run;
- **ephemeral**: optimizer state. With ``train.optimizer_state: reset`` (the default) it
  lives for one round of local training and is then dropped (a fresh optimizer each
  round); with ``keep`` each client keeps it in its personal state under ``opt.`` keys
  (never sent), so Adam's moments carry over from one round to the client's next.

A client's personal state may hold such private entries besides its personal
parameters (``opt.*``; HETLoRA's own adapter under ``own.*``): they never leave the client
and are never loaded into the model as parameters (:meth:`Method.params_of`).

The defaults below implement FedAvg over the shared tensors (FeDeRA paper, sec. 3.1):
the server sends its state, clients train ``E`` epochs or ``K`` steps, and the new
state is the mean of the returned ones weighted by ``|D_i|``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedpeft.data.task import Encoded, take_steps
from fedpeft.models.device import grad_scaler

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig
    from fedpeft.models.backbone import TaskModel

Tensors = dict[str, torch.Tensor]


class MethodConfig(BaseModel):
    """Options common to every method; each method subclasses this with its own."""

    model_config = ConfigDict(extra="forbid")

    name: str
    head: Literal["shared", "personal"] = Field(
        "shared", description="Whether the classification head is aggregated or kept per client."
    )


@dataclass
class ClientData:
    """One client's examples: its training split and its local test split."""

    cid: int
    train: Encoded
    test: Encoded


@dataclass
class FitResult:
    """What one client's local round produces."""

    uplink: Tensors  # sent to the server
    personal: Tensors  # kept on the client
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    cid: int = -1  # the client it came from (set by the engine, as a server would know)


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


# ---------------------------------------------------------------- local training


def local_steps(n: int, cfg: TrainConfig) -> int:
    """Optimizer steps one client takes per round: ``K``, or ``E * ceil(n / B)``."""
    return cfg.local_steps or cfg.local_epochs * math.ceil(n / cfg.batch_size)


OPT = "opt."  # personal keys of a kept optimizer state: opt.<state key>.<parameter name>


def make_optimizer(
    named: dict[str, torch.Tensor], cfg: TrainConfig, saved: Tensors | None = None
) -> torch.optim.Optimizer:
    """``train.optimizer`` over the named parameters; with ``train.optimizer_state: keep``
    its state is restored from the ``opt.*`` entries of ``saved`` (a client's personal
    state), where there are any."""
    params = list(named.values())
    if cfg.optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer_state == "keep" and saved:
        for key, value in saved.items():
            if key.startswith(OPT):
                state_key, name = key.removeprefix(OPT).split(".", 1)
                if name in named:  # Adam's step count stays on the CPU (torch's default)
                    device = "cpu" if state_key == "step" else named[name].device
                    opt.state[named[name]][state_key] = value.to(device, copy=True)
    return opt


def optimizer_tensors(
    opt: torch.optim.Optimizer, named: dict[str, torch.Tensor], cfg: TrainConfig
) -> Tensors:
    """The optimizer's per-parameter state as ``opt.<key>.<name>`` tensors when
    ``train.optimizer_state`` is ``keep`` (else nothing: a fresh optimizer next round)."""
    if cfg.optimizer_state != "keep":
        return {}
    out = {}
    for name, p in named.items():
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{OPT}{key}.{name}"] = value.detach().to("cpu", copy=True)
    return out


def trainable_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The parameters that require grad, by name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def sgd_steps(
    model: TaskModel,
    batches: Iterable[dict[str, torch.Tensor]],
    opt: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    max_grad_norm: float | None,
    penalty: Callable[[], torch.Tensor] | None = None,
) -> float:
    """Cross-entropy (plus ``penalty()``, e.g. a regulariser) steps of ``opt`` over
    ``batches``; returns the summed cross-entropy. In float16 the loss is scaled (a step
    whose gradients overflow is skipped and the scale halved)."""
    model.train()
    total = 0.0
    scaler = grad_scaler(params[0].device, getattr(model, "precision", None))
    for batch in batches:
        loss = torch.nn.functional.cross_entropy(model(**batch), batch["labels"])
        scaler.scale(loss + penalty() if penalty else loss).backward()
        scaler.unscale_(opt)
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        total += loss.item()
    return total


def step_with(
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    max_grad_norm: float | None,
) -> None:
    """One optimizer step with gradients computed elsewhere (a hypergradient, a MAML gradient)."""
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    if max_grad_norm:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_local(
    model: TaskModel,
    data: Encoded,
    cfg: TrainConfig,
    generator: torch.Generator,
    saved: Tensors | None = None,
) -> tuple[dict[str, float], Tensors]:
    """Plain supervised local training of every parameter that requires grad; returns the
    figures and the optimizer state to keep (empty unless ``train.optimizer_state: keep``).
    ``saved``: the client's personal state, holding a kept optimizer state if any."""
    named = trainable_params(model)
    params = list(named.values())
    steps = local_steps(len(data), cfg)
    batches = take_steps(data, cfg.batch_size, steps, generator)
    opt = make_optimizer(named, cfg, saved)
    start = time.perf_counter()
    total = sgd_steps(model, batches, opt, params, cfg.max_grad_norm)
    metrics = {
        "loss": total / steps,
        "steps": float(steps),
        "time_step": (time.perf_counter() - start) / steps,
    }
    return metrics, optimizer_tensors(opt, named, cfg)


# ---------------------------------------------------------------- the interface


class Method:
    """Base class: FedAvg over ``shared_names``; subclasses choose what is trainable."""

    name: ClassVar[str]
    paper: ClassVar[str] = ""
    #: Train on all clients' data pooled as one client (the Centralized reference).
    pooled: ClassVar[bool] = False
    #: False when nothing crosses a network (pooled training): bytes are recorded as 0.
    communicates: ClassVar[bool] = True
    #: False for a method that takes gradients itself (``torch.autograd.grad``) rather than
    #: through :func:`sgd_steps`, whose loss scaling float16 training needs.
    fp16: ClassVar[bool] = True

    def __init__(self, cfg: MethodConfig, train: TrainConfig, seed: int = 0):
        self.cfg = cfg
        self.train = train
        self.seed = seed  # the experiment's seed, for a method's own draws (HETLoRA's ranks)
        self.shared_names: list[str] = []
        self.personal_names: list[str] = []
        #: one-off figures of init_server (e.g. FeDeRA's decomposition time), recorded with round 1
        self.setup_info: dict[str, float] = {}

    # ----- structure
    def prepare(self, model: TaskModel) -> None:
        """Add modules to ``model`` / unfreeze parameters, then split them (override)."""
        self.split_trainable(model)

    def split_trainable(self, model: TaskModel) -> None:
        """Trainable parameters are shared, except the head when ``head: personal``."""
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        head = [n for n in names if n.startswith("head.")] if self.cfg.head == "personal" else []
        self.personal_names = head
        self.shared_names = [n for n in names if n not in head]

    # ----- server side
    def init_server(self, model: TaskModel) -> ServerState:
        return ServerState(read_tensors(model, self.shared_names))

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        return server.tensors

    def join_message(self, server: ServerState) -> Tensors:
        """Tensors each client receives once, at first contact (FeDeRA's initial ``A, B``)."""
        return {}

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        states = [r.uplink for r in results]
        return ServerState(weighted_mean(states, [r.num_examples for r in results]), server.extras)

    def uplink_as_shared(self, uplink: Tensors) -> Tensors:
        """A client's update in the names and shapes of the shared state, which a networked
        server checks every update against (HETLoRA zero-pads a smaller rank); default: as is."""
        return uplink

    def global_state(self, server: ServerState) -> Tensors | None:
        """The tensors of the one global model, or None when there is none."""
        return server.tensors if not self.personal_names else None

    # ----- client side
    def params_of(self, personal: Tensors) -> Tensors:
        """The personal *parameters* of a personal state (without ``opt.*`` and other
        private entries)."""
        return {n: personal[n] for n in self.personal_names}

    def join(self, model: TaskModel, message: Tensors) -> None:
        """Apply the join message to a client's (frozen) model; idempotent. Default: nothing."""

    def init_client(self, model: TaskModel, initial: Tensors, client: ClientData) -> Tensors:
        """A client's personal state before it first trains (default: the initial values)."""
        return {n: initial[n].clone() for n in self.personal_names}

    def fit(
        self,
        model: TaskModel,
        received: Tensors,
        personal: Tensors,
        client: ClientData,
        generator: torch.Generator,
    ) -> FitResult:
        load_tensors(model, {**received, **self.params_of(personal)})
        metrics, opt_state = train_local(model, client.train, self.train, generator, personal)
        return FitResult(
            uplink=read_tensors(model, self.shared_names),
            personal={**read_tensors(model, self.personal_names), **opt_state},
            num_examples=len(client.train),
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

    def finalize_client(
        self, model: TaskModel, received: Tensors, personal: Tensors, client: ClientData
    ) -> Tensors:
        """Personal state after the last round (FDLoRA's AdaFusion); default: unchanged."""
        return personal

    # ----- results
    def export(self, model: TaskModel, tensors: Tensors, out_dir: Path) -> Path:
        """Save ``tensors`` (the global model's shared tensors, or one client's whole model)
        under ``out_dir`` as safetensors; LoRA methods override this with an HF PEFT adapter."""
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "trainable.safetensors"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
        return path
