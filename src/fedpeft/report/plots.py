"""Plots: global accuracy against rounds and against cumulative bytes, for one or more runs;
LoRA update variation, per-client readouts and client drift."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def save_figure(fig, path: Path) -> Path:
    """Lay out, save as PNG and close ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _series(records: list[dict], x_key: str, metric: str) -> tuple[list[float], list[float]]:
    pts = [(r[x_key], r["global"][metric]) for r in records if r.get("global")]
    if x_key == "cum_bytes":  # in MB, on a log axis: runs that send nothing have no place there
        pts = [(x / 1e6, y) for x, y in pts if x > 0]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_accuracy(runs: dict[str, list[dict]], out_dir: Path, prefix: str = "") -> list[Path]:
    """``<score>_vs_round.png`` and ``<score>_vs_bytes.png`` with one line per run, of the
    headline score (accuracy; ROUGE-L for generation: ``fedpeft.report.results.headline``)."""
    from fedpeft.report.results import headline

    metric = headline(next(iter(runs.values()), []))
    paths = []
    for x_key, xlabel, fname in (
        ("round", "round", f"{metric}_vs_round.png"),
        ("cum_bytes", "cumulative MB sent (down + up), log scale", f"{metric}_vs_bytes.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, records in runs.items():
            xs, ys = _series(records, x_key, metric)
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        if x_key == "cum_bytes":
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(
                matplotlib.ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5))
            )
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"global test {metric}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / f"{prefix}{fname}"))
    return paths


def plot_variation(runs: dict[str, list[dict]], out_dir: Path) -> Path | None:
    """``update_variation.png``: magnitude and direction variation of each LoRA matrix between
    consecutive global states (rows), per matrix kind (columns: query/value x A/B); one colour
    per run, a thin line per layer and a thick line for the mean over layers."""
    import numpy as np

    kinds = sorted(
        {k.split(".", 1)[1] for recs in runs.values() for r in recs for k in r.get("update_variation", {})}
    )
    if not kinds:
        return None
    fig, axes = plt.subplots(2, len(kinds), figsize=(3.2 * len(kinds), 5.5), squeeze=False, sharex=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(runs.items()):
        colour = colours[i % len(colours)]
        rounds = [r["round"] for r in records if "update_variation" in r]
        for col, kind in enumerate(kinds):
            names = sorted(
                {k for r in records for k in r.get("update_variation", {}) if k.endswith("." + kind)}
            )
            if not names:  # this run has no such matrix (e.g. not a LoRA method)
                continue
            for row, metric in enumerate(("magnitude", "direction")):
                ax = axes[row][col]
                # a matrix missing from a round (Fed-SB's fixed factors before its setup) is NaN there
                curves = np.array(
                    [
                        [
                            r["update_variation"].get(n, [np.nan, np.nan])[row]
                            for r in records
                            if "update_variation" in r
                        ]
                        for n in names
                    ]
                )
                for curve in curves:
                    ax.plot(rounds, curve, color=colour, alpha=0.25, linewidth=0.8)
                present = (~np.isnan(curves)).sum(0)
                mean = np.where(present > 0, np.nansum(curves, 0) / np.maximum(present, 1), np.nan)
                ax.plot(rounds, mean, color=colour, linewidth=2, label=label if col == 0 else None)
                if np.nanmax(curves, initial=0.0) > 0:  # a log axis needs a positive value
                    ax.set_yscale("log")
                ax.set_title(f"{kind}: {metric}", fontsize=9)
                if row == 1:
                    ax.set_xlabel("round")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("variation between consecutive global states (thin: one layer; thick: mean)", fontsize=9)
    return save_figure(fig, out_dir / "update_variation.png")


def plot_readouts(records: list[dict], out_dir: Path) -> Path | None:
    """``client_readout.png``: each per-client readout (e.g. PF2LoRA's effective rank) against
    the rounds in which that client trained, one line per client."""
    keys = sorted({k for r in records for v in r.get("client_readout", {}).values() for k in v})
    if not keys:
        return None
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.8), squeeze=False)
    clients = sorted({c for r in records for c in r.get("client_readout", {})}, key=int)
    for ax, key in zip(axes[0], keys, strict=True):
        for cid in clients:
            pts = [
                (r["round"], r["client_readout"][cid][key])
                for r in records
                if cid in r.get("client_readout", {})
            ]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1, label=f"client {cid}")
        ax.set_xlabel("round")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    if len(clients) <= 12:
        axes[0][-1].legend(fontsize=7)
    return save_figure(fig, out_dir / "client_readout.png")


def plot_drift(runs: dict[str, list[dict]], out_dir: Path) -> Path | None:
    """``drift_vs_round.png`` (``eval.drift``): per run, the mean over the round's clients of
    the CKA between a client's logits after its local round and the global model's (a line),
    and each client's value (dots); lower is more drift. None when no run recorded any."""
    drifting = {
        label: [r for r in records if "mean" in r.get("drift", {})] for label, records in runs.items()
    }
    drifting = {label: records for label, records in drifting.items() if records}
    if not drifting:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (label, records) in enumerate(drifting.items()):
        colour = colours[i % len(colours)]
        points = [(r["round"], v) for r in records for v in r["drift"]["clients"].values()]
        ax.scatter([p[0] for p in points], [p[1] for p in points], color=colour, alpha=0.3, s=8)
        ax.plot([r["round"] for r in records], [r["drift"]["mean"] for r in records], color=colour,
                marker="o", markersize=3, label=label)  # fmt: skip
    ax.set_xlabel("round")
    ax.set_ylabel("CKA(local logits, global logits)")
    ax.set_title("client drift (line: mean over the round's clients; dots: each client)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out_dir / "drift_vs_round.png")


def plot_client_scores(runs: dict[str, list[float]], metric: str, path: Path) -> Path | None:
    """Each run's clients' final local ``metric`` (each on its own test split, with its own
    model): a box per run and a dot per client. None when no run recorded them."""
    runs = {label: scores for label, scores in runs.items() if scores}
    if not runs:
        return None
    labels = list(runs)
    fig, ax = plt.subplots(figsize=(7, 0.55 * len(labels) + 1.6))
    ax.boxplot([runs[label] for label in labels], orientation="horizontal", widths=0.5, showfliers=False)
    jitter = np.random.default_rng(0)
    for i, label in enumerate(labels, start=1):
        ys = i + jitter.uniform(-0.18, 0.18, len(runs[label]))
        ax.scatter(runs[label], ys, s=9, alpha=0.5, color="tab:blue")
    ax.set_yticks(range(1, len(labels) + 1), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(f"client's local test {metric} (final round)")
    ax.grid(alpha=0.3, axis="x")
    return save_figure(fig, path)
