"""How a cohort of more than one client trains (``train.cohort_mode``), decided in one place.

- ``vmap``: one client's step (:mod:`~fedpeft.engines.local.step`) vmapped over the cohort;
- ``folded``: the cohort's batches folded into one, the frozen modules run once on it and
  only the adapters per client (:mod:`~fedpeft.engines.local.folding`);
- ``alone``: one client after another.

``train.compile`` folds (compiled: :func:`~fedpeft.engines.local.folding.folded_step`),
under ``auto`` too. Otherwise ``auto`` vmaps, except where the model's steps run in plain
autograd (a quantised or a checkpointed backbone: vmap cannot batch bitsandbytes' kernels
or checkpoints), where it folds, or trains one client at a time when the method cannot
fold. On a GPU, where both could, the engine times a step of each as the run starts and
takes the faster (:func:`fedpeft.engines.memory.choose_cohort_mode`). The cohort loop
(``loop.run_cohort``) follows :func:`cohort_mode`; the experiment's set-up asks it too, to
refuse a ``train.cohort_size`` or ``train.cohort_mode`` that cannot be had before anything
trains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from fedpeft.config.common import ConfigError
from fedpeft.engines.local.folding import fold_refusal
from fedpeft.engines.local.gradients import plain_autograd_reason

if TYPE_CHECKING:
    from fedpeft.engines.local.hooks import LocalMethod


@dataclass(frozen=True)
class CohortMode:
    """How a cohort trains, and why it does not vmap ("" where it does)."""

    how: Literal["vmap", "folded", "alone"]
    why: str = ""


def cohort_mode(
    method: LocalMethod, model: torch.nn.Module, requested: str, dp_sgd: bool, compiled: bool = False
) -> CohortMode:
    """How a cohort of ``method`` (prepared on ``model``) trains under ``train.cohort_mode``
    ``requested``, with or without DP-SGD (``privacy.mode: sample``, which vmaps over each
    client's rows and so cannot fold) and ``train.compile`` (``compiled``: folded). A mode
    that cannot be had is a :class:`~fedpeft.config.ConfigError` naming the setting in the way."""
    if compiled:
        if requested == "vmap":
            raise ConfigError("train.compile compiles folded cohorts: use train.cohort_mode folded or auto")
        refusal = fold_refusal(method, model) or (dp_sgd and "privacy.mode sample needs vmap")
        if refusal:
            why = f"train.compile compiles folded cohorts, and {refusal}"
            raise ConfigError(f"{why}; set train.compile false")
        return CohortMode("folded", "train.compile")
    plain = plain_autograd_reason(model)
    if requested == "vmap" and plain:
        raise ConfigError(f"train.cohort_mode vmap: {plain}; use cohort_mode folded or auto")
    if requested == "vmap" or (requested == "auto" and not plain):
        return CohortMode("vmap")
    refusal = fold_refusal(method, model)
    if dp_sgd:
        refusal = refusal or "privacy.mode sample takes per-example gradients with vmap"
    if not refusal:
        return CohortMode("folded", plain or "train.cohort_mode folded")
    if requested == "folded":
        raise ConfigError(f"train.cohort_mode folded: {refusal}; use cohort_mode vmap or auto")
    return CohortMode("alone", f"cohorts train folded with {plain}, and {refusal}")
