"""SCAFFOLD's drift correction, the server's half (issue 32; ``train.correction: scaffold``).

Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning"
(ICML 2020), Algorithm 1 with option II, over any method whose clients train the shared
tensors they receive (:func:`~fedpeft.methods.capabilities.refusal` of ``correction``):

    server   x (the shared tensors) and its control c, 0 at first
    client   receives x and c; its control c_i (personal state, 0 at first)
             K local SGD steps, each of a shared tensor along  g - c_i + c
             c_i+ = c_i - c + (x - y_i) / (K lr)        (the mean of its K gradients)
             sends y_i (the method's uplink) and dc_i = c_i+ - c_i
    server   x from the method's aggregate and the server step (``server.lr``: lr_g)
             c += (1/N) sum_{i in S} dc_i               (N: all clients, S: this round's)

The client's half runs in the cohort loop (``fedpeft.engines.local``: the corrected
step, :func:`~fedpeft.engines.local.corrections.settle_control`), so a client's round is
the same in-process and on a Flower node. ``c`` lives in the server's extras (``scaffold.c.<name>``):
checkpointed with the server, resumed exactly. ``c_i`` lives in the client's personal
state (``control.<name>``: the client store, a node's state directory), never sent. A
round's bytes count ``c`` in each downlink and ``dc_i`` in each uplink: SCAFFOLD doubles
the traffic of a method that sends its shared tensors.

On the Flower path a node keeps a new ``c_i`` aside (pending) until the server says it
took ``dc_i`` in: a reply lost, refused or in a skipped round would otherwise leave
``c_i`` moved and ``c`` not, and ``c`` would stop being the mean of the ``c_i``. The
server records, per client, the last round whose control update it applied
(``scaffold.applied.<cid>`` in its extras) and sends it with each training message; the
node then takes in its pending control if that round is the pending one's, else drops it
(:func:`confirmed`, :func:`held`). In-process no reply is lost between a client and the
server (one refused as not finite stores nothing), so clients keep ``c_i`` at once.

The server's update of ``c`` is the plain mean: ``server.aggregation`` (a robust rule)
and ``server.weighting`` apply to the model update, and a simulated faulty client
(``faults``) corrupts its model update, not its control update.
"""

from __future__ import annotations

import torch

from fedpeft.engines.local import CONTROL
from fedpeft.methods.base import Method, ServerState, Tensors

PREFIX = "scaffold.c."  # the server's control in its extras: scaffold.c.<shared tensor name>
APPLIED = "scaffold.applied."  # the server's extras: per client, the last round whose dc_i it applied
PENDING = "control_pending."  # a node's new control (CONTROL: its control) until the server confirms it
PENDING_ROUND = "control_pending_round"


def enabled(method: Method) -> bool:
    return method.train.correction == "scaffold"


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


def mark_applied(server: ServerState, cids: list[int], rnd: int) -> ServerState:
    """``server`` recording that it applied the control updates of ``cids`` in round ``rnd``."""
    marks = {f"{APPLIED}{cid}": torch.tensor([float(rnd)]) for cid in cids}
    return ServerState(server.tensors, {**server.extras, **marks})


def applied_round(server: ServerState, cid: int) -> int:
    """The last round whose control update of client ``cid`` the server applied (0: none)."""
    mark = server.extras.get(f"{APPLIED}{cid}")
    return 0 if mark is None else int(mark)


def confirmed(personal: Tensors, applied: int) -> Tensors:
    """A node's personal state as its next round starts: its pending control (from the round
    in ``control_pending_round``) becomes its control if the server applied that round's
    update (``applied``), and is dropped otherwise."""
    if PENDING_ROUND not in personal:
        return personal
    kept = {n: t for n, t in personal.items() if not n.startswith(PENDING) and n != PENDING_ROUND}
    if applied == int(personal[PENDING_ROUND]):
        kept.update(
            {CONTROL + n.removeprefix(PENDING): t for n, t in personal.items() if n.startswith(PENDING)}
        )
    return kept


def held(before: Tensors, after: Tensors, rnd: int) -> Tensors:
    """A node's personal state after round ``rnd`` (``after``, the method's): the new control
    set aside as pending, the control it started the round with (``before``'s; 0 at first)
    kept until the server confirms."""
    new = {n: t for n, t in after.items() if n.startswith(CONTROL)}
    kept = {n: t for n, t in after.items() if not n.startswith(CONTROL)}
    kept.update({n: before.get(n, torch.zeros_like(t)) for n, t in new.items()})  # c_i starts at 0
    kept.update({PENDING + n.removeprefix(CONTROL): t for n, t in new.items()})
    return {**kept, PENDING_ROUND: torch.tensor([float(rnd)])}
