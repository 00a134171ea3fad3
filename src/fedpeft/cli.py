"""The ``fedpeft`` command: run, partition, methods, report, sweep; serve, join, certs (Flower).

Importing this module, ``fedpeft --help`` and a config's errors load no model library
(torch, transformers, flwr, ...): a command imports what it needs when it runs
(tests/test_cli_help.py checks it). Its help is plain, rewrapped text
(:mod:`fedpeft.cli_help`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from fedpeft.cli_help import HelpGroup
from fedpeft.config import ConfigError, ExperimentConfig, load_config
from fedpeft.report.results import headline

HELP = """Federated, parameter-efficient fine-tuning of language models.

'fedpeft run CONFIG' runs an experiment (a YAML file; no CONFIG: the built-in one) and
'fedpeft report RUN...' compares finished runs; serve, superlink and join run one over
Flower. 'fedpeft COMMAND --help' tells more."""

# an error that escapes a command is one traceback, never a dump of every frame's locals
app = typer.Typer(
    cls=HelpGroup, add_completion=False, no_args_is_help=False, help=HELP, pretty_exceptions_show_locals=False
)
warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
console = Console()

ConfigArg = Annotated[Path | None, typer.Argument(help="Experiment YAML (default: the built-in one).")]  # noqa: UP007
SetOpt = Annotated[
    list[str] | None,  # noqa: UP007
    typer.Option("--set", "-s", help="Override a key, e.g. --set train.rounds=5 (YAML value)."),
]


@app.callback()
def options(
    verbose: Annotated[
        bool,
        typer.Option("--verbose", "-v", help="Show other libraries' progress bars, logs and warnings too."),
    ] = False,
) -> None:
    """fedpeft: federated, parameter-efficient fine-tuning of language models."""
    if not verbose:
        quiet_libraries()


def quiet_libraries() -> None:
    """Other libraries' progress bars ("Loading weights"), info logs and warnings off;
    fedpeft's own warnings stay. Through the variables each library reads when it is
    imported, so that a command that loads no model (and every --help) imports none of
    them; a library imported already is told directly."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars follow the hub's
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is imported (log.to)
    os.environ.setdefault("WANDB_SILENT", "true")
    # bitsandbytes (a quantised run) logs at import that its CPU kernels cannot be fetched
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("default", module=r"fedpeft(\.|$)")


def _overrides(sets: list[str] | None) -> dict:
    overrides = {}
    for item in sets or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def _config(path: Path | None, sets: list[str] | None) -> ExperimentConfig:
    return load_config(path, _overrides(sets))


def _checked_config(path: Path | None, sets: list[str] | None) -> ExperimentConfig:
    """The config, or exit 2 saying what is wrong with it: called before a command imports
    torch and the rest, so that a bad key is named at once."""
    try:
        return _config(path, sets)
    except ConfigError as err:
        _fail(err)


def _fail(err: Exception | str) -> None:
    console.print(f"[bold red]error:[/] {err}", soft_wrap=True)  # paths in one piece, to copy
    raise typer.Exit(2)


