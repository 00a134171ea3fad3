"""Split a centralised dataset into per-client shards for federated experiments.

Every partitioner returns a list with one entry per client; each entry is a
sorted ``int64`` array of indices into the dataset, and every sample belongs to
exactly one client. All randomness comes from a caller-supplied
:class:`numpy.random.Generator`, so a partition is reproducible from its seed.

Schemes
-------
``partition_iid``
    Seeded shuffle cut into near-equal parts.
``partition_dirichlet``
    Label skew from a Dirichlet draw, in one of three modes (``DIRICHLET_MODES``):
    per class over clients (uncapped, or capped at the mean client size as in
    FedNLP, which C2A follows), or per client over classes (the FeDeRA paper).
    Small ``alpha`` makes clients nearly single-class, large ``alpha`` approaches iid.
``partition_similarity``
    SCAFFOLD-style mixture (as used by PF2LoRA): a share ``1 - s`` is spread
    iid and the share ``s`` is sorted by label and dealt out in contiguous
    chunks. ``s = 0`` is iid, ``s = 1`` is the most heterogeneous.
``partition_natural``
    One client per natural group (writer, speaker, task, ...), optionally
    merged into fewer, size-balanced clients.
``partition_groups``
    The C2A paper's language partition (sec. 4.2, after Weller et al., 2022):
    clients are divided into groups, each bound to one value of a column (a
    language), and each group's examples are split among its clients by the
    Dirichlet label skew above. Clients of a group are numbered consecutively,
    groups in order of first appearance.

Helpers split each client into local train/test parts, summarise label skew as
per-client histograms and their mean pairwise Jensen-Shannon divergence, and
draw those histograms as a heatmap. The module needs only numpy; matplotlib is
imported lazily by :func:`plot_label_heatmap`.
"""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral, Real
from pathlib import Path

import numpy as np

__all__ = [
    "DIRICHLET_MODES",
    "GROUP_CLIENTS",
    "PartitionError",
    "client_groups",
    "group_client_counts",
    "label_histograms",
    "mean_pairwise_js",
    "partition_dirichlet",
    "partition_groups",
    "partition_iid",
    "partition_natural",
    "partition_similarity",
    "plot_label_heatmap",
    "split_local_test",
]


class PartitionError(ValueError):
    """Raised when a partition request is invalid or cannot be satisfied."""


# --------------------------------------------------------------------------- #
# Validation helpers
# --------------------------------------------------------------------------- #


def _check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as ``int`` if it is an integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise PartitionError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PartitionError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_real(name: str, value: object) -> float:
    """Return ``value`` as a finite ``float``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not np.isfinite(value):
        raise PartitionError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _check_rng(rng: object) -> np.random.Generator:
    """Make sure randomness comes from a numpy ``Generator``."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"rng must be a numpy.random.Generator (e.g. np.random.default_rng(seed)), "
            f"got {type(rng).__name__}"
        )
    return rng


def _check_labels(labels: np.ndarray | Sequence, name: str = "labels") -> np.ndarray:
    """Return ``labels`` as a non-empty 1-D array."""
    array = np.asarray(labels)
    if array.ndim != 1:
        raise PartitionError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        raise PartitionError(f"{name} must not be empty")
    return array


def _check_enough_samples(num_samples: int, num_clients: int, per_client: int = 1) -> None:
    """Raise if ``num_samples`` cannot give every client ``per_client`` samples."""
    if num_samples < num_clients * per_client:
        raise PartitionError(
            f"cannot give each of num_clients={num_clients} clients at least "
            f"{per_client} sample(s): only {num_samples} samples available"
        )


def _finalise(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Sort each client's indices and cast them to ``int64``."""
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]


# --------------------------------------------------------------------------- #
# IID
# --------------------------------------------------------------------------- #


