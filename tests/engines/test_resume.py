"""Checkpoint and resume: an interrupted run continues and ends exactly where an
uninterrupted run with the same seed ends; a crash while writing never corrupts the
last good checkpoint."""

import json

import pytest
import torch

from fedpeft.engines import checkpoint as C
from fedpeft.experiment import build, fingerprint, run
from fedpeft.report.results import read_records
from tests.helpers.runs import Killed, die_on_fit, round_scores

#: each resumed scenario (a method, or a method and a layer) and whether it is in the slow tier
RESUMED = {
    "fedlr": False,
    "federa": False,
    "local": False,
    "fedamp": True,
    "fedkd": True,
    "moon": True,
    "ditto": True,
    "fedmcp": False,
    "fdlora": True,  # ~11 s, its three stages
    "flora": True,
    "fedsb": True,  # its setup round, then R
    "fedlr+fedadam": False,
    "fedlr+scaffold": False,
}


@pytest.mark.parametrize(
    "method", [pytest.param(m, marks=[pytest.mark.slow] if slow else []) for m, slow in RESUMED.items()]
)
def test_resume_equals_uninterrupted(tiny_config, tmp_path, method):
    """(``+fedadam``: with a server optimiser, whose state is server state; ``+scaffold``:
    with SCAFFOLD, the server's control server state, each client's personal state.)"""
    method, _, layer = method.partition("+")
    server = {"server.optimizer": layer, "server.lr": 0.05} if layer == "fedadam" else {}
    if layer == "scaffold":
        server = {"train.correction": "scaffold", "train.optimizer": "sgd", "train.lr": 0.05}
    common = {"method": {"name": method}, "train.rounds": 4, "partition.num_clients": 4, **server}
    straight = tiny_config(**common, output_dir=str(tmp_path / "straight"))
    broken = tiny_config(**common, output_dir=str(tmp_path / "broken"))
    run(straight)

    # Kill the second run in the middle of round 3 (after rounds 1-2 were checkpointed).
    setup = build(broken)
    die_on_fit(setup)  # rounds 1-2 = 4 fits; die on round 3's second client
    with pytest.raises(Killed):
        run(broken, setup=setup)
    assert [r["round"] for r in read_records(broken.output_dir)] == [1, 2]

    run(broken, resume=True)  # a fresh model and method, as after a restart

    a, b = read_records(straight.output_dir), read_records(broken.output_dir)
    assert round_scores(a) == round_scores(b)
    sa = json.loads((straight.output_dir / "summary.json").read_text())
    sb = json.loads((broken.output_dir / "summary.json").read_text())
    assert sa["final_global"] == sb["final_global"] and sa["final_local"] == sb["final_local"]
    ca = C.load_checkpoint(straight.output_dir / "checkpoint.pt", fingerprint(straight))
    cb = C.load_checkpoint(broken.output_dir / "checkpoint.pt", fingerprint(broken))
    for name, t in ca.server.tensors.items():
        assert torch.equal(t, cb.server.tensors[name]), name
    assert ca.server.extras.keys() == cb.server.extras.keys()
    assert not layer or any(k.startswith(("server_opt.", "scaffold.")) for k in ca.server.extras)
    for name, t in ca.server.extras.items():
        assert not torch.is_tensor(t) or torch.equal(t, cb.server.extras[name]), name
    assert ca.personal.keys() == cb.personal.keys()
    for cid in ca.personal:  # every client's state, SCAFFOLD's control included
        mine, theirs = ca.personal[cid], cb.personal[cid]
        assert mine.keys() == theirs.keys() and all(torch.equal(t, theirs[n]) for n, t in mine.items())
        assert (layer == "scaffold") == any(k.startswith("control.") for k in mine)


def test_resume_refuses_another_config(tiny_config, tmp_path):
    cfg = tiny_config(output_dir=str(tmp_path / "r"))
    run(cfg)
    other = tiny_config(output_dir=str(tmp_path / "r"), **{"train.lr": 0.5})
    with pytest.raises(C.ResumeError, match="different config"):
        run(other, resume=True)


def test_resume_without_checkpoint_is_a_clear_error(tiny_config, tmp_path):
    cfg = tiny_config(output_dir=str(tmp_path / "empty"))
    with pytest.raises(C.ResumeError, match="no checkpoint"):
        run(cfg, resume=True)


def test_interrupted_write_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    good = C.Checkpoint(
        1, "fp", C.ServerState({"w": torch.ones(3)}), {0: {"p": torch.zeros(2)}}, [{"round": 1}], [0]
    )
    C.save_checkpoint(path, good)

    def torn_save(obj, fh):
        fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(C.torch, "save", torn_save)
    bad = C.Checkpoint(2, "fp", C.ServerState({"w": torch.zeros(3)}), {}, [], [])
    with pytest.raises(OSError):
        C.save_checkpoint(path, bad)
    monkeypatch.undo()
    loaded = C.load_checkpoint(path, "fp")
    assert loaded.round == 1 and torch.equal(loaded.server.tensors["w"], torch.ones(3))


def test_resume_needs_checkpoints(tiny_config, tmp_path):
    cfg = tiny_config(output_dir=str(tmp_path / "nock"), checkpoint=False)
    with pytest.raises(C.ResumeError, match="checkpoint: false"):
        run(cfg, resume=True)


def test_fingerprint_ignores_options_left_at_their_defaults(tiny_config):
    """A run written before an option existed (its config.yaml lacks the key) has the same
    fingerprint as the same config now, so it still resumes; a changed setting does not."""
    import yaml

    from fedpeft.config import dump_config, parse_config

    cfg = tiny_config()
    older = yaml.safe_load(dump_config(cfg))
    del older["partition"]["dirichlet_mode"], older["data"]["test_path"]  # options added later
    assert fingerprint(parse_config(older)) == fingerprint(cfg)
    assert fingerprint(tiny_config(**{"partition.dirichlet_mode": "per_client"})) != fingerprint(cfg)
    assert fingerprint(tiny_config(**{"method": {"name": "federa"}})) != fingerprint(
        tiny_config(**{"method": {"name": "fedlr"}})
    )
