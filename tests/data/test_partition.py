"""Tests for ``fedpeft.data.partition``: coverage, reproducibility, skew and errors."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from fedpeft.data.partition import (
    DIRICHLET_MODES,
    PartitionError,
    label_histograms,
    mean_pairwise_js,
    partition_dirichlet,
    partition_iid,
    partition_natural,
    partition_similarity,
    plot_label_heatmap,
    split_local_test,
)

NUM_CLASSES = 10


def balanced_labels(num_classes: int = NUM_CLASSES, per_class: int = 200) -> np.ndarray:
    """Labels ``0..num_classes-1``, ``per_class`` of each, in shuffled order."""
    labels = np.repeat(np.arange(num_classes), per_class)
    return np.random.default_rng(1234).permutation(labels)


def assert_is_partition(parts: list[np.ndarray], num_samples: int) -> None:
    """Every index in ``range(num_samples)`` appears exactly once; parts sorted int64."""
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(num_samples))


def max_class_shares(hist: np.ndarray) -> np.ndarray:
    """Share of each client's most frequent label."""
    return hist.max(axis=1) / hist.sum(axis=1)


LABELS = balanced_labels()

# Each factory maps a seed to a partition of LABELS into 10 clients.
SEEDED_SCHEMES: dict[str, Callable[[int], list[np.ndarray]]] = {
    "iid": lambda seed: partition_iid(len(LABELS), 10, np.random.default_rng(seed)),
    "dirichlet": lambda seed: partition_dirichlet(LABELS, 10, 0.5, np.random.default_rng(seed)),
    "similarity": lambda seed: partition_similarity(LABELS, 10, 0.5, np.random.default_rng(seed)),
}


# --------------------------------------------------------------------------- #
# Generic properties of the seeded schemes
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("scheme", sorted(SEEDED_SCHEMES))
def test_every_sample_assigned_exactly_once(scheme: str) -> None:
    # Prepare
    make = SEEDED_SCHEMES[scheme]

    # Execute
    parts = make(0)

    # Assert
    assert len(parts) == 10
    assert_is_partition(parts, len(LABELS))


@pytest.mark.parametrize("scheme", sorted(SEEDED_SCHEMES))
def test_same_seed_reproduces_and_other_seed_differs(scheme: str) -> None:
    # Prepare
    make = SEEDED_SCHEMES[scheme]

    # Execute
    first, again, other = make(7), make(7), make(8)

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_iid_sizes_differ_by_at_most_one() -> None:
    # Prepare
    rng = np.random.default_rng(0)

    # Execute
    parts = partition_iid(103, 10, rng)

    # Assert
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert_is_partition(parts, 103)


# --------------------------------------------------------------------------- #
# Dirichlet
# --------------------------------------------------------------------------- #


def test_dirichlet_tiny_alpha_puts_each_class_on_one_client() -> None:
    # Prepare: min_size=0 isolates the raw Dirichlet draw (no redraws, no top-up).
    labels = balanced_labels(per_class=500)

    # Execute
    parts = partition_dirichlet(labels, 10, 0.001, np.random.default_rng(0), min_size=0)

    # Assert: share of each class held by the client that holds most of it.
    hist = label_histograms(labels, parts, NUM_CLASSES)
    assert_is_partition(parts, len(labels))
    assert (hist.max(axis=0) / hist.sum(axis=0)).mean() > 0.9


def test_dirichlet_tiny_alpha_makes_clients_near_single_class() -> None:
    # Prepare: with 10 classes x 10 clients, two whole classes often collide on
    # one client (a genuine two-class client), so the per-client share is
    # checked with more clients than classes; most clients are then starved
    # and the top-up must keep them single-class too.
    labels = balanced_labels(per_class=500)

    # Execute
    parts = partition_dirichlet(labels, 40, 0.001, np.random.default_rng(0), min_size=10)

    # Assert
    hist = label_histograms(labels, parts, NUM_CLASSES)
    assert_is_partition(parts, len(labels))
    assert min(len(part) for part in parts) >= 10
    assert max_class_shares(hist).mean() > 0.9


def test_dirichlet_huge_alpha_is_near_uniform() -> None:
    # Prepare
    labels = balanced_labels(per_class=500)

    # Execute
    parts = partition_dirichlet(labels, 10, 1000.0, np.random.default_rng(0))

    # Assert
    hist = label_histograms(labels, parts, NUM_CLASSES)
    assert max_class_shares(hist).max() < 0.15  # uniform share is 0.10
    assert mean_pairwise_js(hist) < 0.01


