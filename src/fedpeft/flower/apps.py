"""The Flower apps: ``server_app`` and ``client_app``, for any fedpeft method.

Both read the experiment from the run config (key ``experiment``: the config as YAML,
written by ``fedpeft serve``); nothing here knows one method from another. A SuperNode
says who it is with its node config:

- ``partition-id`` (required): its client id, ``0 .. partition.num_clients - 1``;
- ``data-file`` (optional): its own CSV/TSV/JSONL/Parquet file; without it the node
  uses partition ``partition-id`` of the experiment's corpus;
- ``state-dir`` (optional): where it keeps its personal state between rounds and
  restarts (default ``.fedpeft-node`` in its working directory).
"""

from __future__ import annotations

import time
from pathlib import Path

import flwr.compat.common.recorddict_compat as compat
import yaml
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.serverapp import Grid, ServerApp

from fedpeft.config import ExperimentConfig, parse_config
from fedpeft.engines import compress
from fedpeft.engines.guard import DivergedError
from fedpeft.experiment import (
    build,
    checkpoints,
    export,
    fingerprint,
    finish,
    open_output,
    update_variation_analyzers,
)
from fedpeft.flower import codec, secure
from fedpeft.flower.node import Node
from fedpeft.flower.server import FlowerServer
from fedpeft.methods.base import load_tensors
from fedpeft.report import results as R
from fedpeft.report.tracking import Tracking

server_app = ServerApp()
client_app = ClientApp()


def experiment_of(context: Context) -> ExperimentConfig:
    text = context.run_config.get("experiment")
    if not isinstance(text, str):
        raise ValueError("run config: key 'experiment' (the fedpeft config as YAML) is missing")
    return parse_config(yaml.safe_load(text), "run config 'experiment'")


# ---------------------------------------------------------------- server
@server_app.main()
def serve(grid: Grid, context: Context) -> None:
    cfg = experiment_of(context)
    resume_from = context.run_config.get("resume_from")  # a kept checkpoint's round (--resume-from)
    if resume_from is not None and (type(resume_from) is not int or resume_from < 1):
        raise ValueError(f"run config: 'resume_from' must be a round (an integer >= 1), not {resume_from!r}")
    resume = bool(context.run_config.get("resume", False)) or resume_from is not None
    t0 = time.perf_counter()
    tracking = Tracking(cfg, resume)
    setup = build(cfg)
    load_tensors(setup.model, setup.initial)
    hist = open_output(setup)
    out = Path(cfg.output_dir)
    metrics_path = out / "metrics.jsonl"

    def log(line: str) -> None:
        print(f"[fedpeft] {line}", flush=True)

    def on_start(done: list[dict]) -> None:
        R.write_records(metrics_path, done)
        tracking.start(done)

    def on_round(record: dict) -> None:
        R.append_record(metrics_path, record)
        tracking.round(record)
        acc = record.get("global", {}).get("accuracy")
        returned, sampled = len(record.get("clients_returned", [])), len(record["clients"])
        score = f", global accuracy {acc:.4f}" if acc is not None else ""
        log(f"round {record['round']}: {returned} of {sampled} updates{score}")

    server = FlowerServer(
        setup,
        grid,
        checkpoints=checkpoints(cfg, log),
        fingerprint=fingerprint(cfg),
        on_round=on_round,
        on_start=on_start,
        analyzers=update_variation_analyzers(setup.method),
        log=log,
        context=context,
    )
    t1 = time.perf_counter()
    with tracking:
        try:
            records = server.run(resume=resume, resume_from=resume_from)
        except DivergedError as err:
            if err.round > 1:  # the last good global model (none was trained before round 1)
                export(setup, err.last_good.tensors, out)
            raise
        t2 = time.perf_counter()
        finish(
            setup,
            records,
            server.server,
            hist,
            {"engine": "flower", "time_setup": t1 - t0, "time_total": t2 - t0},
        )
    log(f"done: {out}")


# ---------------------------------------------------------------- client
_nodes: dict[tuple, Node] = {}  # per (experiment, node identity), while this process lives


