"""Sweeps: run an experiment over a grid of config values, then tabulate and plot.

``fedpeft sweep CONFIG --grid partition.alpha=0.1,0.5 --grid seed=0,1,2`` runs every
combination (each in its own output directory; finished ones are skipped, so an
interrupted sweep resumes), then reports each metric's mean and standard deviation over
seeds. ``--grid method=fedlr,federa`` swaps the whole method block for that method's
defaults. Where the x-axis key is a rank or a bottleneck size, the plot's x axis is the
trainable-parameter budget instead.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedpeft.config import ConfigError, ExperimentConfig, load_config, parse_config, set_dotted
from fedpeft.config.io import yaml_value
from fedpeft.report import results as R

METRICS = ("accuracy", "macro_f1", "mcc")


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """``["a.b=1,2", "seed=0,1"]`` -> ``{"a.b": [1, 2], "seed": [0, 1]}`` (YAML values)."""
    grid = {}
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or not values or not key.strip():
            raise ValueError(f"--grid {item!r}: expected KEY=V1,V2,...")
        grid[key.strip()] = [yaml_value(v, f"--grid {item!r}") for v in values.split(",")]
    return grid


def run_dir_name(point: dict[str, Any]) -> str:
    return "_".join(f"{k.split('.')[-1]}={v}" for k, v in point.items()) or "base"


def run_dir(base: Path, point: dict[str, Any]) -> Path:
    """The folder of grid point ``point``: one folder right inside the sweep's ``base``. A
    name that would lead elsewhere (a value holding a path separator: ``name=../../x``) or
    that no file system takes is a ConfigError."""
    name = run_dir_name(point)
    seps = {os.sep, os.altsep, "/"} - {None}
    if any(sep in name for sep in seps) or name in (".", "..") or "\0" in name:
        held = "a NUL" if "\0" in name else "'/'" if "/" in name else "a path separator"
        raise ConfigError(
            f"sweep point {name!r}: its run folder would not be one folder inside {base} (a value holds "
            f"{held}); sweep values without one"
        )
    if len(os.fsencode(name)) > 255:
        raise ConfigError(f"sweep point {name[:60]!r}...: its run folder name is longer than 255 bytes")
    return base / name


def expand(
    config: Path | None, grid: dict[str, list[Any]], overrides: dict[str, Any]
) -> list[tuple[dict, ExperimentConfig]]:
    """Every grid point with its validated config (all are validated before any runs)."""
    base = load_config(config, overrides)
    points = []
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values, strict=True))
        data = base.model_dump(mode="json")
        for key, value in point.items():
            if key == "method" and isinstance(value, str):
                data["method"] = {"name": value}
            else:
                set_dotted(data, key, value)
        data["output_dir"] = str(run_dir(Path(base.output_dir), point))
        data["name"] = f"{base.name}[{run_dir_name(point)}]"
        points.append((point, parse_config(data, f"sweep point {run_dir_name(point)}")))
    return points


def run_sweep(
    points: list[tuple[dict, ExperimentConfig]], runner: Callable[[ExperimentConfig], dict]
) -> list[tuple[dict, dict]]:
    """Run each point not finished yet; returns ``(point, summary)`` for all of them."""
    done = []
    for point, cfg in points:
        summary_path = Path(cfg.output_dir) / "summary.json"
        summary = R.read_summary(cfg.output_dir) if summary_path.is_file() else runner(cfg)
        done.append((point, summary))
    return done


def aggregate(done: list[tuple[dict, dict]]) -> list[dict]:
    """Group points by every key but ``seed``; mean and std of each final global metric."""
    groups: dict[tuple, list[dict]] = {}
    for point, summary in done:
        key = tuple((k, v) for k, v in point.items() if k != "seed")
        groups.setdefault(key, []).append(summary)
    rows = []
    for key, summaries in groups.items():
        row: dict[str, Any] = {"point": dict(key), "runs": len(summaries)}
        row["trainable"] = summaries[0]["params"]["trainable"]
        row["bytes"] = float(np.mean([s["total_bytes"] for s in summaries]))
        for m in METRICS:
            values = [s["final_global"][m] for s in summaries if s.get("final_global")]
            row[f"{m}_mean"] = float(np.mean(values)) if values else None
            row[f"{m}_std"] = float(np.std(values)) if values else None
        rows.append(row)
    return rows


def write_summary(out_dir: Path, rows: list[dict]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    R.write_json(out_dir / "sweep_summary.json", {"rows": rows})
    return out_dir / "sweep_summary.json"


def plot_sweep(rows: list[dict], out_dir: Path) -> list[Path]:
    """One plot per metric: mean ± std against the first swept key (or trainable parameters
    when that key is a rank or bottleneck), one line per value of the other keys."""
    from fedpeft.report.plots import plt, save_figure

    if not rows or not rows[0]["point"]:
        return []
    x_key = next(iter(rows[0]["point"]))
    budget = x_key.endswith((".r", "bottleneck"))
    paths = []
    for m in METRICS:
        fig, ax = plt.subplots(figsize=(6, 4))
        lines: dict[str, list[dict]] = {}
        for row in rows:
            rest = ", ".join(f"{k}={v}" for k, v in row["point"].items() if k != x_key) or m
            lines.setdefault(rest, []).append(row)
        for label, pts in lines.items():
            xs = [p["trainable"] if budget else p["point"][x_key] for p in pts]
            numeric = all(isinstance(x, (int, float)) for x in xs)
            xs_plot = xs if numeric else list(range(len(xs)))
            ax.errorbar(
                xs_plot,
                [p[f"{m}_mean"] for p in pts],
                yerr=[p[f"{m}_std"] for p in pts],
                marker="o",
                capsize=3,
                label=label,
            )
            if not numeric:
                ax.set_xticks(xs_plot, [str(x) for x in xs])
        ax.set_xlabel("trainable parameters" if budget else x_key)
        ax.set_ylabel(f"final global {m} (mean ± std over seeds)")
        if budget:
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(save_figure(fig, out_dir / f"sweep_{m}.png"))
    return paths
