"""The client store: personal states in RAM within a budget, spilled to disk beyond it."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from fedpeft.engines import checkpoint as C
from fedpeft.engines.store import ClientStore, StoreError
from fedpeft.experiment import build, fingerprint, run
from fedpeft.report.results import read_records
from tests.helpers.runs import Killed, die_on_fit, round_scores


def _state(cid: int, floats: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(cid)
    return {"a": torch.randn(floats, generator=g), "b": torch.randn(3, 2, generator=g).double()}


def test_spilled_states_come_back_bit_identical(tmp_path):
    one = sum(t.numel() * t.element_size() for t in _state(0).values())
    store = ClientStore(tmp_path, budget=10 * one)
    for cid in range(100):
        store[cid] = _state(cid)
        assert store.bytes <= 10 * one
    assert store.spilled == 90 and len(store) == 100 and len(store.memory) == 10
    for cid in [5, 99, 0, 42]:
        state = store[cid]
        for key, value in _state(cid).items():
            assert torch.equal(state[key], value) and state[key].dtype == value.dtype
    assert store.loaded == 3  # 99 was still in memory
    store[7] = {}  # an empty state needs no file
    assert store[7] == {} and 7 in store


def test_a_state_reads_back_in_name_order_from_memory_and_from_its_file(tmp_path):
    """A safetensors file does not keep its tensors' order, so the store hands every state
    back in name order: the same order before and after a spill (a norm summed over a
    state's tensors, as gradient clipping sums, then does not change on a resume)."""
    names = ["own.z", "b.lora_B", "a.lora_A", "head.weight", "m.0", "m.10", "m.2"]
    state = {n: torch.full((2,), float(i)) for i, n in enumerate(names)}
    store = ClientStore(tmp_path, budget=1)  # every state but the newest spills
    store[0] = state
    assert list(store[0]) == sorted(names)
    store[1] = {"x": torch.zeros(1)}  # evicts client 0 to its file
    assert 0 not in store.memory
    back = store[0]
    assert list(back) == sorted(names) and store.loaded == 1
    for n in names:
        assert torch.equal(back[n], state[n])


def test_budget_bounds_resident_memory(tmp_path):
    """2,000 states of 256 KiB (500 MiB in all) through a 16 MiB store: resident memory
    grows by about the budget, not by the states' total."""
    gc.collect()
    rss = psutil.Process().memory_info().rss
    store = ClientStore(tmp_path, budget=16 * 2**20)
    for cid in range(2000):
        store[cid] = {"a": torch.full((64 * 1024,), float(cid))}
    grown = psutil.Process().memory_info().rss - rss
    assert grown < 64 * 2**20, f"resident memory grew by {grown / 2**20:.0f} MiB"
    assert store.disk_bytes() > 450 * 2**20
    assert float(store[1234]["a"][0]) == 1234.0


def _files(directory) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.glob("*/*"))


def test_commit_keeps_the_checkpointed_files_until_the_next_one(tmp_path):
    store = ClientStore(tmp_path, budget=None)
    store[1], store[2] = _state(1), _state(2)
    first = store.commit()
    store.collect()
    old = tmp_path / store.entry(1)[0]
    store[1] = _state(11)  # a newer state
    second = store.commit()  # ... written for the next checkpoint
    assert (first, second) == (1, 2)
    assert old.is_file()  # still named by the last good checkpoint until collect()
    store.collect()  # (the next checkpoint is safely written)
    assert not old.is_file()
    named = _files(tmp_path)
    store[2] = _state(22)  # a state written after that checkpoint, then an interruption
    store.commit()
    store.close()
    # A resume from the second commit gets exactly its states back; the newer file is removed.
    reopened, resets = ClientStore.open(tmp_path, second)
    assert resets == {} and len(reopened) == 2
    assert torch.equal(reopened[1]["a"], _state(11)["a"]) and torch.equal(reopened[2]["a"], _state(2)["a"])
    assert _files(tmp_path) == named


def test_kept_checkpoints_keep_their_states_and_a_round_writes_only_its_clients(tmp_path):
    """Three checkpoints kept: a resume from the oldest reads its states, though two newer
    commits replaced some; a commit writes one row a client trained since the last one."""
    store = ClientStore(tmp_path, budget=None)
    for cid in range(50):
        store[cid] = _state(cid, 10)
    commits = [store.commit()]
    store.collect(keep=3)
    for rnd in (1, 2, 3):
        for cid in (rnd, 10 + rnd):
            store[cid] = _state(100 * rnd + cid, 10)
        before = store.index.db.total_changes
        commits.append(store.commit())
        assert store.index.db.total_changes - before == 2 + 2  # two clients' rows, the commit's numbers
        store.collect(keep=3)
    # 50 + 6 files written; clients 1's and 11's first ones replaced at commit 2, the oldest kept: gone
    assert len(_files(tmp_path)) == 54
    store.close()
    reopened, _ = ClientStore.open(tmp_path, commits[1])  # the oldest kept checkpoint's commit
    assert torch.equal(reopened[1]["a"], _state(101, 10)["a"])  # trained in round 1
    assert torch.equal(reopened[2]["a"], _state(2, 10)["a"])  # round 2's newer state rolled back
    assert torch.equal(reopened[12]["a"], _state(12, 10)["a"]) and len(reopened) == 50
    assert len(_files(tmp_path)) == 50  # the rolled-back commits' files deleted


