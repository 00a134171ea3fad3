"""Plots: global accuracy against rounds and against cumulative bytes, for one or more runs."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(records: list[dict], x_key: str) -> tuple[list[float], list[float]]:
    pts = [(r[x_key], r["global"]["accuracy"]) for r in records if r.get("global")]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_accuracy(runs: dict[str, list[dict]], out_dir: Path, prefix: str = "") -> list[Path]:
    """``accuracy_vs_round.png`` and ``accuracy_vs_bytes.png`` with one line per run."""
    paths = []
    for x_key, xlabel, fname in (
        ("round", "round", "accuracy_vs_round.png"),
        ("cum_bytes", "cumulative bytes sent (down + up)", "accuracy_vs_bytes.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, records in runs.items():
            xs, ys = _series(records, x_key)
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if x_key == "cum_bytes":
            ax.set_xscale("symlog")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("global test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{prefix}{fname}"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
