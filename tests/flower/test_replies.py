"""Trust nothing a node sends (issue 72): every malformed reply drops its client with a
one-line reason and the run goes on; a huge claimed uplink is refused before it is
allocated; one member cannot take the global model by its claimed size; a client id
stays with its authenticated node. All on the in-memory grid (tests/helpers/flower.py):
each deployment takes seconds."""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message, RecordDict

from fedpeft.flower import codec, members, replies
from fedpeft.flower.server import DeploymentError, FlowerServer
from fedpeft.report.results import read_records
from tests.helpers.flower import deploy, serve, wrapped_handler

pytestmark = pytest.mark.usefixtures("forget_nodes")  # tests/conftest.py

ONE_ROUND = {"method": {"name": "fedlr"}, "train.rounds": 1, "train.clients_per_round": 4}
TOPK = {"comm.uplink": {"codec": "topk", "fraction": 0.1}}
RANDK = {"comm.uplink": {"codec": "randk", "fraction": 0.1}}


def tampering(kind: str, change, clients=(0,)):
    """The ClientApp's ``kind`` handler, whose replies from ``clients`` pass through
    ``change(reply, message)`` (which edits the reply or returns another)."""

    def wrapper(real, message, context):
        reply = real(message, context)
        if context.node_config["partition-id"] in clients:
            reply = change(reply, message) or reply
        return reply

    return wrapped_handler(kind, wrapper)


def one_round(tiny_config, tmp_path, kind, change, clients=(0,), **over) -> dict:
    """A one-round deployment of four clients whose ``kind`` replies from ``clients`` are
    changed by ``change``; its record."""
    cfg = tiny_config(**{**ONE_ROUND, **over})
    grid = deploy(cfg, tmp_path)
    with tampering(kind, change, clients):
        serve(grid)
    (record,) = read_records(cfg.output_dir)
    return record


def edit_uplink(reply, edit) -> None:
    """Replace a training reply's update by ``edit(update)`` (the encoded tensors)."""
    update = codec.from_record(reply.content["uplink"])
    reply.content["uplink"] = codec.to_record(edit(update))


# ---------------------------------------------------------------- memory


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