def test_dirichlet_skew_decreases_with_alpha() -> None:
    # Prepare
    alphas = [0.05, 0.5, 5.0, 50.0]

    # Execute
    js = [
        mean_pairwise_js(
            label_histograms(
                LABELS,
                partition_dirichlet(LABELS, 10, alpha, np.random.default_rng(3)),
                NUM_CLASSES,
            )
        )
        for alpha in alphas
    ]

    # Assert
    assert js == sorted(js, reverse=True)


def test_dirichlet_min_size_holds_after_redraws() -> None:
    # Prepare
    rng = np.random.default_rng(5)

    # Execute
    parts = partition_dirichlet(LABELS, 20, 0.3, rng, min_size=40)

    # Assert
    assert min(len(part) for part in parts) >= 40
    assert_is_partition(parts, len(LABELS))


def test_dirichlet_top_up_path_gives_every_client_min_size() -> None:
    # Prepare: with alpha=0.01 each of the 45 classes lands almost entirely on
    # one client, so at most 45 of the 60 clients can reach min_size in any
    # draw; every retry fails and the top-up path must run.
    labels = np.repeat(np.arange(45), 20)

    # Execute
    parts = partition_dirichlet(labels, 60, 0.01, np.random.default_rng(0), min_size=5)

    # Assert
    assert len(parts) == 60
    assert min(len(part) for part in parts) >= 5
    assert_is_partition(parts, len(labels))


def test_dirichlet_rejects_too_few_samples_for_min_size() -> None:
    # Prepare
    labels = np.zeros(99, dtype=np.int64)

    # Execute / Assert
    with pytest.raises(PartitionError, match="num_clients=10"):
        partition_dirichlet(labels, 10, 1.0, np.random.default_rng(0), min_size=10)


# --------------------------------------------------------------------------- #
# Dirichlet modes (partition.dirichlet_mode)
# --------------------------------------------------------------------------- #

# Imbalanced classes (class c has 40 + 30 c examples), so the modes' size rules show.
SKEWED = np.random.default_rng(3).permutation(np.repeat(np.arange(8), 40 + 30 * np.arange(8)))


@pytest.mark.parametrize("mode", DIRICHLET_MODES)
@pytest.mark.parametrize("alpha", [0.05, 1.0, 100.0])
def test_every_dirichlet_mode_is_a_seeded_partition(mode: str, alpha: float) -> None:
    # Execute
    first = partition_dirichlet(SKEWED, 12, alpha, np.random.default_rng(4), min_size=5, mode=mode)
    again = partition_dirichlet(SKEWED, 12, alpha, np.random.default_rng(4), min_size=5, mode=mode)

    # Assert
    assert_is_partition(first, len(SKEWED))
    assert min(len(part) for part in first) >= 5
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_per_class_capped_feeds_no_client_above_the_mean_size() -> None:
    # Prepare: classes are dealt in label order, so the highest label a client holds is
    # the last class it was given; before that it must have been under the mean size N / M.
    mean_size = len(SKEWED) / 10

    # Execute
    for seed in range(5):
        parts = partition_dirichlet(SKEWED, 10, 0.1, np.random.default_rng(seed), min_size=0,
                                    max_retries=0, mode="per_class_capped")  # fmt: skip

        # Assert
        for part in parts:
            held = SKEWED[part]
            if held.size:
                assert np.sum(held != held.max()) < mean_size


def test_per_class_capped_balances_sizes_that_per_class_leaves_free() -> None:
    # Prepare: many small classes, so that the cap has classes left to withhold
    labels = np.random.default_rng(1).permutation(np.repeat(np.arange(40), 50))

    # Execute
    def size_spread(mode: str) -> float:
        parts = [partition_dirichlet(labels, 10, 0.1, np.random.default_rng(seed), min_size=0,
                                     max_retries=0, mode=mode) for seed in range(10)]  # fmt: skip
        return float(np.mean([np.std([len(p) for p in draw]) for draw in parts]))

    # Assert
    assert size_spread("per_class_capped") < 0.7 * size_spread("per_class")


def test_per_client_gives_equal_sizes() -> None:
    # Execute
    parts = partition_dirichlet(SKEWED, 13, 0.3, np.random.default_rng(0), mode="per_client")

    # Assert
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert_is_partition(parts, len(SKEWED))


