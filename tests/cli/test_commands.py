"""The CLI's commands write what they promise (exports: tests/test_export.py)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedpeft.cli import app


def test_cli_run_partition_report_methods(tiny_config, tmp_path, monkeypatch):
    cfg = tiny_config()
    path = tmp_path / "exp.yaml"
    from fedpeft.config import dump_config

    path.write_text(dump_config(cfg))
    runner = CliRunner()

    res = runner.invoke(
        app, ["run", str(path), "--set", f"output_dir={tmp_path / 'a'}", "--set", "log.plots=true"]
    )
    assert res.exit_code == 0, res.output
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "accuracy_vs_round.png",
        "accuracy_vs_bytes.png",
        "partition_heatmap.png",
        "checkpoint.pt",
    ):
        assert (tmp_path / "a" / name).is_file(), name
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2]
    # not a terminal (issue 35): one plain line per round, no progress bar
    rounds = [line for line in res.output.splitlines() if line.startswith("round ")]
    assert [line.split(" |")[0] for line in rounds] == ["round 1", "round 2"]
    assert "setting up" not in res.output
    assert "\r" not in res.output and "\x1b[" not in res.output  # no frames, no cursor moves (issue 61)

    res = runner.invoke(
        app,
        [
            "run",
            str(path),
            "--set",
            f"output_dir={tmp_path / 'b'}",
            "--set",
            "method={name: fedbf}",
            "--set",
            "log.plots=true",
        ],
    )
    assert res.exit_code == 0, res.output

    runs = [str(tmp_path / "a"), str(tmp_path / "b")]
    html = tmp_path / "report.html"
    res = runner.invoke(app, ["report", *runs, "--out", str(tmp_path / "cmp"), "--html", str(html)])
    assert res.exit_code == 0, res.output
    assert "fedlr" in res.output and "fedbf" in res.output
    assert (tmp_path / "cmp" / "accuracy_vs_bytes.png").stat().st_size > 1000
    assert (tmp_path / "cmp" / "update_variation.png").stat().st_size > 1000  # fedlr has LoRA matrices
    assert "time to target" in res.output

    # issue 35: the HTML page, whole in one file (its look: tests/report/test_html_browser.py)
    from fedpeft.report.results import read_summary, results_table

    page = html.read_text()
    _, rows = results_table([read_summary(d) for d in runs])
    for row in rows:
        assert "".join(f"<td>{cell}</td>" for cell in row) in page
    # accuracy vs rounds and vs bytes, the clients' scores, update variation, two heatmaps
    assert page.count('src="data:image/png;base64,') == 6
    assert "final local accuracy" in page and "Labels per client" in page
    assert page.count("<pre>") == 2 and "name: fedbf" in page  # each run's resolved config
    assert "No partition heatmap" not in page
    # a run that drew no figures (log.plots: false): the page says how to draw its heatmap
    from fedpeft.report.html import write_report

    (tmp_path / "b" / "partition_heatmap.png").unlink()
    page = write_report([Path(d) for d in runs], ["a", "b"], tmp_path / "nofig.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5
    assert f"<code>fedpeft partition {tmp_path / 'b'}/config.yaml</code> draws it" in page
    assert "<script" not in page and "http" not in page.replace(str(tmp_path), "")  # nothing fetched

    res = runner.invoke(app, ["partition", str(path), "--set", f"output_dir={tmp_path / 'p'}"])
    assert res.exit_code == 0, res.output
    assert "Jensen-Shannon" in res.output
    assert (tmp_path / "p" / "partition_heatmap.png").is_file()

    from fedpeft.cli import common
    from fedpeft.experiment import build, param_counts
    from fedpeft.methods import REGISTRY

    monkeypatch.setattr(common.console, "width", 80)  # issue 35: an 80-column terminal shows it whole
    res = runner.invoke(app, ["methods", str(path)])
    assert res.exit_code == 0, res.output
    assert "…" not in res.output and "Loading weights" not in res.output
    lines = res.output.splitlines()
    assert all(len(line) <= 80 for line in lines[1:])  # the title holds the backbone's path, unbroken
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in REGISTRY}
    assert set(rows) == set(REGISTRY)  # one whole line per method
    # cohorts column: LoRA folds (tests/engines/test_folding.py); PF2LoRA's hypergradient is vmapped only
    assert rows["fedlr"][4] == "v,f" and rows["pf2lora"][4] == "v"
    setup = build(cfg)  # the configured method's row counts its configured options
    assert rows[cfg.method.name][1] == f"{param_counts(setup.model, setup.method)['shared']:,}"
    notes = {line.split(". ", 1)[0]: line for line in lines if line[:1].isdigit() and ". " in line}
    pf2lora_note = rows["pf2lora"][6]  # its note's number
    assert "pf2lora: not train.precision fp16" in notes[pf2lora_note]


def test_cli_bad_config_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  rounds: 0\n")
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2
    assert "train.rounds" in res.output


def test_an_error_inside_a_run_draws_no_progress_bar_after_it(tiny_config, tmp_path, monkeypatch):
    """Issue 35: on a terminal, the bar drawn while a run sets up is erased when the run
    meets an error: the error is the last thing left on the screen."""
    import io

    from rich.console import Console

    from fedpeft.cli import common
    from fedpeft.config import dump_config

    # a config error the run meets while it builds (after the bar started), not at parsing
    path = tmp_path / "fp16.yaml"
    path.write_text(dump_config(tiny_config(method={"name": "pf2lora"}, **{"train.precision": "fp16"})))
    buf = io.StringIO()
    monkeypatch.setattr(common, "console", Console(file=buf, force_terminal=True, width=80))
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2
    text = buf.getvalue()
    assert "setting up" in text  # the bar was drawn while the run set up
    last_frame = text.rsplit("\x1b[2K", 1)[1]  # what the terminal shows after the bar's last erase
    assert "setting up" not in last_frame and "train.precision: fp16" in last_frame


def test_time_to_target_by_hand():
    from fedpeft.report.efficiency import Link, time_to_target

    records = [
        {
            "round": 1,
            "clients": [0, 1],
            "bytes_down": 2_000_000,
            "bytes_up": 2_000_000,
            "cum_bytes": 4_000_000,
            "time_train": 10.0,
            "time_fit_max": 6.0,
            "global": {"accuracy": 0.50},
            "setup": {"time_decompose": 0.5},
        },
        {
            "round": 2,
            "clients": [2, 3],
            "bytes_down": 2_000_000,
            "bytes_up": 2_000_000,
            "cum_bytes": 8_000_000,
            "time_train": 10.0,
            "time_fit_max": 7.0,
            "global": {"accuracy": 0.80},
        },
    ]
    rows = time_to_target(records, target=0.85, link=Link(bandwidth_mbit=8.0, latency_ms=100.0))
    r90, r95, r99 = rows
    # 90 % of 0.85 = 0.765: reached at round 2
    assert r90["round"] == 2 and r90["bytes"] == 8_000_000
    # per round one client moves 2 MB = 16 Mbit: 2 s at 8 Mbit/s, plus 2 messages x 0.1 s
    assert r90["comm_s"] == pytest.approx(2 * (2.0 + 0.2))
    assert r90["train_s"] == pytest.approx(6.0 + 7.0) and r90["simulated_train_s"] == pytest.approx(20.0)
    assert r90["total_s"] == pytest.approx(13.0 + 4.4 + 0.5)
    assert r95["round"] is None and r99["round"] is None  # 0.8075 and 0.8415 never reached


def names_in_tables(text: str) -> list[list[str]]:
    """Per table in ``text`` (as ``fedpeft.cli.tables.print_fitted`` prints them: header, a rule,
    rows, a blank line), the names in its first column, read back from their lines: a
    row's first line holds the name's start and the row's other cells (two or more
    spaces apart), the lines under it the rest of the name alone. A line that ends in
    ``-`` or ``_`` joins the next directly, any other with a space: so a name broken
    mid-word (or anywhere but after ``-``, ``_`` or a space) does not read back whole."""
    import re

    tables: list[list[str]] = []
    rows: list[list[str]] | None = None
    for line in text.splitlines():
        if set(line.strip()) == {"─"}:
            rows = []
        elif rows is not None and not line.strip():
            tables.append([_join(pieces) for pieces in rows])
            rows = None
        elif rows is not None:
            fields = re.split(r"\s{2,}", line.strip())
            if len(fields) > 1 or not rows:
                rows.append([fields[0]])
            else:
                rows[-1].append(fields[0])
    return tables


def _join(pieces: list[str]) -> str:
    name = pieces[0]
    for piece in pieces[1:]:
        name += piece if name.endswith(("-", "_")) else " " + piece
    return name


def test_the_results_table_holds_every_number_and_name_at_80_columns(monkeypatch):
    """Issues 35 and 61: at 80 columns no score, byte count or time is cut; a long run
    name breaks onto more lines only after a ``-`` or ``_`` (or a space), never mid-word."""
    import io

    from rich.console import Console

    from fedpeft.cli import common, tables

    buf = io.StringIO()
    monkeypatch.setattr(common, "console", Console(width=80, file=buf))
    short = {"name": "default-fedlr", "method": "fedlr", "rounds": 12, "best_round": 11,
             "final_global": {"accuracy": 0.6581, "macro_f1": 0.3451, "mcc": 0.6361},
             "final_local": {"accuracy_mean": 0.6212, "accuracy_std": 0.1234}, "best_global_accuracy": 0.6612,
             "total_bytes": 87_412_345, "time_train": 275.33}  # fmt: skip
    long = {**short, "name": "a-very-long-experiment-name-for-the-cross-silo-comparison", "method": "fedmcp",
            "total_bytes": 1_234_567_890, "time_train": 12345.6}  # fmt: skip
    snake = {**short, "name": "cross_silo_fedmcp_beta0.1_seed2", "method": "fedmcp"}
    tables.print_summaries([short, long, snake])
    text = buf.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    for number in (
        "0.658",
        "0.345",
        "0.636",
        "0.621±0.123",
        "0.661@11",
        "87.41",
        "275.3",
        "1234.57",
        "12345.6",
    ):
        assert number in text
    assert names_in_tables(text) == [
        [
            "default-fedlr",
            "a-very-long-experiment-name-for-the-cross-silo-comparison (fedmcp)",
            "cross_silo_fedmcp_beta0.1_seed2",
        ]
    ]
    assert "fedlr" in [line.strip() for line in text.splitlines()]  # "default-fedlr" did break, at "-"
    for header in ("run", "rnds", "acc", "F1", "MCC", "local acc", "best@rnd", "MB", "train s"):
        assert header in text.replace("\n", " "), header

    # where the names fit, they are never broken
    buf.truncate(0), buf.seek(0)
    tables.print_summaries([short])
    assert "default-fedlr    12  0.658" in buf.getvalue()


def test_a_name_breaks_only_after_a_dash_underscore_or_space():
    from fedpeft.report.tables import break_name

    assert break_name("default-fedlr", 13) == "default-fedlr"
    assert break_name("default-fedlr", 10) == "default-\nfedlr"
    assert break_name("cross_silo_fedmcp seed2", 12) == "cross_silo_\nfedmcp seed2"
    assert break_name("a-b-c-d", 4) == "a-b-\nc-d"
    # only a piece wider than the whole column (which no layout gives it) is folded
    assert break_name("flowertune", 4) == "flow\nertu\nne"


def test_a_causal_lm_runs_results_table_is_whole_at_80_columns(
    tiny_config, tiny_decoder, tmp_path, monkeypatch
):
    """Issue 61: the results table of a causal-LM run (four scores, the FlowerTune recipe's
    global-only evaluation) at 80 columns: every header whole, and the run column, with
    the run named, in each of the two tables its columns take; the run writes no
    carriage-return progress frames where there is no terminal."""
    import io

    from rich.console import Console

    from fedpeft.cli import common
    from fedpeft.config import dump_config
    from fedpeft.report.results import read_summary, results_table

    cfg = tiny_config(**{"name": "flowertune-smollm2_nf4", "model.backbone": str(tiny_decoder),
                         "data.task": "causal_lm", "data.max_length": 32, "data.max_samples": 60,
                         "data.max_test_samples": 6, "eval.generation.max_new_tokens": 4,
                         "eval.generation.samples": 2, "eval.local": False, "train.rounds": 1})  # fmt: skip
    path = tmp_path / "lm.yaml"
    path.write_text(dump_config(cfg))
    buf = io.StringIO()
    monkeypatch.setattr(common, "console", Console(width=80, file=buf))
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 0, res.output
    text = buf.getvalue()
    assert "\r" not in text and "\r" not in res.output  # no progress frames off a terminal
    header, _ = results_table([read_summary(cfg.output_dir)])
    assert header[2] == "ROUGE-L"
    results = text[text.index("results") :]
    assert "…" not in results and all(len(line) <= 80 for line in results.splitlines())
    for title in header:
        assert title in results, title  # whole, on one line
    tables = names_in_tables(results)
    assert tables and all(names == ["flowertune-smollm2_nf4 (fedlr)"] for names in tables)
    assert sum(line.startswith("run ") for line in results.splitlines()) == len(tables)


@pytest.mark.slow
def test_a_smollm2_run_into_a_file_writes_no_progress_frames(tmp_path):
    """Issue 61: `fedpeft run flowertune` (shrunk; the bundled SmolLM2 loaded from its GGUF
    file, which transformers converts under a tqdm bar of its own) with its output in a
    file: no carriage-return frames, no cursor moves, and the results whole at 80 columns."""
    import os
    import subprocess
    import sys

    sets = {"train.rounds": 1, "model.quantization": "none", "train.local_steps": 1, "train.batch_size": 2,
            "data.max_samples": 40, "data.max_test_samples": 4, "eval.generation.samples": 2,
            "eval.generation.max_new_tokens": 4, "partition.num_clients": 2, "log.plots": False,
            "name": "flowertune-smollm2_tiny", "output_dir": str(tmp_path / "run")}  # fmt: skip
    args = [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    log = tmp_path / "out.log"
    cmd = [sys.executable, "-c", "from fedpeft.cli import app; app()", "run", "flowertune", *args]
    with log.open("w") as out:
        env = {**os.environ, "COLUMNS": "80"}
        subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=True, timeout=1500)
    text = log.read_text()
    assert "\r" not in text and "\x1b[" not in text, text
    assert "Converting and de-quantizing GGUF" not in text and "round 1 |" in text
    results = text[text.index("results") :]
    assert "…" not in results and all(len(line) <= 80 for line in results.splitlines())
    titles = ("run", "rnds", "ROUGE-L", "BLEU", "chrF", "ppl", "local ROUGE-L", "best@rnd", "MB", "train s")
    for title in titles:
        assert title in results, title
    tables = names_in_tables(results)
    assert tables and all(names == ["flowertune-smollm2_tiny (fedlr)"] for names in tables)


def test_the_partition_and_sweep_tables_hold_every_number_and_name_at_80_columns(tiny_config, tmp_path):
    """Issues 35 and 61: the other tables at 80 columns: nothing cut ("…"), a grid point
    broken only after a space, ``-`` or ``_``."""
    import io

    from rich.console import Console

    from fedpeft.cli import common, tables
    from fedpeft.config import dump_config

    buf = io.StringIO()
    common.console, real = Console(width=80, file=buf), common.console
    try:
        path = tmp_path / "exp.yaml"
        path.write_text(dump_config(tiny_config()))
        res = CliRunner().invoke(app, ["partition", str(path), "--set", f"output_dir={tmp_path / 'p'}"])
        assert res.exit_code == 0, res.output
        rows = {"point": {"partition.alpha": 0.1, "method.lora.r": 16}, "runs": 3,
                "trainable": 1_234_567, "bytes": 987_654_321, "accuracy_mean": 0.6581,
                "accuracy_std": 0.0123, "macro_f1_mean": 0.3451, "macro_f1_std": 0.0456,
                "mcc_mean": None, "mcc_std": None}  # fmt: skip
        tables.print_sweep([rows], ("accuracy", "macro_f1", "mcc"))
    finally:
        common.console = real
    text = buf.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    for cell in ("1,234,567", "987.7", "0.658±0.012", "0.345±0.046"):
        assert cell in text
    assert names_in_tables(text.split("sweep (")[1]) == [["partition.alpha=0.1, method.lora.r=16"]]
    partition = text.split("sweep")[0]
    assert "Jensen-Shannon" in partition and partition.count("\n") > 5


def test_the_report_tables_hold_every_number_and_name_at_80_columns(monkeypatch):
    """Issues 35 and 61: `fedpeft report`'s time-to-target and rounds-to-target tables at 80
    columns, the runs' names broken only after a ``-`` or a space."""
    import io

    from rich.console import Console

    from fedpeft.cli import common, tables
    from fedpeft.report.efficiency import Link, time_to_target

    buf = io.StringIO()
    monkeypatch.setattr(common, "console", Console(width=80, file=buf))
    long = "a-very-long-experiment-name-for-the-cross-silo-comparison (fedmcp-beta0.1-seed2)"

    def records(accuracies):
        return [{"round": i, "clients": [0, 1], "bytes_down": 123_456_789, "bytes_up": 123_456_789,
                 "time_train": 1234.5, "cum_bytes": 2 * 123_456_789 * i, "global": {"accuracy": a}}
                for i, a in enumerate(accuracies, start=1)]  # fmt: skip

    runs = {long: records([0.2, 0.5, 0.7]), "fedap (fedap-seed0)": records([0.1, 0.3, 0.5, 0.6, 0.7])}
    tables.print_time_to_target(runs, 0.7, "accuracy", Link(25.0, 0.0), time_to_target)
    methods = {long: "fedmcp", "fedap (fedap-seed0)": "fedap"}
    tables.print_rounds_to_target(runs, methods, 0.7, "accuracy", "fedap (fedap-seed0)")
    text = buf.getvalue()
    assert "…" not in text and all(len(line) <= 80 for line in text.splitlines())
    for cell in ("740.74", "1234.57", "3703.5", "3822.0", "6370.0", "×1.67", "fedap-seed0"):
        assert cell in text, cell
    assert names_in_tables(text.split("rounds to target")[0]) == [[long] * 3 + ["fedap (fedap-seed0)"] * 3]
    boxed: list[list[str]] = []  # per row, the run's lines (a row starts where its rounds cell does)
    for line in text.split("rounds to target")[1].splitlines():
        cells = [cell.strip() for cell in line.split("│")[1:-1]]
        if cells and cells[0] != "run" and cells[2]:
            boxed.append([cells[0]])
        elif cells and cells[0] != "run":
            boxed[-1].append(cells[0])
    assert [_join(pieces) for pieces in boxed] == [long, "fedap (fedap-seed0)"]  # broken after "-" alone
