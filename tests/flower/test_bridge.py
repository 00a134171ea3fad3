"""The Flower bridge's protocol on an in-memory grid: same results as the in-process
engine, personal state kept on the nodes, faults dropped and recorded, bad replies
refused whole, restarted nodes rejoining with their state."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal

import pytest
import torch
from flwr.app import ArrayRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedpeft.config import dump_config
from fedpeft.engines.checkpoint import load_checkpoint
from fedpeft.experiment import fingerprint, run
from fedpeft.flower import apps, codec, relay
from fedpeft.flower.node import Node
from fedpeft.flower.server import DeploymentError
from fedpeft.methods import REGISTRY
from fedpeft.methods.base import Method
from fedpeft.report.results import read_records, read_summary
from tests.helpers.configs import FEDSB, PF2, SCAFFOLD, task_config
from tests.helpers.flower import FakeGrid, deploy, serve, wrapped_handler

pytestmark = pytest.mark.usefixtures("forget_nodes")  # tests/conftest.py


HET = {"name": "hetlora", "lora": {"r": 4}, "r_min": 1}
FLEX = {"name": "flexlora", "lora": {"r": 4}, "ranks": [1, 4, 2]}
KEEP = {"train.optimizer_state": "keep"}


FDLORA = {"name": "fdlora", "sync_every": 1}  # all three stages (local, outer step, sync) in 2 rounds
#: the server's layers (issue 32): an optimiser, a robust rule, uniform weights
SERVER_LAYERS = {"server.optimizer": "fedadam", "server.lr": 0.05, "server.aggregation": "median",
                 "server.weighting": "uniform"}  # fmt: skip
#: the default tier's runs: FedAvg over LoRA, a personal adapter, a join message, a personal
#: module, FedAvg under the server's layers, SCAFFOLD
FAST_CASES = [({"name": "fedlr"}, {}), (PF2, {}), ({"name": "federa"}, {}), ({"name": "fedmcp"}, {}),
              ({"name": "fedlr"}, SERVER_LAYERS), ({"name": "fedmcp"}, SCAFFOLD)]  # fmt: skip
#: a method's options and settings where its defaults would not show what it does over the
#: network (its ranks, its stages) or its optimizer state is kept
OPTIONS = {"hetlora": (HET, KEEP), "flexlora": (FLEX, KEEP), "flora": ({**FLEX, "name": "flora"}, KEEP),
           "fedsb": (FEDSB, KEEP), "rolora": ({"name": "rolora"}, KEEP), "fdlora": (FDLORA, {}),
           "pf2lora": (PF2, {})}  # fmt: skip
#: the slow tier (CI runs it; the default tier stays under its 10 minutes): every other
#: registered method but a pooled one (which no deployment runs), each with its options
FAST_NAMES = {m["name"] for m, _ in FAST_CASES}
SLOW_CASES = [
    OPTIONS.get(name, ({"name": name}, {}))
    for name, cls in REGISTRY.items()
    if name not in FAST_NAMES and not cls.pooled
]
CASES = FAST_CASES + SLOW_CASES
#: methods whose clients receive a join message once (FeDeRA's initial A, B; FFA-LoRA's frozen A)
JOINING = {name for name, cls in REGISTRY.items() if cls.join_message is not Method.join_message}
PERSONAL_CASES = [(PF2, {}), (PF2, KEEP), ({"name": "fedsalora"}, {}), (HET, KEEP), ({"name": "fedmcp"}, {}),
                  (FDLORA, {}), ({"name": "fedmcp"}, SCAFFOLD)]  # fmt: skip


def case_ids(cases) -> list[str]:
    return [
        f"{m['name']}{'+' + '+'.join(k.split('.')[-1] for k in over) if over else ''}" for m, over in cases
    ]


def case_params(cases) -> list:
    return [
        pytest.param(m, over, id=name, marks=[pytest.mark.slow] if (m, over) in SLOW_CASES else [])
        for (m, over), name in zip(cases, case_ids(cases), strict=True)
    ]


@pytest.mark.parametrize(("method", "over"), case_params(CASES))
def test_same_metrics_as_in_process(tiny_config, tmp_path, method, over):
    """HETLoRA: client ranks below r_max pass the server's update check; with ``keep`` each
    node's optimizer state carries over its rounds as in-process."""
    flower_cfg = tiny_config(method=method, output_dir=str(tmp_path / "flower"), **over)
    local_cfg = tiny_config(method=method, output_dir=str(tmp_path / "inproc"), **over)
    run(local_cfg)
    grid = deploy(flower_cfg, tmp_path)
    serve(grid)
    a, b = read_records(local_cfg.output_dir), read_records(flower_cfg.output_dir)
    assert [r["clients"] for r in a] == [r["clients"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-6)
        assert rb["local"] == pytest.approx(ra["local"], rel=1e-6)
        assert rb["clients_evaluated"] == ra["clients_evaluated"]
        assert rb["payload_bytes_up"] == ra["bytes_up"]
        if method["name"] not in JOINING:
            assert rb["payload_bytes_down"] == ra["bytes_down"]
    if method["name"] in JOINING:
        # every node gets the join message once, with its first message of any kind (an
        # unsampled node needs it to evaluate); in-process only clients that train count it
        join = sum(r["payload_bytes_down"] for r in b) - sum(r["bytes_down"] for r in a)
        trained = {c for r in a for c in r["clients"]}
        assert join > 0 and join % (flower_cfg.partition.num_clients - len(trained)) == 0
        assert rb["bytes_up"] > rb["payload_bytes_up"]  # Flower's framing on top of the tensors
    assert read_summary(flower_cfg.output_dir)["engine"] == "flower"
    assert all(r["dropped"] == {} for r in b if "dropped" in r)  # no update refused


@pytest.mark.parametrize(("method", "over"), PERSONAL_CASES, ids=case_ids(PERSONAL_CASES))
def test_personal_state_stays_on_the_nodes(tiny_config, tmp_path, method, over):
    """Personal parameters, kept optimizer state (``opt.*``), HETLoRA's own adapter
    (``own.*``) and SCAFFOLD's client control (``control.*``) never appear in a message;
    each node keeps them on its own disk. SCAFFOLD's server control goes down with each
    training message, and each client's control update comes back with its update."""
    cfg = tiny_config(method=method, output_dir=str(tmp_path / "flower"), **over)
    grid = deploy(cfg, tmp_path)
    serve(grid)
    node = next(iter(apps._nodes.values()))
    personal, shared = set(node.method.personal_names), set(node.method.shared_names)
    assert shared
    for m in grid.sent + grid.replies:
        names = {k for rec in m.content.array_records.values() for k in codec.from_record(rec)}
        assert not names & personal
        assert not any(n.startswith(("opt.", "own.", "control.")) for n in names)
    uplinks = [set(codec.from_record(m.content["uplink"])) for m in grid.replies if "uplink" in m.content]
    assert uplinks and all(u == shared for u in uplinks)
    # each trained node keeps its own snapshots on its own disk
    saved = torch.load(tmp_path / "node0" / "client-0-personal.pt", weights_only=True)["value"]
    kept = set(next(iter(saved.values())))
    assert {n for n in kept if not n.startswith(("opt.", "own.", "control.", "control_pending"))} == personal
    if over == KEEP:
        assert any(n.startswith("opt.") for n in kept)
    scaffold = over == SCAFFOLD
    assert scaffold == ({n for n in kept if n.startswith("control.")} == {f"control.{n}" for n in shared})
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert trains and all(("control" in m.content) == scaffold for m in trains)
    if scaffold:
        assert all(set(codec.from_record(m.content["control"])) == shared for m in trains)
        replies = [m for m in grid.replies if "uplink" in m.content]
        assert all(set(codec.from_record(m.content["control"])) == shared for m in replies)


@pytest.mark.slow  # 10-12 s: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_a_kept_node_serves_the_next_run_unless_its_files_changed(tiny_config, tmp_path):
    """A process that lives on (a warm node's worker) keeps each node across runs of the
    same experiment: the second run builds no model and gives the first run's results
    (the server starts afresh; the nodes already hold the join message). A node whose
    state directory was cleared meanwhile is built afresh from the roll call on."""
    cfg = tiny_config(**{"train.rounds": 2, "eval.every": 2, "train.clients_per_round": 4})
    nodes = {100 + i: {"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(4)}

    def fresh_run(name: str) -> list[dict]:
        out = cfg.model_copy(update={"output_dir": tmp_path / name})
        serve(FakeGrid(apps.client_app, nodes, {"experiment": dump_config(cfg)}))
        shutil.move(cfg.output_dir, out.output_dir)  # the next run starts afresh
        return read_records(out.output_dir)

    first = fresh_run("first")
    built, kept = Node.models_built, dict(apps._nodes)
    second = fresh_run("second")
    assert Node.models_built == built and all(apps._nodes[k] is node for k, node in kept.items())
    assert [r["global"] for r in second if "global" in r] == [r["global"] for r in first if "global" in r]
    for path in (tmp_path / "node0").iterdir():
        path.unlink()
    fresh_run("third")
    rebuilt = [k for k, node in apps._nodes.items() if node is not kept[k]]
    assert [k[1] for k in rebuilt] == [0] and Node.models_built == built + 1


def test_tensors_travel_packed_bit_exact_in_a_few_objects():
    """A tensor dict crosses as two arrays (bytes and index), whatever its dtypes and
    shapes (bfloat16 too, which Flower's own arrays refuse), and comes back equal; the
    message is a handful of Flower objects, each of which a node pulls or pushes in a
    request of its own (an array per tensor: one or two objects per tensor). A record
    that is not one of these is refused."""
    tensors = {f"layer{i}.lora_A": torch.randn(4, 8) for i in range(40)}
    tensors |= {"step": torch.tensor(3), "mask": torch.tensor([True, False]), "bf": torch.randn(3).bfloat16(),
                "empty": torch.zeros(0, 5)}  # fmt: skip
    record = codec.to_record(tensors)
    back = codec.from_record(record)
    assert list(back) == list(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    back["step"] += 1  # writable copies
    objects = lambda rec: len(get_all_nested_objects(RecordDict({"uplink": rec})))  # noqa: E731
    per_tensor = ArrayRecord.from_torch_state_dict({k: v for k, v in tensors.items() if k != "bf"})  # no bf16
    assert objects(record) <= 6 < len(tensors) < objects(per_tensor)
    with pytest.raises(codec.ReplyError, match="holds arrays 'packed' and 'index'"):
        codec.from_record(per_tensor)
    short = codec.to_record({"a": torch.ones(4)})
    short[codec.PACKED] = codec.to_record({"a": torch.ones(2)})[codec.PACKED]  # bytes cut short
    with pytest.raises(codec.ReplyError, match="tensor 'a'.*bytes 0..16 of 8"):
        codec.from_record(short)


def test_crashed_silent_and_vanished_clients_are_dropped_and_recorded(tiny_config, tmp_path):
    """Round 2: client 0's app raises, client 1 never answers (dropped at the round
    timeout), client 2's node vanishes (dropped as soon as the SuperLink stops listing
    it, without waiting out the timeout); client 3 trains and the round goes on."""
    cfg = tiny_config(**{"train.rounds": 3, "train.clients_per_round": 4, "deploy.round_timeout": 2})
    grid = deploy(cfg, tmp_path)
    fates = {100: "error", 101: "silent", 102: "vanish"}

    def faults(node, message):
        in_round_2 = message.metadata.message_type == "train" and message.content["config"]["round"] == 2
        return fates.get(node) if in_round_2 else None

    grid.faults = faults
    serve(grid)
    records = read_records(cfg.output_dir)
    assert len(records) == 3
    dropped = records[1]["dropped"]
    assert dropped["0"] == "error 2: simulated crash"
    assert dropped["1"] == "no reply within 2 s"
    assert dropped["2"] == "its node went offline (missed its heartbeats)"
    assert records[1]["clients_returned"] == [3]
    assert "dropped" not in records[0]
    assert records[2]["clients"] == [0, 1, 3]  # the vanished node is gone; the others carry on


def test_too_few_results_skips_the_round_and_then_stops(tiny_config, tmp_path):
    cfg = tiny_config(**{"train.rounds": 4, "deploy.min_results": 2, "deploy.max_skipped_rounds": 2})
    grid = deploy(cfg, tmp_path)
    grid.faults = lambda node, m: "error" if m.metadata.message_type == "train" and node != 100 else None
    with pytest.raises(DeploymentError, match="2 consecutive rounds skipped"):
        serve(grid)
    records = read_records(cfg.output_dir)
    assert len(records) == 2  # stopped after max_skipped_rounds, with what happened recorded
    assert all(r["skipped"].endswith("of deploy.min_results=2 updates") for r in records)
    assert "update_variation" not in records[0]  # nothing was aggregated


def test_malformed_update_is_refused_whole(tiny_config, tmp_path):
    """Client 0 returns an update missing one tensor: it is refused, the others aggregate."""
    cfg = tiny_config(**{"train.rounds": 1, "train.clients_per_round": 4})
    grid = deploy(cfg, tmp_path)

    def truncating(real_train, message, context):
        reply = real_train(message, context)
        if context.node_config["partition-id"] == 0:
            update = codec.from_record(reply.content["uplink"])
            del update[next(iter(update))]  # a partial update
            reply.content["uplink"] = codec.to_record(update)
        return reply

    with wrapped_handler("train", truncating):
        serve(grid)
    record = read_records(cfg.output_dir)[0]
    assert list(record["dropped"]) == ["0"]
    assert record["dropped"]["0"].startswith("refused: client 0 update: missing tensors")
    assert record["clients_returned"] == [1, 2, 3]
    assert "update_variation" in record  # the round aggregated the three whole updates


def test_check_tensors_names_the_difference():
    like = {"a": torch.zeros(2, 3), "b": torch.zeros(4)}
    assert codec.check_tensors({"a": torch.ones(2, 3), "b": torch.ones(4)}, like, "x")
    with pytest.raises(codec.ReplyError, match="missing tensors \\['b'\\]"):
        codec.check_tensors({"a": torch.ones(2, 3)}, like, "x")
    with pytest.raises(codec.ReplyError, match="'a' is torch.float32 \\(3, 2\\)"):
        codec.check_tensors({"a": torch.ones(3, 2), "b": torch.ones(4)}, like, "x")
    with pytest.raises(codec.ReplyError, match="non-finite"):
        codec.check_tensors({"a": torch.full((2, 3), float("nan")), "b": torch.ones(4)}, like, "x")


@pytest.mark.parametrize(
    "method", [{"name": "federa"}, pytest.param(PF2, marks=pytest.mark.slow)]
)  # CI: slow tier
def test_restarted_node_rejoins_with_its_state(tiny_config, tmp_path, method):
    """FeDeRA: the new process needs the join message again; PF2LoRA: it needs its
    personal adapter back from its state dir. Either way the run ends as if nothing
    had happened."""
    cfg = tiny_config(method=method, **{"train.rounds": 3, "train.clients_per_round": 4})
    grid = deploy(cfg, tmp_path)

    def restart_node_0_after_round_1(real_evaluate, message, context):
        reply = real_evaluate(message, context)
        if message.content["config"]["round"] == 1 and context.node_config["partition-id"] == 0:
            # the node's process dies; a new SuperNode starts, under a new node id
            del grid.contexts[100]
            grid.contexts[200] = grid.context(200, context.node_config)
            for key in [k for k in apps._nodes if k[1] == 0]:
                del apps._nodes[key]
            if method["name"] == "federa":  # ... on a fresh disk: its join message is gone too
                (tmp_path / "node0" / "client-0-join.pt").unlink()
        return reply

    with wrapped_handler("evaluate", restart_node_0_after_round_1):
        serve(grid)
    trains = [
        m for m in grid.sent if m.metadata.message_type == "train" and m.metadata.dst_node_id in (100, 200)
    ]
    joins = [(m.metadata.dst_node_id, m.content["config"]["round"]) for m in trains if "join" in m.content]
    assert joins == ([(100, 1), (200, 2)] if method["name"] == "federa" else [])
    assert [r["clients"] for r in read_records(cfg.output_dir)] == [[0, 1, 2, 3]] * 3
    local_cfg = tiny_config(method=method, **{"train.rounds": 3, "train.clients_per_round": 4},
                            output_dir=str(tmp_path / "inproc"))  # fmt: skip
    run(local_cfg)
    assert read_records(cfg.output_dir)[-1]["local"] == pytest.approx(
        read_records(local_cfg.output_dir)[-1]["local"]
    )
    # node 0's personal state after the last round is the in-process engine's, bit for bit
    ckpt = load_checkpoint(local_cfg.output_dir / "checkpoint.pt", fingerprint(local_cfg))
    reference = ckpt.personal[0]
    saved = torch.load(tmp_path / "node0" / "client-0-personal.pt", weights_only=True)["value"]
    assert set(saved[3]) == set(reference)
    assert all(torch.equal(saved[3][k], reference[k]) for k in reference)


def test_nodes_with_their_own_data_files(tiny_config, tmp_path):
    """A real deployment: each node reads its own file, labels mapped by name onto the
    server's class list; an unknown label fails naming the file and row."""
    import pandas as pd

    from fedpeft.data.sources import DataError, load_corpus

    cfg = tiny_config(**{"train.rounds": 1, "partition.num_clients": 2, "train.clients_per_round": 2})
    corpus = load_corpus(cfg.data, cfg.seed)
    files = []
    for i in range(2):
        rows = range(i * 40, (i + 1) * 40)
        texts = [corpus.train_texts[r] for r in rows]
        frame = pd.DataFrame(
            {"text": texts, "label": [corpus.class_names[corpus.train_labels[r]] for r in rows]}
        )
        files.append(tmp_path / f"hospital{i}.csv")
        frame.to_csv(files[-1], index=False)
    apps._nodes.clear()
    nodes = {100 + i: {"partition-id": i, "data-file": str(f), "state-dir": str(tmp_path / f"n{i}")}
             for i, f in enumerate(files)}  # fmt: skip
    grid = FakeGrid(apps.client_app, nodes, {"experiment": dump_config(cfg)})
    serve(grid)
    record = read_records(cfg.output_dir)[0]
    assert record["clients_returned"] == [0, 1]
    node = next(n for n in apps._nodes.values() if n.cid == 0)
    assert len(node.client.train) + len(node.client.test) == 40
    assert node.global_test is None

    bad = tmp_path / "bad.csv"
    pd.DataFrame({"text": ["a gloss", "another gloss"], "label": ["noun.animal", "noun.unicorn"]}).to_csv(
        bad, index=False
    )
    from fedpeft.flower.node import Node

    with pytest.raises(DataError, match=r"bad.csv, line 3: label 'noun.unicorn'"):  # an editor's line
        Node(cfg, 0, state_dir=tmp_path / "n-bad", class_names=corpus.class_names, data_file=bad)


def test_cli_deploy_commands_check_their_input(tmp_path):
    from typer.testing import CliRunner

    from fedpeft.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["serve"])
    assert res.exit_code == 2 and "either --ca" in res.output
    res = runner.invoke(app, ["join", "--superlink", "x:1", "--partition-id", "0", "--insecure",
                              "--data-file", str(tmp_path / "missing.csv")])  # fmt: skip
    assert res.exit_code == 2 and "missing.csv: no such file" in " ".join(res.output.split())
    res = runner.invoke(
        app, ["certs", str(tmp_path / "certs"), "--host", "10.0.0.5", "--host", "fl.example.org"]
    )
    assert res.exit_code == 0
    from cryptography import x509

    cert = x509.load_pem_x509_certificate((tmp_path / "certs" / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    assert san.get_values_for_type(x509.DNSName) == ["fl.example.org"]
    ca = x509.load_pem_x509_certificate((tmp_path / "certs" / "ca.crt").read_bytes())
    assert cert.issuer == ca.subject


def test_pooled_training_is_refused(tiny_config, tmp_path):
    cfg = tiny_config(method={"name": "centralized"})
    with pytest.raises(DeploymentError, match="pooled in one place"):
        serve(deploy(cfg, tmp_path))


@pytest.mark.parametrize("method", [{"name": "fedlr"}, {"name": "federa"}])
def test_secure_aggregation_gives_the_mean_without_showing_updates(tiny_config, tmp_path, method):
    """SecAgg+ (Flower's protocol, both sides, over the in-memory grid): the server ends
    with the in-process global state up to the protocol's quantisation, and no client's
    update ever reaches it in the clear."""
    common = {"method": method, "train.clients_per_round": 4, "train.rounds": 1}
    cfg = tiny_config(output_dir=str(tmp_path / "secure"), **common, **{"deploy.secure_aggregation": True})
    local_cfg = tiny_config(output_dir=str(tmp_path / "inproc"), **common)
    grid = deploy(cfg, tmp_path)
    serve(grid)
    run(local_cfg)
    secure_state = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    plain_state = torch.load(local_cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    for name, value in plain_state.items():
        # one round (later rounds train on, and amplify, the rounding): 2**22 quantisation
        # levels over [-8, 8] are 3.8e-6 apart, and the weights are quantised too
        torch.testing.assert_close(secure_state[name], value, atol=1e-5, rtol=0)
    assert any((secure_state[n] != plain_state[n]).any() for n in plain_state)  # it really was quantised
    records = read_records(cfg.output_dir)
    assert all(r["secure_aggregation"] and r["clients_returned"] == [0, 1, 2, 3] for r in records)
    # the round's loss is weighted by examples, as a plain round's (and in-process) is; the
    # clients hold different numbers of examples, so an unweighted mean would differ
    sizes = {node.cid: len(node.client.train) for node in apps._nodes.values()}
    assert len(set(sizes.values())) > 1
    assert records[0]["loss"] == pytest.approx(read_records(local_cfg.output_dir)[0]["loss"], rel=1e-6)
    # every reply to a training message carries masked integers only, never the update
    node = next(iter(apps._nodes.values()))
    shared = set(node.method.shared_names)
    for reply in grid.replies:
        names = {k for rec in reply.content.array_records.values() for k in rec}
        assert not names & shared
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    protocol = [r.content.config_records.get(RECORD_KEY_CONFIGS, {}) for r in grid.replies]
    masked = [c for c in protocol if Key.MASKED_PARAMETERS in c]
    assert len(masked) == 4 * len(records)


@pytest.mark.slow
def test_secure_aggregation_through_warm_workers(tiny_config, tmp_path):
    """SecAgg+ with the warm nodes' relay as the ClientApp: every stage's message goes to
    a real worker process per node and the protocol's state comes back in the context;
    the server ends with the in-process global state up to the quantisation (as above)."""
    common = {"method": {"name": "fedlr"}, "train.clients_per_round": 4, "train.rounds": 1}
    cfg = tiny_config(output_dir=str(tmp_path / "secure"), **common, **{"deploy.secure_aggregation": True})
    local_cfg = tiny_config(output_dir=str(tmp_path / "inproc"), **common)
    nodes = {100 + i: {"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(4)}
    grid = FakeGrid(relay.client_app, nodes, {"experiment": dump_config(cfg)})
    try:
        serve(grid)
    finally:  # the workers watch this test process's parent: stop them now
        for status in tmp_path.glob("node*/worker-*.json"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(json.loads(status.read_text())["pid"], signal.SIGKILL)
    run(local_cfg)
    secure_state = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    plain_state = torch.load(local_cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    for name, value in plain_state.items():  # the tolerance of the test above, and why
        torch.testing.assert_close(secure_state[name], value, atol=1e-5, rtol=0)
    records = read_records(cfg.output_dir)
    assert all(r["secure_aggregation"] and r["clients_returned"] == [0, 1, 2, 3] for r in records)
    assert len(list(tmp_path.glob("node*/worker-*.json"))) == 4


def test_secure_aggregation_refuses_other_aggregations(tiny_config, tmp_path):
    cfg = tiny_config(method={"name": "hetlora"}, **{"deploy.secure_aggregation": True})
    with pytest.raises(DeploymentError, match="example-weighted mean"):
        serve(deploy(cfg, tmp_path))


@pytest.mark.parametrize(
    "task",
    [
        pytest.param("causal_lm", marks=pytest.mark.slow),  # ~11 s; the slow tier deploys it for real too
        "token_classification",
        pytest.param("extractive_qa", marks=pytest.mark.slow),
    ],  # QA: 25-40 s
)
def test_every_task_deploys_with_the_in_process_metrics(tiny_config, tiny_decoder, tmp_path, task):
    """Instruction tuning (loss, perplexity, generation scores), NER (entity scores) and
    extractive QA (EM, F1) deployed: each node scores its own model with the task's
    scorer, the server the global model; every figure equals the in-process run's."""
    local_cfg = task_config(task, tiny_config, tiny_decoder, tmp_path, tmp_path / "inproc")
    flower_cfg = task_config(task, tiny_config, tiny_decoder, tmp_path, tmp_path / "flower")
    run(local_cfg)
    grid = deploy(flower_cfg, tmp_path)
    serve(grid)
    a, b = read_records(local_cfg.output_dir), read_records(flower_cfg.output_dir)
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b, strict=True):
        assert rb["clients"] == ra["clients"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["global"].keys() == ra["global"].keys() and ra["global"]
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-6, nan_ok=True)
        assert rb["local"] == pytest.approx(ra["local"], rel=1e-6, nan_ok=True)
        assert rb["payload_bytes_up"] == ra["bytes_up"] and rb["payload_bytes_down"] == ra["bytes_down"]
    assert all(r["dropped"] == {} for r in b if "dropped" in r)
    assert read_summary(flower_cfg.output_dir)["headline"] == read_summary(local_cfg.output_dir)["headline"]
