"""What every partitioner checks of its arguments, and the form of its result (sorted
``int64`` index arrays, one per client)."""

from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral, Real

import numpy as np


class PartitionError(ValueError):
    """Raised when a partition request is invalid or cannot be satisfied."""


def check_int(name: str, value: object, minimum: int) -> int:
    """Return ``value`` as ``int`` if it is an integer ``>= minimum``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise PartitionError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise PartitionError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_real(name: str, value: object) -> float:
    """Return ``value`` as a finite ``float``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not np.isfinite(value):
        raise PartitionError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def check_rng(rng: object) -> np.random.Generator:
    """Make sure randomness comes from a numpy ``Generator``."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"rng must be a numpy.random.Generator (e.g. np.random.default_rng(seed)), "
            f"got {type(rng).__name__}"
        )
    return rng


def check_labels(labels: np.ndarray | Sequence, name: str = "labels") -> np.ndarray:
    """Return ``labels`` as a non-empty 1-D array."""
    array = np.asarray(labels)
    if array.ndim != 1:
        raise PartitionError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size == 0:
        raise PartitionError(f"{name} must not be empty")
    return array


def check_enough_samples(num_samples: int, num_clients: int, per_client: int = 1) -> None:
    """Raise if ``num_samples`` cannot give every client ``per_client`` samples."""
    if num_samples < num_clients * per_client:
        raise PartitionError(
            f"cannot give each of num_clients={num_clients} clients at least "
            f"{per_client} sample(s): only {num_samples} samples available"
        )


def finalise(parts: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Sort each client's indices and cast them to ``int64``."""
    return [np.sort(np.asarray(part, dtype=np.int64)) for part in parts]
