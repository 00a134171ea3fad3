"""Sample-level DP-SGD in a local step (``privacy.mode: sample``; Abadi et al. 2016), and
the clip factor every clipping of fedpeft's differential privacy takes.

Each step's batch is drawn anew, each row's gradient is clipped on its own (a ``vmap``
over the rows, inside the cohort's over the clients), and Gaussian noise is added to
their sum. The noise is drawn outside the step, from each client's own stream beside its
round's seed, so a client draws the same noise alone or in any cohort. The accounting
is ``fedpeft.engines.privacy``'s, which clips client updates with :func:`clip_factor` too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.func import vmap

from fedpeft.engines.local.batches import stack
from fedpeft.engines.local.jobs import (
    GradientFn,
    Job,
    RoundContext,
    SampleDP,
    StepInput,
    Tensors,
    derive_seed,
)

#: the random stream of a client's DP-SGD noise, beside its round's seed
NOISE_STREAM = 0x44505347


def norm(tensors: Tensors) -> float:
    """The L2 norm of all of ``tensors`` as one vector, in float64."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


def clip_factor(size: float | torch.Tensor, clip: float) -> float | torch.Tensor:
    """``min(1, clip / size)``: what brings a vector of L2 norm ``size`` within ``clip``
    (1 when it is within already, a zero vector too). ``size`` a float (an update's, a
    gradient sum's: :func:`norm`) or a tensor of norms (each row's, in DP-SGD's step)."""
    if isinstance(size, torch.Tensor):
        return (clip / size.clamp_min(1e-12)).clamp(max=1.0)
    return clip / size if size > clip else 1.0


def noise_generator(job: Job) -> torch.Generator:
    """The generator of ``job``'s client's DP-SGD noise: its own stream beside its round's seed."""
    return torch.Generator().manual_seed(derive_seed(job.seed, NOISE_STREAM))


def private_gradients(
    gradients: GradientFn, dp: SampleDP, params: Tensors, consts: Tensors, batches: StepInput, noise: Tensors
) -> tuple[torch.Tensor, Tensors]:
    """The loss and DP-SGD's gradient of one client's step: ``gradients`` taken of each
    row of the step's one batch on its own (a ``vmap`` over the rows, inside the cohort's
    over the clients), each clipped to ``dp.clip``, summed, plus ``dp.sigma * dp.clip``
    times ``noise`` (standard normal, drawn outside), over the rows drawn (``dp.batch``, or
    the client's all when it has fewer). A padded row (weight 0) has a zero gradient and
    adds nothing, and is not counted."""
    (batch,) = batches

    def one(row: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Tensors]:
        return gradients(params, consts, ({k: v.unsqueeze(0) for k, v in row.items()},))

    losses, per_row = vmap(one)(batch)
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per_row.values()]).sum(0).sqrt()
    factor = clip_factor(norms, dp.clip)
    summed = {n: torch.einsum("b,b...->...", factor, g) for n, g in per_row.items()}
    if noise:
        summed = {n: g + dp.sigma * dp.clip * noise[n] for n, g in summed.items()}
    weight = batch.get("weight", torch.ones_like(losses))
    drawn = weight.sum().clamp_min(1.0)  # min(dp.batch, the client's rows): without replacement
    return (losses * weight).sum() / drawn, {n: g / drawn for n, g in summed.items()}


def dp_noise(
    context: RoundContext, jobs: list[Job], params: Tensors, device: torch.device
) -> Iterator[Tensors]:
    """Each step's DP-SGD noise for the cohort, stacked: standard normal, one draw per
    trained tensor of each client, from the client's own stream (:func:`noise_generator`),
    so a client draws the same noise in any cohort; nothing without ``privacy.mode: sample``."""
    if context.sample_dp is None:
        while True:
            yield {}
    generators = [noise_generator(job) for job in jobs]
    shapes = {n: t.shape[1:] for n, t in sorted(params.items())}
    while True:
        draws = [{n: torch.randn(shape, generator=g) for n, shape in shapes.items()} for g in generators]
        yield stack(draws, device)
