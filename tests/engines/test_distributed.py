"""Rounds over torch.distributed ranks (``fedpeft run --nproc``; gloo on the CPU): the
records of a run over 2 ranks are one process's, and a run resumes with another number
of ranks (fedpeft.engines.distributed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from fedpeft.config import dump_config
from fedpeft.engines.distributed import backend, shares, summable
from fedpeft.engines.store import ClientStore
from fedpeft.experiment import run
from fedpeft.methods import REGISTRY, build_method
from fedpeft.report.results import read_records
from tests.helpers.configs import SCAFFOLD, USER_DP, task_config
from tests.helpers.ranks_batch import launch_batch

#: what a round records that depends on the machine, not on the run
TIMED = ("time_", "setup", "memory")


def written(cfg) -> Path:
    """``cfg`` written beside its output (``OUTPUT_DIR.yaml``)."""
    path = Path(cfg.output_dir).with_suffix(".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(cfg))
    return path


def fedpeft_run(cfg, nproc: int, *flags: str) -> subprocess.CompletedProcess:
    """``fedpeft run CONFIG --nproc N``, as a user runs it (``cfg`` written beside its output)."""
    path = written(cfg)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "fedpeft", "run", str(path), "--nproc", str(nproc), *flags]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)


def comparable(record: dict) -> dict:
    """A round's record less its timings (and a client's time per step)."""
    out = {k: v for k, v in record.items() if not k.startswith(TIMED)}
    out["fit"] = {k: v for k, v in out.get("fit", {}).items() if not k.startswith("time_")}
    return out


def assert_same_records(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert_close(comparable(a), comparable(b), f"round {b['round']}")


def assert_close(got, want, where: str) -> None:
    """Equal structure, numbers to float tolerance (a sum's order may differ in the last bit)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), (where, sorted(got), sorted(want))
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7, nan_ok=True), where
    else:
        assert got == want, where


#: the runs checked over ranks: three rounds of 4 of 6 clients
RANKED = {"train.rounds": 3, "partition.num_clients": 6, "train.clients_per_round": 4}


def assert_ranks_give_one_processs_records(tiny_config, tmp_path, **over) -> list[dict]:
    """The records of a run over 2 ranks, once checked against one process's."""
    extra = {**RANKED, **over}
    alone = tiny_config(output_dir=str(tmp_path / "alone"), **extra)
    ranked = tiny_config(output_dir=str(tmp_path / "ranked"), **extra)
    run(alone)
    done = fedpeft_run(ranked, 2)
    assert done.returncode == 0, done.stdout + done.stderr
    records = read_records(ranked.output_dir)
    assert_same_records(records, read_records(alone.output_dir))
    return records


DRIFT = {"eval.drift": True, "eval.drift_probe": 16}


@pytest.mark.parametrize(("over", "summed"), [(DRIFT, 1.0), (USER_DP, 0.0)], ids=["fedlr-drift", "user-dp"])
def test_two_ranks_give_one_processs_records(tiny_config, tmp_path, over, summed):
    """Every record alike: FedLR's server takes the mean of the uplinks, so the ranks sum
    their updates (one all-reduce), and each rank measures the client drift of the clients
    it trained; under user-level DP the server clips and noises each update, so they gather
    them (the same epsilon, the server's noise drawn once)."""
    records = assert_ranks_give_one_processs_records(tiny_config, tmp_path, **over)
    assert records[0]["setup"]["ranks_summed"] == summed
    if over is DRIFT:  # every drawn client measured, on one rank or the other
        assert all(sorted(r["drift"]["clients"]) == sorted(map(str, r["clients"])) for r in records)


def test_servers_that_take_only_a_mean_let_the_ranks_sum(tiny_config):
    def why(**over) -> str:
        cfg = tiny_config(**over)
        return summable(build_method(cfg.method, cfg.train, cfg.seed), cfg.server, cfg.privacy.mode)

    assert why() == "" and why(method={"name": "pf2lora"}) == ""
    assert why(**{"server.aggregation": "median"}) == "server.aggregation median: needs each update"
    assert why(method={"name": "flexlora"}).startswith("method flexlora: its server takes the weighted mean")
    assert why(**USER_DP).startswith("privacy.mode user:")
    assert why(**SCAFFOLD).startswith("train.correction scaffold:")


#: what composes with every method, over ranks as in one process
COMPOSED = {
    "scaffold": SCAFFOLD,
    "byzantine-median": {
        "faults.byzantine_clients": 1,
        "faults.attack": "gaussian",
        "server.aggregation": "median",
    },
    "topk-error-feedback": {"comm.uplink": {"codec": "topk", "fraction": 0.1}},
}


#: the method whose ranks start as a user's do (``fedpeft run --nproc 2``); the others'
#: in batches, each batch's configs run in turn by one launch of 2 ranks
#: (tests/helpers/ranks_batch.py: the ranks start and import torch once a batch), so that
#: pytest-xdist still spreads the batches over its workers
THROUGH_CLI = "fedlr"
EVERY = [*sorted(REGISTRY), *COMPOSED]
BATCHES = [[n for n in EVERY if n != THROUGH_CLI][i::4] for i in range(4)]