def partition_iid(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle ``range(num_samples)`` and cut it into ``num_clients`` near-equal parts.

    Client sizes differ by at most one. Raises :class:`PartitionError` if there
    are fewer samples than clients.
    """
    num_samples = _check_int("num_samples", num_samples, 1)
    num_clients = _check_int("num_clients", num_clients, 1)
    rng = _check_rng(rng)
    _check_enough_samples(num_samples, num_clients)
    return _finalise(np.array_split(rng.permutation(num_samples), num_clients))


# --------------------------------------------------------------------------- #
# Dirichlet label skew
# --------------------------------------------------------------------------- #


def _dirichlet_proportions(alpha: float, num_clients: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``p ~ Dir(alpha * 1_M)``, falling back to a one-hot draw on underflow.

    For very small ``alpha`` some numpy versions return NaN because every gamma
    variate underflows to zero; the limit of ``Dir(alpha)`` as ``alpha -> 0`` is
    a uniformly random vertex of the simplex, which is what we return then.
    """
    proportions = rng.dirichlet(np.full(num_clients, alpha))
    if np.all(np.isfinite(proportions)) and proportions.sum() > 0:
        return proportions
    one_hot = np.zeros(num_clients)
    one_hot[rng.integers(num_clients)] = 1.0
    return one_hot


DIRICHLET_MODES = ("per_class", "per_class_capped", "per_client")
"""How :func:`partition_dirichlet` draws label skew:

``per_class``
    For each class, client proportions ``p ~ Dir(alpha * 1_M)`` cut the class's
    shuffled examples. Client sizes are left free (e.g. Flower Datasets'
    ``DirichletPartitioner`` without self-balancing).
``per_class_capped``
    As ``per_class``, but a client that already holds at least the mean client
    size ``N / M`` gets no share of the classes still to be dealt (its proportion
    is zeroed and the rest renormalised). This is the FedNLP benchmark's label
    skew (Lin et al., 2022, run on FedML), which the C2A paper follows.
``per_client``
    The FeDeRA paper's App. A.3: every client draws its own class mix
    ``x_i ~ Dir(alpha * m)``, ``m`` the dataset's class shares, and is filled to an
    equal size ``N / M`` (sizes differ by at most one) by drawing its examples'
    classes from ``x_i``; when a class runs out, its share goes to the client's
    other classes, and once all of them are gone the client draws a fresh mix
    ``Dir(alpha * m')`` over the classes left (``m'`` their remaining shares).
    Clients are filled in a random order, so none is always served last.
"""


def _dirichlet_draw(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, mode: str
) -> list[np.ndarray]:
    """One Dirichlet draw in ``mode`` (``DIRICHLET_MODES``)."""
    if mode == "per_client":
        return _per_client_draw(labels, num_clients, alpha, rng)
    mean_size = len(labels) / num_clients
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for cls in np.unique(labels):
        indices = rng.permutation(np.flatnonzero(labels == cls))
        proportions = _dirichlet_proportions(alpha, num_clients, rng)
        ends = np.cumsum(proportions)[:-1] * len(indices)
        if mode == "per_class_capped":  # rounded, so that a full last client gets no stray example
            ends = np.round(np.cumsum(_without_full(proportions, sizes < mean_size, rng))[:-1] * len(indices))
        cuts = ends.astype(np.int64)
        for client, chunk in enumerate(np.split(indices, cuts)):
            buckets[client].append(chunk)
            sizes[client] += len(chunk)
    return [np.concatenate(chunks) for chunks in buckets]


def _without_full(proportions: np.ndarray, open_: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``proportions`` with the full clients' (``~open_``) shares zeroed and the rest
    renormalised; when all the mass was on full clients, the ``alpha -> 0`` limit among
    the open ones (one of them at random takes the class)."""
    kept = proportions * open_
    if kept.sum() > 0:
        return kept / kept.sum()
    kept[rng.choice(np.flatnonzero(open_))] = 1.0
    return kept


def _class_mix(alpha: float, shares: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``x ~ Dir(alpha * shares)`` over the classes with a positive share; on underflow the
    ``alpha -> 0`` limit, a vertex drawn with probabilities ``shares``."""
    mix = np.zeros(len(shares))
    some = shares > 0
    draw = rng.dirichlet(alpha * shares[some])
    if np.all(np.isfinite(draw)) and draw.sum() > 0:
        mix[some] = draw
    else:
        mix[rng.choice(len(shares), p=shares)] = 1.0
    return mix


def _per_client_draw(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """``per_client`` mode: equal client sizes, each filled from its own ``Dir(alpha * m)`` mix."""
    classes, counts = np.unique(labels, return_counts=True)
    prior = counts / counts.sum()
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in classes]
    left = counts.copy()
    sizes = [len(chunk) for chunk in np.array_split(np.arange(len(labels)), num_clients)]
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for client in rng.permutation(num_clients):
        mix = _class_mix(alpha, prior, rng)
        taken: list[int] = []
        need = sizes[client]
        while need:
            if not np.any(mix * (left > 0)):  # the mix's classes ran out: a fresh mix over those left
                mix = _class_mix(alpha, left / left.sum(), rng)
            weights = mix * (left > 0)
            wanted = np.minimum(rng.multinomial(need, weights / weights.sum()), left)
            for c in np.flatnonzero(wanted):
                taken += pools[c][: wanted[c]]
                del pools[c][: wanted[c]]
            left -= wanted
            need -= int(wanted.sum())
        parts[client] = np.asarray(taken, dtype=np.int64)
    return parts


def _majority_first(indices: np.ndarray, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Shuffle ``indices``, then stably move those of the most frequent label to the front."""
    shuffled = rng.permutation(indices)
    values, counts = np.unique(labels[shuffled], return_counts=True)
    is_minority = labels[shuffled] != values[np.argmax(counts)]
    return shuffled[np.argsort(is_minority, kind="stable")]


def _top_up(
    parts: list[np.ndarray], labels: np.ndarray, min_size: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Move random samples from the largest clients to starved ones until all have ``min_size``.

    Each move takes randomly chosen samples of the donor's most frequent label,
    so a starved client receives (mostly) one label and the label skew that a
    small ``alpha`` asks for survives the repair. Donors never drop below
    ``min_size``. This terminates because the caller guarantees
    ``sum(sizes) >= num_clients * min_size``: while a client is short, the
    largest client has a surplus above ``min_size``.
    """
    parts = list(parts)
    while True:
        sizes = np.array([len(part) for part in parts])
        starved = int(np.argmin(sizes))
        if sizes[starved] >= min_size:
            return parts
        donor = int(np.argmax(sizes))
        moved = min(min_size - sizes[starved], sizes[donor] - min_size)
        donor_order = _majority_first(parts[donor], labels, rng)
        parts[starved] = np.concatenate([parts[starved], donor_order[:moved]])
        parts[donor] = donor_order[moved:]


def partition_dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 10,
    max_retries: int = 100,
    mode: str = "per_class",
) -> list[np.ndarray]:
    """Label-skewed partition drawn from a Dirichlet distribution.

    ``mode`` (``DIRICHLET_MODES``) says what is drawn: per class, its split over
    clients (``per_class``; ``per_class_capped`` stops feeding clients above the
    mean size), or per client, its class mix (``per_client``). If some client ends up
    with fewer than ``min_size`` samples, the whole partition is redrawn, up to
    ``max_retries`` times. If every redraw fails (tiny ``alpha`` or many
    clients), starved clients are topped up with random samples taken from the
    currently largest clients (drawn from each donor's most frequent label, to
    preserve the skew), so every client always has ``>= min_size``.

    Raises:
        PartitionError: on invalid arguments, or if
            ``len(labels) < num_clients * min_size``.
    """
    labels = _check_labels(labels)
    num_clients = _check_int("num_clients", num_clients, 1)
    alpha = _check_real("alpha", alpha)
    if alpha <= 0:
        raise PartitionError(f"alpha must be > 0, got {alpha}")
    min_size = _check_int("min_size", min_size, 0)
    max_retries = _check_int("max_retries", max_retries, 0)
    rng = _check_rng(rng)
    if mode not in DIRICHLET_MODES:
        raise PartitionError(f"mode must be one of {DIRICHLET_MODES}, got {mode!r}")
    _check_enough_samples(len(labels), num_clients, min_size)

    for _ in range(max_retries + 1):
        parts = _dirichlet_draw(labels, num_clients, alpha, rng, mode)
        if min(len(part) for part in parts) >= min_size:
            return _finalise(parts)
    return _finalise(_top_up(parts, labels, min_size, rng))


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
    labels = _check_labels(labels)
    num_clients = _check_int("num_clients", num_clients, 1)
    s = _check_real("s", s)
    if not 0.0 <= s <= 1.0:
        raise PartitionError(f"s must be in [0, 1], got {s}")
    rng = _check_rng(rng)
    _check_enough_samples(len(labels), num_clients)

    shuffled = rng.permutation(len(labels))
    num_sorted = int(round(s * len(labels)))
    sorted_share = shuffled[:num_sorted]
    sorted_share = sorted_share[np.argsort(labels[sorted_share], kind="stable")]
    skewed_chunks = np.array_split(sorted_share, num_clients)
    iid_chunks = np.array_split(shuffled[num_sorted:], num_clients)[::-1]
    return _finalise(
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
    groups = _check_labels(groups, name="groups")
    members = _groups_in_order(groups)
    if num_clients is None:
        return _finalise(members)
    num_clients = _check_int("num_clients", num_clients, 1)
    if num_clients > len(members):
        raise PartitionError(
            f"num_clients={num_clients} exceeds the number of distinct groups "
            f"({len(members)}); natural partitions cannot split a group"
        )
    if num_clients == len(members):
        return _finalise(members)
    return _finalise(_merge_balanced(members, num_clients))


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
    num_clients = _check_int("num_clients", num_clients, 1)
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
    labels = _check_labels(labels)
    groups = _check_labels(groups, name="groups")
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
    return _finalise(parts)


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
    fraction = _check_real("fraction", fraction)
    if not 0.0 < fraction < 1.0:
        raise PartitionError(f"fraction must be in (0, 1), got {fraction}")
    rng = _check_rng(rng)

    train_parts: list[np.ndarray] = []
    test_parts: list[np.ndarray] = []
    for part in parts:
        shuffled = rng.permutation(np.asarray(part, dtype=np.int64))
        size = len(shuffled)
        num_test = min(max(int(round(fraction * size)), 1), size - 1) if size >= 2 else 0
        test_parts.append(shuffled[:num_test])
        train_parts.append(shuffled[num_test:])
    return _finalise(train_parts), _finalise(test_parts)


# --------------------------------------------------------------------------- #
# Heterogeneity statistics
# --------------------------------------------------------------------------- #


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client label counts: an ``(M, C)`` integer array.

    ``labels`` must be integers in ``[0, num_classes)``.
    """
    labels = _check_labels(labels)
    num_classes = _check_int("num_classes", num_classes, 1)
    if not np.issubdtype(labels.dtype, np.integer):
        raise PartitionError(f"labels must be integers, got dtype {labels.dtype}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise PartitionError(
            f"labels must lie in [0, num_classes={num_classes}), got range [{labels.min()}, {labels.max()}]"
        )
    hist = np.zeros((len(parts), num_classes), dtype=np.int64)
    for client, part in enumerate(parts):
        hist[client] = np.bincount(labels[np.asarray(part, dtype=np.int64)], minlength=num_classes)
    return hist


def _row_distributions(hist: np.ndarray, allow_empty: bool = False) -> np.ndarray:
    """Validate a histogram matrix and normalise each row to sum to one.

    All-zero rows raise unless ``allow_empty`` is set, in which case they stay zero.
    """
    hist = np.asarray(hist, dtype=np.float64)
    if hist.ndim != 2:
        raise PartitionError(f"hist must be 2-D (clients x classes), got shape {hist.shape}")
    if not np.all(np.isfinite(hist)) or np.any(hist < 0):
        raise PartitionError("hist must contain finite, non-negative counts")
    totals = hist.sum(axis=1, keepdims=True)
    if not allow_empty and np.any(totals == 0):
        empty = np.flatnonzero(totals[:, 0] == 0).tolist()
        raise PartitionError(f"hist rows {empty} are all zero; their distribution is undefined")
    return np.divide(hist, totals, out=np.zeros_like(hist), where=totals > 0)


def _kl_base2(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Row-wise ``KL(p || q)`` in bits, with the convention ``0 * log 0 = 0``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log2(p / q), 0.0)
    return terms.sum(axis=-1)


def mean_pairwise_js(hist: np.ndarray) -> float:
    """Mean Jensen-Shannon divergence (base 2, in ``[0, 1]``) over client pairs ``i < j``.

    Rows of ``hist`` are normalised into label distributions first. With fewer
    than two clients there are no pairs and the result is ``0.0``.
    """
    dist = _row_distributions(hist)
    first, second = np.triu_indices(len(dist), k=1)
    if first.size == 0:
        return 0.0
    p, q = dist[first], dist[second]
    mixture = 0.5 * (p + q)
    js = 0.5 * _kl_base2(p, mixture) + 0.5 * _kl_base2(q, mixture)
    return float(np.clip(js, 0.0, 1.0).mean())


# --------------------------------------------------------------------------- #
# Plotting
# --------------------------------------------------------------------------- #


def plot_label_heatmap(
    hist: np.ndarray,
    path: str | Path,
    class_names: Sequence[str] | None = None,
    title: str = "",
) -> None:
    """Save a clients x classes heatmap of per-client label proportions as a PNG.

    Uses matplotlib's Agg renderer through an explicit ``Figure`` (no pyplot
    global state). Clients with no samples are drawn as all-zero rows. Parent
    directories of ``path`` are created if needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dist = _row_distributions(hist, allow_empty=True)
    num_clients, num_classes = dist.shape
    if class_names is not None and len(class_names) != num_classes:
        raise PartitionError(f"class_names has {len(class_names)} entries but hist has {num_classes} classes")

    fig = Figure(figsize=(min(2 + 0.35 * num_classes, 20), min(1.5 + 0.3 * num_clients, 20)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(dist, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    fig.colorbar(image, ax=ax, label="label proportion")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if class_names is not None:
        ax.set_xticks(np.arange(num_classes), labels=list(class_names), rotation=90)
    if title:
        ax.set_title(title)
    fig.tight_layout()

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
