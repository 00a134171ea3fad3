"""A client's local round as pure functions, run for a whole cohort of clients at once.

A federated simulation is many small, independent trainings. Instead of training the
sampled clients one after another, a cohort of ``C`` clients trains in one batched
computation: every client's trainable tensors are stacked on a leading client axis,
``(C, ...)``, and one local step of all of them is ``torch.func.vmap`` of a pure function

    step(params, opt_state, consts, batches) -> (params, opt_state, loss)

over ``functional_call`` of the one shared model (its frozen weights broadcast, never
copied). The step is the method's gradients (:meth:`Method.step_gradients`: plain
backprop by default; a hypergradient or a MAML gradient where a method says so),
gradient clipping and a functional AdamW or SGD that matches ``torch.optim`` step for
step. A one-client round (``Method.fit``, and every Flower node) is a cohort of one,
so there is a single definition of each method's local training; a cohort of one calls
the step as it is, without ``vmap``, with the model's own attention kernel.

Clients of a cohort differ in data: each step's batches are padded to the cohort's
widest and longest (padded rows weigh 0 in the loss, padded tokens are masked), and a
client that has taken all its steps is inactive: its tensors and optimizer state do
not move. So a cohort gives every client the same round it would have alone, up to the
float rounding of padded reductions (see ``tests/test_cohort.py`` for the tolerance).

Randomness: each client's batches come from its own seeded generator, as alone. A model
with active dropout cannot give the same draws batched and alone, so it trains its
clients in cohorts of one (each with the global RNG seeded for it, as before).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.func import functional_call, vjp, vmap

from fedpeft.data.task import IGNORE, Draw, Encoded, eval_batches
from fedpeft.models.causal import SCORED, scored_counts

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig
    from fedpeft.methods.base import ClientData, FitResult, Method, Tensors

Batch = dict[str, torch.Tensor]
#: One local step's input for one client: one batch, or more (Per-FedAvg's D1, D2).
StepInput = tuple[Batch, ...]
#: ``(params, consts, batches) -> (loss, gradients)``: the gradients of the tensors the step
#: moves (``train.optimizer`` steps them, or SGD at a rate of the method's own:
#: :meth:`Method.sgd_rates`); the others stay as they are.
GradientFn = Callable[["Tensors", "Tensors", StepInput], tuple[torch.Tensor, "Tensors"]]

OPT = "opt."  # personal keys of a kept optimizer state: opt.<state key>.<parameter name>
OWN = "own."  # personal keys of a client's private copy of a model: own.<parameter name>
#: personal keys of a client's SCAFFOLD control c_i: control.<shared tensor name> (``train.correction``)
CONTROL = "control."
BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults, which fedpeft has always used
#: float16's loss scale: static (a dynamic scaler only grows after thousands of steps, more
#: than a round has); a step whose gradients overflow is skipped (:func:`local_step`).
LOSS_SCALE = 2.0**8


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


# ---------------------------------------------------------------- the functional optimizer


def optimizer_init(params: Tensors, cfg: TrainConfig) -> Tensors:
    """A fresh optimizer state for ``params``, keyed ``<state key>.<name>`` as torch's
    (AdamW: ``step`` (a float32 scalar), ``exp_avg``, ``exp_avg_sq``; SGD: none)."""
    if cfg.optimizer == "sgd":
        return {}
    out = {}
    for name, p in params.items():
        out[f"step.{name}"] = torch.zeros((), dtype=torch.float32)
        out[f"exp_avg.{name}"] = torch.zeros_like(p)
        out[f"exp_avg_sq.{name}"] = torch.zeros_like(p)
    return out


def optimizer_state(personal: Tensors, params: Tensors, cfg: TrainConfig) -> Tensors:
    """The optimizer state a client starts its round with: the one it kept (``opt.*``
    entries of its personal state, with ``train.optimizer_state: keep``), else fresh."""
    fresh = optimizer_init(params, cfg)
    if cfg.optimizer_state != "keep":
        return fresh
    kept = {k.removeprefix(OPT): v for k, v in personal.items() if k.startswith(OPT)}
    return {k: kept.get(k, v) for k, v in fresh.items()}


def clip_gradients(grads: Tensors, max_norm: float | None) -> Tensors:
    """``torch.nn.utils.clip_grad_norm_`` as a pure function: every gradient times
    ``min(1, max_norm / (||g|| + 1e-6))``, ``||g||`` the norm of all of them together."""
    if not max_norm or not grads:
        return grads
    # summed in name order: the same norm whatever order the state's tensors came in
    total = torch.stack([grads[n].float().square().sum() for n in sorted(grads)]).sum().sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    return {n: g * coef.to(g.dtype) for n, g in grads.items()}


def optimizer_step(
    params: Tensors, grads: Tensors, state: Tensors, cfg: TrainConfig
) -> tuple[Tensors, Tensors]:
    """One step of ``train.optimizer`` on the tensors ``grads`` names, as a pure function:
    AdamW exactly as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected
    moments), or SGD (weight decay added to the gradient, no momentum)."""
    lr, wd = cfg.lr, cfg.weight_decay
    new_params, new_state = {}, dict(state)
    for name, g in grads.items():
        p = params[name]
        if cfg.optimizer == "sgd":
            new_params[name] = p - lr * (g + wd * p)
            continue
        step = state[f"step.{name}"] + 1
        m0, v0 = state[f"exp_avg.{name}"], state[f"exp_avg_sq.{name}"]
        bias1, bias2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
        # torch's own AdamW arithmetic, in its order; outside vmap and autograd the later
        # operations run in place on the tensors just made (the same values, half the
        # full-size temporaries: what a full fine-tune's step on a CPU pays for most)
        then = _in_place if _plain(p, g, m0, v0) else getattr
        m = m0.lerp(g, 1 - BETAS[0])
        v = then(v0.mul(BETAS[1]), "addcmul")(g, g, value=1 - BETAS[1])
        denom = then(then(v.sqrt(), "div")(bias2.sqrt()), "add")(EPS)
        new_params[name] = then(p.mul(1 - lr * wd), "sub")(then(m.div(denom), "mul")(lr / bias1))
        new_state.update({f"step.{name}": step, f"exp_avg.{name}": m, f"exp_avg_sq.{name}": v})
    return new_params, new_state


def _in_place(tensor: torch.Tensor, op: str) -> Callable:
    return getattr(tensor, op + "_")


def _plain(*tensors: torch.Tensor) -> bool:
    """Tensors that no functorch transform (vmap, grad) wraps and autograd does not track:
    new tensors made from them may be updated in place."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not any(wrapped(t) or t.requires_grad for t in tensors)