@pytest.mark.slow  # every method, two runs each
@pytest.mark.parametrize("names", [[THROUGH_CLI], *BATCHES], ids="+".join)
def test_every_method_over_two_ranks_gives_one_processs_records(tiny_config, tmp_path, names):
    """Every method (and what composes with every method): its records over 2 ranks are one
    process's; each method that fails named, with why."""
    if names == [THROUGH_CLI]:
        assert_ranks_give_one_processs_records(tiny_config, tmp_path, method={"name": THROUGH_CLI})
        return
    alone, ranked, failed = {}, {}, {}
    for name in names:
        over = {**RANKED, **COMPOSED.get(name, {"method": {"name": name}})}
        alone[name] = tiny_config(output_dir=str(tmp_path / name / "alone"), **over)
        ranked[name] = tiny_config(output_dir=str(tmp_path / name / "ranked"), **over)
        try:
            run(alone[name])
        except Exception as err:  # noqa: BLE001 -- named with the method, below
            failed[name] = f"in one process: {type(err).__name__}: {err}"
    configs = {name: written(ranked[name]) for name in names}
    ended = launch_batch(list(configs.values()))  # one launch of 2 ranks (more after a failure)
    for name in names:
        if name in failed:
            continue
        if why := ended[configs[name]]:
            failed[name] = f"over 2 ranks: {why}"
            continue
        try:
            assert_same_records(read_records(ranked[name].output_dir), read_records(alone[name].output_dir))
        except AssertionError as err:
            failed[name] = f"records differ: {err}"
    assert not failed, f"{sorted(failed)} over 2 ranks:\n" + "\n\n".join(
        f"{name}: {why}" for name, why in failed.items()
    )


def test_shares_balance_the_costliest_first():
    assert shares([5, 1, 1, 1, 1, 1], 2) == [[0], [1, 2, 3, 4, 5]]
    assert shares([3, 3, 2, 2, 2], 2) == [[0, 2, 4], [1, 3]]
    assert shares([1, 1, 1], 4) == [[0], [1], [2], []]
    assert sorted(i for s in shares([4, 2, 7, 1, 1, 3], 3) for i in s) == list(range(6))


@pytest.mark.parametrize(("gpus", "local_world", "want"), [(0, 2, "gloo"), (8, 8, "nccl"), (1, 1, "nccl"),
                                                          (1, 4, "gloo"), (2, 4, "gloo")])  # fmt: skip
