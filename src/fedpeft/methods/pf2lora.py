"""PF2LoRA: two-level LoRA solved as a bilevel problem (personalised federated fine-tuning).

Paper: "PF2LoRA: Personalized Federated Fine-tuning via an Automatic Rank Learning
Approach via Two-Level LoRA" (Algorithm 1); docs/personalized.md.

Every adapted matrix of client ``i`` computes
``W0 x + (alpha/r) B A x + (alpha2/r2) D_i C_i x``: a common adapter ``(A, B)`` of rank
``r`` (shared, averaged by the server) and a client adapter ``(C_i, D_i)`` of small rank
``r2`` (personal: it never leaves the client). The head is shared unless ``head:
personal``. One local step on a mini-batch (:func:`bilevel_step`):

1. ``g = grad_{C,D} f(A, B, C, D)``, keeping the graph;
2. lower level, SGD: ``(C', D') = (C, D) - eta_low g``;
3. hypergradient: ``d/d(A,B) f(A, B, C', D')`` *through* step 2, i.e.
   ``grad_AB f(A,B,C',D') - eta_low Hess_{AB,CD} f(A,B,C,D) . grad_CD f(A,B,C',D')``,
   which autograd forms with one Hessian-vector product because step 1 kept the graph;
4. upper level: AdamW (``train.lr``) on ``(A, B)`` and the head with the hypergradient;
   ``(C, D) <- (C', D')``.

The server averages ``(A, B)`` (and the head) every ``I = train.local_steps`` steps, one
round. The global export holds the common adapter (and a shared head) only; a client's
own model (``export.personal``) is one PEFT adapter of rank ``r + r2`` holding both.
``bilevel: false`` is the paper's ablation: both adapters take plain gradients of
the same loss. Reading of the paper: steps 1 and 3 use the same mini-batch (Algorithm 1
draws one sample per step). Under sample-level DP-SGD (``privacy.mode: sample``) each
row of a batch takes its own bilevel step (Algorithm 1's one-sample step), and its
hypergradient and lower-level gradient are clipped together and noised with the others
(everything a row moves, the client adapter included, is bounded and noised); the step is
their noisy mean. Without DP a batch takes one bilevel step, as above. Ephemeral state:
the upper-level AdamW state lives for one round, or is kept by the client with
``train.optimizer_state: keep``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import grad, grad_and_value

from fedpeft.config.methods.pf2lora import PF2LoRAConfig
from fedpeft.engines.local import GradientFn, model_loss
from fedpeft.methods.base import FitResult, ServerState, Tensors
from fedpeft.methods.capabilities import OWN_GRADIENTS
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method
from fedpeft.peft.lora import lora_layers

CLIENT = "client"  # the PEFT adapter name of the personal adapter


def bilevel_step(
    loss: Callable[[Tensors], torch.Tensor],
    upper: Tensors,
    lower: Tensors,
    lower_lr: float,
    bilevel: bool = True,
) -> tuple[torch.Tensor, Tensors, Tensors]:
    """One bilevel step as a pure function (``torch.func``, so it vmaps over clients and,
    under DP-SGD, over a batch's rows): the batch loss ``f(upper, lower)``, the
    hypergradient of ``f(upper, lower - lower_lr * grad_lower f(upper, lower))`` with
    respect to each upper tensor (through the lower step: one Hessian-vector product),
    and ``grad_lower f(upper, lower)``, the lower level's SGD step's gradient (the step,
    ``lower - lower_lr * it``, is the caller's). ``loss(tensors)`` is the batch loss with
    ``tensors`` in place of the model's. ``bilevel=False`` (the ablation): plain
    gradients of ``f`` for both levels."""
    if not bilevel:
        grads, value = grad_and_value(loss)({**upper, **lower})
        return value, {n: grads[n] for n in upper}, {n: grads[n] for n in lower}

    def after_lower_step(up: Tensors) -> tuple[torch.Tensor, tuple[torch.Tensor, Tensors]]:
        g_low, value = grad_and_value(lambda low: loss({**up, **low}))(lower)  # depends on up
        stepped = {n: t - lower_lr * g_low[n] for n, t in lower.items()}
        return loss({**up, **stepped}), (value, g_low)

    hyper, (value, g_low) = grad(after_lower_step, has_aux=True)(upper)
    return value, hyper, g_low


@register_method(PF2LoRAConfig)
class PF2LoRA(FedAvgPeft):
    refuses = {"fp16": OWN_GRADIENTS}  # no loss scaling
    higher_order = True  # a gradient of a gradient
    kind = "lora"

    def prepare(self, model) -> None:
        from peft import LoraConfig

        super().prepare(model)  # the common adapter ("default") via HF PEFT, head trainable
        targets = model.backbone.peft_config["default"].target_modules
        client = LoraConfig(r=self.cfg.client_rank, lora_alpha=self.cfg.client_alpha, target_modules=targets)
        model.backbone.add_adapter(CLIENT, client)  # lora_B starts at 0: D_i C_i = 0
        model.backbone.base_model.set_adapter(["default", CLIENT])  # both active and trainable
        self.split_trainable(model)
        # The global model: the common adapter alone, every client adapter at zero.
        params = dict(model.named_parameters())
        self.zero_client = {n: torch.zeros_like(params[n]) for n in self.personal_names if f".{CLIENT}." in n}
        layer = next(iter(lora_layers(model).values()))
        self.scales = {"default": layer.scaling["default"], CLIENT: layer.scaling[CLIENT]}

    def split_trainable(self, model) -> None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        personal = [n for n in names if f".{CLIENT}." in n]
        if self.cfg.head == "personal":
            personal += [n for n in names if n.startswith("head.")]
        self.personal_names = personal
        self.shared_names = [n for n in names if n not in personal]

    def readout(self, result: FitResult) -> dict[str, float]:
        """Effective rank of each adapted matrix's total update ``s B A + s2 D_i C_i``:
        the number of its singular values above ``rank_tol`` times the largest; the mean
        and the extremes over the adapted matrices."""
        ranks = [
            effective_rank(update, self.cfg.rank_tol)
            for update in total_updates(result.uplink, self.params_of(result.personal), self.scales).values()
        ]
        return {"rank_mean": sum(ranks) / len(ranks), "rank_min": min(ranks), "rank_max": max(ranks)}

    def global_state(self, server: ServerState) -> Tensors | None:
        """The common adapter alone (client adapters zero), unless the head is personal."""
        if self.cfg.head == "personal":
            return None
        return {**server.tensors, **self.zero_client}

    # ----- the local step, as pure functions (vectorised over a cohort by the engine)
    def lower_names(self) -> list[str]:
        """The client adapter ``(C_i, D_i)``: the lower level, stepped by plain SGD."""
        return [n for n in self.personal_names if f".{CLIENT}." in n]

    def optimised_names(self) -> list[str]:
        """The upper level, which AdamW trains: the common adapter, the head (shared or personal)."""
        lower = set(self.lower_names())
        return [n for n in [*self.shared_names, *self.personal_names] if n not in lower]

    def sgd_rates(self) -> dict[str, float]:
        """The lower level steps by plain SGD at ``lower_lr``."""
        return dict.fromkeys(self.lower_names(), self.cfg.lower_lr)

    def step_gradients(self, model) -> GradientFn:
        """The upper level's hypergradient and the lower level's gradient, whose SGD step
        the engine takes (:func:`bilevel_step`, :meth:`sgd_rates`)."""
        loss, lower_names = model_loss(model), self.lower_names()
        eta, bilevel = self.cfg.lower_lr, self.cfg.bilevel

        def gradients(params: Tensors, consts: Tensors, batches):
            upper = {n: t for n, t in params.items() if n not in lower_names}
            lower = {n: params[n] for n in lower_names}
            value, hyper, g_low = bilevel_step(lambda p: loss(p, batches[0]), upper, lower, eta, bilevel)
            return value, {**hyper, **g_low}

        return gradients


def total_updates(shared: Tensors, personal: Tensors, scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """Per adapted module: ``s B A + s2 D C`` from the common and the client LoRA tensors."""
    tensors = {**shared, **personal}
    updates = {}
    for name in tensors:
        if ".lora_A.default." not in name:
            continue
        module = name.split(".lora_A.default.")[0]
        a, b = tensors[name], tensors[f"{module}.lora_B.default.weight"]
        c, d = tensors[f"{module}.lora_A.{CLIENT}.weight"], tensors[f"{module}.lora_B.{CLIENT}.weight"]
        updates[module] = scales["default"] * (b @ a) + scales[CLIENT] * (d @ c)
    return updates


def effective_rank(matrix: torch.Tensor, tol: float) -> int:
    """How many singular values of ``matrix`` exceed ``tol`` times the largest (0 for zero)."""
    sigma = torch.linalg.svdvals(matrix.double())
    return int((sigma > tol * sigma[0]).sum()) if sigma[0] > 0 else 0
