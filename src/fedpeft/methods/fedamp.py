"""FedAMP: federated attentive message passing (a personalised baseline of FDLoRA).

Paper: Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, "Personalized Cross-Silo Federated
Learning on Non-IID Data", AAAI 2021 (FedAMP, sec. 3-4; arXiv 2007.03797);
docs/two_modules.md. FedAMP minimises ``sum_i F_i(w_i) + lambda sum_{i<j} A(||w_i - w_j||^2)``
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
  ``alpha_k = lam = sigma = 1``; fedpeft takes its ``alpha_k`` and ``lam`` and ``sigma = 10``.
  Every ``xi_ij <= alpha_k / sigma``, so ``xi_ii >= 0`` whatever the distances while
  ``alpha_k (n - 1) / sigma <= 1`` over the ``n`` clients that have uploaded (up to 11
  here). PEFT models lie much closer together than ``sigma``, so each ``xi_ij`` is close
  to ``alpha_k / sigma`` and beyond that many clients ``xi_ii`` goes negative: ``u_i``
  would step past the weighted mean of the others, away from the client's own model. The
  server refuses that: :meth:`FedAMP.aggregate` raises an error naming ``method.alpha_k``
  and ``method.sigma`` and the numbers (lower the first or raise the second). fedpeft does
  not choose ``alpha_k`` itself from the number of uploads: it is also in the client's
  proximal weight ``lam / (2 alpha_k)``, which would then change from round to round.
  ``sigma`` also sets the squared distance (over all sent tensors) at which attention
  fades, so it depends on the model and the PEFT kind.
- ``alpha_k`` is constant over rounds (PFLlib's help text mentions a step decaying as
  ``1 / sqrt(k)``, which fedpeft's sources cannot confirm). The paper writes
  ``xi_ij = alpha_k A'(.)`` (the factor 2 of the gradient of ``A(||.||^2)`` absorbed), as
  here; the proximal term is the squared norm (PFLlib's client uses the norm itself).
- ``head: personal`` keeps the head on the client: it is neither sent nor part of ``u_i``,
  and takes plain steps on ``F_i`` (no proximal term).
- There is no global model: each client's own model is scored on the global test set and
  the engine averages the clients' scores.
- Ephemeral state: the optimizer state lives for a round, or is kept with
  ``train.optimizer_state: keep`` (``opt.*``).
"""

from __future__ import annotations

import torch

from fedpeft.config.methods.fedamp import FedAMPConfig
from fedpeft.engines.local import OWN, GradientFn, Start, backprop, model_loss, model_scale, optimizer_state
from fedpeft.methods.base import ClientData, FitResult, Job, ServerState, Tensors, local_steps
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method

UPLOAD = "w."  # server extras: the latest upload of client c, flattened, as w.<c>


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


def uploads(extras: Tensors) -> tuple[list[int], torch.Tensor]:
    """The clients whose uploads ``extras`` holds (ascending) and their models ``(n, d)``,
    float64."""
    cids = sorted(int(k.removeprefix(UPLOAD)) for k in extras if k.startswith(UPLOAD))
    if not cids:
        return [], torch.zeros(0, 0, dtype=torch.float64)
    return cids, torch.stack([extras[f"{UPLOAD}{c}"] for c in cids]).double()


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


