"""What a method composes with, as data: one reader for every check.

A method declares in one place, its class's ``refuses`` mapping, each feature it does not
compose with and why (a method whose reason depends on its config sets its own mapping
in ``__init__``). The features are the layers around a method (docs/architecture.md, "One round,
written once"), two training options and the tasks (``data.task``):

- ``dora``: ``method.lora.use_dora`` (opt-in: refused unless declared ``""``);
- ``fp16``: ``train.precision fp16``, whose loss scaling a method that takes its own
  gradients does not have;
- ``server_step``: a server optimiser (``server.optimizer``), a step along
  ``aggregate - current`` of the shared tensors;
- ``correction``: SCAFFOLD's drift correction (``train.correction``), which fits a method
  whose clients train the shared tensors they received at every step and send them;
- ``robust``: another rule than the mean (``server.aggregation``);
- ``lossy_downlink``: a lossy ``comm.downlink`` codec, which breaks a method whose clients
  keep what they receive beyond the round;
- ``user_dp`` / ``local_dp``: ``privacy.mode user`` (noises the sum, so a server that reads
  each uplink is refused) / ``local`` (clips updates of tensors a client received);
- ``sample_dp``: ``privacy.mode sample`` (DP-SGD), whose accountant needs one batch a step
  drawn without replacement;
- ``secure_aggregation``: SecAgg+ (``deploy.secure_aggregation``), which gives the server
  the example-weighted mean of the updates and nothing else;
- each task of :data:`TASKS`.

:func:`refusal` reads it for the config checks, the engines and the CLI. A feature a
method does not declare takes its default: SCAFFOLD's correction and robust aggregation
are refused for the server step's reason, user-level DP for robust aggregation's (a
server that takes no other rule than the mean reads something of each update), and the
server step by a method that shares nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpeft.methods.base import Method

#: The tasks (``data.task``) a method may be defined for.
TASKS = ("classification", "causal_lm", "token_classification", "extractive_qa")

#: Everything a method's ``refuses`` may name.
FEATURES = (
    "dora",
    "fp16",
    "server_step",
    "correction",
    "robust",
    "lossy_downlink",
    "user_dp",
    "local_dp",
    "secure_aggregation",
    "sample_dp",
    *TASKS,
)

#: An undeclared feature refused for the reason of another.
FALLS_BACK = {"correction": "server_step", "robust": "server_step", "user_dp": "robust"}

#: The reason for ``dora`` of a method that does not declare it.
DORA_UNDEFINED = "its own handling of LoRA's factors or adapters is not defined for DoRA's magnitudes"

#: The reason for ``server_step`` of a method that shares no tensors (nor declares it).
SHARES_NOTHING = "it shares no tensors for a server step to move"

#: The reason for ``fp16`` of a method that takes gradients itself (``torch.autograd.grad``)
#: rather than through its local step's loss-scaled backprop.
OWN_GRADIENTS = "it takes its own gradients"

#: The reason for ``sample_dp`` of a method that draws its step's batches itself.
OWN_BATCHES = "draws its own batches (several a step, or phases)"


def refusal(method: Method | type[Method], feature: str) -> str:
    """Why ``method`` (an instance, or a class where no instance is at hand) does not
    compose with ``feature`` (one of :data:`FEATURES`); "" when it does."""
    if feature not in FEATURES:
        raise KeyError(f"no feature {feature!r}; the features are {', '.join(FEATURES)}")
    declared = method.refuses
    if feature in declared:
        return declared[feature]
    if feature in FALLS_BACK:
        return refusal(method, FALLS_BACK[feature])
    if feature == "dora":
        return DORA_UNDEFINED
    if feature == "server_step" and shares_nothing(method):
        return SHARES_NOTHING
    return ""


def shares_nothing(method: Method | type[Method]) -> bool:
    """Whether no tensors cross a network for the server to step: pooled training, or a
    (prepared) method without shared tensors."""
    return method.pooled or (not isinstance(method, type) and not method.shared_names)


def tasks(method: Method | type[Method]) -> tuple[str, ...]:
    """The tasks ``method`` is defined for."""
    return tuple(task for task in TASKS if not refusal(method, task))
