"""SCAFFOLD's drift correction, the server's half (issue 32; ``train.correction: scaffold``).

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning"
(ICML 2020), Algorithm 1 with option II, over any method whose clients train the shared
tensors they receive (:meth:`~fedpeft.methods.base.Method.correction_refusal`):

    server   x (the shared tensors) and its control c, 0 at first
    client   receives x and c; its control c_i (personal state, 0 at first)
             K local SGD steps, each of a shared tensor along  g - c_i + c
             c_i+ = c_i - c + (x - y_i) / (K lr)        (the mean of its K gradients)
             sends y_i (the method's uplink) and dc_i = c_i+ - c_i
    server   x from the method's aggregate and the server step (``server.lr``: lr_g)
             c += (1/N) sum_{i in S} dc_i               (N: all clients, S: this round's)

The client's half runs in the cohort loop (``fedpeft.methods.cohort``: the corrected
step, :func:`~fedpeft.methods.cohort.settle_control`), so a client's round is the same
in-process and on a Flower node. ``c`` lives in the server's extras (``scaffold.c.<name>``):
checkpointed with the server, resumed exactly. ``c_i`` lives in the client's personal
state (``control.<name>``: the client store, a node's state directory), never sent. A
round's bytes count ``c`` in each downlink and ``dc_i`` in each uplink: SCAFFOLD doubles
the traffic of a method that sends its shared tensors.

The server's update of ``c`` is the plain mean: ``server.aggregation`` (a robust rule)
and ``server.weighting`` apply to the model update, and a simulated faulty client
(``faults``) corrupts its model update, not its control update.
"""

from __future__ import annotations

import torch

from fedpeft.config import ConfigError, ExperimentConfig
from fedpeft.methods.base import Method, ServerState, Tensors

PREFIX = "scaffold.c."  # the server's control in its extras: scaffold.c.<shared tensor name>


def enabled(method: Method) -> bool:
    return method.train.correction == "scaffold"


def check_composes(cfg: ExperimentConfig, method: Method) -> None:
    """A :class:`ConfigError` naming the method when SCAFFOLD does not fit its local round."""
    if cfg.train.correction == "scaffold" and (why := method.correction_refusal()):
        raise ConfigError(f"train.correction scaffold: method {method.name}: {why}")


def server_control(server: ServerState, method: Method) -> Tensors:
    """The server's control ``c``, one tensor per shared tensor (0 before the first update)."""
    return {
        n: server.extras.get(PREFIX + n, torch.zeros_like(server.tensors[n])) for n in method.shared_names
    }


def update_control(
    method: Method, previous: ServerState, new: ServerState, updates: list[Tensors], clients: int
) -> ServerState:
    """``new`` with the server's control moved by the round's control updates ``updates``
    (``dc_i`` of each client that returned one): ``c += sum(dc_i) / clients``, summed in float64."""
    extras = dict(new.extras)
    for name, c in server_control(previous, method).items():
        total = torch.zeros(c.shape, dtype=torch.float64)
        for update in updates:
            total += update[name].double()
        extras[PREFIX + name] = (c.double() + total / clients).to(c.dtype)
    return ServerState(new.tensors, extras)
