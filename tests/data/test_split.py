"""The partition held as arrays, and the clients made from it on demand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedpeft.data.split import Clients, Shards, Split, make_split
from fedpeft.data.task import Encoded
from fedpeft.engines.faults import flip_labels


def _pool(rows: int = 10) -> Encoded:
    return Encoded(torch.arange(rows * 3).view(rows, 3), torch.full((rows,), 3), torch.arange(rows) % 4)


def test_shards_hand_back_each_clients_rows():
    parts = [np.array([3, 1]), np.array([], dtype=np.int64), np.array([0, 2, 4])]
    shards = Shards.of(parts)
    assert len(shards) == 3 and list(shards.sizes()) == [2, 0, 3]
    for got, want in zip(shards, parts, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(shards[-1], parts[2])
    assert [list(p) for p in shards[1:]] == [[], [0, 2, 4]]
    with pytest.raises(IndexError, match="client 3: there are 3"):
        shards[3]
    with pytest.raises(ValueError, match="offsets must rise from 0 to 5"):
        Shards(np.arange(5), np.array([0, 3, 2, 5]))


def test_a_million_clients_partition_is_two_arrays():
    count = 1_000_000
    shards = Shards(np.arange(2 * count), np.arange(0, 2 * count + 1, 2))
    assert len(shards) == count and list(shards[count - 1]) == [2 * count - 2, 2 * count - 1]
    assert shards.rows.nbytes + shards.offsets.nbytes == 8 * (3 * count + 1)  # nothing per client beside


def test_clients_are_made_when_asked_for_with_their_rows_and_changes():
    pool = _pool()
    train, test = [np.array([0, 1]), np.array([2, 3, 4])], [np.array([5]), np.array([6])]
    split = Split(Shards.of(train), Shards.of(test))
    flip = lambda c: type(c)(c.cid, flip_labels(c.train, 4), c.test)  # noqa: E731
    clients = Clients(pool, split)
    changed = clients.altering({1: flip})
    assert len(clients) == 2 and [c.cid for c in clients] == [0, 1]
    one = clients[1]
    assert torch.equal(one.train.ids, pool.ids[2:5]) and torch.equal(one.test.labels, pool.labels[6:7])
    assert torch.equal(changed[1].train.labels, flip_labels(one.train, 4).labels)
    assert torch.equal(changed[0].train.labels, clients[0].train.labels)  # only client 1 changed
    assert torch.equal(clients[1].train.labels, one.train.labels)  # the original stays as it was
    assert [c.cid for c in clients[0:2]] == [0, 1]


def test_the_configured_split_is_held_as_arrays(tiny_config):
    from fedpeft.data.sources import load_corpus

    cfg = tiny_config(partition__val_fraction=0.2)
    split = make_split(cfg, load_corpus(cfg.data, cfg.seed))
    assert all(isinstance(s, Shards) for s in (split.train, split.test, split.val))
    assert len(split.train) == cfg.partition.num_clients
    everything = np.concatenate([split.train.rows, split.test.rows, split.val.rows])
    assert len(np.unique(everything)) == len(everything)  # every row with one client, once


def test_the_largest_client_is_found_from_the_split_alone():
    parts = [np.array([0]), np.array([1, 2, 3]), np.array([4, 5, 6]), np.array([7])]
    clients = Clients(_pool(), Split(Shards.of(parts), Shards.of([np.array([8])] * 4)))
    assert clients.largest().cid == 1 == max(clients, key=lambda c: len(c.train)).cid
