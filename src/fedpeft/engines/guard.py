"""The non-finite guard: one rule for every engine, so a diverging client never poisons a run.

A client whose loss, update or new personal state holds a NaN or an infinity is dropped
from its round: its update is not aggregated, its personal state stays at its last finite
value, and the round's record says so (``dropped``: client -> reason). The round goes on
with the others, which aggregate exactly as if the dropped client had not been sampled.
If every client of a round drops, or the aggregate itself is not finite, the run stops
with :class:`DivergedError` (one line: the round, what diverged and the likely cause),
and the last good state is what the run keeps: the engines checkpoint only finite states
(:func:`fedpeft.engines.checkpoint.save_checkpoint` refuses any other), and the export
holds the last good global model.
"""

from __future__ import annotations

import math

import torch

from fedpeft.methods.base import FitResult, ServerState, Tensors


class DivergedError(RuntimeError):
    """A round with no finite update, or whose aggregate is not finite. ``last_good`` is the
    server state the round started from (the last finite one), ``round`` the round."""

    def __init__(self, message: str, rnd: int, last_good: ServerState):
        super().__init__(message)
        self.round, self.last_good = rnd, last_good


def nonfinite_tensor(tensors: Tensors) -> str | None:
    """The name of the first floating-point tensor with a NaN or infinite value (None: none)."""
    for name, t in tensors.items():
        if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def nonfinite_reason(result: FitResult) -> str | None:
    """Why ``result`` cannot be aggregated (its loss, update, personal state or SCAFFOLD
    control update is not finite), or None when it can."""
    loss = result.metrics.get("loss")
    if loss is not None and not math.isfinite(loss):
        return f"loss is {loss}"
    if (name := nonfinite_tensor(result.uplink)) is not None:
        return f"update tensor {name!r} is not finite"
    if (name := nonfinite_tensor(result.personal)) is not None:
        return f"personal tensor {name!r} is not finite"
    if (name := nonfinite_tensor(result.control)) is not None:
        return f"control update {name!r} is not finite"
    return None


def screen(results: list[FitResult]) -> tuple[list[FitResult], dict[int, str]]:
    """The results that can be aggregated, and the dropped clients with their reasons."""
    kept, dropped = [], {}
    for result in results:
        reason = nonfinite_reason(result)
        if reason is None:
            kept.append(result)
        else:
            dropped[result.cid] = f"non-finite: {reason}"
    return kept, dropped


def likely_cause(lr: float) -> str:
    return f"the learning rate is likely too high (train.lr {lr:g}): lower it"


def all_dropped(rnd: int, dropped: dict[int, str], lr: float, last_good: ServerState) -> DivergedError:
    """The error of a round in which every sampled client diverged."""
    first = min(dropped)
    return DivergedError(
        f"round {rnd}: every sampled client's update is not finite ({len(dropped)} of {len(dropped)}; "
        f"client {first}: {dropped[first]}); {likely_cause(lr)}. The run stopped; the last good "
        f"checkpoint and export (round {rnd - 1}) are kept",
        rnd,
        last_good,
    )


def check_aggregate(rnd: int, server: ServerState, lr: float, last_good: ServerState) -> None:
    """Raise :class:`DivergedError` if the aggregated ``server`` state is not finite."""
    extras = {k: v for k, v in server.extras.items() if torch.is_tensor(v)}
    if (name := nonfinite_tensor({**server.tensors, **extras})) is not None:
        raise DivergedError(
            f"round {rnd}: the aggregate is not finite (server tensor {name!r}); {likely_cause(lr)}. "
            f"The run stopped; the last good checkpoint and export (round {rnd - 1}) are kept",
            rnd,
            last_good,
        )
