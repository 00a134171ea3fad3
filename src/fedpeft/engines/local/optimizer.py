"""The functional optimizer of a local step: AdamW or SGD as pure functions, matching
``torch.optim`` step for step, with ``clip_grad_norm_``'s clipping and the optimizer state
a client keeps between its rounds (``train.optimizer_state: keep``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fedpeft.engines.local.jobs import OPT, Job, Tensors

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig
    from fedpeft.methods.base import FitResult

BETAS, EPS = (0.9, 0.999), 1e-8  # torch.optim.AdamW's defaults, which fedpeft has always used


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


def carry_kept_state(job: Job, result: FitResult) -> FitResult:
    """``result`` with the kept optimizer state (``opt.*``) of tensors its round did not
    train carried over from the client's personal state (the round's own wins)."""
    kept = {k: t for k, t in job.personal.items() if k.startswith(OPT)}
    result.personal = {**kept, **result.personal}
    return result


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