def test_per_client_mix_follows_the_class_shares_at_large_alpha() -> None:
    # Prepare: Dir(alpha * m) has mean m, the dataset's class shares, and shrinks to it as
    # alpha grows, so every client's histogram approaches the global one (not uniform).
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(8), 400 + 300 * np.arange(8)))
    shares = np.bincount(labels) / len(labels)

    # Execute
    parts = partition_dirichlet(labels, 4, 1e4, np.random.default_rng(0), mode="per_client")

    # Assert
    hist = label_histograms(labels, parts, 8)
    np.testing.assert_allclose(hist / hist.sum(axis=1, keepdims=True), np.tile(shares, (4, 1)), atol=0.03)


def test_per_client_tiny_alpha_gives_few_class_clients() -> None:
    # Prepare: 20 classes of 300, 10 clients of 600. At alpha -> 0 a client's mix is one
    # class; when it runs out, a fresh mix picks another, so a client holds about two.
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(20), 300))

    # Execute
    tiny = partition_dirichlet(labels, 10, 1e-4, np.random.default_rng(1), mode="per_client")
    huge = partition_dirichlet(labels, 10, 1e4, np.random.default_rng(1), mode="per_client")

    # Assert
    classes_held = lambda parts: (label_histograms(labels, parts, 20) > 0).sum(axis=1)  # noqa: E731
    assert np.median(classes_held(tiny)) <= 3
    assert np.median(classes_held(huge)) == 20
    assert_is_partition(tiny, len(labels))


def test_dirichlet_default_mode_is_unchanged() -> None:
    # Prepare: the per_class draw as it was before the modes (one Dir(alpha 1_M) per class,
    # in label order, cut by cumulative proportions), reimplemented here.
    rng = np.random.default_rng(9)
    expected: list[list[int]] = [[] for _ in range(6)]
    for cls in range(NUM_CLASSES):
        idx = rng.permutation(np.flatnonzero(cls == LABELS))
        cuts = (np.cumsum(rng.dirichlet(np.full(6, 0.5)))[:-1] * len(idx)).astype(np.int64)
        for client, chunk in enumerate(np.split(idx, cuts)):
            expected[client] += chunk.tolist()

    # Execute
    parts = partition_dirichlet(LABELS, 6, 0.5, np.random.default_rng(9), min_size=0)

    # Assert
    for part, want in zip(parts, expected, strict=True):
        np.testing.assert_array_equal(part, np.sort(want))


def test_unknown_dirichlet_mode_is_refused() -> None:
    # Execute / Assert
    with pytest.raises(PartitionError, match="per_client"):
        partition_dirichlet(LABELS, 5, 1.0, RNG, mode="per_sample")


# --------------------------------------------------------------------------- #
# Similarity
# --------------------------------------------------------------------------- #


def test_similarity_zero_is_close_to_iid() -> None:
    # Prepare
    rng = np.random.default_rng(0)

    # Execute
    parts = partition_similarity(LABELS, 10, 0.0, rng)

    # Assert
    hist = label_histograms(LABELS, parts, NUM_CLASSES)
    assert mean_pairwise_js(hist) < 0.05
    assert np.all(hist > 0)


def test_similarity_one_gives_clients_few_labels() -> None:
    # Prepare
    rng = np.random.default_rng(0)

    # Execute
    parts = partition_similarity(LABELS, 10, 1.0, rng)

    # Assert: 10 equal classes over 10 equal clients -> exactly one label each.
    hist = label_histograms(LABELS, parts, NUM_CLASSES)
    assert np.all((hist > 0).sum(axis=1) == 1)
    assert mean_pairwise_js(hist) == pytest.approx(1.0)


def test_similarity_js_increases_with_s() -> None:
    # Prepare
    levels = [0.0, 0.25, 0.5, 0.75, 1.0]

    # Execute
    js = [
        mean_pairwise_js(
            label_histograms(
                LABELS, partition_similarity(LABELS, 10, s, np.random.default_rng(2)), NUM_CLASSES
            )
        )
        for s in levels
    ]

    # Assert
    assert all(lo < hi for lo, hi in zip(js[:-1], js[1:], strict=True))


def test_similarity_sizes_balanced_with_few_samples() -> None:
    # Prepare
    labels = np.arange(7) % 3

    # Execute
    parts = partition_similarity(labels, 7, 0.5, np.random.default_rng(0))

    # Assert
    assert [len(part) for part in parts] == [1] * 7
    assert_is_partition(parts, 7)


