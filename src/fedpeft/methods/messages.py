"""A method's message part: what crosses between server and clients beside the round's
shared tensors, and the shapes a networked server checks a client's update against.

Most methods send their shared tensors down and their trained values up, and keep these
defaults; a method with messages of its own (FeDeRA's join message, Fed-SB's setup round,
RoLoRA's half adapters, HETLoRA's smaller ranks) subclasses :class:`Messages` and sets
``self.messages`` to it in its ``__init__``. A part reads its method's state through
``self.method``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpeft.methods.base import Method, ServerState, Tensors
    from fedpeft.models.backbone import TaskModel


class Messages:
    """The default: nothing beside the shared tensors, every update of all of them."""

    def __init__(self, method: Method):
        self.method = method

    def join_message(self, server: ServerState) -> Tensors:
        """Tensors each client receives once, at first contact (FeDeRA's initial ``A, B``)."""
        return {}

    def join(self, model: TaskModel, message: Tensors) -> None:
        """Apply the join message to a client's (frozen) model; idempotent. Default: nothing."""

    def uplink_like(self, rnd: int, shared: Tensors, received: Tensors) -> Tensors:
        """The names, shapes and dtypes of the update of round ``rnd`` of a client that was
        sent ``received`` (what a networked server checks it against), given the shared
        tensors' (``shared``). Default: all of ``shared``; RoLoRA's rounds send half of
        them, Fed-SB's setup round (whichever round it falls in) sends others."""
        return {n: shared[n] for n in self.method.shared_names}

    def uplink_messages(self, received: Tensors) -> list[str]:
        """Tensors of the uplink of a client that received ``received`` that are messages of
        their own, not updates of a tensor it received (Fed-SB's setup round: its gradient
        sums); ``privacy.mode`` clips and noises each as an update from zero. Default: none."""
        return []

    def uplink_as_shared(self, uplink: Tensors) -> Tensors:
        """A client's update in the names and shapes of the shared state, which a networked
        server checks every update against (HETLoRA zero-pads a smaller rank); default: as is."""
        return uplink

    def server_frozen_names(self) -> list[str]:
        """Frozen tensors of the model that the server holds and hands to clients with the
        shared ones, and that change over a run (FedEx-LoRA's frozen weights, into which it
        folds residuals); they enter a client's step as constants and are never sent back.
        Default: none (the backbone never moves)."""
        return []

    def global_export_names(self) -> list[str]:
        """The server's tensors the global export is written from: the shared ones and
        :meth:`server_frozen_names`."""
        return [*self.method.shared_names, *self.server_frozen_names()]

    def training_server(self, server: ServerState) -> ServerState:
        """A server state of the rounds that train, for the memory probes to measure a
        round from: ``server`` itself (default), or, before a first round unlike the
        others (Fed-SB's setup round, which trains nothing), a state as after it."""
        return server
