"""FedProx's anchor and SCAFFOLD's controls around a client's local round: what the step
is pulled back to or corrected by (:func:`~fedpeft.engines.local.step.apply_gradients`
applies both), and the control a SCAFFOLD client keeps and sends after it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedpeft.engines.local.jobs import CONTROL, Job, Tensors

if TYPE_CHECKING:
    from fedpeft.config import TrainConfig
    from fedpeft.engines.local.hooks import LocalMethod, LocalResult


def proximal_anchor(method: LocalMethod, train: TrainConfig, params: Tensors) -> Tensors:
    """FedProx's anchor (``train.prox_mu`` > 0): the shared tensors as the round starts
    (what the client received), which the local step is pulled back to; else nothing."""
    if train.prox_mu == 0:
        return {}
    return {n: params[n].clone() for n in method.shared_names if n in params}


def client_control(job: Job) -> Tensors:
    """SCAFFOLD: the client's control ``c_i`` as it enters the round (its personal state's
    ``control.*`` entries; 0 before its first round), for the tensors the server's control
    ``job.control`` names; nothing without SCAFFOLD."""
    return {n: job.personal.get(CONTROL + n, torch.zeros_like(c)) for n, c in job.control.items()}


def settle_control(
    result: LocalResult, job: Job, own: Tensors, trained: Tensors, steps: int, lr: float
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
