"""``fedpeft report --html``: one self-contained page for finished runs (every plot inlined
as a PNG data URI, no script, no request outside the file), so that it opens offline and
travels as one attachment."""

from __future__ import annotations

import base64
import datetime as dt
import tempfile
from pathlib import Path

import jinja2

from fedpeft.report import plots as P
from fedpeft.report import results as R


def inline_png(path: Path | None) -> str | None:
    """``path``'s PNG as a data URI (None for no plot)."""
    if path is None or not Path(path).is_file():
        return None
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def client_scores(summary: dict, metric: str) -> list[float]:
    """The clients' final local ``metric`` of a run, as its last round recorded them."""
    return [c[metric] for c in summary.get("final_local_by_client") or [] if c.get(metric) is not None]


def write_report(runs: list[Path], labels: list[str], target: Path) -> Path:
    """Write the page for ``runs`` (their directories; ``labels``: how the page names
    them) to ``target``: the results table, the headline score against rounds and against
    bytes, the clients' final local scores, client drift and LoRA update variation where
    recorded, and per run its partition heatmap and resolved config."""
    summaries = [R.read_summary(d) for d in runs]
    records = {label: R.read_records(d) for label, d in zip(labels, runs, strict=True)}
    metric = summaries[0].get("headline", "accuracy")
    header, rows = R.results_table(summaries)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        score_plots = [inline_png(p) for p in P.plot_accuracy(records, out)]
        by_client = {label: client_scores(s, metric) for label, s in zip(labels, summaries, strict=True)}
        spread = P.plot_client_scores(by_client, metric, out / "client_scores.png")
        figures = [  # (caption, the PNG, whether it takes the page's width)
            (f"Global test {metric} against rounds", score_plots[0], False),
            (f"Global test {metric} against the bytes sent", score_plots[1], False),
            (f"Each client's final local {metric}", inline_png(spread), False),
            ("Client drift", inline_png(P.plot_drift(records, out)), False),
            ("LoRA update variation", inline_png(P.plot_variation(records, out)), True),
        ]
    page = (
        environment()
        .get_template("report.html.j2")
        .render(
            title=f"fedpeft report: {len(runs)} run{'s' * (len(runs) != 1)}",
            made=dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            header=header,
            rows=rows,
            figures=[figure for figure in figures if figure[1] is not None],
            runs=[
                {
                    "label": label,
                    "directory": str(d),
                    "summary": s,
                    "heatmap": inline_png(d / "partition_heatmap.png"),
                    "config": (d / "config.yaml").read_text() if (d / "config.yaml").is_file() else None,
                }
                for label, d, s in zip(labels, runs, summaries, strict=True)
            ],
        )
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(page, encoding="utf-8")
    return target


def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("fedpeft.report", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
