"""Runs that lose nothing (issue 38): diverging clients, corrupt client states, corrupt
checkpoints, interrupted writes and unexpected errors (docs/reliability.md lists them)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import fedpeft
from fedpeft.cli import app
from fedpeft.config import dump_config
from fedpeft.engines import checkpoint as C
from fedpeft.engines.guard import DivergedError, nonfinite_tensor
from fedpeft.engines.store import ClientStore, StoreError
from fedpeft.experiment import build, fingerprint, run
from fedpeft.flower import codec
from fedpeft.report.results import read_records
from tests.helpers.flower import deploy, serve, wrapped_handler
from tests.helpers.runs import Killed, kill_in_round, round_scores

NAN_CLIENT, INF_CLIENT = 0, 1  # client 0 returns a NaN update, client 1 an infinite loss
COMMON = {"train.rounds": 2, "train.clients_per_round": 4, "partition.num_clients": 4}


def poison(result, how: str) -> None:
    """Make a client's result diverge as a real one would: a NaN update, or an infinite loss."""
    if how == "nan":
        name = next(iter(result.uplink))
        result.uplink = {**result.uplink, name: torch.full_like(result.uplink[name], float("nan"))}
    else:
        result.metrics = {**result.metrics, "loss": float("inf")}


def poisoned_setup(cfg, from_round: int = 1, everyone: bool = False):
    """``cfg``'s setup whose clients diverge from round ``from_round`` on (client 0 and 1,
    or every client)."""
    setup = build(cfg)
    real = setup.method.fit_cohort

    def fit_cohort(model, jobs):
        results = real(model, jobs)
        for job, result in zip(jobs, results, strict=True):
            how = "nan" if everyone else {NAN_CLIENT: "nan", INF_CLIENT: "inf"}.get(job.client.cid)
            if how and job.rnd >= from_round:
                poison(result, how)
        return results

    setup.method.fit_cohort = fit_cohort
    return setup


def without_clients(cfg, cids):
    """``cfg``'s setup whose aggregation never sees clients ``cids``: what the others
    aggregate to on their own."""
    setup = build(cfg)
    real = setup.method.aggregate
    setup.method.aggregate = lambda server, results, rnd: real(
        server, [r for r in results if r.cid not in cids], rnd
    )
    return setup


def server_tensors(cfg):
    return C.load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg)).server.tensors


def test_diverged_clients_are_dropped_and_the_others_aggregate_as_without_them(tiny_config, tmp_path):
    guarded = tiny_config(**COMMON, output_dir=str(tmp_path / "guarded"))
    reference = tiny_config(**COMMON, output_dir=str(tmp_path / "reference"))
    run(guarded, setup=poisoned_setup(guarded))
    run(reference, setup=without_clients(reference, {NAN_CLIENT, INF_CLIENT}))

    records = read_records(guarded.output_dir)
    for r in records:
        assert sorted(r["dropped"]) == ["0", "1"] and r["dropped"]["1"] == "non-finite: loss is inf"
        assert r["dropped"]["0"].startswith("non-finite: update tensor 'backbone.")
        assert r["dropped"]["0"].endswith("lora_A.default.weight' is not finite")
    assert [r["global"] for r in records] == [r["global"] for r in read_records(reference.output_dir)]
    for name, t in server_tensors(guarded).items():
        assert torch.equal(t, server_tensors(reference)[name]), name
    assert nonfinite_tensor(server_tensors(guarded)) is None


@pytest.mark.slow  # ~10 s: the default tier stays under its 10 minutes (CI's slow tier runs it)
def test_flower_drops_diverged_clients_by_the_same_rule(tiny_config, tmp_path):
    """Over the Flower bridge: client 0's reply has a NaN tensor, client 1's an infinite
    loss; both are dropped with the in-process engine's reasons, and the server ends where
    the in-process engine ends with the same two clients diverging."""
    cfg = tiny_config(**{**COMMON, "train.rounds": 1}, output_dir=str(tmp_path / "flower"))
    local = tiny_config(**{**COMMON, "train.rounds": 1}, output_dir=str(tmp_path / "local"))
    grid = deploy(cfg, tmp_path)

    def diverging(real_train, message, context):
        reply = real_train(message, context)
        pid = context.node_config["partition-id"]
        if pid == NAN_CLIENT:
            update = codec.from_record(reply.content["uplink"])
            name = next(iter(update))
            update[name] = torch.full_like(update[name], float("nan"))
            reply.content["uplink"] = codec.to_record(update)
        elif pid == INF_CLIENT:
            reply.content["fit"]["loss"] = float("inf")
        return reply

    with wrapped_handler("train", diverging):
        serve(grid)
    run(local, setup=poisoned_setup(local))
    over_flower, in_process = read_records(cfg.output_dir)[0], read_records(local.output_dir)[0]
    assert over_flower["dropped"] == in_process["dropped"]
    assert over_flower["clients_returned"] == [2, 3]
    for name, t in server_tensors(local).items():
        assert torch.allclose(t, server_tensors(cfg)[name], atol=1e-6), name


