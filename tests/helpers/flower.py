"""An in-memory stand-in for Flower's Grid: delivers each message to the ClientApp of
its node in this process, so the bridge's protocol is tested in seconds; and a fake
federation on it (``deploy``, ``serve``). The real SuperLink/SuperNode path is tested in
tests/flower/test_deploy.py."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.supercore.task_identity import TaskIdentity

from fedpeft.config import dump_config
from fedpeft.experiment import run
from fedpeft.flower import apps
from fedpeft.report.results import read_records

RUN_ID = 7


def wire_copy(message: Message) -> Message:
    """What the other side gets: the message serialised and parsed again (never the very
    objects the sender holds)."""
    return message_from_proto(message_to_proto(message))


class FakeGrid:
    """Nodes ``1..n`` with node configs; ``faults(node_id, message) -> str | None`` makes
    a node fail a message (``"error"``: an error reply, ``"silent"``: no reply,
    ``"vanish"``: no reply and the node is gone)."""

    def __init__(self, app: ClientApp, node_configs: dict[int, dict], run_config: dict):
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = RUN_ID, 0, 0
        self.app, self.run_config = app, run_config
        self.contexts = {n: self.context(n, nc) for n, nc in node_configs.items()}
        self.faults: Callable[[int, Message], str | None] = lambda node, message: None
        self.sent: list[Message] = []
        self.outbox: dict[str, Message] = {}  # replies not yet pulled, by the id they answer
        self.replies: list[Message] = []

    def context(self, node_id: int, node_config: dict) -> Context:
        return Context(RUN_ID, node_id, dict(node_config), RecordDict(), dict(self.run_config))

    def get_node_ids(self) -> Iterable[int]:
        return sorted(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        """Deliver now; the replies wait to be pulled (a silent node never answers)."""
        ids = []
        for message in messages:
            for reply in self.send_and_receive([message]):
                self.outbox[reply.metadata.reply_to_message_id] = reply
            ids.append(message.metadata.message_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.outbox.pop(i) for i in list(message_ids) if i in self.outbox]

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = message.object_id  # as the SuperLink does
            self.sent.append(message)
            node = message.metadata.dst_node_id
            fault = self.faults(node, message)
            if fault == "vanish":  # the node dies: no reply, and the SuperLink stops listing it
                del self.contexts[node]
            if node not in self.contexts or fault == "silent":
                continue
            if fault == "error":
                replies.append(Message(Error(2, "simulated crash"), reply_to=message))
                continue
            reply = self.app(wire_copy(message), self.contexts[node])
            self.replies.append(reply)
            replies.append(wire_copy(reply))
        return replies


def deploy(cfg, tmp_path, num_nodes=None, **grid_kw) -> FakeGrid:
    """A fake federation for ``cfg``: one node per client, each with its own state dir."""
    apps._nodes.clear()
    n = num_nodes or cfg.partition.num_clients
    nodes = {100 + i: {"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(n)}
    return FakeGrid(apps.client_app, nodes, {"experiment": dump_config(cfg)})


@contextlib.contextmanager
def wrapped_handler(kind: str, wrapper):
    """Route the ClientApp's ``kind`` messages through ``wrapper(real, message, context)``."""
    funcs = apps.client_app._registered_funcs
    real = funcs[f"{kind}.default"]
    funcs[f"{kind}.default"] = lambda message, context: wrapper(real, message, context)
    try:
        yield
    finally:
        funcs[f"{kind}.default"] = real


def serve(grid: FakeGrid, resume: bool = False, resume_from: int | None = None) -> None:
    at = {"resume_from": resume_from} if resume_from is not None else {}
    apps.server_app(grid, Context(7, 0, {}, RecordDict(), {**grid.run_config, "resume": resume, **at}))


def in_process_and_deployed(tiny_config, tmp_path, **over):
    """The same config run in-process (``inproc/``) and through the fake federation
    (``flower/``): both runs' records, the grid (its messages) and the two configs."""
    local = tiny_config(output_dir=str(tmp_path / "inproc"), **over)
    flower = tiny_config(output_dir=str(tmp_path / "flower"), **over)
    run(local)
    grid = deploy(flower, tmp_path)
    serve(grid)
    return read_records(local.output_dir), read_records(flower.output_dir), grid, (local, flower)