# --------------------------------------------------------------------------- #
# Natural
# --------------------------------------------------------------------------- #


def test_natural_one_client_per_value_in_first_appearance_order() -> None:
    # Prepare
    groups = ["bob", "ann", "bob", "cat", "ann", "bob"]

    # Execute
    parts = partition_natural(groups)

    # Assert
    assert [part.tolist() for part in parts] == [[0, 2, 5], [1, 4], [3]]
    assert_is_partition(parts, len(groups))


def test_natural_merge_balances_client_sizes() -> None:
    # Prepare: group sizes 5, 4, 3, 3, 2, 1 (18 samples) can be split 6/6/6.
    groups = np.repeat(np.arange(6), [5, 4, 3, 3, 2, 1])

    # Execute
    parts = partition_natural(groups, num_clients=3)

    # Assert
    assert [len(part) for part in parts] == [6, 6, 6]
    assert_is_partition(parts, len(groups))
    for part in parts:  # groups are never split across clients
        for value in np.unique(groups[part]):
            assert np.all(np.isin(np.flatnonzero(groups == value), part))


def test_natural_is_deterministic_and_matches_count() -> None:
    # Prepare
    groups = np.random.default_rng(0).integers(0, 12, size=300)

    # Execute
    first = partition_natural(groups, num_clients=5)
    again = partition_natural(groups, num_clients=5)
    exact = partition_natural(groups, num_clients=12)

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert len(first) == 5 and len(exact) == 12


def test_natural_rejects_more_clients_than_groups() -> None:
    # Prepare
    groups = [0, 1, 1, 2]

    # Execute / Assert
    with pytest.raises(PartitionError, match=r"num_clients=4.*\(3\)"):
        partition_natural(groups, num_clients=4)


# --------------------------------------------------------------------------- #
# Local test split
# --------------------------------------------------------------------------- #


def test_split_local_test_is_disjoint_and_covering() -> None:
    # Prepare
    parts = partition_iid(1000, 8, np.random.default_rng(0)) + [
        np.array([1000, 1001], dtype=np.int64),
        np.array([1002], dtype=np.int64),
    ]

    # Execute
    train, test = split_local_test(parts, 0.2, np.random.default_rng(1))

    # Assert
    for part, tr, te in zip(parts, train, test, strict=True):
        assert np.intersect1d(tr, te).size == 0
        np.testing.assert_array_equal(np.sort(np.concatenate([tr, te])), np.sort(part))
    assert [len(te) for te in test[:8]] == [25] * 8  # 20% of 125
    assert (len(test[8]), len(train[8])) == (1, 1)  # at least one test sample
    assert (len(test[9]), len(train[9])) == (0, 1)  # singleton stays in train


def test_split_local_test_is_seeded() -> None:
    # Prepare
    parts = partition_iid(200, 4, np.random.default_rng(0))

    # Execute
    _, test_a = split_local_test(parts, 0.3, np.random.default_rng(9))
    _, test_b = split_local_test(parts, 0.3, np.random.default_rng(9))
    _, test_c = split_local_test(parts, 0.3, np.random.default_rng(10))

    # Assert
    assert all(np.array_equal(a, b) for a, b in zip(test_a, test_b, strict=True))
    assert not all(np.array_equal(a, c) for a, c in zip(test_a, test_c, strict=True))


# --------------------------------------------------------------------------- #
# Statistics and plotting
# --------------------------------------------------------------------------- #


def test_label_histograms_counts() -> None:
    # Prepare
    labels = np.array([0, 1, 1, 2, 2, 2])
    parts = [np.array([0, 1]), np.array([2, 3, 4, 5])]

    # Execute
    hist = label_histograms(labels, parts, 4)

    # Assert
    np.testing.assert_array_equal(hist, [[1, 1, 0, 0], [0, 1, 3, 0]])


def test_js_identical_rows_is_zero() -> None:
    # Prepare
    hist = np.array([[2, 3, 5], [4, 6, 10], [20, 30, 50]])

    # Execute
    js = mean_pairwise_js(hist)

    # Assert
    assert js == pytest.approx(0.0, abs=1e-12)


def test_js_disjoint_supports_is_one() -> None:
    # Prepare
    hist = np.array([[5, 0, 0], [0, 7, 0], [0, 0, 1]])

    # Execute
    js = mean_pairwise_js(hist)

    # Assert
    assert js == pytest.approx(1.0)