@app.command()
def run(
    config: ConfigArg = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the last completed round (the newest checkpoint that reads).")
    ] = False,
    resume_from: Annotated[
        int | None,  # noqa: UP007
        typer.Option(
            "--resume-from",
            metavar="ROUND",
            help="Continue from round ROUND's kept checkpoint (checkpoint.keep says how many are kept); "
            "the later ones are deleted.",
        ),
    ] = None,
    export_personal: Annotated[
        bool,
        typer.Option(
            "--export-personal",
            help="Also export each client's own model (global + personal part, head included) "
            "under adapter/clients/<cid>/ (the config key export.personal).",
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option("--debug", help="On an error, also print its full traceback (always in fedpeft.log)."),
    ] = False,
    set_: SetOpt = None,
) -> None:
    """Run a federated experiment and write its results directory."""
    cfg = _checked_config(config, [*(set_ or []), *(["export.personal=true"] if export_personal else [])])
    from fedpeft.experiment import run as run_experiment
    from fedpeft.report.runlog import LOG_FILE, close_log, is_expected, one_line, open_log

    log = open_log(Path(cfg.output_dir))
    start = "resume" if resume or resume_from is not None else "start"
    log.info("%s %s: method %s, %d rounds", start, cfg.name, cfg.method.name, cfg.train.rounds)
    console.print(
        f"[bold]{cfg.name}[/]: method [cyan]{cfg.method.name}[/], {cfg.partition.num_clients} clients "
        f"({cfg.partition.scheme}), {cfg.train.rounds} rounds -> {cfg.output_dir}"
    )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    plain = not console.is_terminal  # a log file or a pipe: one line per round, no bar
    with Progress(*columns, console=console, transient=False, disable=plain) as progress:
        task = progress.add_task("setting up", total=cfg.train.rounds)

        last_acc = ""

        def say(line: str) -> None:
            progress.console.print(f"[yellow]note:[/] {line}", soft_wrap=True)
            log.warning(line)

        def on_round(r: dict) -> None:
            nonlocal last_acc
            if r.get("global"):
                name = headline(r["global"])
                last_acc = f"{name} {r['global'][name]:.3f} (round {r['round']})"
            trouble = "".join(
                f" | {len(r[key])} {what}"
                for key, what in (("dropped", "dropped"), ("state_resets", "reset"))
                if r.get(key)
            )
            line = f"round {r['round']} | {len(r['clients'])} clients{trouble} | loss {r['loss']:.3f}"
            line += f" | {last_acc}" if last_acc else ""
            progress.update(task, completed=r["round"], description=line)
            if plain:
                console.print(line, soft_wrap=True, highlight=False)
            log.info(line)
            for key in ("dropped", "state_resets"):
                for cid, why in r.get(key, {}).items():
                    log.warning("round %d: client %s %s: %s", r["round"], cid, key.replace("_", " "), why)

        try:
            summary = run_experiment(cfg, resume=resume, on_round=on_round, resume_from=resume_from, say=say)
        except Exception as err:  # noqa: BLE001 -- every failure: one line here, the traceback in the log
            log.error("%s", one_line(err), exc_info=err)
            close_log(log)
            progress.remove_task(task)  # no bar drawn after the error
            progress.stop()
            if debug:
                console.print_exception()
            where = Path(cfg.output_dir) / LOG_FILE
            _fail(one_line(err) + ("" if is_expected(err) else f"; traceback in {where} (--debug prints it)"))
    log.info("done: %s", cfg.output_dir)
    close_log(log)
    _print_summaries([summary])