def test_a_round_where_every_client_diverges_stops_the_run_and_keeps_the_last_good_state(
    tiny_config, tmp_path, monkeypatch
):
    cfg = tiny_config(**{**COMMON, "train.rounds": 4})
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(cfg))
    setup = poisoned_setup(cfg, from_round=3, everyone=True)
    monkeypatch.setattr("fedpeft.experiment.build", lambda cfg, *a, **k: setup)
    res = CliRunner().invoke(app, ["run", str(path)])

    assert res.exit_code == 2, res.output
    assert "error: round 3: every sampled client's update is not finite (4 of 4" in " ".join(
        res.output.split()
    )
    assert "train.lr 0.01" in res.output and "Traceback" not in res.output
    ckpt = C.load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    assert ckpt.round == 2 and nonfinite_tensor(ckpt.server.tensors) is None
    assert [r["round"] for r in read_records(cfg.output_dir)] == [1, 2]
    exported = fedpeft.load_export(cfg.output_dir / "adapter")  # round 2's global model
    for name, t in ckpt.server.tensors.items():
        if name in dict(exported.model.named_parameters()):
            assert torch.equal(dict(exported.model.named_parameters())[name].detach(), t), name
    assert torch.isfinite(exported.logits(["a small domesticated carnivore"])).all()
    log = (cfg.output_dir / "fedpeft.log").read_text()
    assert "round 3: every sampled client" in log


def test_a_learning_rate_that_diverges_is_named(tiny_config):
    cfg = tiny_config(**{"train.lr": 1e30, "train.rounds": 3, "train.local_steps": 3})
    with pytest.raises(DivergedError, match=r"round 1: .*train.lr 1e\+30"):
        run(cfg)
    assert not (cfg.output_dir / "checkpoint.pt").exists()  # nothing diverged was kept


def spilling(tiny_config, tmp_path, name, **extra):
    common = {
        "method": {"name": "pf2lora"},
        "train.rounds": 4,
        "train.optimizer_state": "keep",
        "train.client_memory_mb": 0.001,  # every state spills to a file
        **extra,
    }
    return tiny_config(**common, output_dir=str(tmp_path / name))


def test_a_truncated_client_state_is_named_at_resume_or_reset(tiny_config, tmp_path):
    cfg = spilling(tiny_config, tmp_path, "broken")
    kill_in_round(cfg, 3)
    victim = sorted((cfg.output_dir / C.STORE_DIR).glob("*/*.safetensors"))[0]
    cid = int(victim.name.split(".")[0])
    victim.write_bytes(victim.read_bytes()[:40])  # truncated

    with pytest.raises(StoreError, match=rf"client {cid}: its state file {victim} is corrupt"):
        run(cfg, resume=True)
    reset = spilling(tiny_config, tmp_path, "broken", **{"train.on_corrupt_state": "reset"})
    run(reset, resume=True)
    records = read_records(cfg.output_dir)
    assert [r["round"] for r in records] == [1, 2, 3, 4]
    assert list(records[2]["state_resets"]) == [str(cid)]
    assert "is corrupt" in records[2]["state_resets"][str(cid)]
    assert all("state_resets" not in r for r in records[:2] + records[3:])


def test_a_state_corrupted_during_a_run_is_caught_when_read(tmp_path):
    store = ClientStore(tmp_path, budget=1)  # every state but the newest spills
    store[1], store[2] = {"a": torch.ones(100)}, {"a": torch.zeros(100)}
    path = tmp_path / store.entry(1)[0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in a value: the file still parses
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=rf"client 1: its state file {path} is corrupt"):
        store[1]


