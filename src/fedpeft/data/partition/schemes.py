"""The partitioners besides Dirichlet's: iid, SCAFFOLD's similarity mixture, natural groups,
groups of clients (Dirichlet within), and each client's local train/test split."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedpeft.data.partition.checks import (
    PartitionError,
    check_enough_samples,
    check_int,
    check_labels,
    check_real,
    check_rng,
    finalise,
)
from fedpeft.data.partition.dirichlet import partition_dirichlet

# --------------------------------------------------------------------------- #
# IID
# --------------------------------------------------------------------------- #


def partition_iid(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``range(num_samples)`` and cut it into ``num_clients`` near-equal parts.

    Client sizes differ by at most one. Raises :class:`PartitionError` if there
    are fewer samples than clients.
    """
    num_samples = check_int("num_samples", num_samples, 1)
    num_clients = check_int("num_clients", num_clients, 1)
    rng = check_rng(rng)
    check_enough_samples(num_samples, num_clients)
    return finalise(np.array_split(rng.permutation(num_samples), num_clients))


# --------------------------------------------------------------------------- #
# Similarity (SCAFFOLD-style) mixture
# --------------------------------------------------------------------------- #


def partition_similarity(
    labels: np.ndarray, num_clients: int, s: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """Mix an iid share ``1 - s`` with a label-sorted share ``s`` of the data.

    The dataset is shuffled; ``round(s * N)`` samples are sorted by label
    (stably) and cut into ``num_clients`` contiguous chunks, one per client, and
    the remaining samples are split evenly. ``s = 0`` is iid and ``s = 1``
    gives each client a contiguous label range. The iid remainder is dealt in
    reverse client order so that client sizes differ by at most one.
    """
    labels = check_labels(labels)
    num_clients = check_int("num_clients", num_clients, 1)
    s = check_real("s", s)
    if not 0.0 <= s <= 1.0:
        raise PartitionError(f"s must be in [0, 1], got {s}")
    rng = check_rng(rng)
    check_enough_samples(len(labels), num_clients)

    shuffled = rng.permutation(len(labels))
    num_sorted = int(round(s * len(labels)))
    sorted_share = shuffled[:num_sorted]
    sorted_share = sorted_share[np.argsort(labels[sorted_share], kind="stable")]
    skewed_chunks = np.array_split(sorted_share, num_clients)
    iid_chunks = np.array_split(shuffled[num_sorted:], num_clients)[::-1]
    return finalise(
        [np.concatenate([skewed, iid]) for skewed, iid in zip(skewed_chunks, iid_chunks, strict=True)]
    )


# --------------------------------------------------------------------------- #
# Natural groups
# --------------------------------------------------------------------------- #


def _groups_in_order(groups: np.ndarray) -> list[np.ndarray]:
    """Indices of each distinct group value, ordered by first appearance."""
    _, first_index, inverse, counts = np.unique(
        groups, return_index=True, return_inverse=True, return_counts=True
    )
    by_group = np.argsort(inverse.reshape(-1), kind="stable")
    members = np.split(by_group, np.cumsum(counts)[:-1])
    return [members[group] for group in np.argsort(first_index)]


def _merge_balanced(members: list[np.ndarray], num_clients: int) -> list[np.ndarray]:
    """Greedily assign groups, largest first, to the currently smallest client.

    Ties are broken deterministically: equally sized groups keep their
    first-appearance order, and among equally small clients the lowest index wins.
    """
    sizes = np.zeros(num_clients, dtype=np.int64)
    assigned: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    group_sizes = np.array([len(group) for group in members])
    for group in np.argsort(-group_sizes, kind="stable"):
        client = int(np.argmin(sizes))
        assigned[client].append(members[group])
        sizes[client] += group_sizes[group]
    return [np.concatenate(chunks) for chunks in assigned]


def partition_natural(groups: np.ndarray | Sequence, num_clients: int | None = None) -> list[np.ndarray]:
    """One client per distinct value of ``groups``, optionally merged into fewer clients.

    Clients are ordered by the **first appearance** of their group value in
    ``groups``. If ``num_clients`` is smaller than the number of distinct
    groups, whole groups are merged greedily (largest group to the currently
    smallest client) to balance client sizes. The result is deterministic.

    Raises:
        PartitionError: if ``num_clients`` exceeds the number of groups.
    """
    groups = check_labels(groups, name="groups")
    members = _groups_in_order(groups)
    if num_clients is None:
        return finalise(members)
    num_clients = check_int("num_clients", num_clients, 1)
    if num_clients > len(members):
        raise PartitionError(
            f"num_clients={num_clients} exceeds the number of distinct groups "
            f"({len(members)}); natural partitions cannot split a group"
        )
    if num_clients == len(members):
        return finalise(members)
    return finalise(_merge_balanced(members, num_clients))


# --------------------------------------------------------------------------- #
# Groups (one column value each), Dirichlet within
# --------------------------------------------------------------------------- #

GROUP_CLIENTS = ("equal", "proportional")
"""How :func:`partition_groups` divides the clients among the groups:

``equal``
    ``M // G`` clients per group; the ``M % G`` left over go one each to the groups
    with the most examples (the C2A paper: 100 clients, 5 languages, 20 each).
``proportional``
    One client per group, the other ``M - G`` in proportion to the groups' sizes
    (largest remainder; ties to the larger, then the earlier group).
"""


def group_client_counts(sizes: Sequence[int], num_clients: int, how: str = "equal") -> np.ndarray:
    """Clients per group for groups of ``sizes`` examples (``GROUP_CLIENTS``); each gets one at least.

    Raises:
        PartitionError: if there are fewer clients than groups, or ``how`` is unknown.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    num_clients = check_int("num_clients", num_clients, 1)
    if how not in GROUP_CLIENTS:
        raise PartitionError(f"clients_per_group must be one of {GROUP_CLIENTS}, got {how!r}")
    num_groups = len(sizes)
    if num_clients < num_groups:
        raise PartitionError(
            f"{num_groups} groups but num_clients={num_clients}: every group needs at least one client"
        )
    larger_first = np.argsort(-sizes, kind="stable")
    if how == "equal":
        counts = np.full(num_groups, num_clients // num_groups, dtype=np.int64)
        counts[larger_first[: num_clients % num_groups]] += 1
        return counts
    rest = num_clients - num_groups
    quota = rest * sizes / sizes.sum()
    counts = 1 + np.floor(quota).astype(np.int64)
    remainder = quota - np.floor(quota)
    order = sorted(range(num_groups), key=lambda g: (-remainder[g], -sizes[g], g))
    counts[order[: num_clients - int(counts.sum())]] += 1
    return counts


def partition_groups(
    labels: np.ndarray | Sequence,
    groups: np.ndarray | Sequence,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
    mode: str = "per_class",
    clients_per_group: str = "equal",
    max_retries: int = 100,
) -> list[np.ndarray]:
    """Clients in groups, each group bound to one value of ``groups``; Dirichlet label skew within.

    The distinct values of ``groups`` (in order of first appearance) each get a block of
    consecutive clients (``clients_per_group``, see ``GROUP_CLIENTS``), and a group's
    examples are split among its clients by :func:`partition_dirichlet` (``alpha``,
    ``mode``, ``min_size``) on their labels. Every client therefore holds examples of one
    group value only, and every example belongs to exactly one client.

    Raises:
        PartitionError: on invalid arguments, a missing group value, fewer clients than
            groups, or a group with fewer than ``min_size`` examples per client.
    """
    labels = check_labels(labels)
    groups = check_labels(groups, name="groups")
    if len(groups) != len(labels):
        raise PartitionError(f"groups has {len(groups)} values but labels has {len(labels)}")
    missing = [i for i, g in enumerate(groups.tolist()) if g is None or (isinstance(g, float) and g != g)]
    if missing:
        raise PartitionError(f"the group value of example {missing[0]} (0-based) is missing")
    members = _groups_in_order(groups)
    values = [groups[m[0]] for m in members]
    counts = group_client_counts([len(m) for m in members], num_clients, clients_per_group)
    parts: list[np.ndarray] = []
    for value, rows, count in zip(values, members, counts, strict=True):
        if len(rows) < count * min_size:
            raise PartitionError(
                f"group {value!r} has {len(rows)} examples, too few for its {count} client(s) of "
                f"min_size={min_size} each"
            )
        within = partition_dirichlet(labels[rows], int(count), alpha, rng, min_size, max_retries, mode)
        parts += [rows[part] for part in within]
    return finalise(parts)


def client_groups(groups: np.ndarray | Sequence, parts: Sequence[np.ndarray]) -> list:
    """The group value of each client (that of its first example; None for an empty client)."""
    groups = np.asarray(groups)
    values = [groups[part[0]] if len(part) else None for part in parts]
    return [v.item() if isinstance(v, np.generic) else v for v in values]


# --------------------------------------------------------------------------- #
# Local train / test split
# --------------------------------------------------------------------------- #


def split_local_test(
    parts: list[np.ndarray], fraction: float, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Hold out a random share ``fraction`` of each client as its local test set.

    A client with ``n >= 2`` samples gets ``round(fraction * n)`` test samples,
    clipped to ``[1, n - 1]`` so both splits are non-empty; a client with fewer
    than two samples keeps everything for training.

    Returns:
        ``(train_parts, test_parts)``, each a list with one sorted ``int64``
        index array per client.
    """
    fraction = check_real("fraction", fraction)
    if not 0.0 < fraction < 1.0:
        raise PartitionError(f"fraction must be in (0, 1), got {fraction}")
    rng = check_rng(rng)

    train_parts: list[np.ndarray] = []
    test_parts: list[np.ndarray] = []
    for part in parts:
        shuffled = rng.permutation(np.asarray(part, dtype=np.int64))
        size = len(shuffled)
        num_test = min(max(int(round(fraction * size)), 1), size - 1) if size >= 2 else 0
        test_parts.append(shuffled[:num_test])
        train_parts.append(shuffled[num_test:])
    return finalise(train_parts), finalise(test_parts)
