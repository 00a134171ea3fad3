"""FedAMP: federated attentive message passing (a personalised baseline of FDLoRA).

Paper: Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, "Personalized Cross-Silo Federated
Learning on Non-IID Data", AAAI 2021 (FedAMP, sec. 3-4; arXiv 2007.03797); METHODS.md,
FDLoRA section. FedAMP minimises ``sum_i F_i(w_i) + lambda sum_{i<j} A(||w_i - w_j||^2)``
over one model ``w_i`` per client by alternating two steps each round ``k``:

1. **Attentive message passing** (server): a gradient step of size ``alpha_k`` on the
   attention term gives client ``i`` its *personalised cloud model*
   ``u_i = xi_ii w_i + sum_{j != i} xi_ij w_j`` with
   ``xi_ij = alpha_k A'(||w_i - w_j||^2)`` for ``j != i`` and
   ``xi_ii = 1 - sum_{j != i} xi_ij``. The attention-inducing function is the paper's
   ``A(x) = 1 - exp(-x / sigma)``, so ``A'(x) = exp(-x / sigma) / sigma``: the closer two
   clients' models, the more they draw on each other (:func:`attention_weights`).
2. **Proximal step** (client): ``w_i`` takes the local steps on
   ``F_i(w) + lambda / (2 alpha_k) ||w - u_i||^2``, ``u_i`` a constant of the round
   (:func:`proximal`).

What is implemented here, and the readings made:

- **The client's model** ``w_i`` is its trainable PEFT tensors (``trainable``: LoRA by
  default, or adapters, BitFit biases, every weight; plus the head). The client keeps it
  between rounds (``own.<name>`` entries of its personal state, never sent as such),
  starts each round's local steps from it (as the reference implementations do; the
  paper leaves the starting point of the proximal solve open) and sends all of it up
  each round. It is what the client is scored with. A client that has never trained has
  no model of its own yet: it starts from, and is scored with, what it receives.
- **The server keeps each client's latest upload** (``w.<client>`` in its extras, one
  flattened vector per client that has uploaded, so the server state, and its
  checkpoint, grows with those clients only); ``u_i`` is formed over every client that
  has uploaded, the clients of earlier rounds with their latest model (the paper has
  every client in every round). ``xi`` is the paper's attention-inducing weighting,
  not the cosine-similarity heuristic (HeurFedAMP, the paper's sec. 5, which many
  reimplementations use with a fixed self-weight).
- **A client that has not uploaded yet** receives the mean of the latest uploads (the
  server's ``tensors``; before any upload, the initial model).
- **Defaults** (``alpha_k = 1``, ``lam = 1``, ``sigma = 10``). The paper's experimental
  values are not in fedpeft's sources. PFLlib's reimplementation defaults to
  ``alpha_k = lam = sigma = 1``; fedpeft takes its ``alpha_k`` and ``lam`` and ``sigma = 10``,
  which keeps ``xi_ii >= 0`` for up to ten other clients whatever their distances (every
  ``xi_ij <= alpha_k / sigma``). With more clients ``xi_ii`` can go negative (a gradient
  step past the weighted mean of the others): the server then logs a warning once; raise
  ``sigma`` or lower ``alpha_k``. ``sigma`` also sets the squared distance (over all sent
  tensors) at which attention fades, so it depends on the model and the PEFT kind.
- ``alpha_k`` is constant over rounds (PFLlib's help text mentions a step decaying as
  ``1 / sqrt(k)``, which fedpeft's sources cannot confirm). The paper writes
  ``xi_ij = alpha_k A'(.)`` (the factor 2 of the gradient of ``A(||.||^2)`` absorbed), as
  here; the proximal term is the squared norm (PFLlib's client uses the norm itself).
- ``head: personal`` keeps the head on the client: it is neither sent nor part of ``u_i``,
  and takes plain steps on ``F_i`` (no proximal term).
- There is no global model: the global test set scores the mean of the clients' own models.
- Ephemeral state: the optimizer state lives for a round, or is kept with
  ``train.optimizer_state: keep`` (``opt.*``).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
from pydantic import Field

from fedpeft.methods.base import ClientData, FitResult, Job, MethodConfig, ServerState, Tensors, local_steps
from fedpeft.methods.cohort import OPT, GradientFn, Start, backprop, model_loss, model_scale, optimizer_state
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.peft import AdapterSpec, LoraSpec, Trainable

log = logging.getLogger(__name__)

OWN = "own."  # personal keys of the client's own model w_i: own.<parameter name>
UPLOAD = "w."  # server extras: the latest upload of client c, flattened, as w.<c>


class FedAMPConfig(MethodConfig):
    """Personalised cloud models by attentive message passing. Paper: FedAMP (Huang et al., 2021)."""

    name: Literal["fedamp"] = "fedamp"
    trainable: Trainable = Field("lora", description="What each client's model w_i trains (the head always).")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    adapter: AdapterSpec = Field(default_factory=AdapterSpec)
    alpha_k: float = Field(
        1.0,
        gt=0,
        description="alpha_k, step size of the message-passing step: xi_ij = alpha_k A'(||w_i - w_j||^2); "
        "the proximal weight is lam / (2 alpha_k).",
    )
    sigma: float = Field(
        10.0,
        gt=0,
        description="sigma of A(x) = 1 - exp(-x / sigma): the squared distance at which attention fades; "
        "xi_ii >= 0 for any distances while alpha_k (clients - 1) / sigma <= 1.",
    )
    lam: float = Field(
        1.0, ge=0, description="lambda: the local objective is F_i(w) + lam / (2 alpha_k) ||w - u_i||^2."
    )


# ---------------------------------------------------------------- the server's math


def attention_weights(models: torch.Tensor, i: int, alpha_k: float, sigma: float) -> torch.Tensor:
    """Row ``i`` of FedAMP's weights over ``models`` ``(n, d)`` (one flattened model per
    row): ``xi_ij = alpha_k exp(-||w_i - w_j||^2 / sigma) / sigma`` for ``j != i`` and
    ``xi_ii = 1 - sum_{j != i} xi_ij``; float64, summing to 1."""
    sq = (models.double() - models[i].double()).square().sum(1)
    xi = alpha_k * torch.exp(-sq / sigma) / sigma
    xi[i] = 0.0
    xi[i] = 1.0 - xi.sum()
    return xi


def cloud_model(models: torch.Tensor, i: int, alpha_k: float, sigma: float) -> torch.Tensor:
    """``u_i = sum_j xi_ij w_j`` (flattened, float32) for the models ``(n, d)``."""
    return (attention_weights(models, i, alpha_k, sigma) @ models.double()).float()


def proximal(params: Tensors, anchor: Tensors) -> torch.Tensor:
    """``||w - u||^2`` summed over the tensors of ``anchor``."""
    return sum(((params[n] - u) ** 2).sum() for n, u in anchor.items())


def flatten(tensors: Tensors, names: list[str]) -> torch.Tensor:
    """The named tensors as one float32 vector, in the order of ``names``."""
    return torch.cat([tensors[n].detach().reshape(-1).float() for n in names])


def unflatten(vector: torch.Tensor, like: Tensors) -> Tensors:
    """The inverse of :func:`flatten` over ``like``'s names and shapes (in its order)."""
    out, at = {}, 0
    for name, ref in like.items():
        out[name] = vector[at : at + ref.numel()].view(ref.shape).to(ref.dtype).clone()
        at += ref.numel()
    return out