@contextlib.contextmanager
def peak_growth():
    """How far this process's peak resident memory rose over the block, in bytes
    (``grew[0]``, set as the block ends): the peak (VmHWM) is reset first, through
    ``/proc/self/clear_refs``, so an earlier peak hides nothing."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak memory")
    before, grew = _status("VmRSS"), [0]
    try:
        yield grew
    finally:
        grew[0] = _status("VmHWM") - before


@pytest.fixture
def decoding_peak(monkeypatch) -> list[int]:
    """The largest rise of peak memory while the server reads one training reply
    (``replies.read_fit``) or decodes its update (``FlowerServer.uplink_of``), over a run."""
    peaks = [0]

    def measured(fn):
        def wrapper(*args, **kwargs):
            grew = [0]
            try:
                with peak_growth() as grew:
                    return fn(*args, **kwargs)
            finally:
                peaks[0] = max(peaks[0], grew[0])

        return wrapper

    monkeypatch.setattr(replies, "read_fit", measured(replies.read_fit))
    monkeypatch.setattr(FlowerServer, "uplink_of", measured(FlowerServer.uplink_of))
    return peaks


def test_the_memory_meter_sees_an_allocation():
    """The meter the huge-uplink tests rely on: 64 MB touched inside the block show."""
    with peak_growth() as grew:
        x = torch.ones(16 * 2**20)  # 64 MB
        del x
    assert grew[0] > 48 * 2**20


# ---------------------------------------------------------------- training replies


def test_a_fit_reply_without_time_fit_is_refused(tiny_config, tmp_path):
    def no_time(reply, message):
        del reply.content["fit"]["time_fit"]

    record = one_round(tiny_config, tmp_path, "train", no_time)
    assert record["dropped"] == {"0": "refused: fit metrics: 'time_fit' is missing"}
    assert record["clients_returned"] == [1, 2, 3] and "update_variation" in record


def test_an_infinite_example_count_is_refused(tiny_config, tmp_path):
    def infinite(reply, message):
        reply.content["fit"]["num_examples"] = float("inf")

    record = one_round(tiny_config, tmp_path, "train", infinite)
    assert record["dropped"] == {"0": "refused: num_examples is inf, not a whole number >= 1"}
    assert record["clients_returned"] == [1, 2, 3]


def test_zero_examples_from_every_client_skips_the_round(tiny_config, tmp_path):
    """Before: ZeroDivisionError in the round's weighted loss. Now every client is
    refused, the round is skipped (the global state kept) and the run completes."""

    def none(reply, message):
        reply.content["fit"]["num_examples"] = 0

    record = one_round(tiny_config, tmp_path, "train", none, clients=(0, 1, 2, 3))
    why = "refused: num_examples is 0, not a whole number >= 1"
    assert record["dropped"] == {str(c): why for c in range(4)}
    assert record["clients_returned"] == [] and record["skipped"] == "0 of deploy.min_results=1 updates"


def test_an_unknown_fit_metric_is_refused_by_name(tiny_config, tmp_path):
    def extra(reply, message):
        reply.content["fit"]["accuracy_on_my_secret_set"] = 1.0

    record = one_round(tiny_config, tmp_path, "train", extra)
    assert record["dropped"] == {"0": "refused: fit metrics: unknown metric 'accuracy_on_my_secret_set'"}
    assert record["clients_returned"] == [1, 2, 3]


def test_more_examples_than_the_roll_call_said_are_refused(tiny_config, tmp_path):
    def inflated(reply, message):
        reply.content["fit"]["num_examples"] = reply.content["fit"]["num_examples"] + 1

    cfg = tiny_config(**ONE_ROUND)
    grid = deploy(cfg, tmp_path)
    with tampering("train", inflated):
        serve(grid)
    (record,) = read_records(cfg.output_dir)
    rows = next(len(node.client.train) for node in _nodes() if node.cid == 0)
    assert record["dropped"] == {
        "0": f"refused: num_examples is {rows + 1}, more than the {rows} its node gave at the roll call"
    }
    assert record["clients_returned"] == [1, 2, 3]


@pytest.mark.parametrize(
    ("meta", "why"),
    [
        (lambda m: m.float(), "is torch.float32 (3,), not int32 [dtype code, *shape]"),
        (lambda m: torch.tensor([99, -4, 7], dtype=torch.int32), "[99, -4, 7] is no dtype code and shape"),
        (lambda m: torch.zeros(0, dtype=torch.int32), "is torch.int32 (0,), not int32 [dtype code, *shape]"),
    ],
    ids=["float", "garbage", "empty"],
)
def test_malformed_topk_metadata_is_refused(tiny_config, tmp_path, meta, why):
    """Before: a float ``#meta`` raised TypeError out of the server's decoding."""
    name = {}

    def bad_meta(reply, message):
        def edit(update):
            key = name["key"] = next(k for k, t in update.items() if k.endswith("#meta") and len(t) == 3)
            return {**update, key: meta(update[key])}

        edit_uplink(reply, edit)

    record = one_round(tiny_config, tmp_path, "train", bad_meta, **TOPK)
    tensor = name["key"].removesuffix("#meta")
    assert record["dropped"] == {"0": f"refused: update: {tensor}: its #meta {why}"}
    assert record["clients_returned"] == [1, 2, 3]


@pytest.mark.parametrize(
    ("over", "shape"), [(TOPK, (10000, 20000)), (RANDK, (5000, 10000))], ids=["topk", "randk"]
)
def test_a_huge_claimed_shape_is_refused_before_it_is_allocated(
    tiny_config, tmp_path, decoding_peak, over, shape
):
    """Before: topk decoded a (10000, 20000) claim at full size (+760 MB) before the
    shape check; randk (5000, 10000): +400 MB. Now the claim is checked against the
    expected update first, and reading every reply of the round raises the server's peak
    memory by far less than the claim (and by more than nothing the true update needs)."""
    name = {}

    def huge(reply, message):
        def edit(update):
            key = name["key"] = next(k for k, t in update.items() if k.endswith("#meta") and len(t) == 3)
            name["like"] = tuple(update[key][1:].tolist())
            return {**update, key: torch.tensor([0, *shape], dtype=torch.int32)}

        edit_uplink(reply, edit)

    record = one_round(tiny_config, tmp_path, "train", huge, **over)
    tensor = name["key"].removesuffix("#meta")
    assert record["dropped"] == {
        "0": f"refused: update: tensor {tensor!r} claims torch.float32 {shape}, "
        f"expected torch.float32 {name['like']}"
    }
    assert record["clients_returned"] == [1, 2, 3]
    claimed = 4 * np.prod(shape)
    true_uplink = record["payload_bytes_up"] // 3
    assert decoding_peak[0] < min(claimed / 20, 32 * 2**20), (decoding_peak[0], claimed, true_uplink)


