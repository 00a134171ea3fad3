"""FedKD: a local mentor and a shared mentee that teach each other, with SVD-compressed updates.

Paper: Wu, Wu, Lyu, Huang, Xie, "Communication-efficient federated learning via
knowledge distillation", Nature Communications 13, 2032 (2022) (FedKD; "Methods":
adaptive mutual distillation, dynamic gradient approximation); the authors' code
(github.com/wuch15/FedKD) settles details the text leaves open. METHODS.md, FDLoRA section.

**Two models on one frozen backbone.** Each client has a *mentor* (personal: it never
leaves the client) and a *mentee* (shared: aggregated by FedAvg). The paper's mentor is a
larger network than the mentee; here both are LoRA adapters on the same frozen backbone,
added through HF PEFT as PF2LoRA adds its second adapter: the mentee is the ``default``
adapter of rank ``lora.r`` (plus the head), the mentor the ``mentor`` adapter of rank
``mentor_rank`` (default 32, four times the default mentee rank; plus its own head,
``mentor_head``, a copy of the initial head; a causal
LM has no head and both use its frozen LM head). Both adapters are active in the model;
each model's forward pass sets the *other* adapter's ``lora_B`` to zero, which removes its
``B A x`` exactly, so a forward pass is a pure function of the tensors (vmappable).

**Adaptive mutual distillation** (one local step, one batch, :func:`mutual_loss`): with
task losses ``L_t`` (mentor) and ``L_s`` (mentee),

- mentor: ``L_t + [KL(p_s || p_t) + MSE(H_t, H_s)] / (L_t + L_s)``;
- mentee: ``L_s + [KL(p_t || p_s) + MSE(H_t, H_s)] / (L_t + L_s)``;

``p`` the predicted distributions, ``H`` the hidden states every transformer layer
outputs. The distillation terms are weighted by ``1 / (L_t + L_s)``, as in the paper: the
better both models predict, the stronger they distil. Readings and choices:

- ``stop_gradient: true`` (default): each model learns from the other's predictions and
  hidden states as targets, and the adaptive weight is a weight, not an objective: the
  other model's outputs and ``L_t + L_s`` are detached, so the mentor's tensors get the
  gradient of the mentor's loss and the mentee's of the mentee's. ``false`` is the
  authors' code: the sum of both losses, nothing detached.
- ``KL`` is per example (summed over classes, or over the vocabulary per response token
  for a causal LM, per labelled token for tagging, over positions for the start and the
  end of a QA span), averaged over examples or tokens; the authors' code used PyTorch's
  element-wise mean. No temperature (the authors' code has none).
- Hidden states (``hidden_distillation``): both models share the backbone's width and
  depth, so layer ``l`` of one is matched with layer ``l`` of the other with no
  projection (the paper's ``W_h`` maps a smaller mentee's width), the mean squared error
  over real tokens, averaged over layers (the authors' code sums its aligned layers). They
  are read with forward hooks on the transformer layers during the step. The paper (and
  its code) also distils attention heatmaps; that term is left out (Hugging Face's
  attention modules do not hand their attention probabilities to a pure step).
- The reported training loss is the task loss of the model the client predicts with.

**Dynamic gradient approximation** (communication). The client's mentee *update*
``Delta = (mentee after training) - (mentee received)`` goes up compressed: every matrix
as its truncated SVD ``U diag(s) V^T`` keeping the fewest singular values whose energy
``sum s_k^2`` reaches ``T`` of the total (:func:`kept_rank`), the factors sent as
``<name>.svd_u``, ``<name>.svd_s``, ``<name>.svd_v``; a matrix whose factors would not be
smaller than itself, and every 1-D tensor (biases, the head's bias), goes dense as
``<name>.delta``. The bytes counted are those of what is sent. ``T`` rises over the rounds
from ``energy`` to ``energy_end`` (the paper's dynamic threshold; 0.95 -> 0.98 in the
authors' code and PFLlib): ``T_t = energy + (energy_end - energy) t / train.rounds``. A
client learns the round from its downlink, which then holds a zero-element tensor
``round.<t>`` (no payload: round numbers are protocol metadata, as in Flower's config record);
``energy_end: null`` keeps ``T = energy`` and sends no marker. The server reconstructs each
update from its factors (:meth:`FedKD.uplink_as_shared`), averages them weighted by
``|D_i|``, and adds the mean to the global mentee.

**The downlink is compressed too** (``compress_downlink``, default true, as the paper):
the server compresses the round's mean update with the same ``T_t`` and applies the
*compressed* update to its global mentee, so the server and every client that applies it
hold the same mentee, bit for bit. A client keeps the mentee it last trained from
(``own.<name>``, never sent). If it trained from the previous round's global mentee it
receives the factors of the latest update only and adds them to its copy; otherwise (it
has never trained, or missed a round: the paper has every client in every round) it
receives the global mentee dense. The server keeps the latest update's factors and, per
client that has trained, the round it last synchronised at.

**The client's model** is its mentor (``personal_model: mentor``, default: the model that
learned from its own data and from the global mentee; PFLlib's reimplementation scores it
too); the mentee is scored beside it as
``local_mentee`` (``personal_model: mentee`` swaps them). The global model is the global
mentee (with ``head: personal`` there is none). Ephemeral state: one optimizer over both
models, reset every round or kept with ``train.optimizer_state: keep``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Literal

import torch
from pydantic import Field
from torch import nn
from torch.func import functional_call, grad

from fedpeft.data.task import IGNORE
from fedpeft.methods.base import (
    ClientData,
    FitResult,
    Job,
    MethodConfig,
    ServerState,
    Tensors,
    local_steps,
    tensor_bytes,
    weighted_mean,
)
from fedpeft.methods.cohort import OPT, GradientFn, Start, StepInput, model_scale, optimizer_state
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import LoraSpec

MENTOR = "mentor"  # the PEFT adapter name of the mentor
MENTOR_HEAD = "mentor_head."  # the mentor's classifier
OWN = "own."  # personal keys of the client's copy of the global mentee: own.<parameter name>
SVD_U, SVD_S, SVD_V, DELTA = ".svd_u", ".svd_s", ".svd_v", ".delta"  # uplink / downlink suffixes
FACTORS = (SVD_U, SVD_S, SVD_V)
ROUND = "round."  # downlink marker (zero elements): round.<t>, the round being trained
UPDATE = "update."  # server extras: the latest global update's factors, update.<name>.svd_*
SYNCED = "synced."  # server extras: synced.<client> = the round whose global mentee it trained from
VERSION = "version"  # server extras: the rounds aggregated so far
EPS = 1e-6  # floor of L_t + L_s in the adaptive weight


class FedKDConfig(MethodConfig):
    """Local mentor + shared mentee, mutual distillation, SVD-compressed updates.
    Paper: FedKD (Wu et al., 2022)."""

    name: Literal["fedkd"] = "fedkd"
    lora: LoraSpec = Field(
        default_factory=LoraSpec, description="The mentee (shared): rank r, alpha, targets, dropout."
    )
    mentor_rank: int = Field(32, ge=1, description="Rank of the mentor (personal), on the mentee's targets.")
    mentor_alpha: float | None = Field(
        None,
        gt=0,
        description="The mentor's LoRA alpha (None: the mentee's scale alpha / r, i.e. alpha r_m / r).",
    )
    energy: float = Field(
        0.95,
        gt=0,
        le=1,
        description="T: the share of an update's energy (sum of s^2) its SVD keeps; T_start.",
    )
    energy_end: float | None = Field(
        0.98,
        gt=0,
        le=1,
        description="T_end: T rises linearly from energy to energy_end over train.rounds (None: T fixed).",
    )
    compress_downlink: bool = Field(
        True, description="Send the global update SVD-compressed too (clients that trained last round)."
    )
    hidden_distillation: bool = Field(
        True, description="Distil every transformer layer's hidden states (MSE) besides the predictions (KL)."
    )
    stop_gradient: bool = Field(
        True,
        description="Each model learns from the other's outputs as targets, the adaptive weight detached "
        "(false: the authors' code, the summed loss with nothing detached).",
    )
    personal_model: Literal["mentor", "mentee"] = Field(
        "mentor", description="The model a client predicts with; the other is scored as local_<other>."
    )


# ---------------------------------------------------------------- SVD compression


def kept_rank(sigma: torch.Tensor, energy: float) -> int:
    """The fewest leading singular values whose energy ``sum s_k^2`` reaches ``energy`` of
    the total (0 for a zero matrix)."""
    cum = sigma.double().square().cumsum(0)
    if len(cum) == 0 or cum[-1] == 0:
        return 0
    return min(int((cum < energy * cum[-1]).sum()) + 1, len(sigma))


def svd_factors(matrix: torch.Tensor, energy: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U (m, k), s (k,), V (n, k))``, float32, with ``U diag(s) V^T`` the truncated SVD
    of ``matrix`` keeping :func:`kept_rank` components; each component's sign is fixed so
    that the largest entry of its ``U`` column is positive (an SVD is unique up to sign)."""
    u, s, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    k = kept_rank(s, energy)
    u, s, v = u[:, :k], s[:k], vh[:k].T
    if k:
        sign = torch.sign(u.gather(0, u.abs().argmax(0, keepdim=True)))[0]
        u, v = u * sign, v * sign
    return u.float().contiguous(), s.float().contiguous(), v.float().contiguous()


