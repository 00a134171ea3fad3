"""Label skew as numbers and as a picture: per-client label histograms, their mean pairwise
Jensen-Shannon divergence, and a heatmap (matplotlib, imported when drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fedpeft.data.partition.checks import PartitionError, check_int, check_labels


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Per-client label counts: an ``(M, C)`` integer array.

    ``labels`` must be integers in ``[0, num_classes)``.
    """
    labels = check_labels(labels)
    num_classes = check_int("num_classes", num_classes, 1)
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
