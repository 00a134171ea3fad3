"""Experiment trackers (``log.to``): TensorBoard's event files and MLflow's run, read back
with the libraries' own readers, hold every round's numbers and the config; a resumed run
continues the same tracked run; a missing package names its extra."""

import json
import struct
import sys

import mlflow
import pytest
import wandb
from tensorboard.backend.event_processing import event_accumulator

from fedpeft.config import ConfigError
from fedpeft.experiment import build, run
from fedpeft.report.results import read_records
from fedpeft.report.tracking import Tracking, flat_config, scalars
from tests.helpers.runs import Killed, die_on_fit


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_run(run_dir):
    state = json.loads((run_dir / "tracking.json").read_text())["mlflow"]
    client = mlflow.MlflowClient(tracking_uri=state["tracking_uri"])
    return client, client.get_run(state["run_id"])


def test_scalars_take_every_number_a_round_has_and_no_per_client_values():
    record = {
        "round": 3,
        "clients": [0, 2],
        "loss": 0.5,
        "global": {"accuracy": 0.75, "macro_f1": 0.5},
        "local": {"accuracy_mean": 0.7, "accuracy_std": 0.1, "accuracy_p10": 0.6},
        "local_by_client": {"0": {"accuracy": 0.7}},
        "drift": {"mean": 0.4, "min": 0.2, "clients": {"0": 0.2, "2": 0.6}},
        "privacy": {"epsilon": 1.5, "delta": 1e-5},
        "update_variation": {"0.query.A": [0.1, 0.2]},
        "bytes_up": 100,
        "time_train": 1.25,
        "nan_score": float("nan"),
        "diverged": False,
    }
    assert scalars(record) == {
        "loss": 0.5,
        "global/accuracy": 0.75,
        "global/macro_f1": 0.5,
        "local/accuracy_mean": 0.7,
        "local/accuracy_std": 0.1,
        "local/accuracy_p10": 0.6,
        "drift/mean": 0.4,
        "drift/min": 0.2,
        "privacy/epsilon": 1.5,
        "privacy/delta": 1e-5,
        "bytes_up": 100.0,
        "time_train": 1.25,
    }


def test_a_run_and_its_resume_log_every_round_once_to_tensorboard_and_mlflow(tiny_config):
    """Killed in round 3, then resumed: one tracked run holds rounds 1-4 once each, the
    numbers of metrics.jsonl, and the config as params."""
    cfg = tiny_config(**{"train.rounds": 4, "log.to": ["tensorboard", "mlflow"]})
    setup = build(cfg)
    die_on_fit(setup)  # in round 3
    with pytest.raises(Killed):
        run(cfg, setup=setup)
    client, first = mlflow_run(cfg.output_dir)
    assert first.info.status == "FAILED"

    run(cfg, resume=True)
    out, records = cfg.output_dir, read_records(cfg.output_dir)
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    client, tracked = mlflow_run(out)
    assert tracked.info.run_id == first.info.run_id and tracked.info.status == "FINISHED"
    experiment = client.get_experiment_by_name(cfg.log.mlflow_experiment)
    assert len(client.search_runs([experiment.experiment_id])) == 1  # no second tracked run
    tb = tensorboard_scalars(out)
    for key in ("loss", "global/accuracy", "local/accuracy_mean", "local/accuracy_p10", "cum_bytes"):
        expected = [(r["round"], pytest.approx(scalars(r)[key], rel=1e-6)) for r in records]
        assert tb[key] == expected, key
        history = sorted((m.step, m.value) for m in client.get_metric_history(tracked.info.run_id, key))
        assert history == expected, key
    assert set(tb) == set().union(*(scalars(r) for r in records))

    params = tracked.data.params
    assert params["train.lr"] == str(cfg.train.lr) and params["method.name"] == "fedlr"
    assert params.keys() == flat_config(cfg).keys()
    assert tracked.info.run_name == cfg.name
    texts = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={"tensors": 0})
    texts.Reload()
    assert any("config" in tag for tag in texts.Tags()["tensors"])


def test_tensorboard_drops_the_rounds_after_the_checkpoint_a_run_resumes_from(tiny_config):
    """Rounds logged by an interrupted run but not checkpointed are replaced, not doubled."""
    cfg = tiny_config(**{"log.to": ["tensorboard", "mlflow"]})
    records = [{"round": r, "loss": float(r)} for r in (1, 2, 3)]
    with Tracking(cfg, resume=False) as tracking:
        tracking.start([])
        for record in records:
            tracking.round(record)
    with Tracking(cfg, resume=True) as tracking:
        tracking.start(records[:1])  # the checkpoint held round 1 only
        tracking.round({"round": 2, "loss": 20.0})
        tracking.round({"round": 3, "loss": 30.0})
        tracking.round({"round": 4, "loss": 40.0})
    assert tensorboard_scalars(cfg.output_dir)["loss"] == [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]
    # MLflow keeps what it was sent: the rounds it held are not sent again
    client, tracked = mlflow_run(cfg.output_dir)
    history = sorted((m.step, m.value) for m in client.get_metric_history(tracked.info.run_id, "loss"))
    assert history == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_a_fresh_run_in_the_same_directory_is_a_new_tracked_run(tiny_config):
    cfg = tiny_config(**{"log.to": ["tensorboard", "mlflow"]})
    for loss in (1.0, 2.0):
        with Tracking(cfg, resume=False) as tracking:
            tracking.start([])
            tracking.round({"round": 1, "loss": loss})
    assert tensorboard_scalars(cfg.output_dir)["loss"] == [(1, 2.0)]
    client, tracked = mlflow_run(cfg.output_dir)
    experiment = client.get_experiment_by_name(cfg.log.mlflow_experiment)
    assert len(client.search_runs([experiment.experiment_id])) == 2


