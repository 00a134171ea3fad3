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
    from fedpeft.engines.local.hooks import R

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


def carry_kept_state(job: Job, result: R) -> R:
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


#: tensors of at most this many elements are stepped together, concatenated (see :func:`optimizer_step`)
SMALL = 2**16


def optimizer_step(
    params: Tensors, grads: Tensors, state: Tensors, cfg: TrainConfig
) -> tuple[Tensors, Tensors]:
    """One step of ``train.optimizer`` on the tensors ``grads`` names, as a pure function:
    AdamW exactly as ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected
    moments), or SGD (weight decay added to the gradient, no momentum).

    Small tensors (LoRA factors, biases, heads: at most :data:`SMALL` elements) of one
    dtype are stepped together, concatenated into one vector, so a step costs a dozen
    operations however many adapters there are, not a dozen per tensor: on a GPU each is a
    kernel launch, and a small adapter's step is launch-bound. The arithmetic is the same
    elementwise, so are the results."""
    new_params, new_state = {}, dict(state)
    for names in _groups(params, grads):
        sizes, shapes = [params[n].numel() for n in names], [params[n].shape for n in names]
        p, g = (_flat([tensors[n] for n in names]) for tensors in (params, grads))
        if cfg.optimizer == "sgd":
            updated = _sgd(p, g, cfg)
        else:
            moments = [_flat([state[f"{key}.{n}"] for n in names]) for key in ("exp_avg", "exp_avg_sq")]
            steps = torch.stack([state[f"step.{n}"] for n in names]) + 1
            updated, m, v = _adamw(p, g, *moments, steps, sizes, cfg)
            for name, step, m_n, v_n, shape in zip(
                names, steps.unbind(-1), *_split(m, v, sizes=sizes), shapes, strict=True
            ):
                new_state.update(
                    {
                        f"step.{name}": step,
                        f"exp_avg.{name}": m_n.view(shape),
                        f"exp_avg_sq.{name}": v_n.view(shape),
                    }
                )
        for name, t, shape in zip(names, *_split(updated, sizes=sizes), shapes, strict=True):
            new_params[name] = t.view(shape)
    return new_params, new_state


def _adamw(p, g, m0, v0, steps, sizes: list[int], cfg: TrainConfig):
    """AdamW on flat ``p``: ``steps`` (one a tensor, ``sizes`` its elements) bias-correct
    each tensor's part; torch's own arithmetic, in its order. Outside vmap and autograd the
    later operations run in place on the tensors just made (the same values, half the
    full-size temporaries: what a full fine-tune's step on a CPU pays for most)."""
    lr, wd = cfg.lr, cfg.weight_decay
    bias1, bias2 = 1 - BETAS[0] ** steps, 1 - BETAS[1] ** steps
    if len(sizes) > 1:  # each tensor's correction at each of its elements
        bias1, bias2 = (_per_element(b, sizes) for b in (bias1, bias2))
    else:
        bias1, bias2 = bias1[..., 0], bias2[..., 0]
    then = _in_place if _plain(p, g, m0, v0) else getattr
    m = m0.lerp(g, 1 - BETAS[0])
    v = then(v0.mul(BETAS[1]), "addcmul")(g, g, value=1 - BETAS[1])
    denom = then(then(v.sqrt(), "div")(bias2.sqrt()), "add")(EPS)
    updated = then(p.mul(1 - lr * wd), "sub")(then(m.div(denom), "mul")(lr / bias1))
    return updated, m, v


def _per_element(values: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``values`` (one a tensor) repeated over each tensor's ``sizes`` elements: views
    joined by one copy (``repeat_interleave`` would copy its repeats to the device at
    every step, a wait for the GPU)."""
    lead = values.shape[:-1]
    return torch.cat([values[..., i : i + 1].expand(*lead, n) for i, n in enumerate(sizes)], dim=-1)


def _sgd(p, g, cfg: TrainConfig):
    return p - cfg.lr * (g + cfg.weight_decay * p)


def _groups(params: Tensors, grads: Tensors) -> list[list[str]]:
    """The names of ``grads`` in the order given, as the groups stepped together: the small
    tensors of one dtype in one group, each larger tensor alone."""
    groups: dict[object, list[str]] = {}
    for name in grads:
        p = params[name]
        key = (p.dtype, grads[name].dtype) if p.numel() <= SMALL else name
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors as one vector (a lone tensor: a view of it)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _split(*flats: torch.Tensor, sizes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Each flat vector back in its tensors' parts (views)."""
    return [torch.split(f, sizes, dim=-1) for f in flats]


def _in_place(tensor: torch.Tensor, op: str) -> Callable:
    return getattr(tensor, op + "_")


def _plain(*tensors: torch.Tensor) -> bool:
    """Tensors that no functorch transform (vmap, grad) wraps and autograd does not track:
    new tensors made from them may be updated in place."""
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not any(wrapped(t) or t.requires_grad for t in tensors)
