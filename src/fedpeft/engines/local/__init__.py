"""The local-training engine: a client's round as pure functions, run for a whole cohort
of clients at once; what a method imports to write its local round.

A method writes its round as ``cohort_start``, ``step_gradients`` and ``cohort_finish``
(``fedpeft.methods.base.Method``) from the pieces below; the engine runs it
(:func:`run_cohort`). The modules, in the order a round uses them:

- ``hooks``: what the engine calls of a method (:class:`LocalMethod`, its hooks);
- ``jobs``: what a round is given (:class:`Job`, with the round's :class:`RoundContext`)
  and starts from (:class:`Start`);
- ``batches``: a cohort's batches, padded and stacked on a client axis;
- ``gradients``: the model's loss and backprop as pure functions (:func:`backprop`);
- ``dp``: DP-SGD's per-example clipping and noise, and fedpeft's one clip factor;
- ``optimizer``: AdamW and SGD as pure functions, and the state a client keeps;
- ``corrections``: FedProx's anchor and SCAFFOLD's controls;
- ``step``: one client's local step (gradients -> corrections -> clip -> optimizer);
- ``attention``, ``gradient_checkpointing``: the kernels a cohort trains with, and the layers
  it recomputes in the backward pass (``model.gradient_checkpointing``);
- ``folding``: a cohort folded into one batch where ``vmap`` cannot batch the model;
- ``modes``: whether a cohort vmaps, folds or trains one client at a time (:func:`cohort_mode`);
- ``loop``: the cohort loop (:func:`run_cohort`);
- ``predict``: each client's predictions, vmapped (:func:`predict_cohort`).

Nothing here imports a method, not even for its annotations: the loop is handed the
method object and calls the hooks :class:`LocalMethod` names.
"""

from fedpeft.engines.local.dp import clip_factor, noise_generator, norm
from fedpeft.engines.local.folding import fold_refusal
from fedpeft.engines.local.gradient_checkpointing import enable_checkpointing
from fedpeft.engines.local.gradients import (
    ModelLossGradients,
    backprop,
    backprop_reporting,
    group_backprop,
    head_logits,
    model_features,
    model_inputs,
    model_loss,
    model_scale,
    needs_plain_autograd,
    prepare_step,
    row_mean,
)
from fedpeft.engines.local.hooks import LocalMethod, LocalResult
from fedpeft.engines.local.jobs import (
    CONTROL,
    OPT,
    OWN,
    Batch,
    GradientFn,
    Job,
    RoundContext,
    SampleDP,
    Start,
    StepInput,
    Tensors,
    derive_seed,
)
from fedpeft.engines.local.loop import run_cohort
from fedpeft.engines.local.modes import CohortMode, cohort_mode
from fedpeft.engines.local.optimizer import carry_kept_state, optimizer_init, optimizer_state
from fedpeft.engines.local.predict import predict_cohort

__all__ = [
    "CONTROL",
    "CohortMode",
    "OPT",
    "OWN",
    "Batch",
    "GradientFn",
    "Job",
    "LocalMethod",
    "LocalResult",
    "RoundContext",
    "SampleDP",
    "Start",
    "StepInput",
    "Tensors",
    "backprop",
    "backprop_reporting",
    "carry_kept_state",
    "clip_factor",
    "cohort_mode",
    "derive_seed",
    "enable_checkpointing",
    "fold_refusal",
    "group_backprop",
    "ModelLossGradients",
    "head_logits",
    "model_features",
    "model_inputs",
    "model_loss",
    "model_scale",
    "needs_plain_autograd",
    "noise_generator",
    "norm",
    "optimizer_init",
    "optimizer_state",
    "predict_cohort",
    "prepare_step",
    "row_mean",
    "run_cohort",
]