class FedAMP(FedAvgPeft):
    name = "fedamp"
    config_cls = FedAMPConfig
    paper = (
        "Huang, Chu, Zhou, Wang, Liu, Pei, Zhang: Personalized Cross-Silo Federated Learning on "
        "Non-IID Data (AAAI 2021)"
    )

    def __init__(self, cfg, train, seed: int = 0):
        super().__init__(cfg, train, seed)
        self._warned = False

    def trainable_kind(self) -> Trainable:
        return self.cfg.trainable

    # ----- server
    def layout(self, server: ServerState) -> Tensors:
        """The server's tensors in the order of ``shared_names``: how uploads are flattened."""
        return {n: server.tensors[n] for n in self.shared_names}

    def uploads(self, server: ServerState) -> tuple[list[int], torch.Tensor | None]:
        """The clients that have uploaded (ascending) and their latest models ``(n, d)``."""
        cids = sorted(int(k.removeprefix(UPLOAD)) for k in server.extras if k.startswith(UPLOAD))
        if not cids:
            return [], None
        return cids, torch.stack([server.extras[f"{UPLOAD}{c}"] for c in cids])

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """``u_i`` for a client that has uploaded; the mean of the uploads (the server's
        tensors; the initial model before any upload) for one that has not."""
        cids, models = self.uploads(server)
        if cid not in cids:
            return server.tensors
        i = cids.index(cid)
        xi = attention_weights(models, i, self.cfg.alpha_k, self.cfg.sigma)
        if xi[i] < 0 and not self._warned:
            self._warned = True
            ratio = self.cfg.alpha_k * (len(cids) - 1) / self.cfg.sigma
            log.warning(
                "fedamp: self-weight xi_ii = %.3g < 0 for client %d (alpha_k (clients - 1) / sigma = %.3g "
                "> 1): its cloud model extrapolates past its neighbours; raise method.sigma or lower "
                "method.alpha_k",
                float(xi[i]),
                cid,
                ratio,
            )
        return unflatten((xi @ models.double()).float(), self.layout(server))

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        """Keep each client's upload (replacing its previous one); the server's tensors
        become the mean of every client's latest upload (what newcomers receive)."""
        extras = dict(server.extras)
        for r in results:
            extras[f"{UPLOAD}{r.cid}"] = flatten(r.uplink, self.shared_names)
        _, models = self.uploads(ServerState(server.tensors, extras))
        return ServerState(unflatten(models.double().mean(0).float(), self.layout(server)), extras)

    def global_state(self, server: ServerState) -> Tensors | None:
        return None  # one model per client: the global test scores the mean of theirs

    # ----- client: the local step as pure functions (vectorised over a cohort by the engine)
    def own_model(self, received: Tensors, personal: Tensors) -> Tensors:
        """The client's model: its own kept ``w_i`` (or, never trained, what it received)
        and its personal parameters."""
        own = {n.removeprefix(OWN): t for n, t in personal.items() if n.startswith(OWN)}
        return {**(own or {n: received[n] for n in self.shared_names}), **self.params_of(personal)}

    def cohort_start(self, model, job: Job) -> Start:
        """Start from the client's own ``w_i``; the received ``u_i`` is a constant of the round."""
        params = self.own_model(job.received, job.personal)
        opt = optimizer_state(job.personal, {n: params[n] for n in self.optimised_names()}, self.train)
        anchor = {n: job.received[n] for n in self.shared_names}
        return Start(params, opt, anchor, local_steps(len(job.client.train), self.train))

    def step_gradients(self, model) -> GradientFn:
        """Backprop of ``F_i(w) + lam / (2 alpha_k) ||w - u_i||^2``."""
        loss, coef = model_loss(model), self.cfg.lam / (2 * self.cfg.alpha_k)

        def objective(params: Tensors, anchor: Tensors, batches) -> torch.Tensor:
            return loss(params, batches[0]) + coef * proximal(params, anchor)

        return backprop(objective, model_scale(model))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """All of ``w_i`` goes up; the client keeps it (``own.*``) for its next round."""
        kept = {OPT + k: v for k, v in opt.items()} if self.train.optimizer_state == "keep" else {}
        return FitResult(
            uplink={n: params[n] for n in self.shared_names},
            personal={
                **{n: params[n] for n in self.personal_names},
                **{OWN + n: params[n] for n in self.shared_names},
                **kept,
            },
            num_examples=len(job.client.train),
            metrics=metrics,
        )

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        return self.own_model(received, personal)
