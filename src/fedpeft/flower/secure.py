"""Secure aggregation: a round's training through Flower's SecAgg+ protocol.

With ``deploy.secure_aggregation: true`` the server never sees a client's update: each
client masks its (quantised, example-weighted) update with pairwise masks and secret
shares, and the server can only reconstruct the **sum** over the clients that
completed the protocol. That is enough for every method whose aggregation is the
example-weighted mean of the uplinks (the FedAvg family: fedft, fedbf, fedap, fedlr,
federa, pf2lora, perfedavg); methods that aggregate otherwise (HETLoRA weighs by norms,
Local-only does not aggregate) are refused.

Flower 1.41 implements SecAgg+ as a workflow over its legacy strategy interface, so
this module speaks that dialect for one round: :class:`OneRound` hands the workflow the
sampled clients' instructions and takes back the unmasked mean; on the nodes,
:func:`secure_train` answers the protocol's training stage (see ``apps.py``). Precision:
values are clipped to ``[-clipping_range, clipping_range]`` (8) and quantised to
``2**22`` levels over that range, so the mean is exact to about 4e-6.

Every reply of every stage is checked as it arrives (:class:`CountingGrid`, with
:func:`fedpeft.flower.replies.check_secure_reply`): the fields Flower's workflow reads,
the masked vector's arrays and sizes, and the training result's size and metrics in the
clear (a size no more than the client's node gave at the roll call). A reply that fails
is handed to the workflow as an error, so its node counts as one that dropped out of the
protocol, which SecAgg+ recovers from. What the server cannot check is the weight each
client folds into its masked update: SecAgg+ hides it with the update. Each masked value
is clipped to ``[-clipping_range, clipping_range]`` after weighting, so a client that
overstates its weight cannot steer the mean to a value of its choosing, but it can
shrink the round's update towards zero.
"""

from __future__ import annotations

import json

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message
from flwr.common import Code, FitIns, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.common.secure_aggregation.secaggplus_constants import Key as SecAggKey
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD, Key
from flwr.serverapp import Grid

from fedpeft.flower import codec, replies
from fedpeft.methods.base import FitResult, Tensors

#: the code of the error that stands for a refused reply (Flower's codes are small numbers)
REFUSED = 72


class CountingGrid:
    """A Grid that adds up the bytes Flower serialises for what passes through it and,
    given what the round expects (``expect``), checks each reply of each SecAgg+ stage
    before the workflow reads it; a reply that fails reaches the workflow as an error
    (its node drops out) and its reason is kept by node (``refused``)."""

    def __init__(self, grid: Grid, expect: replies.SecureRound | None = None):
        self.grid, self.down, self.up, self.expect = grid, 0, 0, expect
        self.refused: dict[int, str] = {}
        self.failure: str | None = None  # the error that ended the protocol, if one did

    def why_dropped(self, node: int) -> str:
        """Why ``node``'s client is not among the round's results."""
        if node in self.refused:
            return f"refused: {self.refused[node]}"
        if self.failure is not None:
            return f"SecAgg+ failed: {self.failure}"
        return "did not complete the SecAgg+ protocol"

    def get_node_ids(self):
        return self.grid.get_node_ids()

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        self.down += sum(codec.wire_bytes(m) for m in messages)
        received = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.up += sum(codec.wire_bytes(r) for r in received if not r.has_error())
        if self.expect is None:
            return received
        asked = {m.metadata.message_id: m for m in messages}
        return [self.checked(asked.get(r.metadata.reply_to_message_id), r) for r in received]

    def checked(self, request: Message | None, reply: Message) -> Message:
        """``reply``, or an error in its place when it fails the checks of its stage."""
        if reply.has_error():
            return reply
        try:
            if request is None:
                raise codec.ReplyError("a reply to no message of this stage")
            stage = str(request.content.config_records[RECORD_KEY_CONFIGS][SecAggKey.STAGE])
            replies.check_secure_reply(stage, reply, request.metadata.dst_node_id, self.expect)
        except codec.ReplyError as err:
            node = request.metadata.dst_node_id if request is not None else reply.metadata.src_node_id
            self.refused[node] = str(err)
            return Message(metadata=reply.metadata, error=Error(REFUSED, f"refused: {err}"))
        return reply


class _Node:
    """What the SecAgg+ workflow needs of a legacy client proxy: its node id."""

    def __init__(self, node_id: int, cid: int):
        self.node_id, self.cid = node_id, cid


def pack(tensors: Tensors) -> tuple[list[np.ndarray], str]:
    names = sorted(tensors)
    return [tensors[n].numpy() for n in names], json.dumps(names)


