"""The partition of the training pool into clients, and the clients it makes.

:func:`make_split` partitions as configured and carves each client's local test (and
validation) split; the result is held as :class:`Shards`, two arrays per split whatever
the number of clients. :class:`Clients` are the clients' examples as a sequence built on
demand from the encoded pool and the split, so that a million clients cost their split's
arrays, not a million objects: only the clients a round draws or a score reads are made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar, overload

import numpy as np

from fedpeft.config import ExperimentConfig
from fedpeft.data import partition as P
from fedpeft.data.task import Encoded
from fedpeft.data.types import ClientData, Corpus

T = TypeVar("T")


class PerClient(Sequence[T]):
    """One item a client, made when asked for (:meth:`item`); a slice is a list of them."""

    def item(self, i: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.item(j) for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(f"client {i}: there are {len(self)}")
        return self.item(i % len(self))

    def __iter__(self) -> Iterator[T]:
        return (self.item(i) for i in range(len(self)))


class Shards(PerClient[np.ndarray]):
    """Per client, its rows of the pool (``shards[i]``, an ``int64`` array), held as two
    arrays: every client's rows one after another, and where each client starts. A
    million clients are two arrays, not a million."""

    def __init__(self, rows: np.ndarray, offsets: np.ndarray):
        if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(rows) or np.any(np.diff(offsets) < 0):
            raise ValueError(f"Shards: offsets must rise from 0 to {len(rows)} (the number of rows)")
        self.rows, self.offsets = rows.astype(np.int64, copy=False), offsets.astype(np.int64, copy=False)

    @classmethod
    def of(cls, parts: Sequence[np.ndarray]) -> Shards:
        sizes = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        rows = np.concatenate(parts) if len(parts) else np.zeros(0, dtype=np.int64)
        return cls(rows, np.concatenate([[0], np.cumsum(sizes)]))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def item(self, i: int) -> np.ndarray:
        return self.rows[self.offsets[i] : self.offsets[i + 1]]

    def sizes(self) -> np.ndarray:
        """Each client's number of rows."""
        return np.diff(self.offsets)


@dataclass
class Split:
    """The partition of the training pool: per client, train and local-test row indices."""

    train: Shards
    test: Shards
    val: Shards | None = None  # with partition.val_fraction

    def histograms(self, labels: np.ndarray, num_classes: int) -> np.ndarray:
        both = [np.concatenate([a, b]) for a, b in zip(self.train, self.test, strict=True)]
        return P.label_histograms(labels, both, num_classes)


#: The random stream of the clients' local test and validation orders (beside ``seed``).
LOCAL_TEST_ORDER_STREAM = 0x4C4F4341  # "LOCA": apart from the rounds' sampling streams


def make_split(cfg: ExperimentConfig, corpus: Corpus) -> Split:
    """Partition the training pool as configured, then carve each client's local test split."""
    pc, rng = cfg.partition, np.random.default_rng([cfg.seed, 1])
    labels = corpus.train_labels
    try:
        if pc.scheme == "iid":
            parts = P.partition_iid(len(labels), pc.num_clients, rng)
        elif pc.scheme == "dirichlet":
            parts = P.partition_dirichlet(
                labels, pc.num_clients, pc.alpha, rng, min_size=pc.min_size, mode=pc.dirichlet_mode
            )
        elif pc.scheme == "similarity":
            parts = P.partition_similarity(labels, pc.num_clients, pc.similarity, rng)
        elif pc.scheme == "groups":
            parts = P.partition_groups(
                labels, group_values(cfg, corpus), pc.num_clients, pc.alpha, rng, min_size=pc.min_size,
                mode=pc.dirichlet_mode, clients_per_group=pc.clients_per_group,
            )  # fmt: skip
        else:
            parts = P.partition_natural(corpus.train_groups, pc.num_clients)
        train, test = P.split_local_test(parts, pc.local_test_fraction, rng)
        val = None
        if pc.val_fraction:  # a share of the whole client: of what the test split left
            train, val = P.split_local_test(train, pc.val_fraction / (1 - pc.local_test_fraction), rng)
        # scored in a seeded order, not the pool's (a sorted source's runs of one label)
        order = np.random.default_rng([cfg.seed, LOCAL_TEST_ORDER_STREAM])
        test = [rows[order.permutation(len(rows))] for rows in test]
        val = None if val is None else [rows[order.permutation(len(rows))] for rows in val]
    except P.PartitionError as err:
        column = f"data.group_column {cfg.data.group_by!r}, " if pc.scheme == "groups" else ""
        raise P.PartitionError(
            f"partition ({pc.scheme}: partition.num_clients={pc.num_clients}, "
            f"partition.min_size={pc.min_size}, {column}{len(labels)} training examples after "
            f"data.max_samples): {err}"
        ) from None
    return Split(Shards.of(train), Shards.of(test), None if val is None else Shards.of(val))


def group_values(cfg: ExperimentConfig, corpus: Corpus) -> np.ndarray:
    """Each training example's value of the group column (``partition.scheme: groups``)."""
    if corpus.train_groups is None:
        raise P.PartitionError(
            "the data has no group column: set data.group_column (the column whose values bind the "
            "groups of clients, e.g. a language column)"
        )
    return corpus.train_groups


class Clients(PerClient[ClientData]):
    """Client ``i``'s :class:`ClientData`, made from the encoded ``pool`` and ``split``
    when asked for (``spaces``: each client's label space, silos only; ``altered``: clients
    whose data a function changes, e.g. a faulty client's flipped labels)."""

    def __init__(
        self,
        pool: Encoded,
        split: Split,
        spaces: Sequence[np.ndarray | None] | None = None,
        altered: dict[int, Callable[[ClientData], ClientData]] | None = None,
    ):
        self.pool, self.split, self.spaces, self.altered = pool, split, spaces, altered or {}

    def __len__(self) -> int:
        return len(self.split.train)

    def item(self, i: int) -> ClientData:
        split, pool = self.split, self.pool
        client = ClientData(
            i,
            pool.examples(split.train[i]),
            pool.examples(split.test[i]),
            val=pool.examples(split.val[i]) if split.val is not None else None,
            classes=self.spaces[i] if self.spaces is not None else None,
        )
        return self.altered[i](client) if i in self.altered else client

    def largest(self) -> ClientData:
        """The (first) client with the most training rows, made alone: from the split's
        sizes, unless an example may have several rows (extractive QA's features)."""
        if "example_ids" in self.pool.aux:
            return max(self, key=lambda c: len(c.train))
        return self[int(np.argmax(self.split.train.sizes()))]

    def altering(self, changes: dict[int, Callable[[ClientData], ClientData]]) -> Clients:
        """The same clients, those of ``changes`` changed by their function."""
        return Clients(self.pool, self.split, self.spaces, {**self.altered, **changes})