def test_ranks_with_a_gpu_each_join_over_nccl_and_ranks_sharing_one_over_gloo(
    monkeypatch, gpus, local_world, want
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert backend(local_world) == want


def test_a_store_adopts_what_another_store_on_its_directory_wrote(tmp_path):
    """Two ranks' stores on one directory, rank 0's with the index: what one trained, the
    other reads (its own copy of the client's older state dropped); a state one reset, the
    other forgets."""
    one, two = ClientStore(tmp_path), ClientStore(tmp_path, durable=False)
    one[3] = {"w": torch.ones(2)}
    two[3] = {"w": torch.zeros(2)}  # an older state rank two held in memory
    two[5] = {"w": torch.full((2,), 5.0)}
    two.adopt(one.publish([3]))
    one.adopt(two.publish([5]))
    assert torch.equal(two[3]["w"], torch.ones(2)) and torch.equal(one[5]["w"], torch.full((2,), 5.0))
    one[3] = {"w": torch.full((2,), 2.0)}  # trained again by rank one: a new file, no clash with two's
    two.adopt(one.publish([3]))
    assert torch.equal(two[3]["w"], torch.full((2,), 2.0))
    assert one.publish([3, 5]) == two.publish([3, 5]) and one.entry(3) != one.entry(5)
    assert two.index is None and one.commit() == 1 and one.index.entry(5) == one.entry(5)
    del one[5]
    two.adopt(one.publish([5]))
    assert 5 not in two


def ditto_configs(tiny_config, tmp_path, *names: str) -> list:
    """Three rounds of Ditto (personal state that travels between ranks), one config a name."""
    extra = {"train.rounds": 3, "partition.num_clients": 6, "train.clients_per_round": 4}
    return [tiny_config(output_dir=str(tmp_path / n), method={"name": "ditto"}, **extra) for n in names]


def test_a_run_resumes_with_another_number_of_ranks(tiny_config, tmp_path):
    """Three rounds on 2 ranks, then round 3 again from round 2's checkpoint in one process
    (and the other way round): the records of an uninterrupted run, as a checkpoint does not
    depend on the number of ranks."""
    alone, ranked = ditto_configs(tiny_config, tmp_path, "alone", "ranked")
    run(alone)
    want = read_records(alone.output_dir)
    assert fedpeft_run(ranked, 2).returncode == 0
    done = fedpeft_run(ranked, 1, "--resume-from", "2")  # round 3 again, one process
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_records(read_records(ranked.output_dir), want)
    run(alone, resume_from=2)  # and one process's run, its round 3 again on 2 ranks
    done = fedpeft_run(alone, 2, "--resume-from", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert_same_records(read_records(alone.output_dir), want)


def kill_rank(rank: int, config: Path, after: Path, timeout: float = 300) -> None:
    """SIGKILL the process of rank ``rank`` running ``config`` once ``after`` exists."""
    deadline = time.monotonic() + timeout
    while not after.exists():
        assert time.monotonic() < deadline, f"{after} never appeared"
        time.sleep(0.05)
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if str(config) in " ".join(proc.info["cmdline"] or []) and proc.environ().get("RANK") == str(
                rank
            ):
                proc.send_signal(signal.SIGKILL)
                return
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no process of rank {rank} runs {config}")


@pytest.mark.slow  # three runs, one killed and restarted
def test_a_rank_killed_mid_run_is_restarted_and_no_round_is_lost(tiny_config, tmp_path):
    """Rank 1 killed (SIGKILL) once round 1 is recorded: with ``--max-restarts 1`` the
    launcher restarts the ranks, they resume from the last checkpoint and the run ends with
    an uninterrupted run's records; without restarts the run stops with one line naming the
    rank and what to run to resume."""
    extra = {
        "train.rounds": 4,
        "train.local_steps": 20,
        "partition.num_clients": 6,
        "train.clients_per_round": 4,
    }
    alone = tiny_config(output_dir=str(tmp_path / "alone"), **extra)
    run(alone)
    for restarts, name in ((1, "restarted"), (0, "stopped")):
        cfg = tiny_config(output_dir=str(tmp_path / name), **extra)
        config = Path(cfg.output_dir).with_suffix(".yaml")
        killer = threading.Thread(target=kill_rank, args=(1, config, Path(cfg.output_dir) / "checkpoint.pt"))
        killer.start()
        done = fedpeft_run(cfg, 2, "--max-restarts", str(restarts))
        killer.join()
        if restarts:
            assert done.returncode == 0, done.stdout + done.stderr
            assert "resume tiny" in (Path(cfg.output_dir) / "fedpeft.log").read_text()  # restarted, resumed
            assert_same_records(read_records(cfg.output_dir), read_records(alone.output_dir))
        else:
            assert done.returncode == 2
            assert "rank 1 failed (killed by signal 9)" in done.stdout and "--resume" in done.stdout


@pytest.mark.slow  # two torchrun node groups
def test_two_torchrun_node_groups_on_loopback_give_one_processs_records(tiny_config, tmp_path):
    """``torchrun --nnodes 2`` (one rank a node, a c10d rendezvous on 127.0.0.1): the
    records of one process, as across two machines."""
    alone, nodes = ditto_configs(tiny_config, tmp_path, "alone", "nodes")
    run(alone)
    config = Path(nodes.output_dir).with_suffix(".yaml")
    config.write_text(dump_config(nodes))
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=loopback",
                "-m", "fedpeft", "run", str(config)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    groups = [subprocess.Popen(launcher, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
              for _ in range(2)]  # fmt: skip
    outputs = [g.communicate(timeout=900)[0] for g in groups]
    assert [g.returncode for g in groups] == [0, 0], outputs
    assert_same_records(read_records(nodes.output_dir), read_records(alone.output_dir))


@pytest.mark.slow  # three tasks, two runs each, their ranks launched once
def test_every_task_over_two_ranks_gives_one_processs_records(tiny_config, tiny_decoder, tmp_path):
    """Each rank scores its part of the global test set (NER's rows, QA's features,
    generation's likelihood rows and generated batches): the same records as one process,
    each task's runs in turn in one launch of 2 ranks (each task that fails named)."""
    extra = {"partition.num_clients": 4, "train.clients_per_round": 4, "train.rounds": 2}
    tasks = ("token_classification", "extractive_qa", "causal_lm")
    alone = {
        t: task_config(t, tiny_config, tiny_decoder, tmp_path, tmp_path / t / "alone", **extra) for t in tasks
    }
    ranked = {
        t: task_config(t, tiny_config, tiny_decoder, tmp_path, tmp_path / t / "ranked", **extra)
        for t in tasks
    }
    for cfg in alone.values():
        run(cfg)
    configs = {t: written(ranked[t]) for t in tasks}
    ended = launch_batch(list(configs.values()))
    failed = {}
    for task in tasks:
        if why := ended[configs[task]]:
            failed[task] = f"over 2 ranks: {why}"
            continue
        records = read_records(ranked[task].output_dir)
        try:
            assert "global" in records[-1], "no global scores"
            assert_same_records(records, read_records(alone[task].output_dir))
        except AssertionError as err:
            failed[task] = f"records differ: {err}"
    assert not failed, "\n\n".join(f"{task}: {why}" for task, why in failed.items())