def test_js_hand_computed_values() -> None:
    # Prepare: p = (1, 0), q = (1/2, 1/2), m = (3/4, 1/4)
    #   KL(p||m) = log2(4/3);  KL(q||m) = 1/2 log2(2/3) + 1/2 log2(2)
    #   JS = 1/2 log2(4/3) + 1/4 log2(2/3) + 1/4 = 0.311278...
    pair = np.array([[4, 0], [3, 3]])
    # Three clients (1,0), (0,1), (1,0): pair JS values 1, 0, 1 -> mean 2/3.
    triple = np.array([[1, 0], [0, 1], [1, 0]])

    # Execute
    js_pair, js_triple = mean_pairwise_js(pair), mean_pairwise_js(triple)

    # Assert
    assert js_pair == pytest.approx(0.3112781244591328)
    assert js_triple == pytest.approx(2 / 3)


def test_js_single_client_is_zero() -> None:
    # Prepare / Execute / Assert
    assert mean_pairwise_js(np.array([[1, 2, 3]])) == 0.0


def test_heatmap_writes_png(tmp_path: Path) -> None:
    # Prepare
    parts = partition_dirichlet(LABELS, 6, 0.3, np.random.default_rng(0))
    hist = label_histograms(LABELS, parts, NUM_CLASSES)
    path = tmp_path / "plots" / "labels.png"

    # Execute
    plot_label_heatmap(hist, path, class_names=[f"c{i}" for i in range(10)], title="alpha=0.3")

    # Assert
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- #
# Argument validation
# --------------------------------------------------------------------------- #

RNG = np.random.default_rng(0)
BAD_CALLS: dict[str, tuple[Callable[[], object], str]] = {
    "iid clients 0": (lambda: partition_iid(10, 0, RNG), "num_clients"),
    "iid too few samples": (lambda: partition_iid(3, 5, RNG), "num_clients=5"),
    "iid float clients": (lambda: partition_iid(10, 2.5, RNG), "num_clients"),
    "dirichlet alpha 0": (lambda: partition_dirichlet(LABELS, 5, 0.0, RNG), "alpha"),
    "dirichlet alpha neg": (lambda: partition_dirichlet(LABELS, 5, -1.0, RNG), "alpha"),
    "dirichlet alpha nan": (lambda: partition_dirichlet(LABELS, 5, float("nan"), RNG), "alpha"),
    "dirichlet min_size": (
        lambda: partition_dirichlet(LABELS, 5, 1.0, RNG, min_size=-1),
        "min_size",
    ),
    "dirichlet retries": (
        lambda: partition_dirichlet(LABELS, 5, 1.0, RNG, max_retries=-1),
        "max_retries",
    ),
    "dirichlet 2-D labels": (lambda: partition_dirichlet(np.zeros((4, 4)), 2, 1.0, RNG), "1-D"),
    "similarity s > 1": (lambda: partition_similarity(LABELS, 5, 1.5, RNG), "s must"),
    "similarity s < 0": (lambda: partition_similarity(LABELS, 5, -0.1, RNG), "s must"),
    "natural clients 0": (lambda: partition_natural([0, 1], num_clients=0), "num_clients"),
    "natural empty": (lambda: partition_natural([]), "groups"),
    "split fraction 0": (lambda: split_local_test([np.arange(5)], 0.0, RNG), "fraction"),
    "split fraction 1": (lambda: split_local_test([np.arange(5)], 1.0, RNG), "fraction"),
    "hist label range": (lambda: label_histograms(np.array([0, 3]), [np.arange(2)], 3), "labels"),
    "js negative": (lambda: mean_pairwise_js(np.array([[1, -1], [1, 1]])), "non-negative"),
    "js empty row": (lambda: mean_pairwise_js(np.array([[0, 0], [1, 1]])), "all zero"),
    "heatmap names": (
        lambda: plot_label_heatmap(np.ones((2, 3)), "unused.png", class_names=["a"]),
        "class_names",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_arguments_raise_partition_error(case: str) -> None:
    # Prepare
    call, message = BAD_CALLS[case]

    # Execute / Assert
    with pytest.raises(PartitionError, match=message):
        call()


def test_non_generator_rng_is_rejected() -> None:
    # Execute / Assert
    with pytest.raises(TypeError, match="Generator"):
        partition_iid(10, 2, 0)  # type: ignore[arg-type]
