"""FDLoRA: a personal and a global LoRA per client, an outer optimiser, and AdaFusion.

Paper: "FDLoRA: Personalized Federated Learning of Large Language Model via Dual LoRA
Tuning" (Algorithm 1, sec. 3); docs/two_modules.md.

Every client holds two LoRA modules of the same rank (each with its own classifier on
a classification task): a personal one ``theta_p`` (kept, as private ``own.*`` entries
of its personal state) and the global one ``theta_s`` (the shared tensors).

1. **Local learning** (a client's first round): it trains ``theta_p`` from the initial
   LoRA for ``personal_steps`` AdamW steps. In round 1 the server has no global module
   yet: the clients upload their ``theta_p`` and the server starts from their mean,
   ``theta_s^0 = mean_i theta_p^i`` (``global_init: personal_mean``, the paper; that
   one upload is the only time a personal module leaves a client, and only its mean is
   kept; ``global_init: fresh`` starts ``theta_s`` from the initial LoRA instead and
   uploads nothing personal). A client first sampled later learns ``theta_p`` in its
   first round, then goes on with step 2 in the same round.
2. **Federated learning**, outer step ``t = round - 1``: each client starts from
   ``theta_s^{t-1}`` and takes ``K = train.local_steps`` inner AdamW steps on its data,
   giving ``theta_s^{i,t}``; when ``t % H == 0`` (``sync_every``; ``rounds``: H = T,
   the last round only, as in the paper's ablations; ``never``: H = infinity) it also
   sets ``theta_p^i <- theta_s^{i,t}``. The server forms the outer gradient
   ``Delta = mean_i (theta_s^{t-1} - theta_s^{i,t})`` (``average: uniform``, the
   paper's plain mean over the round's clients, also for ``theta_s^0``; ``examples``
   weights each client by its examples as FedAvg does: ``theta_s^{t-1}`` minus the
   clients' mean) and steps
   ``theta_s^t = OuterOpt(theta_s^{t-1}, Delta)``: SGD with Nesterov
   momentum (:func:`outer_step`, torch's SGD semantics, in float64); with ``outer_lr``
   1 and no momentum it is FedAvg exactly (with ``average: examples``; the mean of the
   clients with ``uniform``).
3. **AdaFusion**: a client's model is one fused LoRA, per adapted matrix
   ``(w1 A_p + w2 A_s)`` and ``(w1 B_p + w2 B_s)`` (eq. 7), its classifier
   ``w1 h_p + w2 h_s``, with ``w`` found by a gradient-free optimiser (nevergrad's
   NGOpt, ``fusion_budget`` evaluations, ``w`` in ``[-fusion_bound, fusion_bound]``
   starting from the average (0.5, 0.5)) minimising the loss on ``fusion_examples``
   of its training examples plus ``fusion_l1 (|w1| + |w2|)`` (eq. 8). Fusion
   baselines (``fusion``): ``random`` (w uniform in [0, 1], seeded per client),
   ``average`` (0.5, 0.5), ``sum`` (1, 1), and the modules alone, ``personal`` (1, 0)
   and ``global`` (0, 1). The fusion is computed whenever a client is scored, so every
   evaluation reports the model the client would keep if training stopped there; with
   ``compare_fusions`` the other fusions are scored beside it (``local_<fusion>``).

Defaults are the paper's (outer lr 1e-3, momentum 0.5, K = 3 via ``train.local_steps``,
lambda 0.05, a budget of 5 fusion evaluations); its inner learning rate is ``train.lr``.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import torch

from fedpeft.config import TrainConfig
from fedpeft.config.methods.fdlora import FDLoRAConfig
from fedpeft.data.task import make_batch
from fedpeft.engines.local import (
    OPT,
    OWN,
    Job,
    Start,
    derive_seed,
    model_loss,
    optimizer_init,
    optimizer_state,
    run_cohort,
)
from fedpeft.methods.base import (
    ClientData,
    FitResult,
    ServerState,
    Tensors,
    local_steps,
    read_tensors,
    weighted_mean,
)
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method

MOMENTUM = "momentum."  # server extras: the outer optimiser's momentum buffers
READY = "global_ready"  # server extras: 1 once theta_s^0 exists
FUSIONS = ("adafusion", "random", "average", "sum", "personal", "global")


def outer_step(
    params: Tensors, mean: Tensors, momentum: Tensors, lr: float, mu: float, nesterov: bool
) -> tuple[Tensors, Tensors]:
    """One outer step: SGD with momentum, as ``torch.optim.SGD(lr, momentum=mu,
    nesterov=nesterov)`` (dampening 0), on the outer gradient ``Delta = params - mean``
    (``mean``: the clients' averaged modules): ``buf = mu buf + Delta``, ``step = Delta +
    mu buf`` (Nesterov) or ``buf``, ``params - lr step``. In float64, and written as
    ``(1 - lr) params + lr mean - lr mu buf`` (Nesterov; the previous ``buf`` otherwise),
    so that with ``lr`` 1 and ``mu`` 0 the result is
    ``mean`` exactly: FedAvg bit for bit. Returns the new params (their dtype) and the new
    momentum buffers (float64)."""
    new_params, new_momentum = {}, {}
    for name, p in params.items():
        theta, target, previous = p.double(), mean[name].double(), momentum[name].double()
        buf = mu * previous + (theta - target)
        extra = mu * buf if nesterov else mu * previous  # the step beyond Delta itself
        new_params[name] = ((1 - lr) * theta + lr * target - lr * extra).to(p.dtype)
        new_momentum[name] = buf
    return new_params, new_momentum


def fuse(personal: Tensors, global_: Tensors, w1: float, w2: float) -> Tensors:
    """Eq. 7 per tensor: ``w1 x_p + w2 x_s`` for every LoRA factor (so each adapted
    matrix gets ``(w1 B_p + w2 B_s)(w1 A_p + w2 A_s)``) and classifier tensor."""
    return {n: w1 * personal[n] + w2 * global_[n] for n in global_}


@register_method(FDLoRAConfig)
class FDLoRA(FedAvgPeft):
    paper = "FDLoRA"
    kind = "lora"
    refuses = {
        "server_step": "its server takes an outer optimiser step of its own (method.outer_lr, "
        "method.outer_momentum)",
        "secure_aggregation": "its server takes an outer optimiser step of its own (method.outer_lr, "
        "method.outer_momentum)",
    }

    def __init__(self, cfg, train, seed: int = 0):
        super().__init__(cfg, train, seed)
        if cfg.global_init == "personal_mean":
            self.refuses = {
                **self.refuses,
                "local_dp": "round 1 uploads each client's personal LoRA, not an update of a tensor it "
                "received",
            }

    def prepare(self, model) -> None:
        super().prepare(model)
        self.start = read_tensors(model, self.shared_names)  # both modules' initial value
        self.stage = "global"

    # ----- server side
    def init_server(self, model) -> ServerState:
        zeros = {MOMENTUM + n: torch.zeros(t.shape, dtype=torch.float64) for n, t in self.start.items()}
        ready = self.cfg.global_init == "fresh"
        return ServerState(
            read_tensors(model, self.shared_names), {READY: torch.tensor(float(ready)), **zeros}
        )

    @staticmethod
    def ready(server: ServerState) -> bool:
        return bool(server.extras[READY])

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """The global module; nothing before it exists (round 1 is local learning)."""
        return server.tensors if self.ready(server) else {}

    def global_state(self, server: ServerState) -> Tensors | None:
        return server.tensors if self.ready(server) else None

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        """Round 1 (``personal_mean``): ``theta_s^0`` = the mean of the uploaded personal
        modules. Then the outer step on ``Delta = mean_i (theta_s - theta_s^i)``."""
        weights = [r.num_examples if self.cfg.average == "examples" else 1 for r in results]
        if not self.ready(server):
            extras = {**server.extras, READY: torch.tensor(1.0)}
            return ServerState(weighted_mean([r.uplink for r in results], weights), extras)
        mean = weighted_mean([{n: t.double() for n, t in r.uplink.items()} for r in results], weights)
        momentum = {n: server.extras[MOMENTUM + n] for n in server.tensors}
        cfg = self.cfg
        new, buffers = outer_step(
            server.tensors, mean, momentum, cfg.outer_lr, cfg.outer_momentum, cfg.nesterov
        )
        return ServerState(new, {**server.extras, **{MOMENTUM + n: b for n, b in buffers.items()}})

    # ----- client side: the two stages, each a cohort run of plain local steps
    def has_personal(self, personal: Tensors) -> bool:
        return any(k.startswith(OWN) for k in personal)

    def personal_module(self, personal: Tensors) -> Tensors:
        """theta_p, under the parameters' names (the initial LoRA before stage 1)."""
        if not self.has_personal(personal):
            return dict(self.start)
        return {n: personal[OWN + n] for n in self.shared_names}

    def outer_steps(self) -> int:
        """T: the rounds of stage 2 (round 1 is local learning alone with ``personal_mean``)."""
        return self.train.rounds - (self.cfg.global_init == "personal_mean")

    def synchronises(self, rnd: int) -> bool:
        """Whether round ``rnd``'s outer step ``t`` has ``t % H == 0`` (theta_p <- theta_s^i)."""
        t = rnd - (self.cfg.global_init == "personal_mean")
        h = self.cfg.sync_every
        if h == "never" or t < 1:
            return False
        return t % (self.outer_steps() if h == "rounds" else h) == 0

    def private_steps(self, n: int, train: TrainConfig) -> tuple[int, int]:
        """Stage 2's steps every round, and stage 1's (``theta_p``, which round 1 uploads
        under ``personal_mean`` and which later stage 2s start beside) once more in a client's
        first round (counted on top of stage 2's even in round 1, where stage 2 does not
        run: an upper bound)."""
        return local_steps(n, train), self.cfg.personal_steps or local_steps(n, train)

    def local_rounds(self, model, jobs: list[Job]) -> list[FitResult]:
        """Stage 1 for the clients that have no personal module yet, then stage 2 for all
        that received the global one (both in a client's first round after round 1)."""
        jobs = list(jobs)
        fresh = [i for i, job in enumerate(jobs) if not self.has_personal(job.personal)]
        done: dict[int, FitResult] = {}
        if fresh:
            self.stage = "personal"
            stage_one = [
                replace(jobs[i], seed=derive_seed(jobs[i].seed, 1)) for i in fresh
            ]  # its own batches
            for i, result in zip(fresh, run_cohort(model, self, stage_one), strict=True):
                done[i] = result
                jobs[i] = replace(jobs[i], personal={**jobs[i].personal, **result.personal})
        federated = [i for i, job in enumerate(jobs) if job.received]
        if federated:
            self.stage = "global"
            for i, result in zip(
                federated, run_cohort(model, self, [jobs[i] for i in federated]), strict=True
            ):
                if i in done:  # both stages this round: steps and tokens of both
                    first = done[i].metrics
                    for key in ("steps", "tokens"):
                        result.metrics[key] += first.get(key, 0.0)
                    result.metrics["personal_loss"] = first["loss"]
                done[i] = result
        self.stage = "global"
        return [done[i] for i in range(len(jobs))]

    def cohort_start(self, model, job: Job) -> Start:
        n, train = len(job.client.train), job.context.train
        if self.stage == "personal":  # stage 1: theta_p from the initial LoRA, its own optimizer
            params = dict(self.start)
            steps = self.cfg.personal_steps or local_steps(n, train)
            return Start(params, optimizer_init(params, train), {}, steps)
        params = dict(job.received)
        return Start(params, optimizer_state(job.personal, params, train), {}, local_steps(n, train))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        kept = {k: v for k, v in job.personal.items() if k.startswith(OPT)}
        if self.stage == "personal":  # the upload of round 1 (personal_mean) is theta_p itself
            own = {OWN + n: t for n, t in params.items()}
            upload = params if self.cfg.global_init == "personal_mean" else {}
            return FitResult(upload, {**own, **kept}, len(job.client.train), metrics)
        own = {k: v for k, v in job.personal.items() if k.startswith(OWN)}
        if self.synchronises(job.rnd):
            own = {OWN + n: t.clone() for n, t in params.items()}
        if job.context.train.optimizer_state == "keep":
            kept = {OPT + k: v for k, v in opt.items()}
        return FitResult(dict(params), {**own, **kept}, len(job.client.train), metrics)

    # ----- the client's model: its two modules fused
    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        theta_p, theta_s = self.personal_module(personal), received or dict(self.start)
        return fuse(theta_p, theta_s, *self.fusion_weights(model, self.cfg.fusion, theta_p, theta_s, client))

    def extra_eval_states(self, model, received: Tensors, personal: Tensors, client: ClientData) -> dict:
        if not self.cfg.compare_fusions:
            return {}
        theta_p, theta_s = self.personal_module(personal), received or dict(self.start)
        return {
            kind: fuse(theta_p, theta_s, *self.fusion_weights(model, kind, theta_p, theta_s, client))
            for kind in FUSIONS
            if kind != self.cfg.fusion
        }

    def fusion_weights(
        self, model, kind: str, theta_p: Tensors, theta_s: Tensors, client: ClientData
    ) -> tuple[float, float]:
        """``(w1, w2)`` of fusion ``kind`` for this client (seeded by its id)."""
        fixed = {"average": (0.5, 0.5), "sum": (1.0, 1.0), "personal": (1.0, 0.0), "global": (0.0, 1.0)}
        if kind in fixed:
            return fixed[kind]
        rng = np.random.default_rng([self.seed, client.cid])
        if kind == "random":
            w1, w2 = rng.uniform(0.0, 1.0, size=2)
            return float(w1), float(w2)
        return self.adafusion(model, theta_p, theta_s, client, rng)

    @torch.no_grad()
    def adafusion(
        self, model, theta_p: Tensors, theta_s: Tensors, client: ClientData, rng: np.random.Generator
    ) -> tuple[float, float]:
        """Eq. 8: the ``w`` minimising the loss of the fused model on a few of the
        client's training examples plus ``lambda (|w1| + |w2|)``, searched gradient-free
        by nevergrad's NGOpt within ``fusion_budget`` evaluations."""
        import nevergrad as ng

        cfg = self.cfg
        rows = torch.as_tensor(rng.permutation(len(client.train))[: cfg.fusion_examples])
        batch = make_batch(client.train, rows.to(client.train.ids.device))
        loss = model_loss(model)
        model.eval()

        def objective(w: np.ndarray) -> float:
            fused = fuse(theta_p, theta_s, float(w[0]), float(w[1]))
            return float(loss(fused, batch)) + cfg.fusion_l1 * float(np.abs(w).sum())

        weights = ng.p.Array(init=np.array([0.5, 0.5])).set_bounds(-cfg.fusion_bound, cfg.fusion_bound)
        weights.random_state = np.random.RandomState(int(rng.integers(2**31)))
        with warnings.catch_warnings():  # NGOpt's pick for tiny budgets (COBYLA) warns about its defaults
            warnings.simplefilter("ignore", UserWarning)
            best = ng.optimizers.NGOpt(parametrization=weights, budget=cfg.fusion_budget).minimize(objective)
        return float(best.value[0]), float(best.value[1])
