"""Real Flower deployments on loopback: a SuperLink and three SuperNodes as processes.

Same seed, same results: every node builds the same model with the same seeded
construction, trains with the same per-(seed, round, client) generators and a single
torch thread, tensors cross as exact float32 arrays and the server aggregates in
float64 as in-process. So the metrics should agree to float rounding; the tolerance
(relative 1e-6) only allows for that, and in practice they are identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from fedpeft.experiment import run
from fedpeft.flower import deploy
from fedpeft.flower.certs import make_certificates
from fedpeft.report.results import read_records, read_summary
from tests.helpers.configs import PF2, SMALL

# one SuperLink federation per module: its tests stay on one xdist worker (scripts/test.sh)
pytestmark = [pytest.mark.deploy, pytest.mark.xdist_group("flower_deploy")]


#: a deployed run's limit: about 2 min alone, but the slow tier runs beside another test on
#: two cores (a SuperLink, three SuperNodes and their workers share them)
TIMEOUT = 900


def submit(fed: deploy.Federation, cfg, workdir: Path, **kw) -> dict:
    """``deploy.submit`` on ``fed``; a failure quotes the federation's logs."""
    try:
        return deploy.submit(
            cfg, fed.address, workdir=workdir, tls=fed.tls, timeout=TIMEOUT, echo=False, **kw
        )
    except deploy.DeployError as err:
        raise deploy.DeployError(f"{err}\n{fed.log_tails()}") from err


@pytest.fixture(scope="module")
def tls_federation(tmp_path_factory):
    """Three SuperNodes behind a TLS SuperLink (certificates from a fresh local CA)."""
    work = tmp_path_factory.mktemp("federation")
    paths = make_certificates(work / "certs", ["127.0.0.1", "localhost"])
    tls = deploy.Tls(paths["ca.crt"], paths["server.pem"], paths["server.key"])
    with deploy.local_federation(work, 3, tls=tls) as fed:
        yield fed


# PF2LoRA: shared and personal state both cross the deployment (FedLR's shared-only case
# is covered against the in-process engine by tests/flower/test_bridge.py).
@pytest.mark.slow  # about 75 s (a SuperLink and three SuperNodes); keeps the default tier under 10 min
@pytest.mark.parametrize("method", [PF2], ids=["pf2lora"])
def test_deployment_matches_in_process(tiny_config, tmp_path, tls_federation, method):
    flower_cfg = tiny_config(method=method, output_dir=str(tmp_path / "flower"), **SMALL)
    local_cfg = tiny_config(method=method, output_dir=str(tmp_path / "inproc"), **SMALL)
    status = submit(tls_federation, flower_cfg, tmp_path / "submit")
    assert status["status"] == "finished:completed"
    run(local_cfg)
    a, b = read_records(local_cfg.output_dir), read_records(flower_cfg.output_dir)
    assert [r["clients"] for r in b] == [r["clients"] for r in a]
    assert all("dropped" not in r for r in b)
    for key in ("global", "local"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-6)
    assert b[-1]["loss"] == pytest.approx(a[-1]["loss"], rel=1e-6)
    # the same tensors were accounted; Flower's serialisation adds its framing on top
    assert sum(r["payload_bytes_up"] for r in b) == sum(r["bytes_up"] for r in a)
    assert sum(r["bytes_up"] for r in b) > sum(r["bytes_up"] for r in a)
    # and the SuperLink saw at least those bytes cross (it counts its own protocol too)
    traffic = status["network-traffic"]
    assert traffic["inbound-bytes"] >= sum(r["bytes_up"] for r in b)
    assert read_summary(flower_cfg.output_dir)["engine"] == "flower"
    # warm nodes: each node's worker built its model once and handled every message of the
    # run (a roll call, a training message a round, an evaluation), in the worker's one life,
    # each handed over by a ClientApp process forked from the SuperExec's fork server
    for cid in range(3):
        worker = worker_status(tls_federation, cid)
        assert worker["starts"] == 1 and worker["models_built"] == 1, worker
        assert worker["messages"] >= 1 + 2 + 1 and worker["handling"] is None, worker
        assert worker["messages_forked"] == worker["messages"], worker