def test_a_plain_uplink_far_larger_than_expected_is_refused_before_it_is_copied(
    tiny_config, tmp_path, decoding_peak
):
    """An uncompressed update padded with 32 MB: its packed bytes are compared with the
    most the expected update can take before anything is copied out of the message."""

    def padded(reply, message):
        edit_uplink(reply, lambda update: {**update, "padding": torch.zeros(8 * 2**20)})

    record = one_round(tiny_config, tmp_path, "train", padded)
    why = record["dropped"]["0"]
    assert re.fullmatch(r"refused: array 'packed': \d+ bytes, at most \d+ expected", why), why
    expected = int(why.split("at most ")[1].split()[0])
    assert expected < 2**20  # the tiny model's update (an uncompressed bound), far below the padding
    assert record["clients_returned"] == [1, 2, 3]
    assert decoding_peak[0] < 8 * 2**20, decoding_peak[0]


def test_an_npy_header_claiming_more_than_it_holds_is_refused():
    """A tensor record whose packed array's header claims 10 GB over 16 bytes: refused
    from the header, never allocated (``np.load`` would allocate the claim first)."""
    record = codec.to_record({"a": torch.ones(4)})
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (10**10,)})
    lying = Array("uint8", (10**10,), "numpy.ndarray", header.getvalue() + bytes(16))
    forged = ArrayRecord({codec.PACKED: lying, codec.INDEX: record[codec.INDEX]})
    refusal = pytest.raises(codec.ReplyError, match="declares 10000000000 bytes, it holds 16")
    with peak_growth() as grew, refusal:
        codec.from_record(forged)
    assert grew[0] < 2**20


# ---------------------------------------------------------------- roll call and evaluation


def test_a_roll_call_reply_without_node_ignores_that_node(tiny_config, tmp_path, capsys):
    """Before: KeyError. Now node 100 (client 0) is left out of every round it answers
    so, logged and recorded; the others train and evaluate."""
    cfg = tiny_config(**{**ONE_ROUND, "train.rounds": 2})
    grid = deploy(cfg, tmp_path)
    with tampering("query", lambda reply, message: Message(RecordDict({}), reply_to=message)):
        serve(grid)
    records = read_records(cfg.output_dir)
    why = "refused: roll-call reply: record 'node' is missing"
    assert [r["ignored_nodes"] for r in records] == [{"100": why}] * 2
    assert all(r["clients"] == [1, 2, 3] and r["clients_evaluated"] == 3 for r in records)
    out = capsys.readouterr().out
    assert "node 100's roll-call reply refused (roll-call reply: record 'node' is missing)" in out


def test_an_evaluation_reply_with_an_extra_metric_is_left_out(tiny_config, tmp_path):
    """Before: KeyError in the clients' spread of scores. Now client 0's scores are
    recorded as failed, with the metric named, and the means are of the other three."""

    def extra(reply, message):
        reply.content["local"]["bogus"] = 0.5

    record = one_round(tiny_config, tmp_path, "evaluate", extra)
    assert record["eval_failed"] == {"0": "refused: evaluation local: unknown metric 'bogus'"}
    assert record["clients_evaluated"] == 3 and "accuracy_mean" in record["local"]
    assert record["clients_returned"] == [0, 1, 2, 3]  # its training reply was fine


# ---------------------------------------------------------------- one member cannot take the model


def _nodes():
    from fedpeft.flower import apps

    return list(apps._nodes.values())


def poisoning(tiny_config, tmp_path, **over):
    """One round of four clients where client 0 says it holds 10**15 examples (at the
    roll call and in its training reply) and sends its update scaled by 1000. Returns
    the global tensors after the round, the honest clients' uplinks and sizes, and the
    attacker's uplink."""
    cfg = tiny_config(**{**ONE_ROUND, **over})
    honest, attack = {}, {}

    def big_roll_call(reply, message):
        reply.content["node"]["num_examples"] = 10**15

    def train(real, message, context):
        reply = real(message, context)
        update = codec.from_record(reply.content["uplink"])
        if context.node_config["partition-id"] != 0:
            honest[context.node_config["partition-id"]] = (update, int(reply.content["fit"]["num_examples"]))
            return reply
        received = codec.from_record(message.content["downlink"])
        attack.update({n: received[n] + 1000 * (t - received[n]) for n, t in update.items()})
        reply.content["uplink"] = codec.to_record(attack)
        reply.content["fit"]["num_examples"] = 1e15
        return reply

    grid = deploy(cfg, tmp_path)
    with tampering("query", big_roll_call), wrapped_handler("train", train):
        serve(grid)
    (record,) = read_records(cfg.output_dir)
    assert record["clients_returned"] == [0, 1, 2, 3] and "dropped" not in record
    tensors = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["tensors"]
    return tensors, honest, attack, record