@register_method(FedAMPConfig)
class FedAMP(FedAvgPeft):
    refuses = {
        "server_step": "its server sends each client a personalised cloud model, not one global model to "
        "step",
        "robust": "its server weighs each client's upload by its similarity to every other's, one by one",
        "secure_aggregation": "its server weighs each client's upload by its similarity to every other's, "
        "one by one",
    }
    paper = (
        "Huang, Chu, Zhou, Wang, Liu, Pei, Zhang: Personalized Cross-Silo Federated Learning on "
        "Non-IID Data (AAAI 2021)"
    )

    def __init__(self, cfg, train, seed: int = 0):
        super().__init__(cfg, train, seed)
        #: the server extras the cloud models were last formed from, and those cloud models
        self._clouds: tuple[Tensors, dict[int, torch.Tensor]] | None = None

    # ----- server
    def layout(self, server: ServerState) -> Tensors:
        """The server's tensors in the order of ``shared_names``: how uploads are flattened."""
        return {n: server.tensors[n] for n in self.shared_names}

    def cloud_models(self, cids: list[int], models: torch.Tensor) -> dict[int, torch.Tensor]:
        """``u_i`` (flattened, float32) of every client ``cids`` names, from their models
        ``(n, d)``; an error where a self-weight ``xi_ii`` is negative (module docstring)."""
        if not cids:
            return {}
        alpha_k, sigma, n = self.cfg.alpha_k, self.cfg.sigma, len(cids)
        xi = torch.stack([attention_weights(models, i, alpha_k, sigma) for i in range(n)])
        worst = int(xi.diagonal().argmin())
        if xi[worst, worst] < 0:
            raise ValueError(
                f"fedamp: with {n} uploaded clients, method.alpha_k = {alpha_k:g} and method.sigma = "
                f"{sigma:g} give client {cids[worst]} the self-weight xi_ii = {float(xi[worst, worst]):.3g} "
                f"< 0 (each other client weighs up to alpha_k / sigma = {alpha_k / sigma:.3g}): its cloud "
                f"model would step past its neighbours' mean. Keep alpha_k (clients - 1) / sigma <= 1 (here "
                f"{alpha_k * (n - 1) / sigma:.3g}): lower method.alpha_k, or raise method.sigma to at least "
                f"{alpha_k * (n - 1):g}"
            )
        return dict(zip(cids, (xi @ models).float(), strict=True))

    def clouds(self, server: ServerState) -> dict[int, torch.Tensor]:
        """The cloud models of the clients that have uploaded, formed once per server
        state (the engine asks for a downlink for every client it evaluates)."""
        if self._clouds is None or self._clouds[0] is not server.extras:
            self._clouds = (server.extras, self.cloud_models(*uploads(server.extras)))
        return self._clouds[1]

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """``u_i`` for a client that has uploaded; the mean of the uploads (the server's
        tensors; the initial model before any upload) for one that has not."""
        cloud = self.clouds(server).get(cid)
        return server.tensors if cloud is None else unflatten(cloud, self.layout(server))

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        """Keep each client's upload (replacing its previous one) and form the cloud models
        (an error where a self-weight is negative); the server's tensors become the mean of
        every client's latest upload (what newcomers receive)."""
        extras = dict(server.extras)
        for r in results:
            extras[f"{UPLOAD}{r.cid}"] = flatten(r.uplink, self.shared_names)
        cids, models = uploads(extras)
        self._clouds = (extras, self.cloud_models(cids, models))
        return ServerState(unflatten(models.mean(0).float(), self.layout(server)), extras)

    def global_state(self, server: ServerState) -> Tensors | None:
        return None  # one model per client, each scored on the global test set

    # ----- client: the local step as pure functions (vectorised over a cohort by the engine)
    def own_model(self, received: Tensors, personal: Tensors) -> Tensors:
        """The client's model: its own kept ``w_i`` (or, never trained, what it received)
        and its personal parameters."""
        own = {n.removeprefix(OWN): t for n, t in personal.items() if n.startswith(OWN)}
        return {**(own or {n: received[n] for n in self.shared_names}), **self.params_of(personal)}

    def cohort_start(self, model, job: Job) -> Start:
        """Start from the client's own ``w_i``; the received ``u_i`` is a constant of the round."""
        params = self.own_model(job.received, job.personal)
        opt = optimizer_state(job.personal, {n: params[n] for n in self.optimised_names()}, job.context.train)
        anchor = {n: job.received[n] for n in self.shared_names}
        return Start(params, opt, anchor, local_steps(len(job.client.train), job.context.train))

    def step_gradients(self, model) -> GradientFn:
        """Backprop of ``F_i(w) + lam / (2 alpha_k) ||w - u_i||^2``."""
        loss, coef = model_loss(model), self.cfg.lam / (2 * self.cfg.alpha_k)

        def objective(params: Tensors, anchor: Tensors, batches) -> torch.Tensor:
            return loss(params, batches[0]) + coef * proximal(params, anchor)

        return backprop(objective, model_scale(model))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """All of ``w_i`` goes up; the client keeps it (``own.*``) for its next round."""
        result = super().cohort_finish(job, params, opt, metrics)
        result.personal.update({OWN + n: params[n] for n in self.shared_names})
        return result

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        return self.own_model(received, personal)
