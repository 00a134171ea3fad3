"""FedKD: a local mentor and a shared mentee that teach each other, with SVD-compressed updates.

Paper: Wu, Wu, Lyu, Huang, Xie, "Communication-efficient federated learning via
knowledge distillation", Nature Communications 13, 2032 (2022) (FedKD; "Methods":
adaptive mutual distillation, dynamic gradient approximation); the authors' code
(github.com/wuch15/FedKD) settles details the text leaves open. docs/two_modules.md.

**Two models on one frozen backbone.** Each client has a *mentor* (personal: it never
leaves the client) and a *mentee* (shared: aggregated by FedAvg). The paper's mentor is a
larger network than the mentee; here both are LoRA adapters on the same frozen backbone,
added through HF PEFT as PF2LoRA adds its second adapter: the mentee is the ``default``
adapter of rank ``lora.r`` (plus the head), the mentor the ``mentor`` adapter of rank
``mentor_rank`` (default 32, four times the default mentee rank; plus its own head,
``mentor_head``, a copy of the initial head; a causal LM has no head and both use its
frozen LM head). Both adapters are active in the model;
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
``Delta = (mentee after training) - (mentee received)`` goes up compressed
(:mod:`fedpeft.peft.svd`): every matrix as its truncated SVD ``U diag(s) V^T`` keeping the
fewest singular values whose energy ``sum s_k^2`` reaches ``T`` of the total, the factors
sent as ``<name>.svd_u``, ``<name>.svd_s``, ``<name>.svd_v``; a matrix whose factors would
not be smaller than itself, and every 1-D tensor (biases, the head's bias), goes dense as
``<name>.delta``. The bytes counted are those of what is sent. ``T`` rises over the rounds
from ``energy`` to ``energy_end`` (the paper's dynamic threshold; 0.95 -> 0.98 in the
authors' code and PFLlib): ``T_t = energy + (energy_end - energy) t / train.rounds``, the
round ``t`` the client's job's (``Job.rnd``; a Flower node learns it from the server);
``energy_end: null`` keeps ``T = energy``. The server reconstructs each update from its
factors (:meth:`CompressedUpdates.uplink_as_shared`), averages them weighted by ``|D_i|``, and adds
the mean to the global mentee.

**The downlink is compressed too** (``compress_downlink``, default true, as the paper):
the server compresses the round's mean update with the same ``T_t`` and applies the
*compressed* update to its global mentee, so the server and every client that applies it
hold the same mentee, bit for bit. A client keeps the mentee it last trained from
(``own.<name>``, never sent); the server keeps the latest update's factors and, per client
that has trained, the version of the global mentee (the number of updates applied to it)
that the client trained from. To a client it knows to hold the version before the
current one it sends the factors of the latest update, which the client adds to its
copy; to the others (a client that has never trained, or missed a round: the paper has
every client in every round) the global mentee dense.

The server's knowledge lags when it skips aggregating a round (a Flower server short of
results): a client that trained in that round holds the current version already, while
the server still takes it for one behind and sends it the same factors again. So a
factor downlink also names the version it brings the client to (``version``, a float32
scalar: 4 bytes of sync metadata), and the client keeps the version of its copy
(``own.version``): holding that version already, it keeps its copy rather than apply the
update twice (:meth:`FedKD.base_mentee`). A dense downlink carries no version (it would
outgrow the dense state by those 4 bytes) and needs none: a client sent the dense mentee
is sent it again until the server aggregates an update the client trained from it, so
when factors next come, a copy taken from a dense downlink is one version behind.

**The client's model** is its mentor (``personal_model: mentor``, default: the model that
learned from its own data and from the global mentee; PFLlib's reimplementation scores it
too); the mentee is scored beside it as ``local_mentee`` (``personal_model: mentee``
swaps them). The global model is the global
mentee (with ``head: personal`` there is none). Ephemeral state: one optimizer over both
models, reset every round or kept with ``train.optimizer_state: keep``; each model's
gradients are clipped to ``train.max_grad_norm`` on their own (:meth:`FedKD.clip_group`),
so the two models step as they would with an optimizer each.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.func import functional_call

from fedpeft.config.methods.fedkd import FedKDConfig
from fedpeft.data.task import IGNORE
from fedpeft.engines.local import (
    OWN,
    GradientFn,
    Start,
    StepInput,
    backprop_reporting,
    model_inputs,
    model_scale,
    optimizer_state,
    row_mean,
)
from fedpeft.methods.base import (
    ClientData,
    FitResult,
    Job,
    ServerState,
    Tensors,
    local_steps,
    tensor_bytes,
)
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method
from fedpeft.peft.svd import DELTA, FACTORS, SVD_U, compress, decompress, reconstruct

MENTOR = "mentor"  # the PEFT adapter name of the mentor
MENTOR_HEAD = "mentor_head."  # the mentor's classifier
#: the global mentee's version (updates applied): in the server extras and a factor
#: downlink; a client keeps its copy's as own.version
VERSION = "version"
UPDATE = "update."  # server extras: the latest global update's factors, update.<name>.svd_*
SYNCED = "synced."  # server extras: synced.<client> = the version the client last trained from
EPS = 1e-6  # floor of L_t + L_s in the adaptive weight


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


def token_mean(values: torch.Tensor, batch, counted: torch.Tensor) -> torch.Tensor:
    """The mean of per-token values ``(B, L)`` over the ``counted`` tokens of the batch's
    real rows (a cohort's padded rows have weight 0)."""
    mask = counted.to(values.dtype)
    if "weight" in batch:
        mask = mask * batch["weight"].to(values.dtype).unsqueeze(1)
    return (values * mask).sum() / mask.sum().clamp_min(1.0)


def kl_of_log_probs(task: str, log_p: torch.Tensor, log_q: torch.Tensor, batch) -> torch.Tensor:
    """The mean of ``KL(p || q)`` (each over the last dimension) over what counts: the
    batch's real rows (for a span, the mean of its start's and end's), labelled tokens, or
    positions predicting a response token (all positions', or only the scored positions'
    distributions: ``fedpeft.models.causal.SCORED``)."""
    from fedpeft.models.causal import scored_weight

    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    labels = batch["labels"]
    if task == "lm" and kl.dim() == 1:  # (K,): at the scored positions
        weight = scored_weight(batch)
        return (kl * weight).sum() / weight.sum().clamp_min(1.0)
    if task == "lm":  # position t predicts token t + 1
        return token_mean(kl[:, :-1], batch, labels[:, 1:] != IGNORE)
    if task == "tokens":
        return token_mean(kl, batch, labels != IGNORE)
    return row_mean(kl.mean(-1) if task == "span" else kl, batch)


def hidden_mse(first: list[torch.Tensor], second: list[torch.Tensor], batch) -> torch.Tensor:
    """Mean over layers of the mean squared error between two models' hidden states
    ``(B, L, H)`` over the batch's real tokens."""
    terms = [
        token_mean((a.float() - b.float()).square().mean(-1), batch, batch["attention_mask"])
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


@register_method(FedKDConfig)
class FedKD(FedAvgPeft):
    kind = "lora"
    paper = (
        "Wu, Wu, Lyu, Huang, Xie: Communication-efficient federated learning via knowledge distillation "
        "(Nature Communications 2022)"
    )
    refuses = {
        "correction": "a client sends a compressed update (SVD factors), not the trained tensors a control "
        "is read from",
        "secure_aggregation": "its server reconstructs each client's update from its SVD factors",
    }

    # ----- messages: a client's update as SVD factors, which the server's checks read reconstructed
    def uplink_as_shared(self, uplink: Tensors) -> Tensors:
        """A client's update reconstructed from its factors, by parameter name (a malformed
        one comes back as it is, for the server's check to refuse)."""
        out = decompress(uplink)
        return uplink if out is None else out

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
    def energy_at(self, rnd: int) -> float:
        """``T_t``: ``energy`` rising linearly to ``energy_end`` at the last round."""
        cfg = self.cfg
        if cfg.energy_end is None:
            return cfg.energy
        return cfg.energy + (cfg.energy_end - cfg.energy) * min(rnd, self.train.rounds) / self.train.rounds

    @staticmethod
    def version(server: ServerState) -> float:
        """The global mentee's version: the updates applied to it so far."""
        return float(server.extras.get(VERSION, 0.0))

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """The global mentee: for a client that trained from the version before, the latest
        update's factors and the version they bring it to (dense tensors for every tensor
        not compressed); for the others, dense."""
        version = self.version(server)
        synced = server.extras.get(f"{SYNCED}{cid}")
        one_behind = self.cfg.compress_downlink and synced is not None and float(synced) == version - 1
        factored = [n for n in self.shared_names if one_behind and UPDATE + n + SVD_U in server.extras]
        out = {n: server.tensors[n] for n in self.shared_names if n not in factored}
        for n in factored:
            out.update({n + k: server.extras[UPDATE + n + k] for k in FACTORS})
        if factored:
            out[VERSION] = torch.tensor(version, dtype=torch.float32)
        return out

    def base_mentee(self, received: Tensors, personal: Tensors) -> Tensors:
        """The global mentee a client holds on receiving ``received``: dense tensors as
        they are; where the latest update's factors came instead, its kept copy plus the
        update, or the copy alone when it holds the downlink's version already (it trained
        in a round the server then skipped; module docstring)."""
        if all(n in received for n in self.shared_names):
            return {n: received[n] for n in self.shared_names}
        version, held = float(received[VERSION]), personal.get(OWN + VERSION)
        lag = 1.0 if held is None else version - float(held)  # a copy from a dense downlink: one behind
        missing = [n for n in self.shared_names if n not in received and OWN + n not in personal]
        if missing or lag not in (0.0, 1.0):
            holds = "no copy of it" if missing else f"its version {float(held):g}"
            raise RuntimeError(
                f"fedkd: the server sent the update to global mentee version {version:g}, but this client "
                f"holds {holds}; it needs the global mentee dense"
            )
        out = {}
        for n in self.shared_names:
            if n in received:
                out[n] = received[n]
            elif lag == 1.0:
                out[n] = personal[OWN + n] + reconstruct(*(received[n + k] for k in FACTORS))
            else:
                out[n] = personal[OWN + n]
        return out

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        """The clients' updates reconstructed and averaged by ``|D_i|``; the mean
        compressed with ``T_rnd`` (``compress_downlink``) and added to the global mentee,
        a version on; each client recorded as having trained from the version before."""
        updates = [self.uplink_as_shared(r.uplink) for r in results]
        mean = self.mean(updates, [r.num_examples for r in results])
        if self.cfg.compress_downlink:
            sent = compress(mean, self.energy_at(rnd))
        else:
            sent = {n + DELTA: t for n, t in mean.items()}
        step = decompress(sent)
        version = self.version(server)
        extras = {k: v for k, v in server.extras.items() if not k.startswith(UPDATE)}
        extras.update({UPDATE + k: t for k, t in sent.items() if k.endswith(FACTORS)})
        extras[VERSION] = torch.tensor(version + 1, dtype=torch.float32)
        extras.update({f"{SYNCED}{r.cid}": torch.tensor(version, dtype=torch.float32) for r in results})
        return ServerState({n: server.tensors[n] + step[n] for n in self.shared_names}, extras)

    def global_state(self, server: ServerState) -> Tensors | None:
        """The global mentee (the mentor's tensors zero), unless the head is personal."""
        if self.cfg.head == "personal":
            return None
        return {**server.tensors, **self.zero_mentor}

    # ----- client: the local step as pure functions (vectorised over a cohort by the engine)
    def cohort_start(self, model, job: Job) -> Start:
        """The mentee as received (applied to the kept copy), the mentor and heads as kept."""
        params = {**self.base_mentee(job.received, job.personal), **self.params_of(job.personal)}
        opt = optimizer_state(job.personal, {n: params[n] for n in self.optimised_names()}, job.context.train)
        return Start(params, opt, {}, local_steps(len(job.client.train), job.context.train))

    def clip_group(self, name: str) -> str:
        """The mentor and the mentee are clipped each on its own."""
        return MENTOR if self.is_mentor(name) else "mentee"

    def step_gradients(self, model) -> GradientFn:
        """The gradient of :func:`mutual_loss` for both models; reported: the task loss of
        the model the client predicts with."""
        layers = transformer_layers(model) if self.cfg.hidden_distillation else None
        stop, report_mentor = self.cfg.stop_gradient, self.cfg.personal_model == "mentor"

        def forward(params: Tensors, batch) -> torch.Tensor:
            args, kwargs = model_inputs(batch)
            return functional_call(model, params, args, kwargs)

        def objective(params: Tensors, consts: Tensors, batches: StepInput):
            batch = batches[0]
            with hidden_states(layers) as hidden_t:
                logits_t = forward(self.as_mentor(params), batch)
            with hidden_states(layers) as hidden_s:
                logits_s = forward(self.as_mentee(params), batch)
            total, task_t, task_s = mutual_loss(model, logits_t, logits_s, batch, hidden_t, hidden_s, stop)
            return total, task_t if report_mentor else task_s

        return backprop_reporting(objective, model_scale(model))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """The mentee's update goes up compressed; the client keeps its mentor, heads and
        (``compress_downlink``) the global mentee it trained from, with its version if the
        downlink named it."""
        base = self.base_mentee(job.received, job.personal)
        deltas = {n: params[n] - base[n] for n in self.shared_names}
        uplink = compress(deltas, self.energy_at(job.rnd))
        ratio = tensor_bytes(uplink) / max(tensor_bytes(deltas), 1)
        result = super().cohort_finish(job, params, opt, {**metrics, "uplink_ratio": ratio})
        result.uplink = uplink
        if self.cfg.compress_downlink:
            result.personal.update({OWN + n: t.clone() for n, t in base.items()})
            if VERSION in job.received:
                result.personal[OWN + VERSION] = job.received[VERSION].clone()
        return result

    # ----- evaluation
    def client_models(self, received: Tensors, personal: Tensors) -> dict[str, Tensors]:
        """The client's two models, ``mentor`` and ``mentee``, each as the tensors that compute it."""
        state = {**self.base_mentee(received, personal), **self.params_of(personal)}
        return {"mentor": self.as_mentor(state), "mentee": self.as_mentee(state)}

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        """The model the client predicts with (``personal_model``)."""
        return self.client_models(received, personal)[self.cfg.personal_model]

    def extra_eval_states(self, model, received: Tensors, personal: Tensors, client: ClientData) -> dict:
        """The other model, scored as ``local_<other>``."""
        models = self.client_models(received, personal)
        return {name: state for name, state in models.items() if name != self.cfg.personal_model}