def reconstruct(u: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``U diag(s) V^T``."""
    return (u * s) @ v.T


def compressed(delta: torch.Tensor, energy: float) -> tuple[torch.Tensor, ...] | None:
    """The SVD factors of a matrix when they are smaller than the matrix, else None (and
    None for a tensor that is not a matrix)."""
    if delta.dim() != 2:
        return None
    factors = svd_factors(delta, energy)
    return factors if sum(f.numel() for f in factors) < delta.numel() else None


def compress(deltas: Tensors, energy: float) -> Tensors:
    """What a client sends for its update ``deltas``: a matrix's factors
    (``<name>.svd_u/.svd_s/.svd_v``) when they are smaller, else the tensor (``<name>.delta``)."""
    out = {}
    for name, delta in deltas.items():
        factors = compressed(delta, energy)
        if factors is None:
            out[name + DELTA] = delta
        else:
            out.update(zip((name + SVD_U, name + SVD_S, name + SVD_V), factors, strict=True))
    return out


def decompress(sent: Tensors) -> Tensors | None:
    """The update :func:`compress` encoded, by parameter name; None for a malformed message."""
    out = {}
    for key, t in sent.items():
        if key.endswith(DELTA):
            out[key.removesuffix(DELTA)] = t
        elif key.endswith(SVD_U):
            name = key.removesuffix(SVD_U)
            s, v = sent.get(name + SVD_S), sent.get(name + SVD_V)
            if s is None or v is None or t.dim() != 2 or s.dim() != 1 or v.dim() != 2:
                return None
            if not t.shape[1] == s.shape[0] == v.shape[1]:
                return None
            out[name] = reconstruct(t, s, v)
        elif not key.endswith((SVD_S, SVD_V)):
            return None
    return out


# ---------------------------------------------------------------- distillation


def _task(model: nn.Module) -> str:
    """Which prediction ``model`` makes: ``lm``, ``span``, ``tokens`` or ``rows``."""
    from fedpeft.models.backbone import SpanExtractor, TokenClassifier  # here: models import config
    from fedpeft.models.causal import CausalLM

    if isinstance(model, CausalLM):
        return "lm"
    if isinstance(model, SpanExtractor):
        return "span"
    return "tokens" if isinstance(model, TokenClassifier) else "rows"


def log_probs(task: str, logits: torch.Tensor, batch) -> torch.Tensor:
    """The predicted log-distributions, over the last dimension: over classes per row
    (``rows``) or token (``tokens``), over the vocabulary per position (``lm``), over the
    real positions for the start and for the end (``span``: ``(B, 2, L)``)."""
    if task == "span":
        valid = (batch["labels"] != IGNORE).unsqueeze(1)  # (B, 1, L)
        logits = logits.transpose(1, 2).masked_fill(~valid, torch.finfo(logits.dtype).min / 2)
    return logits.log_softmax(-1)


def _mean(values: torch.Tensor, batch, counted: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of per-row ``(B,)`` or per-token ``(B, L)`` values over the counted ones
    of the batch's real rows (a cohort's padded rows have weight 0)."""
    mask = torch.ones_like(values) if counted is None else counted.to(values.dtype)
    if "weight" in batch:
        weight = batch["weight"].to(values.dtype)
        mask = mask * (weight if values.dim() == 1 else weight.unsqueeze(1))
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def kl_of_log_probs(task: str, log_p: torch.Tensor, log_q: torch.Tensor, batch) -> torch.Tensor:
    """The mean of ``KL(p || q)`` (each over the last dimension) over what counts: the
    batch's real rows, labelled tokens, or positions predicting a response token."""
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    labels = batch["labels"]
    if task == "lm":  # position t predicts token t + 1
        return _mean(kl[:, :-1], batch, labels[:, 1:] != IGNORE)
    if task == "tokens":
        return _mean(kl, batch, labels != IGNORE)
    return _mean(kl.mean(-1) if task == "span" else kl, batch)


def distill_kl(model: nn.Module, target: torch.Tensor, logits: torch.Tensor, batch) -> torch.Tensor:
    """The mean per-example KL divergence of ``logits``' predictions from ``target``'s, for
    the task of ``model``: over classes (classification), over the vocabulary at each
    response token (causal LM), at each labelled token (tagging), over the positions of
    the span's start and end (extractive QA; their mean)."""
    task = _task(model)
    return kl_of_log_probs(task, log_probs(task, target, batch), log_probs(task, logits, batch), batch)


def hidden_mse(first: list[torch.Tensor], second: list[torch.Tensor], batch) -> torch.Tensor:
    """Mean over layers of the mean squared error between two models' hidden states
    ``(B, L, H)`` over the batch's real tokens."""
    mask = batch["attention_mask"].float()
    if "weight" in batch:
        mask = mask * batch["weight"].unsqueeze(1)
    terms = [
        ((a.float() - b.float()).square().sum(-1) * mask).sum() / (mask.sum() * a.shape[-1]).clamp_min(1.0)
        for a, b in zip(first, second, strict=True)
    ]
    return sum(terms) / max(len(terms), 1)


def mutual_loss(
    model: nn.Module,
    logits_t: torch.Tensor,
    logits_s: torch.Tensor,
    batch,
    hidden_t: list[torch.Tensor] | None = None,
    hidden_s: list[torch.Tensor] | None = None,
    stop_gradient: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FedKD's adaptive mutual distillation: ``(objective, L_t, L_s)`` with the objective
    ``L_t + L_s + [KL(p_s||p_t) + KL(p_t||p_s) + MSE_t + MSE_s] / (L_t + L_s)``, ``t`` the
    mentor and ``s`` the mentee (module docstring). With ``stop_gradient`` each term's
    target side and the weight are detached, so each model's tensors get its own loss's
    gradient."""
    sg: Callable[[torch.Tensor], torch.Tensor] = torch.detach if stop_gradient else (lambda t: t)
    task_t, task_s = model.loss(logits_t, batch), model.loss(logits_s, batch)
    weight = 1.0 / sg(task_t + task_s).clamp_min(EPS)
    task = _task(model)
    log_t, log_s = log_probs(task, logits_t, batch), log_probs(task, logits_s, batch)  # once each
    distil = kl_of_log_probs(task, sg(log_s), log_t, batch) + kl_of_log_probs(task, sg(log_t), log_s, batch)
    if hidden_t:
        distil = distil + hidden_mse(hidden_t, [sg(h) for h in hidden_s], batch)
        distil = distil + hidden_mse([sg(h) for h in hidden_t], hidden_s, batch)
    return task_t + task_s + weight * distil, task_t, task_s


def transformer_layers(model: nn.Module) -> list[nn.Module]:
    """The backbone's stack of transformer layers (the module list of
    ``config.num_hidden_layers`` blocks)."""
    count = model.backbone.config.num_hidden_layers
    for _, module in model.backbone.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return list(module)
    raise ValueError(
        "method.hidden_distillation: found no list of num_hidden_layers transformer layers in the "
        "backbone; set method.hidden_distillation: false"
    )


@contextmanager
def hidden_states(layers: list[nn.Module] | None) -> Iterator[list[torch.Tensor]]:
    """The output of every layer of ``layers`` during the block, in order (none when
    ``layers`` is None)."""
    states: list[torch.Tensor] = []
    hook = lambda module, args, out: states.append(out[0] if isinstance(out, tuple) else out)  # noqa: E731
    handles = [layer.register_forward_hook(hook) for layer in layers or []]
    try:
        yield states
    finally:
        for handle in handles:
            handle.remove()


class FedKD(FedAvgPeft):
    name = "fedkd"
    config_cls = FedKDConfig
    kind = "lora"
    paper = (
        "Wu, Wu, Lyu, Huang, Xie: Communication-efficient federated learning via knowledge distillation "
        "(Nature Communications 2022)"
    )

    # ----- structure
    def prepare(self, model) -> None:
        from peft import LoraConfig

        super().prepare(model)  # the mentee ("default" adapter) via HF PEFT, the head trainable
        cfg = self.cfg
        targets = model.backbone.peft_config["default"].target_modules
        alpha = cfg.mentor_alpha or cfg.lora.alpha / cfg.lora.r * cfg.mentor_rank
        mentor = LoraConfig(
            r=cfg.mentor_rank, lora_alpha=alpha, lora_dropout=cfg.lora.dropout, target_modules=targets
        )
        model.backbone.add_adapter(MENTOR, mentor)  # lora_B starts at 0: the mentor starts at the backbone
        model.backbone.base_model.set_adapter(["default", MENTOR])  # both active and trainable
        if getattr(model, "head", None) is not None:
            model.mentor_head = copy.deepcopy(model.head)
        self.split_trainable(model)
        names = [*self.shared_names, *self.personal_names]
        self.mentee_b = [n for n in names if ".lora_B.default." in n]
        self.mentor_b = [n for n in names if f".lora_B.{MENTOR}." in n]
        self.mentor_heads = [n for n in names if n.startswith(MENTOR_HEAD)]
        params = dict(model.named_parameters())
        self.zero_mentor = {n: torch.zeros_like(params[n]) for n in self.personal_names if self.is_mentor(n)}

    @staticmethod
    def is_mentor(name: str) -> bool:
        return f".{MENTOR}." in name or name.startswith(MENTOR_HEAD)

    def split_trainable(self, model) -> None:
        """The mentee (and the head unless ``head: personal``) is shared; the mentor personal."""
        super().split_trainable(model)
        mentor = [n for n in self.shared_names if self.is_mentor(n)]
        self.personal_names = [*mentor, *self.personal_names]
        self.shared_names = [n for n in self.shared_names if n not in mentor]

    def as_mentor(self, tensors: Tensors) -> Tensors:
        """``tensors`` computing the mentor: the mentee's ``B`` zero, the mentor's head as the head."""
        out = {**tensors, **{n: torch.zeros_like(tensors[n]) for n in self.mentee_b}}
        out.update({"head." + n.removeprefix(MENTOR_HEAD): tensors[n] for n in self.mentor_heads})
        return out

    def as_mentee(self, tensors: Tensors) -> Tensors:
        """``tensors`` computing the mentee: the mentor's ``B`` zero."""
        return {**tensors, **{n: torch.zeros_like(tensors[n]) for n in self.mentor_b}}

    # ----- communication
    def energy_at(self, rnd: int | None) -> float:
        """``T_t``: ``energy`` rising linearly to ``energy_end`` at the last round."""
        cfg = self.cfg
        if cfg.energy_end is None or rnd is None:
            return cfg.energy
        return cfg.energy + (cfg.energy_end - cfg.energy) * min(rnd, self.train.rounds) / self.train.rounds

    @staticmethod
    def round_of(received: Tensors) -> int | None:
        """The round a downlink was sent for (its ``round.<t>`` marker), if it has one."""
        return next((int(k.removeprefix(ROUND)) for k in received if k.startswith(ROUND)), None)

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """The latest global update's factors for a client that trained from the previous
        global mentee, dense tensors otherwise (and for every tensor not compressed), plus
        the round marker when ``T`` follows a schedule."""
        version = int(server.extras.get(VERSION, 0))
        synced = server.extras.get(f"{SYNCED}{cid}")
        in_sync = self.cfg.compress_downlink and synced is not None and int(synced) == version - 1
        out = {}
        for n in self.shared_names:
            if in_sync and UPDATE + n + SVD_U in server.extras:
                out.update({n + k: server.extras[UPDATE + n + k] for k in FACTORS})
            else:
                out[n] = server.tensors[n]
        if self.cfg.energy_end is not None:
            out[f"{ROUND}{version + 1}"] = torch.zeros(0)
        return out

    def base_mentee(self, received: Tensors, personal: Tensors) -> Tensors:
        """The global mentee a client holds on receiving ``received``: dense tensors as
        they are, its kept copy plus the factors' update for the others."""
        out = {}
        for n in self.shared_names:
            if n in received:
                out[n] = received[n]
            elif n + SVD_U in received:
                if OWN + n not in personal:
                    raise RuntimeError(
                        f"fedkd: the server sent an update of {n} on top of a mentee this client "
                        "does not hold"
                    )
                out[n] = personal[OWN + n] + reconstruct(*(received[n + k] for k in FACTORS))
            else:
                raise KeyError(f"fedkd: the downlink holds no {n}")
        return out

    def uplink_as_shared(self, uplink: Tensors) -> Tensors:
        """A client's update reconstructed from its factors, by parameter name (a malformed
        one comes back as it is, for the server's check to refuse)."""
        out = decompress(uplink)
        return uplink if out is None else out

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        """The clients' updates reconstructed and averaged by ``|D_i|``; the mean
        compressed with ``T_rnd`` (``compress_downlink``) and added to the global mentee."""
        updates = [self.uplink_as_shared(r.uplink) for r in results]
        mean = weighted_mean(updates, [r.num_examples for r in results])
        energy = self.energy_at(rnd)
        extras = {k: v for k, v in server.extras.items() if not k.startswith(UPDATE)}
        tensors = {}
        for n in self.shared_names:
            step = mean[n]
            factors = compressed(step, energy) if self.cfg.compress_downlink else None
            if factors is not None:
                extras.update({UPDATE + n + k: f for k, f in zip(FACTORS, factors, strict=True)})
                step = reconstruct(*factors)
            tensors[n] = server.tensors[n] + step
        extras[VERSION] = torch.tensor(rnd)
        for r in results:
            extras[f"{SYNCED}{r.cid}"] = torch.tensor(rnd - 1)
        return ServerState(tensors, extras)

    def global_state(self, server: ServerState) -> Tensors | None:
        """The global mentee (the mentor's tensors zero), unless the head is personal."""
        if self.cfg.head == "personal":
            return None
        return {**server.tensors, **self.zero_mentor}

    # ----- client: the local step as pure functions (vectorised over a cohort by the engine)
    def cohort_start(self, model, job: Job) -> Start:
        """The mentee as received (applied to the kept copy), the mentor and heads as kept."""
        params = {**self.base_mentee(job.received, job.personal), **self.params_of(job.personal)}
        opt = optimizer_state(job.personal, {n: params[n] for n in self.optimised_names()}, self.train)
        return Start(params, opt, {}, local_steps(len(job.client.train), self.train))

    def step_gradients(self, model) -> GradientFn:
        """The gradient of :func:`mutual_loss` for both models; reported: the task loss of
        the model the client predicts with."""
        layers = transformer_layers(model) if self.cfg.hidden_distillation else None
        scale, stop = model_scale(model), self.cfg.stop_gradient
        report_mentor = self.cfg.personal_model == "mentor"

        def forward(params: Tensors, batch) -> torch.Tensor:
            return functional_call(model, params, (batch["input_ids"], batch["attention_mask"]))

        def objective(params: Tensors, consts: Tensors, batches: StepInput):
            batch = batches[0]
            with hidden_states(layers) as hidden_t:
                logits_t = forward(self.as_mentor(params), batch)
            with hidden_states(layers) as hidden_s:
                logits_s = forward(self.as_mentee(params), batch)
            total, task_t, task_s = mutual_loss(model, logits_t, logits_s, batch, hidden_t, hidden_s, stop)
            return total * scale, task_t if report_mentor else task_s

        def gradients(params: Tensors, consts: Tensors, batches: StepInput):
            grads, reported = grad(objective, has_aux=True)(params, consts, batches)
            return reported, {n: g / scale for n, g in grads.items()} if scale != 1.0 else grads, {}

        return gradients

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """The mentee's update goes up compressed; the client keeps its mentor, heads and
        (``compress_downlink``) the global mentee it trained from."""
        base = self.base_mentee(job.received, job.personal)
        deltas = {n: params[n] - base[n] for n in self.shared_names}
        uplink = compress(deltas, self.energy_at(self.round_of(job.received)))
        own = {OWN + n: t.clone() for n, t in base.items()} if self.cfg.compress_downlink else {}
        kept = {OPT + k: v for k, v in opt.items()} if self.train.optimizer_state == "keep" else {}
        return FitResult(
            uplink=uplink,
            personal={**{n: params[n] for n in self.personal_names}, **own, **kept},
            num_examples=len(job.client.train),
            metrics={**metrics, "uplink_ratio": tensor_bytes(uplink) / max(tensor_bytes(deltas), 1)},
        )

    # ----- evaluation
    def mentor_model(self, received: Tensors, personal: Tensors) -> Tensors:
        return self.as_mentor({**self.base_mentee(received, personal), **self.params_of(personal)})

    def mentee_model(self, received: Tensors, personal: Tensors) -> Tensors:
        return self.as_mentee({**self.base_mentee(received, personal), **self.params_of(personal)})

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        if self.cfg.personal_model == "mentor":
            return self.mentor_model(received, personal)
        return self.mentee_model(received, personal)

    def extra_eval_states(self, model, received: Tensors, personal: Tensors, client: ClientData) -> dict:
        if self.cfg.personal_model == "mentor":
            return {"mentee": self.mentee_model(received, personal)}
        return {"mentor": self.mentor_model(received, personal)}