# ---------------------------------------------------------------- losses and gradients


def model_inputs(batch: Batch) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
    """A batch's forward-pass arguments: ids and attention mask, and the positions whose
    prediction is scored when the batch names them (a causal LM's LM head runs there only:
    ``fedpeft.models.causal.SCORED``)."""
    return (batch["input_ids"], batch["attention_mask"]), ({SCORED: batch[SCORED]} if SCORED in batch else {})


def prepare_step(model: torch.nn.Module, batches: StepInput, scored: list[int] | None = None) -> StepInput:
    """A step's batches with what the model computes of them outside ``vmap`` (its
    ``prepare_batch``: a causal LM's scored positions, whose count depends on the data;
    ``scored``: that count for each batch, when worked out beforehand)."""
    prepare = getattr(model, "prepare_batch", None)
    if prepare is None:
        return batches
    return tuple(prepare(b, k) for b, k in zip(batches, scored or [None] * len(batches), strict=True))


def model_loss(model: torch.nn.Module) -> Callable[[Tensors, Batch], torch.Tensor]:
    """``loss(params, batch)``: the model's own loss (``model.loss``: a classifier's
    cross-entropy, a causal LM's over response tokens) with ``params`` in place of its own
    trainable tensors (the frozen ones are the model's, shared)."""

    def loss(params: Tensors, batch: Batch) -> torch.Tensor:
        args, kwargs = model_inputs(batch)
        return model.loss(functional_call(model, params, args, kwargs), batch)

    return loss


def model_features(model: torch.nn.Module) -> Callable[[Tensors, Batch], torch.Tensor]:
    """``features(params, batch)``: the pooled representation ``(B, H)`` a classifier's
    head reads (``TaskModel.forward(pooled=True)``), with ``params`` in place of the
    model's trainable tensors; what a method with its own heads or a representation
    loss (MOON, FedMCP, FedRoD) builds on. Apply a head with :func:`head_logits`."""

    def features(params: Tensors, batch: Batch) -> torch.Tensor:
        return functional_call(model, params, (batch["input_ids"], batch["attention_mask"]), {"pooled": True})

    return features


def head_logits(params: Tensors, features: torch.Tensor, prefix: str = "head.") -> torch.Tensor:
    """The logits of the linear head whose tensors ``params`` holds under ``prefix``
    (``head.weight``, ``head.bias``) on ``features``."""
    return torch.nn.functional.linear(features, params[prefix + "weight"], params[prefix + "bias"])