def wandb_history(path) -> list[dict]:
    """The rows a W&B run file (``run-<id>.wandb``) holds: LevelDB's log format (a 7-byte
    header, then 32 KiB blocks of chunks: crc, length, type), each record one of W&B's
    protobuf ``Record``s."""
    from wandb.proto import wandb_internal_pb2

    data, pos, block, chunks, rows = path.read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's zero-filled tail
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record.FromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
    return rows


def started(run_file) -> tuple[str, int]:
    """Order W&B run files by their run's start: ``offline-run-<time>-<id>``, and a
    second run of the same id in the same second ``...-<id>-1`` (which sorts first by name)."""
    _, _, time, _, *again = run_file.parent.name.split("-")
    return time, int(again[0]) if again else 0


def test_wandb_logs_offline_and_a_resume_continues_its_run(tiny_config):
    cfg = tiny_config(**{"log.to": ["wandb"]})
    with Tracking(cfg, resume=False) as tracking:
        tracking.start([])
        tracking.round({"round": 1, "loss": 1.0, "global": {"accuracy": 0.5}})
        tracking.round({"round": 2, "loss": 0.5, "global": {"accuracy": 0.6}})
    run_id = json.loads((cfg.output_dir / "tracking.json").read_text())["wandb"]["run_id"]
    with Tracking(cfg, resume=True) as tracking:
        tracking.start([{"round": 1}])  # round 2 is repeated: W&B holds it already
        tracking.round({"round": 2, "loss": 0.5, "global": {"accuracy": 0.6}})
        tracking.round({"round": 3, "loss": 0.25, "global": {"accuracy": 0.7}})
    # ``finish`` returns before W&B's service has surely written the run's last records
    # (a CI run once read a file without round 3); ``teardown`` waits for the service.
    wandb.teardown()
    files = sorted((cfg.output_dir / "wandb").glob("offline-run-*/run-*.wandb"), key=started)
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # one W&B run, resumed
    rows = [row for f in files for row in wandb_history(f)]
    assert [(r["_step"], r["loss"], r["global/accuracy"]) for r in rows] == [
        (1, 1, 0.5),
        (2, 0.5, 0.6),
        (3, 0.25, 0.7),
    ]


def test_a_missing_tracker_package_names_its_extra(tiny_config, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    cfg = tiny_config(**{"log.to": ["wandb"]})
    with pytest.raises(ConfigError, match=r"log.to wandb: .*pip install 'fedpeft\[wandb\]'"):
        run(cfg)
    assert not cfg.output_dir.exists()  # refused before anything ran


def test_log_to_names_each_tracker_once(tiny_config):
    with pytest.raises(ValueError, match="names a tracker twice"):
        tiny_config(**{"log.to": ["mlflow", "mlflow"]})


def test_the_flower_engine_logs_on_the_server(tiny_config, tmp_path):
    """A deployed run (on the in-memory grid of tests/helpers/flower.py) is tracked by its
    ServerApp: every round's numbers, as its metrics.jsonl has them."""
    from flwr.app import Context, RecordDict

    from fedpeft.config import dump_config
    from fedpeft.flower import apps
    from tests.helpers.flower import FakeGrid

    cfg = tiny_config(**{"log.to": ["tensorboard"]})
    nodes = {100 + i: {"partition-id": i, "state-dir": str(tmp_path / f"node{i}")} for i in range(4)}
    grid = FakeGrid(apps.client_app, nodes, {"experiment": dump_config(cfg)})
    try:
        apps.server_app(grid, Context(7, 0, {}, RecordDict(), grid.run_config))
    finally:
        apps._nodes.clear()
    records = read_records(cfg.output_dir)
    assert [r["round"] for r in records] == list(range(1, cfg.train.rounds + 1))
    tb = tensorboard_scalars(cfg.output_dir)
    assert tb["global/accuracy"] == [(r["round"], pytest.approx(r["global"]["accuracy"])) for r in records]
    assert tb["bytes_up"] == [(r["round"], r["bytes_up"]) for r in records]
    # each client's own final scores, as in-process
    assert len(records[-1]["local_by_client"]) == cfg.partition.num_clients