def test_one_member_cannot_take_the_model_by_its_claimed_size(tiny_config, tmp_path):
    """With ``deploy.max_weight_share`` s the attacker's weight is lowered to s of the
    round: the global model is ``(1 - s)`` the honest clients' mean plus ``s`` its
    update, no more (without the cap its 10**15 examples made the global model its
    update). The honest clients keep their own weights (none is above s)."""
    share = 0.4
    tensors, honest, attack, record = poisoning(tiny_config, tmp_path, **{"deploy.max_weight_share": share})
    sizes = {c: n for c, (_, n) in honest.items()}
    total = sum(sizes.values())
    assert max(sizes.values()) / total * (1 - share) < share  # no honest client is capped
    cap = share * total / (1 - share)
    assert record["capped_weights"] == {"0": pytest.approx(cap)}
    for name, x_a in attack.items():
        mean = sum(u[name].double() * n for u, n in honest.values()) / total
        expected = (1 - share) * mean + share * x_a.double()
        assert torch.allclose(tensors[name].double(), expected, atol=1e-5), name
        # the bound: the global model moves from the honest mean by at most s of the attack
        reach = (x_a.double() - mean).abs()
        assert ((tensors[name].double() - mean).abs() <= share * reach + 1e-5).all(), name
    assert any((x_a.double() - tensors[n].double()).abs().max() > 1 for n, x_a in attack.items())


@pytest.mark.parametrize(
    "rule", [{"server.aggregation": "median"}, {"server.aggregation": "trimmed_mean", "server.trim": 0.25}],
    ids=["median", "trimmed_mean"],
)  # fmt: skip
def test_a_robust_rule_keeps_the_model_among_the_honest_updates(tiny_config, tmp_path, rule):
    """A coordinate-wise median (or a mean trimmed of one update at each end) of three
    honest updates and the attacker's lies between the honest ones, whatever the
    attacker claims or sends: near the honest clients' mean."""
    tensors, honest, attack, _ = poisoning(tiny_config, tmp_path, **rule)
    for name in attack:
        stacked = torch.stack([u[name].double() for u, _ in honest.values()])
        low, high, mean = stacked.min(0).values, stacked.max(0).values, stacked.mean(0)
        got = tensors[name].double()
        assert ((got >= low - 1e-6) & (got <= high + 1e-6)).all(), name
        assert ((got - mean).abs() <= (high - low) + 1e-6).all(), name


def test_capped_weights():
    assert replies.capped_weights([10, 20, 30], 1.0) == [10, 20, 30]
    capped = replies.capped_weights([10, 20, 30, 10**15], 0.4)
    assert capped[:3] == [10, 20, 30] and capped[3] == pytest.approx(0.4 * sum(capped))
    capped = replies.capped_weights([20, 30, 100, 10**15], 0.35)  # two lowered to one cap
    assert capped[:2] == [20, 30] and capped[2] == capped[3] == pytest.approx(0.35 * sum(capped))
    assert replies.capped_weights([10, 50, 60, 10**15], 0.3) == pytest.approx([10, 30, 30, 30])
    assert replies.capped_weights([10, 20], 0.4) == [10, 10]  # no cap holds two clients to 40%: equal


def test_secure_aggregation_refuses_a_weight_above_the_roll_call(tiny_config, tmp_path):
    """SecAgg+: client 0 claims 10**15 examples beside its masked update; its reply is
    refused as it arrives, so it counts as a node that dropped out, which the protocol
    recovers from: the round aggregates the other three."""

    def inflated(reply, message):
        if "fitres.num_examples" in reply.content.metric_records:  # the masked-vector stage
            reply.content.metric_records["fitres.num_examples"]["num_examples"] = 10**15

    record = one_round(tiny_config, tmp_path, "train", inflated, **{"deploy.secure_aggregation": True})
    assert record["clients_returned"] == [1, 2, 3] and "skipped" not in record
    assert re.fullmatch(r"refused: num_examples is 1000000000000000, more than the \d+ its node gave at "
                        r"the roll call", record["dropped"]["0"])  # fmt: skip


