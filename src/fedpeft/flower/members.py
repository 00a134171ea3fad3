"""Who holds which client id in a deployment (issue 72): a client id belongs to a member.

Without SuperNode authentication a node is known by its node id alone, which changes
when it restarts, so the newest node to claim a client id holds it. With authentication
(the SuperLink's environment says so: :func:`enrolment`) a client id belongs to the
**key** of the node that first claimed it, or to the node the operator assigned it to
(``fedpeft enrol --client``), and another key's claim to it is refused
(:class:`ClientIds`). A key, not a node id: the same key enrolled with a new SuperLink
(``fedpeft serve`` starts one per run, and a resume starts another) gets a new node id,
and ``fedpeft enrol`` records which key each node id has. The binding is kept in the
server state (:data:`BINDINGS`), so a resumed run keeps it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedpeft.methods.base import ServerState

#: The server state's extra that binds client ids to authenticated nodes' keys: ``(k, 2)``
#: int64 rows of (client id, key): the node's enrolled key (:func:`key_id`), or its node id
#: when its key is not on record; a value above 2**63 - 1 is kept as its two's-complement
#: int64 (keys and Flower's node ids are unsigned 64-bit).
BINDINGS = "deploy.client_nodes"
NODE_AUTH_ENV, ASSIGNMENTS_ENV = "FEDPEFT_NODE_AUTH", "FEDPEFT_CLIENT_ASSIGNMENTS"
NODE_KEYS_ENV = "FEDPEFT_NODE_KEYS"


@dataclass(frozen=True)
class Enrolment:
    """Whether the SuperLink authenticates its nodes (then a node id is bound to an
    enrolled public key), which key each enrolled node id has (``keys``: node id -> the
    key's id, from ``fedpeft enrol``), and the operator's client-id assignments (client
    id -> node id); ``problem``: why a file could not be read (then it is not used).

    A node's **key** (:meth:`key`) is what holds a client id: the same key enrolled with a
    new SuperLink (``fedpeft serve`` starts one per run, and a resume starts another) gets
    a new node id but is the same member. A node whose key is not on record is known by
    its node id."""

    authenticated: bool
    assigned: dict[int, int]
    source: str = ""
    problem: str | None = None
    keys: dict[int, int] = field(default_factory=dict)

    def key(self, node: int) -> int:
        return self.keys.get(node, node)

    def named(self, key: int) -> str:
        """How a log line names the holder of ``key``: a node id it has, or the key."""
        nodes = [n for n, k in self.keys.items() if k == key]
        return f"node {max(nodes)}" if nodes else f"node {key}"  # a key not on record is a node id


def _json_file(path: str, what: str) -> tuple[dict, str | None]:
    """The JSON object at ``path`` (empty when there is none), and why it could not be read."""
    if not (path and Path(path).is_file()):
        return {}, None
    try:
        raw = json.loads(Path(path).read_text())
        if not isinstance(raw, dict):
            raise TypeError(f"a {type(raw).__name__}")
        return raw, None
    except (OSError, ValueError, TypeError) as err:
        return {}, f"{path}: not a JSON object of {what} ({err})"


def key_id(fingerprint: str) -> int:
    """A key's id: the first 64 bits of its fingerprint (hex SHA-256 of the public key)."""
    return int(fingerprint[:16], 16)


def enrolment() -> Enrolment:
    """The SuperLink's word, from the environment the ServerApp inherits from it:
    ``FEDPEFT_NODE_AUTH=1`` when SuperNode authentication is on; ``FEDPEFT_NODE_KEYS``, the
    ``{"<node id>": "<key fingerprint>"}`` file ``fedpeft enrol`` keeps; and
    ``FEDPEFT_CLIENT_ASSIGNMENTS``, the operator's ``{"<client id>": <node id>}`` file
    (``fedpeft enrol KEY --client N``; absent: no assignments). Read at every roll call,
    so an enrolment or assignment made during a run takes effect at the next."""
    authenticated = os.environ.get(NODE_AUTH_ENV, "0").strip() == "1"
    path = os.environ.get(ASSIGNMENTS_ENV, "")
    if not authenticated:
        return Enrolment(False, {}, path)
    raw_keys, key_problem = _json_file(os.environ.get(NODE_KEYS_ENV, ""), "node id -> key fingerprint")
    raw, problem = _json_file(path, "client id -> node id")
    try:
        keys = {int(n): key_id(str(f)) for n, f in raw_keys.items()}
    except ValueError as err:
        keys, key_problem = {}, f"{os.environ.get(NODE_KEYS_ENV)}: not node id -> key fingerprint ({err})"
    try:
        assigned = {int(c): int(n) for c, n in raw.items()}
    except (ValueError, TypeError) as err:
        assigned, problem = {}, f"{path}: not a JSON object of client id -> node id ({err})"
    return Enrolment(True, assigned, path, problem or key_problem, keys)


def claim_refusal(cid: int, node: int, who: Enrolment, bound: dict[int, int]) -> str | None:
    """Why ``node``'s claim to client ``cid`` is refused (None: it is not). Without
    authentication every claim stands (a restarted node comes back under a new id). With
    it, the operator's assignment decides, and otherwise the key that holds the id
    (``bound``: client id -> key, the first to claim it)."""
    if not who.authenticated:
        return None
    assigned = who.assigned.get(cid)
    if assigned is not None:
        if who.key(assigned) == who.key(node):
            return None
        return f"node {node} claims client {cid}, assigned to node {assigned} by the operator; refused"
    holder = bound.get(cid)
    if holder is not None and holder != who.key(node):
        return f"node {node} claims client {cid}, held by {who.named(holder)} (its enrolled key); refused"
    return None


class ClientIds:
    """Which node holds which client id under SuperNode authentication (:func:`enrolment`):
    the node that first claimed it, or the one the operator assigned it to, until the
    operator assigns it elsewhere. Kept in the server state (:data:`BINDINGS`), so a
    resumed run keeps it. Without authentication it binds nothing (node ids change when a
    node restarts: the newest claim stands)."""

    def __init__(self, log):
        self.bound: dict[int, int] = {}
        self.log, self.told, self.who = log, None, Enrolment(False, {})

    def start(self, rnd: int, held: dict[int, int]) -> list[int]:
        """Read the SuperLink's word for round ``rnd``'s roll call; the client ids of
        ``held`` (client id -> node id) that the operator's assignment moved to another
        node, each logged: their old node holds them no longer."""
        who = self.who = enrolment()
        if who.problem and who.problem != self.told:
            self.log(f"round {rnd}: the operator's client assignments are not used: {who.problem}")
        self.told = who.problem
        if not who.authenticated:
            return []
        # the operator's word overrides the first claim
        self.bound.update({cid: who.key(node) for cid, node in who.assigned.items()})
        moved = [cid for cid, node in held.items() if self.bound.get(cid, who.key(node)) != who.key(node)]
        for cid in moved:
            self.log(
                f"round {rnd}: client {cid} moves from node {held[cid]} to {who.named(self.bound[cid])} "
                "(the operator's assignment)"
            )
        return moved

    def claim(self, cid: int, node: int) -> str | None:
        """Why ``node``'s claim to client ``cid`` is refused; None when it stands (then,
        under authentication, ``node`` holds ``cid`` from now on)."""
        why = claim_refusal(cid, node, self.who, self.bound)
        if why is None and self.who.authenticated:
            self.bound[cid] = self.who.key(node)
        return why

    def resume(self, server: ServerState) -> None:
        self.bound = bindings_of(server.extras)

    def kept_in(self, server: ServerState) -> ServerState:
        """``server`` with the bindings in its extras (unchanged when nothing is bound)."""
        if not self.bound:
            return server
        return ServerState(server.tensors, {**server.extras, BINDINGS: bindings_extra(self.bound)})


def bindings_of(extras: dict) -> dict[int, int]:
    """The client ids bound to keys, as the server state keeps them (:data:`BINDINGS`)."""
    if BINDINGS not in extras:
        return {}
    return {int(c): int(n) % 2**64 for c, n in extras[BINDINGS].tolist()}


def bindings_extra(bound: dict[int, int]) -> torch.Tensor:
    """``bound`` (client id -> key) as the server state's :data:`BINDINGS` extra."""
    rows = [(c, n - 2**64 if n >= 2**63 else n) for c, n in sorted(bound.items())]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)
