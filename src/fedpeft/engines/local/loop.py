"""A client's local round as pure functions, run for a whole cohort of clients at once.

A federated simulation is many small, independent trainings. Instead of training the
sampled clients one after another, a cohort of ``C`` clients trains in one batched
computation: every client's trainable tensors are stacked on a leading client axis,
``(C, ...)``, and one local step of all of them is ``torch.func.vmap`` of a pure function

    step(params, opt_state, consts, batches) -> (params, opt_state, loss)

over ``functional_call`` of the one shared model (its frozen weights broadcast, never
copied). The step (:mod:`~fedpeft.engines.local.step`) is the method's gradients
(:meth:`Method.step_gradients`: plain backprop by default; a hypergradient or a MAML
gradient where a method says so), gradient clipping and a functional AdamW or SGD that
matches ``torch.optim`` step for step. A one-client round (every Flower node's) is a
cohort of one, so there is a single definition of each method's local training; a
cohort of one calls the step as it is, without ``vmap``, with the model's own attention
kernel.

Clients of a cohort differ in data: each step's batches are padded to the cohort's
widest and longest (padded rows weigh 0 in the loss, padded tokens are masked), and a
client that has taken all its steps is inactive: its tensors and optimizer state do
not move. So a cohort gives every client the same round it would have alone, up to the
float rounding of padded reductions (see ``tests/engines/test_cohort.py`` for the tolerance).

Randomness: each client's batches come from its own seeded generator, as alone. A model
with active dropout cannot give the same draws batched and alone, so it trains its
clients in cohorts of one (each with the global RNG seeded for it, as before).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch.func import vmap

from fedpeft.engines.local.attention import training_attention
from fedpeft.engines.local.batches import CohortBatches, stack, unstack
from fedpeft.engines.local.corrections import client_control, proximal_anchor, settle_control
from fedpeft.engines.local.dp import dp_noise
from fedpeft.engines.local.folding import folded_step
from fedpeft.engines.local.gradient_checkpointing import checkpointing
from fedpeft.engines.local.gradients import needs_plain_autograd, plain_autograd, prepare_step
from fedpeft.engines.local.jobs import Job, RoundContext
from fedpeft.engines.local.modes import cohort_mode
from fedpeft.engines.local.step import local_step, with_client_axis, without_client_axis

if TYPE_CHECKING:
    from fedpeft.engines.local.hooks import LocalMethod, R


def run_cohort(model: torch.nn.Module, method: LocalMethod[R], jobs: list[Job]) -> list[R]:
    """Every job's local round, trained together (see the module docstring)."""
    context, how = round_context(jobs), "alone"
    if len(jobs) > 1:  # train.cohort_mode: vmapped, folded or one client at a time
        train, dp_sgd = context.train, context.sample_dp is not None
        how = cohort_mode(method, model, train.cohort_mode, dp_sgd, compiled=train.compile).how
        if how == "alone" or has_active_dropout(model):
            return [r for job in jobs for r in run_cohort(model, method, [job])]
    device = next(model.parameters()).device
    starts = [method.cohort_start(model, job) for job in jobs]
    batches = CohortBatches(
        [list(method.step_draws(job, s.steps, job.generator())) for job, s in zip(jobs, starts, strict=True)],
        device,
    )
    params = stack([s.params for s in starts], device)
    opt = stack([s.opt for s in starts], device)
    consts = stack([s.consts for s in starts], device)
    anchor = proximal_anchor(method, context.train, params)
    own = [client_control(job) for job in jobs]  # SCAFFOLD's c_i (none without it)
    correction = stack(
        [{n: c - own_i[n] for n, c in job.control.items()} for job, own_i in zip(jobs, own, strict=True)],
        device,
    )
    dropout = has_active_dropout(model)
    if dropout:
        torch.manual_seed(jobs[0].seed)  # a cohort of one: its own dropout draws, as alone
    folded, alone = how == "folded", how != "folded" and len(jobs) == 1
    noises = dp_noise(context, jobs, params, device)
    if folded:
        step = folded_step(method, model, context)
    elif alone:  # the client's own tensors, all round (step.without_client_axis)
        step = local_step(method, model, context)
        params, opt, consts, anchor, correction = map(
            without_client_axis, (params, opt, consts, anchor, correction)
        )
    else:
        step = vmap(local_step(method, model, context), randomness="different" if dropout else "error")
    model.train(dropout)  # eval mode when no dropout is active: the same function, no RNG calls
    step_counts = [s.steps for s in starts]  # on the CPU: no device sync to ask who is still training
    steps = torch.tensor(step_counts, device=device)
    losses = torch.zeros(len(jobs), device=device)
    tokens = torch.zeros(len(jobs), dtype=torch.long, device=device)  # real tokens each client trained on
    start = time.perf_counter()
    attention = nullcontext() if folded else training_attention(model, method, len(jobs), context)
    with plain_autograd(needs_plain_autograd(model)), attention, checkpointing(model):
        for k in range(len(batches)):
            stacked = prepare_step(model, batches.step(k), batches.scored[k] or None)
            tokens += sum(b["attention_mask"].flatten(1).sum(1) for b in stacked)
            noise = next(noises)
            if alone:
                stacked, noise = tuple(map(without_client_axis, stacked)), without_client_axis(noise)
            new_params, new_opt, loss = step(params, opt, consts, stacked, anchor, correction, noise)
            active = k < steps  # (C,): a finished client's tensors do not move
            if k < min(step_counts):  # every client still training: take the step whole
                params, opt = {n: new_params[n] for n in params}, {n: new_opt[n] for n in opt}
            else:
                params = {n: _where(active, new_params[n], t) for n, t in params.items()}
                opt = {n: _where(active, new_opt[n], t) for n, t in opt.items()}
            losses += torch.where(active, loss.detach().float(), 0.0)
    time_step = (time.perf_counter() - start) / len(batches)
    if alone:
        params, opt = with_client_axis(params), with_client_axis(opt)
    results = []
    for job, s, p, o, total, seen, own_i in zip(
        jobs, starts, unstack(params, len(jobs)), unstack(opt, len(jobs)), losses.tolist(), tokens.tolist(),
        own, strict=True,
    ):  # fmt: skip
        metrics = {
            "loss": total / s.steps,
            "steps": float(s.steps),
            "time_step": time_step,
            "tokens": float(seen),
        }
        result = method.cohort_finish(job, p, o, metrics)
        if job.control:
            settle_control(result, job, own_i, p, s.steps, context.train.lr)
        results.append(result)
    return results


def round_context(jobs: list[Job]) -> RoundContext:
    """The round's settings the cohort's jobs share (a cohort is of one round)."""
    context = jobs[0].context
    if any(job.context != context for job in jobs[1:]):
        raise ValueError("a cohort's jobs come from one round, but these carry different round contexts")
    return context


def has_active_dropout(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def _where(active: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(active.view(-1, *([1] * (new.dim() - 1))), new, old)