def test_secure_aggregation_refuses_a_setup_reply_without_its_keys(tiny_config, tmp_path):
    """Before: KeyError in Flower's workflow, out of the server. Now client 0's reply is
    refused at the first stage. Flower's SecAgg+ recovers from a node that drops out at
    the masked-vector stage only: one gone earlier fails the round's protocol (here the
    other nodes' unmasking raises, which the in-memory grid hands to the server). The
    round is then recorded with every client dropped and why, and the run goes on."""

    def keyless(reply, message):
        configs = reply.content.config_records.get("secaggplus_configs", {})
        if "pk1" in configs:
            del configs["pk1"]

    over = {"deploy.secure_aggregation": True}
    record = one_round(tiny_config, tmp_path, "train", keyless, **over)
    assert record["dropped"]["0"] == "refused: SecAgg+ setup reply: pk1 is not bytes"
    assert all(record["dropped"][str(c)].startswith("SecAgg+ failed: ") for c in (1, 2, 3))
    assert record["skipped"] == "0 of deploy.min_results=1 updates"


def test_secure_aggregation_refuses_a_weight_share_cap(tiny_config, tmp_path):
    cfg = tiny_config(**{**ONE_ROUND, "deploy.secure_aggregation": True, "deploy.max_weight_share": 0.5})
    with pytest.raises(DeploymentError, match="deploy.max_weight_share 0.5: under deploy.secure_aggregation"):
        serve(deploy(cfg, tmp_path))


# ---------------------------------------------------------------- a client id bound to its node


def with_a_second_node_for_client_0(cfg, tmp_path):
    """The fake federation of ``cfg`` and a node 200 that also says it is client 0."""
    grid = deploy(cfg, tmp_path)
    grid.contexts[200] = grid.context(200, {"partition-id": 0, "state-dir": str(tmp_path / "impostor")})
    return grid


def trained_by(grid, cid_node: int) -> list[tuple[int, int]]:
    """(round, node) of every training message sent to node ``cid_node`` or 200."""
    return [(m.content["config"]["round"], m.metadata.dst_node_id) for m in grid.sent
            if m.metadata.message_type == "train" and m.metadata.dst_node_id in (cid_node, 200)]  # fmt: skip


def test_without_authentication_a_new_node_replaces_the_old_one(tiny_config, tmp_path, monkeypatch, capsys):
    """Today's behaviour, kept: without SuperNode authentication node ids change when a
    node restarts, so the last node to claim a client id holds it."""
    monkeypatch.delenv(members.NODE_AUTH_ENV, raising=False)
    cfg = tiny_config(**ONE_ROUND)
    grid = with_a_second_node_for_client_0(cfg, tmp_path)
    serve(grid)
    assert "node 200 replaces node 100 as client 0" in capsys.readouterr().out
    assert trained_by(grid, 100) == [(1, 200)]