def node_of(context: Context, class_names: list[str] | None = None) -> Node:
    """This node's client. A process that handles one message only (Flower's own
    ClientApp process) rebuilds it from its state dir; one that lives on (a warm node's
    worker, a simulation, the tests) keeps it across messages, rounds and runs of the same
    experiment, and builds it afresh when the roll call (the first message of a run)
    finds that its files changed on disk meanwhile. A node identity keeps the Node of one
    experiment at a time."""
    nc = context.node_config
    if "partition-id" not in nc:
        raise ValueError(
            "node config: 'partition-id' is missing (flower-supernode --node-config 'partition-id=0')"
        )
    cid, data_file = int(nc["partition-id"]), nc.get("data-file")
    state_dir = nc.get("state-dir", ".fedpeft-node")
    key = (context.run_config.get("experiment"), cid, data_file, state_dir)
    node = _nodes.get(key)
    if node is None or (class_names is not None and node.changed_on_disk()):
        for other in [k for k in _nodes if k[1:] == key[1:]]:  # another experiment, or a stale copy
            del _nodes[other]
        node = _nodes[key] = Node(
            experiment_of(context),
            cid,
            state_dir=Path(str(state_dir)),
            class_names=class_names,
            data_file=Path(str(data_file)) if data_file else None,
        )
    return node


def _received(node: Node, msg: Message):
    if "join" in msg.content and not node.joined:
        node.join(codec.from_record(msg.content["join"]))
    return codec.from_record(msg.content["downlink"])


@client_app.query()
def roll_call(msg: Message, context: Context) -> Message:
    node = node_of(context, list(msg.content["ask"]["class_names"]))
    info = ConfigRecord(
        {
            "cid": node.cid,
            "joined": node.joined,
            "last_round": node.last_round,
            "num_examples": len(node.client.train),
        }
    )
    return Message(RecordDict({"node": info}), reply_to=msg)


def _secure_train(msg: Message, context: Context) -> Message:
    """The training stage of SecAgg+: legacy fit instructions in, a legacy fit result out
    (which ``secaggplus_mod`` then quantises, masks and sends)."""
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    received, join, orders = secure.read_instructions(ins)
    node = node_of(context)
    if join is not None and not node.joined:
        node.join(join)
    t0 = time.perf_counter()
    # SecAgg+ takes no compressed uplink (the config refuses it): ``sent`` is the update's
    # values, clipped (and, local mode, noised) under privacy.mode
    result, sent = node.fit(received, orders)
    metrics = {**result.metrics, "time_fit": time.perf_counter() - t0}
    metrics.pop("fitted", None)  # metrics travel in the clear: nothing of the update's norm
    metrics |= {f"readout.{k}": v for k, v in node.method.readout(result).items()}
    user_dp = node.cfg.privacy.mode == "user"  # uniform weights: one client moves the sum by C at most
    if user_dp:  # its size in the clear, as SecAgg+ sends a weight: the round's loss is weighed by it
        metrics["num_examples"] = result.num_examples
    fitres = secure.fit_reply(sent, 1 if user_dp else result.num_examples, metrics)
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)


def secure_or_plain(msg: Message, context: Context, call_next) -> Message:
    """Route SecAgg+ protocol messages through Flower's client mod, the rest as usual."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, _secure_train)
    return call_next(msg, context)


@client_app.train(mods=[secure_or_plain])
def train(msg: Message, context: Context) -> Message:
    node = node_of(context)
    received = compress.decode(_received(node, msg), node.cfg.comm.downlink)  # comm.downlink
    t0 = time.perf_counter()
    control = codec.from_record(msg.content["control"]) if "control" in msg.content else None
    result, sent = node.fit(received, codec.Orders.read(msg.content["config"]), control)
    fit = {**result.metrics, "num_examples": result.num_examples, "time_fit": time.perf_counter() - t0}
    records = {"uplink": codec.to_record(sent), "fit": codec.to_metrics(fit)}
    if result.control:  # SCAFFOLD: the update of this client's control
        records["control"] = codec.to_record(result.control)
    if readout := node.method.readout(result):  # computed here: it may need the personal state
        records["readout"] = codec.to_metrics(readout)
    return Message(RecordDict(records), reply_to=msg)


@client_app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    node = node_of(context)
    config = msg.content["config"]
    received = _received(node, msg)
    ev = node.evaluate(received, int(config["round"]), bool(config["global_test"]))
    records: dict = {"config": ConfigRecord({"trained": ev.trained})}
    if ev.local:
        records["local"] = MetricRecord(ev.local)
    if ev.global_:
        records["global"] = MetricRecord(ev.global_)
    for name, values in ev.extra.items():
        records[f"local_{name}"] = MetricRecord(values)
    return Message(RecordDict(records), reply_to=msg)
