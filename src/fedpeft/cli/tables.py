"""The tables the commands print, each whole on the terminal: numbers and headers never
cut, a long name broken only after a ``-``, ``_`` or space (issues 35 and 61)."""

from __future__ import annotations

from rich.table import Table

from fedpeft.cli import common


def narrow_table(title: str) -> Table:
    """A table with no more around its cells than a rule under the header: what an
    80-column terminal has room for."""
    from rich import box

    return Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)


def print_fitted(title: str | None, columns: list, rows: list[list[str]], **style) -> None:
    """A table that fits the console's width whole (issue 61; fedpeft.report.tables): a
    name breaks only after ``-``/``_``/a space, numbers and headers are never cut, and
    columns that do not fit side by side go to a second table under the first (which
    repeats the names). ``style``: rich ``Table`` options (default: ``narrow_table``'s)."""
    from rich import box

    from fedpeft.report.tables import fit_tables

    style = style or {"box": box.SIMPLE_HEAD, "padding": (0, 1), "pad_edge": False, "collapse_padding": True,
                      "show_edge": False}  # fmt: skip
    for table in fit_tables(title, columns, rows, common.console.width, **style):
        common.console.print(table)
        if not style.get("show_edge", True):
            common.console.print()  # a blank line under each (and between stacked ones), as an edge would


def print_summaries(summaries: list[dict]) -> None:
    """The results table, whole at 80 columns: numbers and headers never cut, a long run
    name broken only after a ``-``/``_``/space (a causal LM's many scores: two tables)."""
    from fedpeft.report.results import results_table
    from fedpeft.report.tables import Column

    header, rows = results_table(summaries)
    print_fitted("results", [Column(header[0], name=True, justify="left"), *map(Column, header[1:])], rows)


def print_time_to_target(records: dict, target: float, name: str, link, time_to_target) -> None:
    """The time each run took to reach 90/95/99 % of ``target``, over ``link``."""
    from fedpeft.report.tables import Column

    link_text = f"link {link.bandwidth_mbit:g} Mbit/s, {link.latency_ms:g} ms"
    columns = [Column("run", name=True, justify="left")]  # a long name breaks after -/_; numbers whole
    columns += map(Column, ("target", "round", "MB", "train s", "comm s", "decomp s", "total s"))
    rows = []
    for label, recs in records.items():
        for row in time_to_target(recs, target, link, metric=name):
            cells = ["-"] * 6
            if row["round"] is not None:
                cells = [
                    str(row["round"]),
                    f"{row['bytes'] / 1e6:.2f}",
                    f"{row['train_s']:.1f}",
                    f"{row['comm_s']:.1f}",
                    f"{row['decompose_s']:.2f}",
                    f"{row['total_s']:.1f}",
                ]
            rows.append([label, f"{row['fraction']:.0%}", *cells])
    print_fitted(f"time to target ({name} {target:.3f}; {link_text})", columns, rows)


def print_rounds_to_target(records: dict, methods: dict, target: float, name: str, base: str) -> None:
    """The C2A paper's Table 4 for one target: rounds to reach it, and speed-up over ``base``."""
    from rich import box

    from fedpeft.report.efficiency import rounds_to_target
    from fedpeft.report.tables import Column

    columns = [Column("run", name=True, justify="left"), Column("method", name=True, justify="left")]
    columns += [Column("rounds", justify="left"), Column("speed-up", justify="left")]
    rows = []
    for row in rounds_to_target(records, target, base, name):
        rounds = str(row["round"]) if row["round"] is not None else f"not reached (> {row['rounds_run']})"
        speedup = "-"
        if row["speedup"] is not None:
            prefix = {"=": "", "<=": "≤ ", ">=": "≥ "}[row["bound"]]
            speedup = f"{prefix}×{row['speedup']:.2f}"
        rows.append([row["run"], methods[row["run"]], rounds, speedup])
    title = f"rounds to target ({name} {target:.3f}); speed-up = rounds of {base} / rounds of the run"
    print_fitted(title, columns, rows, box=box.HEAVY_HEAD)


def print_sweep(rows: list[dict], metrics: tuple[str, ...]) -> None:
    """The sweep's table, whole at 80 columns: a grid point's settings break after a
    space, ``-`` or ``_``; numbers are never cut."""
    from fedpeft.report.tables import Column

    columns = [Column("point", name=True, justify="left")]
    columns += map(Column, ("runs", "trainable", "MB", *metrics))
    cells = []
    fmt = lambda r, m: "-" if r[f"{m}_mean"] is None else f"{r[f'{m}_mean']:.3f}±{r[f'{m}_std']:.3f}"  # noqa: E731
    for r in rows:
        point = ", ".join(f"{k}={v}" for k, v in r["point"].items())
        sizes = [str(r["runs"]), f"{r['trainable']:,}", f"{r['bytes'] / 1e6:.1f}"]
        cells.append([point, *sizes, *(fmt(r, m) for m in metrics)])
    print_fitted("sweep (final global scores, mean±std over seeds)", columns, cells)