def test_with_authentication_a_client_id_stays_with_its_first_node(
    tiny_config, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv(members.NODE_AUTH_ENV, "1")
    monkeypatch.setenv(members.ASSIGNMENTS_ENV, str(tmp_path / "clients.json"))  # none yet
    cfg = tiny_config(**{**ONE_ROUND, "train.rounds": 2})
    grid = with_a_second_node_for_client_0(cfg, tmp_path)
    serve(grid)
    why = "node 200 claims client 0, held by node 100 (its enrolled key); refused"
    assert why in capsys.readouterr().out
    records = read_records(cfg.output_dir)
    assert [r["ignored_nodes"] for r in records] == [{"200": why}] * 2  # asked again, refused again
    assert trained_by(grid, 100) == [(1, 100), (2, 100)]
    extras = torch.load(cfg.output_dir / "checkpoint.pt", weights_only=True)["server"]["extras"]
    assert members.bindings_of(extras) == {0: 100, 1: 101, 2: 102, 3: 103}


def test_an_operator_assignment_moves_a_client_id(tiny_config, tmp_path, monkeypatch, capsys):
    """``fedpeft enrol KEY --client 0`` writes the assignment; read at each roll call, it
    moves client 0 to node 200 from the next round on."""
    assignments = tmp_path / "clients.json"
    monkeypatch.setenv(members.NODE_AUTH_ENV, "1")
    monkeypatch.setenv(members.ASSIGNMENTS_ENV, str(assignments))
    cfg = tiny_config(**{**ONE_ROUND, "train.rounds": 2})
    grid = with_a_second_node_for_client_0(cfg, tmp_path)

    def assign_after_round_1(reply, message):
        if message.content["config"]["round"] == 1:
            assignments.write_text(json.dumps({"0": 200}))

    with tampering("evaluate", assign_after_round_1):
        serve(grid)
    out = capsys.readouterr().out
    assert "round 2: client 0 moves from node 100 to node 200 (the operator's assignment)" in out
    assert trained_by(grid, 100) == [(1, 100), (2, 200)]
    records = read_records(cfg.output_dir)
    assert "ignored_nodes" not in records[1] or "200" not in records[1]["ignored_nodes"]


def stopped_in_round_2(tiny_config, tmp_path):
    """A 3-round run whose round 2 is skipped (every update fails) and which then stops
    (``deploy.max_skipped_rounds: 1``), ready to resume: its config and grid."""
    cfg = tiny_config(**{**ONE_ROUND, "train.rounds": 3, "deploy.max_skipped_rounds": 1})
    grid = deploy(cfg, tmp_path)
    grid.faults = lambda node, m: (
        "error" if m.metadata.message_type == "train" and m.content["config"]["round"] == 2 else None
    )
    with pytest.raises(DeploymentError, match="1 consecutive rounds skipped"):
        serve(grid)
    grid.faults = lambda node, m: None
    return cfg, grid


def test_a_resumed_run_keeps_who_holds_a_client_id(tiny_config, tmp_path, monkeypatch, capsys):
    """Round 2 is skipped (every update fails) and the run stops; it resumes with node
    100 offline and node 200 claiming client 0: refused, since the server state says
    node 100 holds it (a server that forgot would give it to the first claimant)."""
    monkeypatch.setenv(members.NODE_AUTH_ENV, "1")
    monkeypatch.delenv(members.ASSIGNMENTS_ENV, raising=False)
    cfg, grid = stopped_in_round_2(tiny_config, tmp_path)
    del grid.contexts[100]
    grid.contexts[200] = grid.context(200, {"partition-id": 0, "state-dir": str(tmp_path / "impostor")})
    capsys.readouterr()
    serve(grid, resume=True)
    assert "node 200 claims client 0, held by node 100 (its enrolled key); refused" in capsys.readouterr().out
    last = read_records(cfg.output_dir)[-1]
    assert last["round"] == 3 and last["clients"] == [1, 2, 3]


def test_a_key_enrolled_anew_keeps_its_client_id_under_its_new_node_id(
    tiny_config, tmp_path, monkeypatch, capsys
):
    """A client id is held by the node's key, not its node id: ``fedpeft serve`` starts a
    SuperLink per run, so a resumed run's nodes come back under new node ids for the same
    keys (``nodes.json``, written by ``fedpeft enrol``). Client 0's key, back as node 300,
    keeps client 0; node 200, another key, is refused; without the key on record the new
    node id would be a stranger to the binding."""
    from fedpeft.flower import control
    from fedpeft.flower.certs import make_node_keys

    keys = make_node_keys(tmp_path / "keys", range(5))  # 0..3: clients 0..3; 4: the impostor
    nodes = tmp_path / "nodes.json"
    fingerprints = {i: control.fingerprint(public) for i, (_, public) in keys.items()}
    assert len(set(fingerprints.values())) == 5
    nodes.write_text(json.dumps({str(100 + i): fingerprints[i] for i in range(4)} | {"200": fingerprints[4]}))
    monkeypatch.setenv(members.NODE_AUTH_ENV, "1")
    monkeypatch.setenv(members.NODE_KEYS_ENV, str(nodes))
    monkeypatch.delenv(members.ASSIGNMENTS_ENV, raising=False)
    cfg, grid = stopped_in_round_2(tiny_config, tmp_path)
    # a new SuperLink: client 0's key enrolled again as node 300, the impostor as 200
    state_0 = grid.contexts.pop(100).node_config
    grid.contexts[300] = grid.context(300, state_0)
    grid.contexts[200] = grid.context(200, {"partition-id": 0, "state-dir": str(tmp_path / "impostor")})
    nodes.write_text(json.dumps({**json.loads(nodes.read_text()), "300": fingerprints[0]}))
    capsys.readouterr()
    serve(grid, resume=True)
    out = capsys.readouterr().out
    assert "node 200 claims client 0, held by node 300 (its enrolled key); refused" in out
    assert trained_by(grid, 300) == [(3, 300)]
    assert read_records(cfg.output_dir)[-1]["clients"] == [0, 1, 2, 3]