@app.command()
def partition(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print per-client sizes, label histograms and the mean pairwise JS divergence; save a heatmap."""
    cfg = _checked_config(config, set_)
    import numpy as np

    from fedpeft.data import partition as P
    from fedpeft.data.sources import load_corpus
    from fedpeft.experiment import make_split

    try:
        corpus = load_corpus(cfg.data, cfg.seed)
        split = make_split(cfg, corpus)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        _fail(err)
    hist = split.histograms(corpus.train_labels, corpus.num_classes)
    table = narrow_table(f"{cfg.partition.scheme} partition of {len(corpus.train_labels)} examples")
    for col in ("client", "train", "test", "classes"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("top labels (count)", overflow="fold")  # long label names fold, whole
    for i, row in enumerate(hist):
        top = np.argsort(row)[::-1][:3]
        labels = ", ".join(f"{corpus.class_names[j]} ({row[j]})" for j in top if row[j])
        table.add_row(
            str(i),
            str(len(split.train[i])),
            str(len(split.test[i])),
            str(int((row > 0).sum())),
            labels,
        )
    console.print(table)
    console.print(f"mean pairwise Jensen-Shannon divergence: [bold]{P.mean_pairwise_js(hist):.4f}[/]")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    P.plot_label_heatmap(hist, out / "partition_heatmap.png", corpus.class_names, cfg.name)
    console.print(f"heatmap: {out / 'partition_heatmap.png'}")


#: ``fedpeft methods``' short forms, with their legend under the table
TASK_LETTERS = {"classification": "C", "causal_lm": "L", "token_classification": "N", "extractive_qa": "Q"}
COHORT_CODES = {"vmap, folded": "v,f", "vmap": "v", "folded": "f", "one at a time": "1"}


@app.command()
def methods(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """List the registered methods with their parameter counts on the configured backbone.

    One line per method (an 80-column terminal shows it whole), reasons as notes below."""
    cfg = _checked_config(config, set_)
    import copy

    from rich import box

    from fedpeft.data.sources import load_corpus
    from fedpeft.experiment import param_counts
    from fedpeft.methods import REGISTRY, build_method
    from fedpeft.models.backbone import build_model
    from fedpeft.report.tables import Column

    try:
        num_classes = load_corpus(cfg.data, cfg.seed).num_classes
        base, _ = build_model(cfg.model, num_classes, cfg.seed, cfg.data.task)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        _fail(err)
    task, quantized = cfg.data.task, cfg.model.quantization != "none"
    columns = [Column("method", name=True, justify="left"), *map(Column, ("sent", "personal", "% model")),
               *(Column(col, justify="left") for col in ("cohorts", "tasks", "notes"))]  # fmt: skip
    rows: list[list[str]] = []
    notes: list[str] = []

    def note(text: str) -> str:
        notes.append(text)
        return str(len(notes))

    for name, cls in REGISTRY.items():
        tasks = "".join(TASK_LETTERS[t] for t in cls.tasks)
        reasons: dict[str, list[str]] = {}  # one note per reason, naming every task it rules out
        for t, why in cls.not_for.items():
            reasons.setdefault(why, []).append(t)
        marks = [note(f"{name}: not {', '.join(ts)}: {why}") for why, ts in reasons.items()]
        if not cls.fp16:
            marks.append(note(f"{name}: not train.precision fp16 (it takes its own gradients): bf16 or fp32"))
        model = copy.deepcopy(base)
        options = cfg.method if cfg.method.name == name else cls.config_cls()  # the configured options
        method = build_method(options, cfg.train)
        try:
            method.prepare(model)
        except ValueError as err:  # e.g. BitFit on a decoder without biases
            marks.append(note(f"{name}: not on this backbone: {err}"))
            rows.append([name, "-", "-", "-", "-", tasks, ", ".join(marks)])
            continue
        c = param_counts(model, method)
        rows.append([
            name,
            f"{c['shared']:,}",
            f"{c['personal']:,}",
            f"{100 * c['trainable'] / c['total']:.2f}",
            COHORT_CODES[cohorts(method, model, quantized)],
            tasks,
            ", ".join(marks),
        ])  # fmt: skip
    console.print(
        f"methods on {cfg.model.backbone}, task {task}, {num_classes} classes or domains", soft_wrap=True
    )
    print_fitted(None, columns, rows, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    console.print(
        "sent: trained parameters shared with the server; personal: trained and kept on the client; "
        "cohorts (train.cohort_mode): v vmap, f folded (the frozen backbone once on the folded batch; on a "
        "quantised backbone the only way), 1 one at a time; tasks: C classification, L causal LM, N NER "
        "(token classification), Q extractive QA"
    )
    for number, text in enumerate(notes, 1):
        console.print(f"{number}. {text}")


def cohorts(method, model, quantized: bool) -> str:
    """How ``method`` (prepared on ``model``) trains a cohort: ``fedpeft methods``' cell."""
    from fedpeft.methods.folding import fold_refusal

    if not method.vectorised:
        return "one at a time"
    folds = not fold_refusal(method, model)
    if quantized:
        return "folded" if folds else "one at a time"
    return "vmap, folded" if folds else "vmap"


#: The summary table's score columns per headline score: (title, key of the scores).
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
    for table in fit_tables(title, columns, rows, console.width, **style):
        console.print(table)
        if not style.get("show_edge", True):
            console.print()  # a blank line under each (and between stacked ones), as an edge would


def _print_summaries(summaries: list[dict]) -> None:
    """The results table, whole at 80 columns: numbers and headers never cut, a long run
    name broken only after a ``-``/``_``/space (a causal LM's many scores: two tables)."""
    from fedpeft.report.results import results_table
    from fedpeft.report.tables import Column

    header, rows = results_table(summaries)
    print_fitted("results", [Column(header[0], name=True, justify="left"), *map(Column, header[1:])], rows)


@app.command()
def report(
    runs: Annotated[list[Path], typer.Argument(help="Run directories to compare.")],
    out: Annotated[Path, typer.Option(help="Where to write the comparison plots.")] = Path("runs/report"),
    target: Annotated[
        list[float] | None,  # noqa: UP007
        typer.Option(
            help="Target global score (accuracy; ROUGE-L for generation) for time-to-target and, with "
            "--baseline, rounds-to-target (default: the best of these runs); repeatable."
        ),
    ] = None,
    baseline: Annotated[
        str | None,  # noqa: UP007
        typer.Option(
            help="Also print the rounds each run took to reach the target and its speed-up over this "
            "run (the C2A paper's Table 4): baseline rounds / run rounds. A method name (e.g. fedap) "
            "that exactly one run has, or a run directory's name."
        ),
    ] = None,
    bandwidth: Annotated[float, typer.Option(help="Client link bandwidth, Mbit/s.")] = 25.0,
    latency: Annotated[float, typer.Option(help="Client link latency per message, ms.")] = 0.0,
    html: Annotated[
        Path | None,  # noqa: UP007
        typer.Option(
            help="Also write one self-contained HTML page here (plots inline; opens offline): the "
            "results table, score vs rounds and bytes, the clients' scores, each run's partition and config."
        ),
    ] = None,
) -> None:
    """Compare finished runs: a results table, the time to a target score, and plots.

    The time to 90/95/99 % of the target (--target); with --baseline, the rounds each run
    took to reach it and its speed-up over the baseline. The plots put every run on one
    figure: accuracy against rounds and bytes, LoRA update variation, client drift. --html:
    a page of it all."""
    from fedpeft.report import results as R
    from fedpeft.report.efficiency import Link, time_to_target
    from fedpeft.report.plots import plot_accuracy, plot_drift, plot_variation

    try:
        summaries = [R.read_summary(d) for d in runs]
        labels = [f"{s['name']} ({d.name})" for s, d in zip(summaries, runs, strict=True)]
        records = {label: R.read_records(d) for label, d in zip(labels, runs, strict=True)}
        base = _baseline_run(baseline, summaries, runs, labels) if baseline is not None else None
    except (FileNotFoundError, json.JSONDecodeError, ValueError) as err:
        _fail(err)
    _print_summaries(summaries)
    name = summaries[0].get("headline", "accuracy")
    targets = target or [max((s.get(f"best_global_{name}") or 0.0) for s in summaries)]
    link = Link(bandwidth, latency)
    for goal in targets:
        _print_time_to_target(records, goal, name, link, time_to_target)
    if base is not None:
        methods = {label: s["method"] for label, s in zip(labels, summaries, strict=True)}
        for goal in targets:
            _print_rounds_to_target(records, methods, goal, name, base)
    out.mkdir(parents=True, exist_ok=True)
    for path in [*plot_accuracy(records, out), plot_variation(records, out), plot_drift(records, out)]:
        if path is not None:
            console.print(f"plot: {path}")
    if html is not None:
        from fedpeft.report.html import write_report

        console.print(f"report: {write_report(runs, labels, html)}")


def _print_time_to_target(records: dict, target: float, name: str, link, time_to_target) -> None:
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


def _baseline_run(baseline: str, summaries: list[dict], runs: list[Path], labels: list[str]) -> str:
    """The label of the run ``--baseline`` names: the one run of that method, or the run
    whose directory has that name (or path)."""
    by_dir = [label for label, d in zip(labels, runs, strict=True) if baseline in (d.name, str(d))]
    if len(by_dir) == 1:
        return by_dir[0]
    if by_dir:
        raise ValueError(f"--baseline {baseline}: {len(by_dir)} run directories have that name; give a path")
    by_method = [label for label, s in zip(labels, summaries, strict=True) if s["method"] == baseline]
    if len(by_method) == 1:
        return by_method[0]
    if by_method:
        raise ValueError(
            f"--baseline {baseline}: {len(by_method)} runs are of method {baseline} "
            f"({', '.join(by_method)}); give the baseline run's directory name instead"
        )
    methods = sorted({s["method"] for s in summaries})
    raise ValueError(
        f"--baseline {baseline}: no run is of that method (methods: {', '.join(methods)}) or in a "
        f"directory of that name (directories: {', '.join(d.name for d in runs)})"
    )


def _print_rounds_to_target(records: dict, methods: dict, target: float, name: str, base: str) -> None:
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


@app.command()
def sweep(
    config: ConfigArg = None,
    grid: Annotated[
        list[str], typer.Option("--grid", "-g", help="KEY=V1,V2,... (repeatable), e.g. seed=0,1,2")
    ] = [],  # noqa: B006 - typer reads the default, never mutates it
    set_: SetOpt = None,
) -> None:
    """Run an experiment over a grid of config values; one table and one plot per metric
    (mean ± std over seeds). Finished points are skipped, so a sweep can be resumed."""
    from fedpeft import sweep as S

    try:
        points = S.expand(config, S.parse_grid(grid), _overrides(set_))
    except (ConfigError, ValueError) as err:
        _fail(err)
    from fedpeft.experiment import run as run_experiment

    console.print(f"sweep: {len(points)} runs")
    done = S.run_sweep(points, lambda cfg: run_experiment(cfg))
    rows = S.aggregate(done)
    out = Path(points[0][1].output_dir).parent
    S.write_summary(out, rows)
    _print_sweep(rows, S.METRICS)
    for path in S.plot_sweep(rows, out):
        console.print(f"plot: {path}")


def _print_sweep(rows: list[dict], metrics: tuple[str, ...]) -> None:
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


# ---------------------------------------------------------------- Flower deployment
CaOpt = Annotated[Path | None, typer.Option("--ca", help="CA certificate every party trusts (TLS).")]  # noqa: UP007
InsecureOpt = Annotated[
    bool, typer.Option("--insecure", help="Plain HTTP, no TLS (loopback and trials only).")
]
HostOpt = Annotated[str, typer.Option(help="Interface the SuperLink listens on (0.0.0.0: all).")]
PortOpt = Annotated[int, typer.Option(help="The SuperLink's port (one port: nodes and runs alike).")]
CertOpt = Annotated[Path | None, typer.Option(help="SuperLink certificate (TLS).")]  # noqa: UP007
KeyOpt = Annotated[Path | None, typer.Option(help="SuperLink private key (TLS).")]  # noqa: UP007
EnrolledOpt = Annotated[
    Path | None,  # noqa: UP007
    typer.Option(
        help="A folder of node public keys (*.pub, from `fedpeft certs --nodes N`) enrolled at start."
    ),
]
AuthOpt = Annotated[
    bool | None,  # noqa: UP007
    typer.Option(
        "--auth/--no-auth",
        help="SuperNode authentication: only enrolled nodes join (default: on with TLS; Flower allows "
        "it over TLS only).",
    ),
]


def _tls(ca: Path | None, insecure: bool, cert: Path | None = None, key: Path | None = None):
    """The TLS setting, its paths made absolute (Flower's processes run in other folders)."""
    from fedpeft.flower.tls import DeployError, Tls

    if insecure == (ca is not None):
        _fail(ValueError("give either --ca (TLS, the default for a deployment) or --insecure"))
    if insecure:
        for flag, path in (("--cert", cert), ("--key", key)):
            if path is not None:
                _fail(ValueError(f"{flag} {path}: a certificate with --insecure; give --ca too, or drop it"))
        return None
    tls = Tls(ca, cert, key)
    try:
        tls.check()
    except DeployError as err:
        _fail(err)
    return tls


def _say(prefix: str):
    from rich.markup import escape

    return lambda line: console.print(f"[bold]{prefix}:[/] {escape(line)}", soft_wrap=True)


def _join_hint(address: str, ca: Path | None, auth: bool = False) -> str:
    security = f"--ca {ca}" if ca is not None else "--insecure"
    signing = " --key NODE_KEY" if auth else ""
    return f"fedpeft join --superlink {address} {security}{signing} --partition-id N --state-dir DIR"


def _auth(auth: bool | None, tls, enrolled: Path | None) -> bool:
    """Whether the SuperLink authenticates nodes: on with TLS unless --no-auth."""
    on = tls is not None if auth is None else auth
    if on and tls is None:
        _fail(ValueError("--auth: Flower authenticates SuperNodes over TLS only; give --ca, --cert, --key"))
    if enrolled is not None and not on:
        _fail(ValueError(f"--enrolled {enrolled}: enrolment needs SuperNode authentication (drop --no-auth)"))
    if enrolled is not None and not enrolled.is_dir():
        _fail(FileNotFoundError(f"--enrolled {enrolled}: no such folder"))
    return on


def _enrol_folder(address: str, enrolled: Path | None, tls, work: Path) -> None:
    """Enrol every public key of ``enrolled`` with the SuperLink just started at ``address``."""
    from fedpeft.flower import deploy

    keys = sorted(enrolled.glob("*.pub")) if enrolled is not None else []
    for key in keys:
        node = deploy.enrol(address, key, tls, work, name=key.stem)
        console.print(f"enrolled {key.name} as node {node}", soft_wrap=True)
    if not keys:
        console.print(
            "no node enrolled yet: this SuperLink admits enrolled nodes only (--enrolled DIR at start, "
            f"or `fedpeft enrol KEY.pub --superlink {address} --ca CA` while it runs; --no-auth: anyone)",
            soft_wrap=True,
        )


def _public_address(host: str, port: int) -> str:
    from fedpeft.flower.connect import WILDCARDS, join_address

    return join_address("<this host>" if host in WILDCARDS else host, port)


def _serve_stopped(stop, cfg: ExperimentConfig) -> None:
    """``fedpeft serve`` stopped by a signal: what became of the run; the shell's exit code."""
    again = (
        "`fedpeft serve` with the same options and --resume continues it from its last completed round"
        if cfg.checkpoint.enabled
        else "it kept no checkpoint (checkpoint: false): run it again from the start"
    )
    console.print(
        f"fedpeft serve: stopped by {stop.name}, the run with it, and every process serve started; {again}",
        soft_wrap=True,
    )
    raise typer.Exit(stop.exit_code)


@app.command()
def serve(
    config: ConfigArg = None,
    set_: SetOpt = None,
    resume: Annotated[bool, typer.Option(help="Continue from the last completed round.")] = False,
    superlink: Annotated[
        str | None,  # noqa: UP007
        typer.Option(
            help="A running SuperLink (HOST:PORT, e.g. from `fedpeft superlink`) to submit the run to; "
            "default: start one here for this run only."
        ),
    ] = None,
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 9092,
    ca: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    insecure: InsecureOpt = False,
    enrolled: EnrolledOpt = None,
    auth: AuthOpt = None,
    workdir: Annotated[Path | None, typer.Option(help="Flower's files (default: OUTPUT_DIR/flower).")] = None,  # noqa: UP007
    max_wait: Annotated[
        float,
        typer.Option(
            min=1,
            help="With --superlink: seconds to wait for it to answer (it may still be starting) before "
            "giving up with the reason.",
        ),
    ] = 60,
) -> None:
    """Run the experiment over Flower and follow it until its last round; results land in
    the config's output_dir as with ``fedpeft run``. Clients join with ``fedpeft join`` and
    receive the config from here. Without --superlink a SuperLink is started for this run
    and stopped after it; with --superlink the run goes to a long-lived one. Stopped
    (Ctrl-C, SIGTERM, SIGHUP, its shell gone), it stops the run and everything it started;
    --resume continues the run."""
    from fedpeft.flower import deploy
    from fedpeft.flower.connect import local_address, wait_for_superlink
    from fedpeft.flower.processes import CommandProcesses, Stopped

    try:
        cfg = _config(config, set_)
        deploy.check_deployable(cfg)
    except ConfigError as err:
        _fail(err)
    if superlink is not None and (cert is not None or key is not None):
        _fail(
            ValueError("--cert/--key: for the SuperLink serve starts itself; with --superlink give --ca only")
        )
    tls = _tls(ca, insecure, cert, key)
    if superlink is not None and (enrolled is not None or auth is not None):
        _fail(
            ValueError("--enrolled/--auth: for the SuperLink serve starts itself; a running one has its own")
        )
    authenticate = _auth(auth, tls, enrolled) if superlink is None else False
    work = (workdir or Path(cfg.output_dir) / "flower").resolve()
    link = None
    try:
        with CommandProcesses():  # on leaving, however: no process it started is left
            try:
                if superlink is None:
                    link = deploy.start_superlink(  # for this run only: its state in memory
                        work, host, port, tls, log=work / "superlink.log", auth=authenticate, persistent=False
                    )
                    superlink = local_address(host, port, tls)
                    if authenticate:
                        _enrol_folder(superlink, enrolled, tls, work)
                    log = work / "superlink.log"
                    console.print(f"SuperLink on {host}:{port} for this run (log: {log})", soft_wrap=True)
                    hint = _join_hint(_public_address(host, port), ca, authenticate)
                    console.print(f"clients join with: {hint}", soft_wrap=True)
                else:
                    wait_for_superlink(superlink, tls, max_wait=max_wait, say=_say("fedpeft serve"))
                # its own SuperLink, stopped, ends the run; a long-lived one is asked to
                status = deploy.submit(
                    cfg, superlink, workdir=work, tls=tls, resume=resume, stop_if_interrupted=link is None
                )
            except deploy.DeployError as err:
                _fail(err)
            finally:
                if link is not None:
                    deploy.stop(link)
                    console.print(
                        "SuperLink stopped. Nodes wait up to their --max-wait for the next `fedpeft serve` "
                        "on this port; for several runs keep one up with `fedpeft superlink` and use "
                        "`serve --superlink`.",
                        soft_wrap=True,
                    )
    except Stopped as stop:
        _serve_stopped(stop, cfg)
    traffic = status.get("network-traffic", {})
    megabytes = traffic.get("total-bytes", 0) / 1e6
    console.print(f"run {status['run-id']}: {status['status']}, {megabytes:.2f} MB on the wire")
    from fedpeft.report.results import read_summary

    _print_summaries([read_summary(Path(cfg.output_dir))])


@app.command()
def superlink(
    host: HostOpt = "0.0.0.0",
    port: PortOpt = 9092,
    ca: CaOpt = None,
    cert: CertOpt = None,
    key: KeyOpt = None,
    insecure: InsecureOpt = False,
    enrolled: EnrolledOpt = None,
    auth: AuthOpt = None,
    workdir: Annotated[Path, typer.Option(help="The SuperLink's files (database, log).")] = Path(
        "runs/superlink"
    ),
) -> None:
    """Run a long-lived SuperLink until stopped (Ctrl-C): nodes join it once and take part in
    every run submitted with ``fedpeft serve CONFIG --superlink HOST:PORT``. With TLS only
    enrolled nodes join (``--enrolled`` at start, ``fedpeft enrol`` while it runs). Stopped
    (Ctrl-C, SIGTERM, SIGHUP, its shell gone), it ends the SuperLink and everything it
    started, the runs' ServerApps too."""
    from fedpeft.flower import deploy
    from fedpeft.flower.connect import local_address
    from fedpeft.flower.processes import CommandProcesses, Stopped

    tls = _tls(ca, insecure, cert, key)
    authenticate = _auth(auth, tls, enrolled)
    work = workdir.resolve()
    try:
        with CommandProcesses():  # on leaving, however: no process it started is left
            try:
                link = deploy.start_superlink(
                    work, host, port, tls, log=work / "superlink.log", auth=authenticate
                )
                if authenticate:
                    _enrol_folder(local_address(host, port, tls), enrolled, tls, work)
            except deploy.DeployError as err:
                _fail(err)
            address = _public_address(host, port)
            console.print(
                f"SuperLink listening on {host}:{port} until stopped (log: {work / 'superlink.log'})",
                soft_wrap=True,
            )
            console.print(f"clients join with: {_join_hint(address, ca, authenticate)}", soft_wrap=True)
            security = f"--ca {ca}" if ca is not None else "--insecure"
            console.print(
                f"runs start with: fedpeft serve CONFIG --superlink {address} {security}", soft_wrap=True
            )
            code = link.wait()
    except Stopped:
        code = 0
    if code:
        _fail(deploy.DeployError(f"flower-superlink exited with code {code} (log: {work / 'superlink.log'})"))
    console.print("SuperLink stopped")


@app.command()
def join(
    superlink: Annotated[str, typer.Option(help="The SuperLink's address, HOST:PORT.")],
    partition_id: Annotated[int, typer.Option(help="This client's id, 0 .. partition.num_clients-1.")],
    data_file: Annotated[
        Path | None,  # noqa: UP007
        typer.Option(
            help="This client's own data (CSV/TSV/JSONL/Parquet); default: partition "
            "PARTITION_ID of the experiment's corpus."
        ),
    ] = None,
    state_dir: Annotated[Path, typer.Option(help="Where this client keeps its state.")] = Path(
        ".fedpeft-node"
    ),
    port: Annotated[
        int | None,  # noqa: UP007
        typer.Option(help="Local port of this node's app runtime (default: a free one)."),
    ] = None,
    max_wait: Annotated[
        float,
        typer.Option(
            min=1,
            help="Seconds to wait for an unreachable SuperLink (at the start, or once lost) before "
            "giving up with the reason.",
        ),
    ] = 300,
    ca: CaOpt = None,
    insecure: InsecureOpt = False,
    key: Annotated[
        Path | None,  # noqa: UP007
        typer.Option(
            help="This node's private key (from `fedpeft certs --nodes N`), for a SuperLink that "
            "admits enrolled nodes only."
        ),  # fmt: skip
    ] = None,
) -> None:
    """Join a federation as one client, until stopped (Ctrl-C). The node receives the
    experiment's config from the server with each run, trains and evaluates on its own data,
    and keeps its personal state (never sent) in --state-dir, where its warm worker (the
    model, built once, and the data, across rounds and runs) logs to worker-N.log. It
    rejoins a restarted SuperLink, and gives up after --max-wait seconds without one,
    saying why. Stopped (Ctrl-C, SIGTERM, SIGHUP, its shell gone), it ends the node and
    everything it started, its worker too."""
    from fedpeft.flower import deploy
    from fedpeft.flower.connect import split_address
    from fedpeft.flower.join import run_node
    from fedpeft.flower.processes import CommandProcesses, Stopped

    tls = _tls(ca, insecure)
    if data_file is not None and not data_file.is_file():
        _fail(FileNotFoundError(f"--data-file {data_file}: no such file"))
    if key is not None and not key.is_file():
        _fail(FileNotFoundError(f"--key {key}: no such file"))
    try:
        split_address(superlink)
    except deploy.DeployError as err:
        _fail(err)
    state = state_dir.resolve()

    def command() -> list[str]:
        return deploy.supernode_command(
            superlink,
            partition_id,
            state,
            data_file=data_file,
            tls=tls,
            port=port or deploy.free_port(),
            key=key,
        )

    console.print(
        f"client {partition_id} joining {superlink} ({'TLS' if tls else 'no TLS'}); state in {state_dir}",
        soft_wrap=True,
    )
    try:
        with CommandProcesses():  # on leaving, however: no process it started is left
            try:
                run_node(
                    command,
                    deploy.flower_env(state / "flwr-home"),  # carries the processes' owner
                    superlink,
                    tls,
                    cid=partition_id,
                    max_wait=max_wait,
                    log_path=state / "supernode.log",
                    fixed_port=port,
                    say=_say("fedpeft join"),
                )
            except deploy.DeployError as err:
                _fail(err)
    except Stopped as stop:
        console.print(f"client {partition_id}: stopped ({stop.name})")


@app.command()
def certs(
    out: Annotated[Path, typer.Argument(help="Directory for ca.crt, ca.key, server.pem, server.key.")],
    host: Annotated[
        list[str],
        typer.Option("--host", help="Name or IP address clients use for the SuperLink (repeatable)."),
    ] = ["127.0.0.1", "localhost"],  # noqa: B006 - typer reads the default, never mutates it
    nodes: Annotated[
        int, typer.Option(min=0, help="Also a key pair per node, OUT/nodes/node-<i>.key and .pub, i < N.")
    ] = 0,
) -> None:
    """Make a local certificate authority and a SuperLink certificate for TLS.

    With --nodes N, also the key pairs nodes sign with: the SuperLink enrols the .pub
    files, node i joins with --key OUT/nodes/node-<i>.key."""
    from fedpeft.flower.certs import make_certificates, make_node_keys

    for name, path in make_certificates(out, host).items():
        console.print(f"{name}: {path}")
    for i, (private, public) in make_node_keys(out / "nodes", range(nodes)).items():
        console.print(f"node {i}: {private} (its own), {public} (the SuperLink's)")


LinkOpt = Annotated[str, typer.Option("--superlink", help="The SuperLink's address, HOST:PORT.")]
RegistryOpt = Annotated[
    Path, typer.Option(help="The flwr CLI's files and which key got which node id (the SuperLink's workdir).")
]


@app.command()
def enrol(
    public_key: Annotated[Path, typer.Argument(help="The node's public key (node-<i>.pub).")],
    superlink: LinkOpt,
    ca: CaOpt = None,
    workdir: RegistryOpt = Path("runs/superlink"),
) -> None:
    """Admit a node to a running SuperLink that authenticates nodes.

    Prints the node id it will hold, which 'fedpeft revoke' takes (or the key file)."""
    from fedpeft.flower import deploy

    tls = _tls(ca, False)
    try:
        node = deploy.enrol(superlink, public_key, tls, workdir.resolve(), name=public_key.stem)
    except deploy.DeployError as err:
        _fail(err)
    console.print(f"enrolled {public_key} as node {node}", soft_wrap=True)


@app.command()
def revoke(
    node: Annotated[str, typer.Argument(help="The node: the public key file enrolled, or its node id.")],
    superlink: LinkOpt,
    ca: CaOpt = None,
    workdir: RegistryOpt = Path("runs/superlink"),
) -> None:
    """Remove a node from a running SuperLink: it is refused from its next request on, and
    runs go on with the other nodes."""
    from fedpeft.flower import deploy

    tls = _tls(ca, False)
    work = workdir.resolve()
    try:
        node_id = int(node) if node.isdigit() else deploy.enrolled_node(Path(node), work)
        deploy.revoke(superlink, node_id, tls, work)
    except deploy.DeployError as err:
        _fail(err)
    console.print(f"revoked node {node_id}", soft_wrap=True)


@app.command()
def keys(
    out: Annotated[Path, typer.Argument(help="Directory for node-<i>.key and node-<i>.pub.")],
    ids: Annotated[list[int], typer.Argument(help="The nodes (client ids) to make a key pair for.")],
) -> None:
    """Make nodes' key pairs for a SuperLink that admits enrolled nodes only.

    Node i joins with --key OUT/node-<i>.key, the SuperLink's operator enrols
    OUT/node-<i>.pub ('fedpeft certs --nodes N' makes those of nodes 0..N-1 too). An
    existing pair is kept."""
    from fedpeft.flower.certs import make_node_keys

    new = [i for i in ids if not (out / f"node-{i}.key").exists()]
    for i in sorted(set(ids) - set(new)):
        console.print(f"node {i}: {out / f'node-{i}.key'} exists; kept")
    for i, (private, public) in make_node_keys(out, new).items():
        console.print(f"node {i}: {private} (its own), {public} (the SuperLink's)")


def main() -> None:  # pragma: no cover
    app()