def unpack(arrays: list[np.ndarray], names: str) -> Tensors:
    return {n: torch.from_numpy(np.array(a)) for n, a in zip(json.loads(names), arrays, strict=True)}


class OneRound(Strategy):
    """Adapts one fedpeft round to the legacy strategy calls the SecAgg+ workflow makes."""

    def __init__(self, instructions: dict[int, tuple[int, FitIns]], uplink_like: Tensors):
        self.instructions = instructions  # node id -> (client id, FitIns)
        self.uplink_like = uplink_like
        self.result: FitResult | None = None
        self.returned: list[int] = []  # client ids, ascending
        self.metrics: list[dict] = []  # each returned client's fit metrics, in that order
        self.num_examples: list[int] = []  # and its number of examples (sent in the clear)

    def configure_fit(self, server_round, parameters, client_manager):
        return [(_Node(node, cid), ins) for node, (cid, ins) in self.instructions.items()]

    def aggregate_fit(self, server_round, results, failures):
        """``results`` all carry the same unmasked mean (the workflow puts it in each)."""
        if not results:
            return None, {}
        _, first = results[0]
        # the workflow dequantises in float64; the mean is stored like weighted_mean's
        mean = unpack(parameters_to_ndarrays(first.parameters), json.dumps(sorted(self.uplink_like)))
        mean = {n: t.to(self.uplink_like[n].dtype) for n, t in mean.items()}
        mean = codec.check_tensors(mean, self.uplink_like, "securely aggregated update")
        results = sorted(results, key=lambda pair: pair[0].cid)
        total = sum(res.num_examples for _, res in results)
        self.returned = [proxy.cid for proxy, _ in results]
        self.metrics = [dict(res.metrics) for _, res in results]
        self.num_examples = [res.num_examples for _, res in results]
        self.result = FitResult(mean, {}, total, {})
        return None, {}  # fedpeft keeps the state; the workflow's copy is not used

    def initialize_parameters(self, client_manager):
        return None

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


def secure_round(
    grid: Grid,
    context: Context,
    rnd: int,
    instructions: dict[int, tuple[int, FitIns]],
    uplink_like: Tensors,
    max_weight: float,
    timeout: float,
    expect: replies.SecureRound | None = None,
) -> tuple[OneRound, CountingGrid]:
    """Run SecAgg+ for one round over the clients in ``instructions`` (``expect``: what
    their replies are checked against; None: unchecked). An error the workflow raises
    (a reply that passed the checks and still broke the protocol) ends the round with
    every client dropped and the error as their reason, never the server."""
    strategy = OneRound(instructions, uplink_like)
    legacy = LegacyContext(context, strategy=strategy)
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({Key.CURRENT_ROUND: rnd})
    legacy.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    counting = CountingGrid(grid, expect)
    workflow = SecAggPlusWorkflow(
        num_shares=1.0, reconstruction_threshold=0.5, max_weight=max_weight, timeout=timeout
    )
    try:
        workflow(counting, legacy)
    except Exception as err:  # noqa: BLE001  a reply the checks let through broke the protocol
        strategy = OneRound(instructions, uplink_like)  # nothing aggregated: every client dropped
        counting.failure = f"{type(err).__name__}: {err}"
    return strategy, counting


# ---------------------------------------------------------------- node side
def fit_instructions(received: Tensors, join: Tensors | None, orders: codec.Orders) -> FitIns:
    arrays, names = pack(received)
    config = {**orders.as_config(), "names": names, "join": ""}
    if join:
        join_arrays, config["join"] = pack(join)
        arrays += join_arrays
    return FitIns(ndarrays_to_parameters(arrays), config)


def read_instructions(ins: FitIns) -> tuple[Tensors, Tensors | None, codec.Orders]:
    """What :func:`fit_instructions` packed: the downlink, the join message (None without)
    and the round's orders."""
    arrays = parameters_to_ndarrays(ins.parameters)
    n = len(json.loads(ins.config["names"]))
    received = unpack(arrays[:n], str(ins.config["names"]))
    join = unpack(arrays[n:], str(ins.config["join"])) if ins.config["join"] else None
    return received, join, codec.Orders.read(ins.config)


def fit_reply(uplink: Tensors, weight: int, metrics: dict[str, float]) -> FitRes:
    """The legacy fit result SecAgg+ masks: ``uplink`` (what the client sends), its weight
    in the mean (its examples; 1 each under user-level DP) and its metrics (in the clear)."""
    arrays, _ = pack(uplink)
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), weight, metrics)
