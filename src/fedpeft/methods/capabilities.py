"""What a method composes with, as data: the vocabulary of its class's ``refuses``.

A method declares in one place, its class's ``refuses`` mapping, each feature it does not
compose with and why (a method whose reason depends on its config sets its own mapping
in ``__init__``). The features (:data:`FEATURES`: the layers around a method, two training
options and the tasks), their defaults (:data:`FALLS_BACK`: SCAFFOLD's correction and
robust aggregation are refused for the server step's reason, user-level DP for robust
aggregation's; DoRA is opt-in; the server step is refused by a method that shares
nothing) and the one reader of a declaration (:func:`refusal`) live with the rules that
read them, in :mod:`fedpeft.composition` (docs/composition.md); this module names them
for the methods, with the reasons several methods share.
"""

from __future__ import annotations

from fedpeft.composition import (
    DORA_UNDEFINED,
    FALLS_BACK,
    FEATURES,
    SHARES_NOTHING,
    TASKS,
    shares_nothing,
)
from fedpeft.composition import declined as refusal

__all__ = [
    "DORA_UNDEFINED",
    "FALLS_BACK",
    "FEATURES",
    "OWN_BATCHES",
    "OWN_GRADIENTS",
    "SHARES_NOTHING",
    "TASKS",
    "refusal",
    "shares_nothing",
    "tasks",
]

#: The reason for ``fp16`` of a method that takes gradients itself (``torch.autograd.grad``)
#: rather than through its local step's loss-scaled backprop.
OWN_GRADIENTS = "it takes its own gradients"

#: The reason for ``sample_dp`` of a method that draws its step's batches itself.
OWN_BATCHES = "draws its own batches (several a step, or phases)"


def tasks(method) -> tuple[str, ...]:
    """The tasks ``method`` (an instance or a class) is defined for."""
    return tuple(task for task in TASKS if not refusal(method, task))