def row_mean(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The mean of per-row ``values`` ``(B,)`` over the batch's real rows: a cohort's
    padded rows (weight 0) count for nothing, so a client's loss is the one it has alone."""
    if "weight" not in batch:
        return values.mean()
    weight = batch["weight"]
    return (values * weight).sum() / weight.sum().clamp_min(1.0)


def model_scale(model: torch.nn.Module) -> float:
    """The loss scale of ``model``'s precision: :data:`LOSS_SCALE` in float16, else 1."""
    return LOSS_SCALE if getattr(model, "precision", None) == torch.float16 else 1.0


#: Set while a quantised or checkpointed backbone trains (:func:`run_cohort`): gradients by
#: plain autograd (:func:`needs_plain_autograd`).
PLAIN_AUTOGRAD: ContextVar[bool] = ContextVar("plain_autograd", default=False)


def quantised(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds quantised weights (bitsandbytes stores them as integers)."""
    return any(not p.is_floating_point() for p in model.parameters())


def needs_plain_autograd(model: torch.nn.Module) -> bool:
    """Whether ``model``'s training steps run in plain autograd, outside functorch: a
    quantised backbone (bitsandbytes has no functorch rules) or one that checkpoints its
    layers (``torch.utils.checkpoint`` cannot run under ``vjp`` or ``vmap``)."""
    from fedpeft.models.backbone import checkpointed_layers

    return quantised(model) or bool(checkpointed_layers(model))


@contextmanager
def checkpointing(model: torch.nn.Module) -> Iterator[None]:
    """The checkpointed layers of ``model`` in training mode for the duration, the rest as
    it is: Hugging Face checkpoints a layer only in training mode, and the engine's steps
    run in eval mode when no dropout is active (``model.gradient_checkpointing``)."""
    from fedpeft.models.backbone import checkpointed_layers

    layers = [(layer, layer.training) for layer in checkpointed_layers(model)]
    for layer, _ in layers:
        layer.training = True
    try:
        yield
    finally:
        for layer, before in layers:
            layer.training = before


@contextmanager
def plain_autograd(enabled: bool) -> Iterator[None]:
    """:data:`PLAIN_AUTOGRAD` set to ``enabled`` for the duration."""
    token = PLAIN_AUTOGRAD.set(enabled)
    try:
        yield
    finally:
        PLAIN_AUTOGRAD.reset(token)


def first_order_grad(
    objective: Callable[[Tensors], tuple[torch.Tensor, torch.Tensor]], params: Tensors
) -> tuple[Tensors, torch.Tensor]:
    """The gradient of ``objective(params)[0]`` (a scalar) with respect to ``params``, and
    ``objective(params)[1]``: ``torch.func.grad`` with ``has_aux``, for a gradient nothing
    differentiates further (a local step's). ``torch.func.grad`` records its backward pass
    for higher derivatives and holds the forward pass's saved tensors until it returns,
    which doubles a step's memory; here the backward pass records nothing and frees them
    as it goes (``vjp``'s ``retain_graph``, ``create_graph`` False). Works under ``vmap``.
    For a quantised or checkpointed backbone (:data:`PLAIN_AUTOGRAD`, outside any functorch
    transform: a cohort of one) it is plain autograd, the same gradient, through which
    kernels that have no functorch rule (bitsandbytes' quantised matmuls) and checkpoints run."""
    if PLAIN_AUTOGRAD.get() and torch._C._functorch.maybe_current_level() is None:
        leaves = {n: t.detach().requires_grad_(True) for n, t in params.items()}
        value, aux = objective(leaves)
        grads = torch.autograd.grad(value, list(leaves.values()), allow_unused=True)
        pairs = zip(leaves.items(), grads, strict=True)
        return {n: torch.zeros_like(t) if g is None else g for (n, t), g in pairs}, aux
    value, pullback, aux = vjp(objective, params, has_aux=True)
    (grads,) = pullback(torch.ones_like(value), retain_graph=False, create_graph=False)
    return grads, aux


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


#: the random stream of a client's DP-SGD noise, beside its round's seed
NOISE_STREAM = 0x44505347


def private_gradients(
    gradients: GradientFn, dp: SampleDP, params: Tensors, consts: Tensors, batches: StepInput, noise: Tensors
) -> tuple[torch.Tensor, Tensors]:
    """The loss and DP-SGD's gradient of one client's step: ``gradients`` taken of each
    row of the step's one batch on its own (a ``vmap`` over the rows, inside the cohort's
    over the clients), each clipped to ``dp.clip``, summed, plus ``dp.sigma * dp.clip``
    times ``noise`` (standard normal, drawn outside), over the rows drawn (``dp.batch``, or
    the client's all when it has fewer). A padded row (weight 0) has a zero gradient and
    adds nothing, and is not counted."""
    (batch,) = batches

    def one(row: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Tensors]:
        return gradients(params, consts, ({k: v.unsqueeze(0) for k, v in row.items()},))

    losses, per_row = vmap(one)(batch)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per_row.values()]).sum(0).sqrt()
    factor = (dp.clip / norms.clamp_min(1e-12)).clamp(max=1.0)
    summed = {n: torch.einsum("b,b...->...", factor, g) for n, g in per_row.items()}
    if noise:
        summed = {n: g + dp.sigma * dp.clip * noise[n] for n, g in summed.items()}
    weight = batch.get("weight", torch.ones_like(losses))
    drawn = weight.sum().clamp_min(1.0)  # min(dp.batch, the client's rows): without replacement
    return (losses * weight).sum() / drawn, {n: g / drawn for n, g in summed.items()}


def backprop(loss: Callable[[Tensors, Tensors, StepInput], torch.Tensor], scale: float = 1.0) -> GradientFn:
    """The gradient of ``loss(params, consts, batches)`` with respect to every tensor of
    ``params``; taken of ``scale * loss`` and divided back, so that float16 gradients do
    not underflow."""

    def gradients(params: Tensors, consts: Tensors, batches: StepInput):
        def scaled(p: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
            value = loss(p, consts, batches)
            return value * scale, value

        grads, value = first_order_grad(scaled, params)
        return value, {n: g / scale for n, g in grads.items()} if scale != 1.0 else grads

    return gradients


def group_backprop(model: torch.nn.Module, group: set[str]) -> GradientFn:
    """:func:`backprop` of the model's loss with respect to the tensors named in ``group``
    only: the others enter the loss as constants and get no gradient (nor any step); a
    method whose local round trains part of its tensors (FedRep's phases, RoLoRA's halves)."""
    loss, scale = model_loss(model), model_scale(model)

    def gradients(params: Tensors, consts: Tensors, batches: StepInput):
        frozen = {n: t for n, t in params.items() if n not in group}
        trained = {n: t for n, t in params.items() if n in group}
        return backprop(lambda p, c, b: loss({**frozen, **p}, b[0]), scale)(trained, consts, batches)

    return gradients


def carry_kept_state(job: Job, result: FitResult) -> FitResult:
    """``result`` with the kept optimizer state (``opt.*``) of tensors its round did not
    train carried over from the client's personal state (the round's own wins)."""
    kept = {k: t for k, t in job.personal.items() if k.startswith(OPT)}
    result.personal = {**kept, **result.personal}
    return result


def backprop_reporting(
    objective: Callable[[Tensors, Tensors, StepInput], tuple[torch.Tensor, torch.Tensor]], scale: float = 1.0
) -> GradientFn:
    """:func:`backprop` of an ``objective`` that returns ``(value to differentiate, value to
    report)``: the reported loss need not be the differentiated one (Ditto, FedRoD and
    FedKD sum the losses of two models but report that of the one the client predicts with)."""

    def gradients(params: Tensors, consts: Tensors, batches: StepInput):
        def scaled(p: Tensors) -> tuple[torch.Tensor, torch.Tensor]:
            value, reported = objective(p, consts, batches)
            return value * scale, reported

        grads, reported = first_order_grad(scaled, params)
        return reported, {n: g / scale for n, g in grads.items()} if scale != 1.0 else grads

    return gradients


# ---------------------------------------------------------------- batches


class CohortBatches:
    """A cohort's batches for a run of steps, stacked on a leading client axis and cut on
    the device. ``plans[c][k]``: client ``c``'s draws (:class:`~fedpeft.data.task.Draw`)
    for step ``k``, one per batch of a step; a plan shorter than the longest: the client
    has finished. Each batch of a step is padded to the cohort's most rows and longest
    row: a padded row has weight 0 and no real token; a draw's ``extras`` are stacked as
    they are (a finished client's are zeros).

    Everything about the shapes is worked out here, once, on the CPU: the cohort's data
    goes into one pool per tensor (each client's rows, then one padding row), every
    batch becomes indices into it and a width, and the indices cross to the device in one
    copy. :meth:`step` then cuts a step's batches with one gather per tensor: no loop over
    the clients, no host-device synchronisation."""

    def __init__(self, plans: list[list[tuple[Draw, ...]]], device: torch.device):
        self.clients, self.device = len(plans), device
        sources: dict[int, Encoded] = {}
        for plan in plans:
            for draws in plan:
                for draw in draws:
                    sources.setdefault(id(draw.data), draw.data)
        parts = list(sources.values())
        offsets = dict(zip(sources, np.cumsum([0] + [len(d) for d in parts]).tolist(), strict=False))
        self._pool(parts)
        lengths = torch.cat([d.lengths.cpu() for d in parts] + [torch.zeros(1, dtype=torch.long)])
        pad = len(lengths) - 1
        zero = torch.zeros(1, dtype=torch.long)  # token labels: each row's scored positions
        counts = (
            torch.cat([scored_counts(d.labels).cpu() for d in parts] + [zero]) if self.per_token else None
        )
        # each step's batches: (rows, width, where its indices start)
        self.shapes: list[list[tuple[int, int, int]]] = []
        #: each step's batches' SCORED count K (token labels): the most of any client, at least 1
        self.scored: list[list[int]] = []
        index, extras, at = [], [], 0
        for k in range(max(len(plan) for plan in plans)):
            draws = [plan[k] if k < len(plan) else None for plan in plans]
            live = next(d for d in draws if d is not None)
            shapes, scored = [], []
            for j in range(len(live)):
                rows = max(len(d[j].rows) for d in draws if d is not None)
                rows_of = torch.full((self.clients, rows), pad, dtype=torch.long)
                for c, d in enumerate(draws):
                    if d is not None:
                        rows_of[c, : len(d[j].rows)] = d[j].rows + offsets[id(d[j].data)]
                shapes.append((rows, int(lengths[rows_of].max()), at))
                if counts is not None:
                    scored.append(max(int(counts[rows_of].sum(1).max()), 1))
                index.append(rows_of.flatten())
                at += rows_of.numel()
            self.shapes.append(shapes)
            self.scored.append(scored)
            extras.append([_stacked_extras(draws, j) for j in range(len(live))])
        self.index = torch.cat(index).to(device)
        #: ``extras[j][key]``: batch j's extra ``key`` at every step, ``(steps, C, ...)``
        self.extras = [
            {key: torch.stack([e[j][key] for e in extras]).to(device) for key in extras[0][j]}
            for j in range(len(extras[0]))
        ]

    def _pool(self, parts: list[Encoded]) -> None:
        """The cohort's rows, then a padding row (no token, label 0 or :data:`IGNORE`), on the device."""
        width = max(d.ids.shape[1] for d in parts)
        self.per_token = parts[0].labels.dim() == 2

        def pooled(tensors: list[torch.Tensor], fill: int) -> torch.Tensor:
            shape = (1, width) if tensors[0].dim() == 2 else (1,)
            padded = [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) if t.dim() == 2 else t
                      for t in tensors]  # fmt: skip
            return torch.cat(
                [t.to(self.device) for t in padded] + [torch.full(shape, fill, device=self.device)]
            )

        self.ids = pooled([d.ids for d in parts], 0)
        self.lengths = pooled([d.lengths for d in parts], 0)
        self.labels = pooled([d.labels for d in parts], IGNORE if self.per_token else 0)
        self.real = torch.ones(len(self.lengths), device=self.device)
        self.real[-1] = 0.0
        self.positions = torch.arange(width, device=self.device)

    def __len__(self) -> int:
        return len(self.shapes)

    def step(self, k: int) -> StepInput:
        """Step ``k``'s batches, each ``(C, rows, ...)``."""
        out = []
        for j, (rows, width, at) in enumerate(self.shapes[k]):
            index = self.index[at : at + self.clients * rows].view(self.clients, rows)
            batch = {
                "input_ids": self.ids[:, :width][index],
                "attention_mask": (self.positions[:width] < self.lengths[index].unsqueeze(-1)).long(),
                "labels": self.labels[:, :width][index] if self.per_token else self.labels[index],
                "weight": self.real[index],
            }
            out.append(batch | {key: t[k] for key, t in self.extras[j].items()})
        return tuple(out)


def _stacked_extras(draws: list[tuple[Draw, ...] | None], j: int) -> Tensors:
    """The extras of batch ``j`` of a step's draws, stacked over the clients (a finished
    client's, None: zeros)."""
    first = next(d for d in draws if d is not None)[j].extras
    return {
        key: torch.stack([d[j].extras[key] if d is not None else torch.zeros_like(t) for d in draws])
        for key, t in first.items()
    }


def stack(states: list[Tensors], device: torch.device) -> Tensors:
    """Per-client tensor dicts (same names, same shapes) as one dict of ``(C, ...)`` tensors."""
    return {n: torch.stack([s[n] for s in states]).to(device) for n in states[0]} if states else {}


def unstack(stacked: Tensors, count: int) -> list[Tensors]:
    """The inverse of :func:`stack`, back on the CPU (what leaves a model is device-free)."""
    cpu = {n: t.detach().to("cpu") for n, t in stacked.items()}
    return [{n: t[c].clone() for n, t in cpu.items()} for c in range(count)]


# ---------------------------------------------------------------- the cohort loop


def has_active_dropout(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


@contextmanager
def eager_attention(model: torch.nn.Module) -> Iterator[None]:
    """Hugging Face's plain-matmul attention for the duration: ``vmap`` batches it, while
    the fused SDPA kernels have no batching rule and would loop over the clients."""
    config = getattr(getattr(model, "backbone", None), "config", None)
    if config is None:
        yield
        return
    before = config._attn_implementation
    config._attn_implementation = "eager"
    try:
        yield
    finally:
        config._attn_implementation = before


def training_attention(model: torch.nn.Module, method: Method, clients: int):
    """The attention a cohort trains with: eager (:func:`eager_attention`), which ``vmap``
    batches, except for a cohort of one (not vmapped: :func:`run_cohort`), which keeps the
    model's own kernel (SDPA: faster, and without the ``(heads, L, L)`` weights eager
    attention holds per layer for the backward pass) when the method takes no gradient of
    a gradient (fused kernels have no second derivative) and no gradient per example
    (DP-SGD vmaps over the rows)."""
    alone = clients == 1 and not method.higher_order and method.sample_dp is None
    return nullcontext() if alone else eager_attention(model)


def unvmapped(step: Callable) -> Callable:
    """``step`` (a client's local step, what :func:`run_cohort` vmaps) for a cohort of one,
    called as it is: the client axis taken off its inputs and put back on its outputs.
    ``vmap`` of one client costs a little on every operation, and loops over the client
    for kernels it has no batching rule for (SDPA)."""

    def first(tensors: Tensors) -> Tensors:
        return {n: t[0] for n, t in tensors.items()}

    def again(tensors: Tensors) -> Tensors:
        return {n: t.unsqueeze(0) for n, t in tensors.items()}

    def run(
        params: Tensors,
        opt: Tensors,
        consts: Tensors,
        batches: StepInput,
        anchor: Tensors,
        correction: Tensors,
        noise: Tensors,
    ):
        new_params, new_opt, loss = step(
            first(params),
            first(opt),
            first(consts),
            tuple(map(first, batches)),
            first(anchor),
            first(correction),
            first(noise),
        )
        return again(new_params), again(new_opt), loss.unsqueeze(0)

    return run


def run_cohort(model: torch.nn.Module, method: Method, jobs: list[Job]) -> list[FitResult]:
    """Every job's local round, trained together (see the module docstring)."""
    if has_active_dropout(model) and len(jobs) > 1:
        return [r for job in jobs for r in run_cohort(model, method, [job])]
    device = next(model.parameters()).device
    starts = [method.cohort_start(model, job) for job in jobs]
    batches = CohortBatches(
        [
            list(method.step_draws(job.client, s.steps, job.generator()))
            for job, s in zip(jobs, starts, strict=True)
        ],
        device,
    )
    params = stack([s.params for s in starts], device)
    opt = stack([s.opt for s in starts], device)
    consts = stack([s.consts for s in starts], device)
    anchor = proximal_anchor(method, params)
    own = [client_control(job) for job in jobs]  # SCAFFOLD's c_i (none without it)
    correction = stack(
        [{n: c - own_i[n] for n, c in job.control.items()} for job, own_i in zip(jobs, own, strict=True)],
        device,
    )
    dropout = has_active_dropout(model)
    if dropout:
        torch.manual_seed(jobs[0].seed)  # a cohort of one: its own dropout draws, as alone
    folded = len(jobs) > 1 and folds(method, model)
    if folded:
        from fedpeft.methods.folding import folded_step

        step = folded_step(method, model)
    elif len(jobs) == 1:
        step = unvmapped(local_step(method, model))
    else:
        step = vmap(local_step(method, model), randomness="different" if dropout else "error")
    noises = dp_noise(method, jobs, params, device)
    model.train(dropout)  # eval mode when no dropout is active: the same function, no RNG calls
    step_counts = [s.steps for s in starts]  # on the CPU: no device sync to ask who is still training
    steps = torch.tensor(step_counts, device=device)
    losses = torch.zeros(len(jobs), device=device)
    tokens = torch.zeros(len(jobs), dtype=torch.long, device=device)  # real tokens each client trained on
    start = time.perf_counter()
    attention = nullcontext() if folded else training_attention(model, method, len(jobs))
    with plain_autograd(needs_plain_autograd(model)), attention, checkpointing(model):
        for k in range(len(batches)):
            stacked = prepare_step(model, batches.step(k), batches.scored[k] or None)
            noise = next(noises)
            new_params, new_opt, loss = step(params, opt, consts, stacked, anchor, correction, noise)
            tokens += sum(b["attention_mask"].flatten(1).sum(1) for b in stacked)
            active = k < steps  # (C,): a finished client's tensors do not move
            if k < min(step_counts):  # every client still training: take the step whole
                params, opt = {n: new_params[n] for n in params}, {n: new_opt[n] for n in opt}
            else:
                params = {n: _where(active, new_params[n], t) for n, t in params.items()}
                opt = {n: _where(active, new_opt[n], t) for n, t in opt.items()}
            losses += torch.where(active, loss.detach().float(), 0.0)
    time_step = (time.perf_counter() - start) / len(batches)
    results = []
    for job, s, p, o, total, seen, own_i in zip(
        jobs, starts, unstack(params, len(jobs)), unstack(opt, len(jobs)), losses.tolist(), tokens.tolist(),
        own, strict=True,
    ):  # fmt: skip
        metrics = {
            "loss": total / s.steps,
            "steps": float(s.steps),
            "time_step": time_step,
            "tokens": float(seen),
        }
        result = method.cohort_finish(job, p, o, metrics)
        if job.control:
            settle_control(result, job, own_i, p, s.steps, method.train.lr)
        results.append(result)
    return results


def folds(method: Method, model: torch.nn.Module) -> bool:
    """Whether a cohort trains folded (:mod:`fedpeft.methods.folding`) rather than vmapped:
    ``train.cohort_mode``; auto folds where the steps run in plain autograd (a quantised or
    checkpointed backbone: :func:`needs_plain_autograd`), which vmap cannot batch."""
    mode = method.train.cohort_mode
    return mode == "folded" or (mode == "auto" and needs_plain_autograd(model))


def dp_noise(method: Method, jobs: list[Job], params: Tensors, device: torch.device) -> Iterator[Tensors]:
    """Each step's DP-SGD noise for the cohort, stacked: standard normal, one draw per
    trained tensor of each client, from the client's own stream (its round's seed), so a
    client draws the same noise in any cohort; nothing without ``privacy.mode: sample``."""
    if method.sample_dp is None:
        while True:
            yield {}
    generators = [torch.Generator().manual_seed(derive_seed(job.seed, NOISE_STREAM)) for job in jobs]
    shapes = {n: t.shape[1:] for n, t in sorted(params.items())}
    while True:
        draws = [{n: torch.randn(shape, generator=g) for n, shape in shapes.items()} for g in generators]
        yield stack(draws, device)


def proximal_anchor(method: Method, params: Tensors) -> Tensors:
    """FedProx's anchor (``train.prox_mu`` > 0): the shared tensors as the round starts
    (what the client received), which the local step is pulled back to; else nothing."""
    if method.train.prox_mu == 0:
        return {}
    return {n: params[n].clone() for n in method.shared_names if n in params}


def client_control(job: Job) -> Tensors:
    """SCAFFOLD: the client's control ``c_i`` as it enters the round (its personal state's
    ``control.*`` entries; 0 before its first round), for the tensors the server's control
    ``job.control`` names; nothing without SCAFFOLD."""
    return {n: job.personal.get(CONTROL + n, torch.zeros_like(c)) for n, c in job.control.items()}


def settle_control(
    result: FitResult, job: Job, own: Tensors, trained: Tensors, steps: int, lr: float
) -> None:
    """SCAFFOLD after a client's round (Karimireddy et al. 2020, option II): its new control
    ``c_i+ = c_i - c + (x - y) / (K lr)`` (``x`` the shared tensors it received, ``y`` the
    ones it trained, ``K`` its steps), which under SGD is the mean of its ``K`` (clipped)
    gradients, kept in its personal state; the update ``c_i+ - c_i`` is what it sends
    (``result.control``). A client that took no step keeps its control (and sends zeros)."""
    new = {}
    for n, c in job.control.items():
        drift = (job.received[n].double() - trained[n].double()) / (steps * lr) if steps else None
        new[n] = own[n] if drift is None else (own[n].double() - c.double() + drift).to(c.dtype)
    result.personal = {**result.personal, **{CONTROL + n: t for n, t in new.items()}}
    result.control = {n: new[n] - own[n] for n in new}


def local_step(method: Method, model: torch.nn.Module):
    """One client's local step as a pure function (what :func:`run_cohort` vmaps): the
    method's gradients (DP-SGD's, under ``privacy.mode: sample``), then
    :func:`apply_gradients`."""
    gradients, dp = method.step_gradients(model), method.sample_dp
    apply = apply_gradients(method, model)

    def step(
        params: Tensors,
        opt: Tensors,
        consts: Tensors,
        batches: StepInput,
        anchor: Tensors,
        correction: Tensors,
        noise: Tensors,
    ):
        if dp is not None:
            loss, grads = private_gradients(gradients, dp, params, consts, batches, noise)
        else:
            loss, grads = gradients(params, consts, batches)
        return apply(params, opt, loss, grads, anchor, correction)

    return step


def apply_gradients(method: Method, model: torch.nn.Module):
    """``apply(params, opt, loss, grads, anchor, correction) -> (params, opt, loss)``:
    what one client's local step does with its gradients, as a pure function. With FedProx
    (Li et al. 2020; ``train.prox_mu``), the gradient of ``mu/2 ||w - anchor||^2`` over the
    shared tensors joins the method's gradient before clipping; the loss reported stays
    the method's. With SCAFFOLD (``train.correction``), ``correction`` (``c - c_i`` per
    shared tensor) is added to the clipped gradient, so the step follows ``g - c_i + c``
    (clipping bounds the stochastic gradient, not the drift estimate). Then the optimizer
    step, and plain SGD at the method's own rate on :meth:`Method.sgd_rates`'s tensors."""
    cfg, skip_overflow = method.train, model_scale(model) != 1.0
    mu, rates = cfg.prox_mu, method.sgd_rates()

    def apply(
        params: Tensors,
        opt: Tensors,
        loss: torch.Tensor,
        grads: Tensors,
        anchor: Tensors,
        correction: Tensors,
    ):
        own = {n: params[n] - rates[n] * g for n, g in grads.items() if n in rates}
        stepped = {n: g for n, g in grads.items() if n not in rates}
        if anchor:
            stepped = {n: g + mu * (params[n] - anchor[n]) if n in anchor else g for n, g in stepped.items()}
        clipped = {}
        for group in clip_groups(method, stepped):  # each model of a client clipped on its own
            clipped.update(clip_gradients(group, cfg.max_grad_norm))
        if correction:
            clipped = {n: g + correction[n] if n in correction else g for n, g in clipped.items()}
        updated, new_opt = optimizer_step(params, clipped, opt, cfg)
        new_params = {**params, **updated, **own}
        if skip_overflow:  # float16: a step with an overflowed gradient changes nothing
            finite = torch.stack([torch.isfinite(g).all() for g in grads.values()]).all()
            new_params = {n: torch.where(finite, t, params[n]) for n, t in new_params.items()}
            new_opt = {n: torch.where(finite, t, opt[n]) for n, t in new_opt.items()}
        return new_params, new_opt, loss

    return apply


def clip_groups(method: Method, grads: Tensors) -> list[Tensors]:
    """``grads`` split by :meth:`Method.clip_group`: the gradients clipped together (as
    one ``clip_grad_norm_`` call would), in a fixed order."""
    groups: dict[str, Tensors] = {}
    for name, g in grads.items():
        groups.setdefault(method.clip_group(name), {})[name] = g
    return [groups[k] for k in sorted(groups)]


def _where(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, old)


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def predict_cohort(
    model: torch.nn.Module,
    states: list[Tensors],
    data: Encoded | list[Encoded],
    batch_size: int,
    batch_tokens: int | None = None,
) -> list[np.ndarray]:
    """Arg-max predictions of each client's model (``states[c]`` in place of the model's
    trainable tensors) on its own examples (``data[c]``) or, given one :class:`Encoded`,
    on those same examples for every client; the clients' forward passes run vmapped.
    Each client's examples are cut into batches of at most ``batch_size`` rows and
    ``batch_tokens`` tokens (:func:`fedpeft.data.task.eval_batches`)."""
    device = next(model.parameters()).device
    stacked = stack(states, device)

    def forward(params: Tensors, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return functional_call(model, params, (ids, mask)).argmax(-1)

    model.eval()
    shared = isinstance(data, Encoded)  # the same batches for every client: broadcast, not copied
    sets = [data] if shared else data
    plans = [
        [(Draw(d, rows),) for rows in eval_batches(d.lengths.cpu(), batch_size, batch_tokens)] for d in sets
    ]
    counts = [[len(draws[0].rows) for draws in plan] for plan in plans]
    out: list[list[torch.Tensor]] = [[] for _ in states]  # on the device until the end
    if any(plans):
        batches = CohortBatches(plans, device)
        batched = vmap(forward, in_dims=(0, None, None) if shared else 0)
        folded = len(states) > 1 and quantised(model)  # vmap cannot batch quantised kernels
        with nullcontext() if folded else eager_attention(model):
            for k in range(len(batches)):
                (batch,) = batches.step(k)
                ids, mask = batch["input_ids"], batch["attention_mask"]
                if folded:
                    from fedpeft.methods.folding import cohort_outputs

                    wide = {"input_ids": ids, "attention_mask": mask}
                    if shared:  # the one batch, for every client
                        wide = {k: t[:1].expand(len(states), *t.shape[1:]) for k, t in wide.items()}
                    preds = cohort_outputs(model, stacked, wide).argmax(-1)
                elif shared:
                    preds = batched(stacked, ids[0], mask[0])
                else:
                    preds = batched(stacked, ids, mask)
                for c in range(len(states)):
                    rows = counts[0 if shared else c]
                    if k < len(rows):
                        out[c].append(preds[c, : rows[k]])
    sizes = [sum(len(p) for p in preds) for preds in out]
    flat = (
        torch.cat([p for preds in out for p in preds]).cpu()
        if any(sizes)
        else torch.zeros(0, dtype=torch.long)
    )
    return [part.numpy() for part in flat.split(sizes)]
