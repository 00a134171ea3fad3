"""LoRA-FAIR: FedAvg of LoRA's ``A`` and ``B`` plus a server-side correction of ``B``
that brings ``(B_bar + dB) A_bar`` nearest to the clients' mean update.

Paper: Bian, Wang, Zhang and Xu, "LoRA-FAIR: Federated LoRA Fine-Tuning with Aggregation
and Initialization Refinement", ICCV 2025 (arXiv 2411.14961; docs/lora_family.md states
it, with where fedpeft departs).

The server averages the factors (``p_k = |D_k| / sum |D|``), ``A_bar = sum_k p_k A_k``,
``B_bar = sum_k p_k B_k``, and per adapted module solves

    dB = argmin  D((B_bar + dB) A_bar, dW) + lam ||dB||_F^2,   dW = sum_k p_k B_k A_k,

with ``D`` the cosine distance ``1 - cos`` (``similarity: cosine``, the paper's metric as
read; solved by L-BFGS from ``dB = 0``) or the squared Frobenius distance (``similarity:
frobenius``: a ridge regression, solved in closed form ``dB = (dW - B_bar A_bar) A_bar^T
(A_bar A_bar^T + lam I)^-1``). Clients start the next round from ``A_bar`` and
``B_bar + dB`` (the paper's "initialisation refinement": an informative start, not
LoRA's fresh zero ``B``); the global model is that LoRA, a plain PEFT adapter. The
uplink and downlink are FedLR's, byte for byte.
"""

from __future__ import annotations

import torch

from fedpeft.config.methods.lorafair import LoRAFAIRConfig
from fedpeft.methods.base import FitResult, ServerState
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.registry import register_method
from fedpeft.peft.lora import lora_layers


def ridge_correction(
    b_bar: torch.Tensor, a_bar: torch.Tensor, target: torch.Tensor, lam: float
) -> torch.Tensor:
    """``argmin ||(b_bar + dB) a_bar - target||_F^2 + lam ||dB||_F^2`` (float64, closed form)."""
    gram = a_bar @ a_bar.T + lam * torch.eye(a_bar.shape[0], dtype=a_bar.dtype)
    return torch.linalg.solve(gram, a_bar @ (target - b_bar @ a_bar).T).T


def cosine_objective(
    delta: torch.Tensor, b_bar: torch.Tensor, a_bar: torch.Tensor, target: torch.Tensor, lam: float
) -> torch.Tensor:
    """``1 - cos((b_bar + delta) a_bar, target) + lam ||delta||_F^2``."""
    product = (b_bar + delta) @ a_bar
    cosine = (product * target).sum() / (product.norm() * target.norm()).clamp_min(1e-300)
    return 1 - cosine + lam * delta.pow(2).sum()


def cosine_correction(
    b_bar: torch.Tensor, a_bar: torch.Tensor, target: torch.Tensor, lam: float, max_iter: int
) -> torch.Tensor:
    """A minimiser of :func:`cosine_objective` by L-BFGS (strong Wolfe line search) from
    ``dB = 0``; ``0`` when the product or the target is zero (no direction to match)."""
    delta = torch.zeros_like(b_bar, requires_grad=True)
    if float((b_bar @ a_bar).norm()) == 0 or float(target.norm()) == 0:
        return delta.detach()
    solver = torch.optim.LBFGS(
        [delta],
        lr=1,
        max_iter=max_iter,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        solver.zero_grad()
        loss = cosine_objective(delta, b_bar, a_bar, target, lam)
        loss.backward()
        return loss

    with torch.enable_grad():
        solver.step(closure)
    return delta.detach()


@register_method(LoRAFAIRConfig)
class LoRAFAIR(FedAvgPeft):
    kind = "lora"
    refuses = {
        "dora": "",  # DoRA's magnitudes: trained and averaged, as the head is
        "server_step": "its server corrects B for the clients' weighted mean; a server step would move it "
        "off that",
        "robust": "its correction matches the clients' weighted mean update; another rule has none to match",
        "secure_aggregation": "its correction of B matches the clients' products B_k A_k, which the mean of "
        "their factors does not give",
    }

    def prepare(self, model) -> None:
        super().prepare(model)
        #: per adapted module: the names of its A and B
        self.modules = {
            name: (f"{name}.lora_A.default.weight", f"{name}.lora_B.default.weight")
            for name in lora_layers(model)
        }

    def correction(self, b_bar: torch.Tensor, a_bar: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``dB`` for one module (float64)."""
        if self.cfg.similarity == "frobenius":
            return ridge_correction(b_bar, a_bar, target, self.cfg.lam)
        return cosine_correction(b_bar, a_bar, target, self.cfg.lam, self.cfg.max_iter)

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
        weights /= weights.sum()
        tensors = {
            **server.tensors,
            **self.mean([r.uplink for r in results], [r.num_examples for r in results]),
        }
        for a, b in self.modules.values():
            target = sum(
                w * r.uplink[b].double() @ r.uplink[a].double() for w, r in zip(weights, results, strict=True)
            )
            b_bar = tensors[b].double()
            tensors[b] = (b_bar + self.correction(b_bar, tensors[a].double(), target)).to(tensors[b].dtype)
        return ServerState(tensors, server.extras)