def test_an_interrupted_spill_leaves_the_checkpointed_states(tmp_path, monkeypatch):
    """A kill in the middle of writing a spilled state (half a temporary file) loses nothing
    of the last checkpoint: reopening its index reads every state back, and the stray
    temporary file is removed."""
    store = ClientStore(tmp_path, budget=None)
    store[1], store[2] = {"a": torch.ones(4)}, {"a": torch.full((4,), 2.0)}
    first = store.commit()
    store.collect()

    def torn(self, data):
        with open(self, "wb") as fh:
            fh.write(data[: len(data) // 2])
        raise Killed

    monkeypatch.setattr(type(tmp_path), "write_bytes", torn)
    store[1] = {"a": torch.zeros(4)}
    with pytest.raises(Killed):
        store.commit()
    monkeypatch.undo()
    assert list(tmp_path.glob("*/*.tmp"))
    store.close()
    reopened, resets = ClientStore.open(tmp_path, first)
    assert resets == {} and not list(tmp_path.glob("*/*.tmp"))
    assert torch.equal(reopened[1]["a"], torch.ones(4)) and torch.equal(
        reopened[2]["a"], torch.full((4,), 2.0)
    )


@pytest.mark.slow  # ~10 s: the default tier stays under its 10 minutes (CI's slow tier runs it)
def test_a_corrupt_newest_checkpoint_resumes_from_the_previous_one(tiny_config, tmp_path):
    straight = spilling(tiny_config, tmp_path, "straight")
    broken = spilling(tiny_config, tmp_path, "broken")
    run(straight)
    kill_in_round(broken, 4)  # rounds 1-3 checkpointed; kept: round 3 (newest) and round 2
    assert sorted(p.name for p in broken.output_dir.glob("checkpoint*")) == [
        "checkpoint.pt",
        "checkpoint.round2.pt",
    ]
    newest = broken.output_dir / "checkpoint.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    said = []
    run(broken, resume=True, say=said.append)

    assert "resuming from the previous checkpoint, checkpoint.round2.pt (round 2)" in said
    assert (broken.output_dir / "checkpoint.pt.unreadable").is_file()
    assert round_scores(read_records(straight.output_dir)) == round_scores(read_records(broken.output_dir))
    a = json.loads((straight.output_dir / "summary.json").read_text())
    b = json.loads((broken.output_dir / "summary.json").read_text())
    assert a["final_global"] == b["final_global"] and a["final_local"] == b["final_local"]


@pytest.mark.slow  # ~10 s: the default tier's 10 minutes (the corrupt-newest case keeps kept rounds there)
def test_resume_from_a_kept_round(tiny_config, tmp_path):
    """--resume-from 3 after a finished 4-round run redoes round 4 from round 3's kept
    checkpoint (its clients' files kept for it) and ends where the run ended."""
    cfg = spilling(tiny_config, tmp_path, "run")
    run(cfg)
    first = read_records(cfg.output_dir)
    with pytest.raises(C.ResumeError, match=r"--resume-from 1: .*round 1 .*kept: 4, 3"):
        run(cfg, resume_from=1)
    run(cfg, resume_from=3)
    assert round_scores(read_records(cfg.output_dir)) == round_scores(first)
    assert C.load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg)).round == 4


def test_kept_checkpoints_rotate_and_survive_a_crash_between_renames(tmp_path, monkeypatch):
    keeper = C.Checkpoints(tmp_path / "checkpoint.pt", keep=2)

    def ckpt(rnd):
        return C.Checkpoint(rnd, "fp", C.ServerState({"w": torch.full((2,), float(rnd))}), {}, [], [])

    for rnd in (1, 2, 3):
        keeper.save(ckpt(rnd))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.round2.pt"]

    def killed(*args):
        raise Killed

    monkeypatch.setattr(keeper, "_adopt", killed)
    with pytest.raises(Killed):  # killed after round 4 was written, before it was moved into place
        keeper.save(ckpt(4))
    restarted = C.Checkpoints(tmp_path / "checkpoint.pt", keep=2)
    assert restarted.load("fp").round == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt", "checkpoint.round3.pt"]
    with pytest.raises(ValueError, match="server tensor 'w' is not finite"):
        keeper.save(C.Checkpoint(5, "fp", C.ServerState({"w": torch.tensor([float("nan")])}), {}, [], []))


def test_an_unexpected_error_is_one_line_and_its_traceback_goes_to_the_log(
    tiny_config, tmp_path, monkeypatch
):
    cfg = tiny_config()
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(cfg))

    def broken_build(cfg, *args, **kwargs):
        return {}["no such key"]  # a bug: an error nobody meant to raise

    monkeypatch.setattr("fedpeft.experiment.build", broken_build)
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2
    error = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "Traceback" not in res.output
    assert "error: unexpected KeyError at test_reliability.py" in error[0]
    assert "called from fedpeft/experiment.py" in error[0] and "fedpeft.log (--debug prints it)" in error[0]
    log = (cfg.output_dir / "fedpeft.log").read_text()
    assert "Traceback (most recent call last)" in log and "broken_build" in log

    res = CliRunner().invoke(app, ["run", str(path), "--debug"])
    assert res.exit_code == 2 and "broken_build" in res.output  # the traceback, printed
