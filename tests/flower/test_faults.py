"""A SuperNode killed mid-round: the round completes without it and it rejoins later.

Its own module (and so, under pytest-xdist's loadscope, its own worker): it waits about
a minute for the dead node's heartbeats to lapse, which should not queue behind the
module that compares deployments with in-process runs.
"""

from __future__ import annotations

import json
import threading
import time

import pytest

from fedpeft.flower import deploy
from fedpeft.report.results import read_records
from tests.helpers.configs import PF2, SMALL

# one SuperLink federation per module: its tests stay on one xdist worker (scripts/test.sh)
pytestmark = [pytest.mark.deploy, pytest.mark.xdist_group("flower_faults")]


@pytest.mark.slow  # close to three minutes (a dead node is dropped once its heartbeats lapse)
def test_node_killed_mid_round(tiny_config, tmp_path):
    """Client 2's SuperNode is killed while round 2 runs: the round completes with the
    other two and records the drop; a new SuperNode for client 2 rejoins in round 3."""
    cfg = tiny_config(
        method=PF2,
        output_dir=str(tmp_path / "flower"),
        # a generous timeout: the dead node is dropped once its heartbeats lapse (about a
        # minute), and a slow machine must not drop the healthy ones
        **{**SMALL, "train.rounds": 3, "eval.every": 3, "deploy.round_timeout": 300},
    )
    with deploy.local_federation(tmp_path / "fed", 3) as fed:
        caught = threading.Event()

        def saboteur():
            """Kill node 2 while its worker holds round 2's training message (it has pulled
            it: a node started in its place cannot answer it), and start a new one at once."""
            metrics = cfg.output_dir / "metrics.jsonl"
            status = tmp_path / "fed" / "node-2" / "worker-2.json"
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                if metrics.is_file() and metrics.read_text().count("\n") >= 1:  # round 1 recorded
                    try:
                        worker = json.loads(status.read_text())
                    except (OSError, json.JSONDecodeError):  # mid-replace
                        worker = {}
                    if worker.get("handling") == "train":
                        fed.kill_node(2)
                        fed.start_node(2, state_dir=tmp_path / "fed" / "node-2")  # same disk
                        caught.set()
                        return
                time.sleep(0.005)

        thread = threading.Thread(target=saboteur, daemon=True)
        thread.start()
        status = deploy.submit(cfg, fed.address, workdir=tmp_path / "submit", timeout=900, echo=False)
        thread.join()
    assert caught.is_set(), "node 2 was never seen holding round 2's training message"
    assert status["status"] == "finished:completed"
    records = read_records(cfg.output_dir)
    assert len(records) == 3
    assert "2" in records[1]["dropped"]
    assert 2 not in records[1]["clients_returned"]
    assert records[1]["clients_returned"] == [0, 1]  # the round went on with the others
    assert 2 in records[2]["clients_returned"]  # the restarted node rejoined
    assert records[-1]["local"]["accuracy_mean"] >= 0
