"""Dirichlet label skew (:func:`partition_dirichlet`), in the modes of ``DIRICHLET_MODES``."""

from __future__ import annotations

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
    labels = check_labels(labels)
    num_clients = check_int("num_clients", num_clients, 1)
    alpha = check_real("alpha", alpha)
    if alpha <= 0:
        raise PartitionError(f"alpha must be > 0, got {alpha}")
    min_size = check_int("min_size", min_size, 0)
    max_retries = check_int("max_retries", max_retries, 0)
    rng = check_rng(rng)
    if mode not in DIRICHLET_MODES:
        raise PartitionError(f"mode must be one of {DIRICHLET_MODES}, got {mode!r}")
    check_enough_samples(len(labels), num_clients, min_size)

    for _ in range(max_retries + 1):
        parts = _dirichlet_draw(labels, num_clients, alpha, rng, mode)
        if min(len(part) for part in parts) >= min_size:
            return finalise(parts)
    return finalise(_top_up(parts, labels, min_size, rng))