def worker_status(fed, cid: int) -> dict:
    return json.loads((fed.workdir / f"node-{cid}" / f"worker-{cid}.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("task", ["causal_lm", "token_classification", "extractive_qa"])
def test_every_task_deployed_matches_in_process(tiny_config, tiny_decoder, tmp_path, tls_federation, task):
    """Instruction tuning, NER and extractive QA on the real SuperLink and three SuperNodes:
    the in-process figures, to the classification test's tolerance."""
    from tests.helpers.configs import task_config

    runs = {e: task_config(task, tiny_config, tiny_decoder, tmp_path, tmp_path / e, **SMALL)
            for e in ("flower", "inproc")}  # fmt: skip
    status = submit(tls_federation, runs["flower"], tmp_path / "submit")
    assert status["status"] == "finished:completed"
    run(runs["inproc"])
    a, b = read_records(runs["inproc"].output_dir), read_records(runs["flower"].output_dir)
    assert [r["clients"] for r in b] == [r["clients"] for r in a]
    assert all("dropped" not in r for r in b)
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        for key in [k for k in ("global", "local") if k in ra]:  # scored every eval.every rounds
            assert rb[key].keys() == ra[key].keys()
            assert rb[key] == pytest.approx(ra[key], rel=1e-6, nan_ok=True)
        assert rb["payload_bytes_up"] == ra["bytes_up"]
    assert "global" in a[-1] and "local" in a[-1]


@pytest.mark.slow
def test_only_enrolled_nodes_join_and_a_revoked_one_is_refused(tiny_config, tmp_path):
    """A TLS SuperLink admits enrolled nodes only: a node with a key it never enrolled is
    refused at once (one line, non-zero exit: ``fedpeft join``), the three enrolled ones
    train; client 2's node, revoked after round 1, is refused from then on and the run
    completes with the other two."""
    import subprocess
    import sys
    import threading
    import time

    from fedpeft.flower.certs import make_node_keys

    paths = make_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    tls = deploy.Tls(paths["ca.crt"], paths["server.pem"], paths["server.key"])
    cfg = tiny_config(**{**SMALL, "train.rounds": 5, "eval.every": 1, "deploy.min_results": 2,
                         "deploy.round_timeout": 60}, output_dir=str(tmp_path / "run"))  # fmt: skip
    with deploy.local_federation(tmp_path / "fed", 3, tls=tls) as fed:
        assert sorted(fed.enrolled) == [0, 1, 2]
        stranger = make_node_keys(tmp_path / "stranger", [0])[0][0]
        fedpeft = str(Path(sys.executable).parent / "fedpeft")
        refused = subprocess.run(
            [fedpeft, "join", "--superlink", fed.address, "--ca", str(tls.ca), "--key", str(stranger),
             "--partition-id", "0", "--state-dir", str(tmp_path / "stranger-node"), "--max-wait", "30"],
            capture_output=True, text=True, timeout=300,  # a loaded machine starts each try slowly
        )  # fmt: skip
        assert refused.returncode != 0
        assert "refused this node" in refused.stdout + refused.stderr
        assert "Exit Code" not in refused.stdout + refused.stderr

        metrics = Path(cfg.output_dir) / "metrics.jsonl"
        finished_at_revocation: list[int] = []

        def revoke_after_round_1() -> None:
            while not (metrics.is_file() and metrics.read_text().count("\n") >= 1):
                time.sleep(0.5)
            fed.revoke(2)
            # the rounds recorded once the revocation is in force (round 2's training message
            # may already be on node 2 by then: a round under way when its node is revoked
            # may still get its reply)
            finished_at_revocation.append(metrics.read_text().count("\n"))

        revoker = threading.Thread(target=revoke_after_round_1, daemon=True)
        revoker.start()
        status = submit(fed, cfg, tmp_path / "submit")
        revoker.join(5)
        assert status["status"] == "finished:completed"
        assert not list((tmp_path / "submit").rglob("credentials.yaml"))  # no operator token left behind
        records = read_records(cfg.output_dir)
        assert len(records) == 5
        assert 2 in records[0]["clients"]
        # every round that started after the revocation took effect went on without node 2:
        # round finished + 1 may have been under way, so the rounds from finished + 2 on (warm
        # nodes run a round in seconds, about as long as the `flwr` call that revokes: 5 rounds)
        (finished,) = finished_at_revocation
        assert finished <= 3, "the revocation came too late to test a round after it"
        later = records[finished + 1 :]
        assert later and all(2 not in r.get("clients_returned", r["clients"]) for r in later)
        assert all(r["nodes"] == 2 for r in later)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_loses_no_round(tiny_config, tmp_path):
    """Client 0's worker is killed (SIGKILL) while it trains round 2: the node's next
    attempt starts a new worker from the state directory and sends the message again, so
    every round has every client and the run ends as an uninterrupted one. Each worker
    builds its model once: the model is not rebuilt per message."""
    over = {**SMALL, "train.rounds": 3, "eval.every": 3}
    flower_cfg = tiny_config(output_dir=str(tmp_path / "flower"), **over)
    local_cfg = tiny_config(output_dir=str(tmp_path / "inproc"), **over)
    killed: list[int] = []
    with deploy.local_federation(tmp_path / "fed", 3) as fed:

        def kill_in_round_2() -> None:
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                with contextlib.suppress(FileNotFoundError, ValueError):
                    worker = worker_status(fed, 0)
                    if worker["messages"] >= 2 and worker["handling"] == "train":  # roll call, round 1 done
                        os.kill(worker["pid"], signal.SIGKILL)
                        killed.append(worker["pid"])
                        return
                time.sleep(0.01)

        killer = threading.Thread(target=kill_in_round_2, daemon=True)
        killer.start()
        status = submit(fed, flower_cfg, tmp_path / "submit")
        killer.join(1)
        statuses = {cid: worker_status(fed, cid) for cid in range(3)}
    assert status["status"] == "finished:completed" and killed
    assert statuses[0]["starts"] == 2 and statuses[0]["pid"] != killed[0]
    assert all(statuses[c]["starts"] == 1 for c in (1, 2))
    assert all(s["models_built"] == 1 for s in statuses.values()), statuses
    run(local_cfg)
    a, b = read_records(local_cfg.output_dir), read_records(flower_cfg.output_dir)
    assert [r["clients_returned"] for r in b] == [r["clients"] for r in a]
    assert all("dropped" not in r for r in b)
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
    assert b[-1]["global"] == pytest.approx(a[-1]["global"], rel=1e-6)
    assert b[-1]["local"] == pytest.approx(a[-1]["local"], rel=1e-6)