def test_a_reset_state_is_committed_as_no_state(tmp_path):
    store = ClientStore(tmp_path, budget=None)
    store[1], store[2] = _state(1), _state(2)
    store.commit()
    store.collect()
    del store[1]
    assert 1 not in store and len(store) == 1
    again = store.commit()
    store.collect()
    assert len(_files(tmp_path)) == 1
    store.close()
    reopened, _ = ClientStore.open(tmp_path, again)
    assert 1 not in reopened and list(reopened) == [2]


def test_missing_store_file_is_a_clear_resume_error(tiny_config):
    cfg = tiny_config(method={"name": "pf2lora"})
    run(cfg)
    for path in (cfg.output_dir / C.STORE_DIR).glob("*/*"):
        path.unlink()
    with pytest.raises(StoreError, match=r"client \d+: .*clients/.*safetensors is missing"):
        C.load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))


# the spilling budget (~13 s) in the slow tier: the default tier's 10 minutes (CI runs both)
@pytest.mark.parametrize("budget_mb", [pytest.param(0.001, marks=pytest.mark.slow), None])
def test_interrupted_run_with_a_spilling_store_resumes_exactly(tiny_config, tmp_path, budget_mb):
    """PF2LoRA's personal adapters and kept Adam state through a store far smaller than
    one client's state (every state spills) or without a budget; the run is killed in
    round 3 and resumed: the same records as uninterrupted."""
    common = {
        "method": {"name": "pf2lora"},
        "train.rounds": 4,
        "train.optimizer_state": "keep",
        "train.client_memory_mb": budget_mb,
    }
    straight = tiny_config(**common, output_dir=str(tmp_path / "straight"))
    broken = tiny_config(**common, output_dir=str(tmp_path / "broken"))
    run(straight)
    setup = build(broken)
    die_on_fit(setup)
    with pytest.raises(Killed):
        run(broken, setup=setup)
    run(broken, resume=True)
    assert round_scores(read_records(straight.output_dir)) == round_scores(read_records(broken.output_dir))
    ckpt = C.load_checkpoint(broken.output_dir / "checkpoint.pt", fingerprint(broken))
    assert isinstance(ckpt.personal, ClientStore) and len(ckpt.personal) > 0
    files = {str(p.relative_to(ckpt.personal.directory)) for p in ckpt.personal.directory.glob("*/*")}
    assert files == ckpt.personal.index.files()  # none that no kept checkpoint names
    clients = len(ckpt.personal)
    ckpt.personal.close()
    # the earlier kept checkpoint's states are all there too (each file checked as it opens)
    earlier = C.load_checkpoint(broken.output_dir / "checkpoint.round3.pt", fingerprint(broken))
    assert len(earlier.personal) == clients


def test_a_checkpoint_holding_the_whole_index_still_resumes(tmp_path):
    """A checkpoint of an earlier fedpeft held the store's index itself (client -> file and
    checksums); resuming from it moves the index to disk and reads every state back."""
    directory = tmp_path / C.STORE_DIR
    store = ClientStore(directory)
    store[1], store[2] = _state(1), _state(2)
    store.commit()
    index = {cid: store.entry(cid)[0] for cid in (1, 2)}
    checksums = {name: store.entry(cid)[1] for cid, name in index.items()}
    store.close()
    (directory / "index.sqlite").unlink()  # that version kept no index on disk
    payload = {
        "round": 3,
        "fingerprint": "f",
        "server": {"tensors": {"w": torch.zeros(2)}, "extras": {}},
        "personal": {},
        "personal_index": index,
        "personal_checksums": checksums,
        "personal_retained": [],
        "records": [],
        "joined": [1, 2],
    }
    torch.save(payload, tmp_path / "checkpoint.pt")
    ckpt = C.load_checkpoint(tmp_path / "checkpoint.pt", "f")
    assert ckpt.round == 3 and sorted(ckpt.personal) == [1, 2]
    assert torch.equal(ckpt.personal[2]["a"], _state(2)["a"])
    ckpt.personal.close()
    (directory / index[1]).write_bytes(b"changed")
    with pytest.raises(StoreError, match=r"client 1: its state file .* is corrupt"):
        C.load_checkpoint(tmp_path / "checkpoint.pt", "f")


def test_a_client_id_may_be_a_numpy_integer(tmp_path):
    import numpy as np

    store = ClientStore(tmp_path)
    store[np.int64(4)] = _state(4)
    assert store.commit() == 1
    store.close()
    reopened, _ = ClientStore.open(tmp_path, 1)  # read from its file, through the index
    assert np.int64(4) in reopened and 4 in reopened
    assert torch.equal(reopened[np.int64(4)]["a"], _state(4)["a"])
