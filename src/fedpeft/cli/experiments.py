"""The experiment commands: run, partition, methods, report, sweep.

Each reads its config first (a bad key: exit 2 before any model library loads), then
imports what it needs; tables go through :mod:`fedpeft.cli.tables`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from fedpeft.cli import common, ranks
from fedpeft.cli.common import ConfigArg, SetOpt, checked_config, fail, parse_overrides
from fedpeft.cli.tables import (
    narrow_table,
    print_fitted,
    print_rounds_to_target,
    print_summaries,
    print_sweep,
    print_time_to_target,
)
from fedpeft.config import ConfigError
from fedpeft.report.results import headline

app = typer.Typer()


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
    nproc: Annotated[
        int,
        typer.Option(
            "--nproc",
            min=1,
            help="Share each round's clients among N local processes (ranks, started by torch's elastic "
            "launcher: gloo on CPUs, NCCL with rank r on GPU r). Across machines: torchrun -m fedpeft run.",
        ),
    ] = 1,
    max_restarts: Annotated[
        int,
        typer.Option(
            "--max-restarts",
            min=0,
            help="With --nproc: restart the ranks up to this many times when one fails; they resume from the "
            "last checkpoint.",
        ),
    ] = 0,
    set_: SetOpt = None,
) -> None:
    """Run a federated experiment and write its results directory."""
    cfg = checked_config(config, [*(set_ or []), *(["export.personal=true"] if export_personal else [])])
    if nproc > 1 and not ranks.launched():
        again = [
            *(["--resume"] if resume else []),
            *([f"--resume-from={resume_from}"] if resume_from else []),
        ]
        args = ["run", *([str(config)] if config else []), *again, *(["--debug"] if debug else [])]
        args += [
            f"--set={item}"
            for item in [*(set_ or []), *(["export.personal=true"] if export_personal else [])]
        ]
        if why := ranks.launch(nproc, max_restarts, args):
            fail(f"{why}; resume with: fedpeft run {' '.join(args[1:])} --nproc {nproc} --resume")
        return
    if ranks.restarted() and any(Path(cfg.output_dir).glob("checkpoint*.pt*")):
        resume = True  # the launcher restarted the ranks after a failure: go on from the last checkpoint
    from fedpeft.experiment import run as run_experiment
    from fedpeft.report.runlog import LOG_FILE, close_log, is_expected, one_line, open_log

    if ranks.rank() != 0:  # rank 0 reports and logs; another rank only says why it stopped
        try:
            run_experiment(cfg, resume=resume, resume_from=resume_from)
        except Exception as err:  # noqa: BLE001 -- one line; rank 0 logs the run
            fail(f"rank {ranks.rank()}: {one_line(err)}")
        return

    log = open_log(Path(cfg.output_dir))
    start = "resume" if resume or resume_from is not None else "start"
    log.info("%s %s: method %s, %d rounds", start, cfg.name, cfg.method.name, cfg.train.rounds)
    common.console.print(
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
    plain = not common.console.is_terminal  # a log file or a pipe: one line per round, no bar
    with Progress(*columns, console=common.console, transient=False, disable=plain) as progress:
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
                common.console.print(line, soft_wrap=True, highlight=False)
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
                common.console.print_exception()
            where = Path(cfg.output_dir) / LOG_FILE
            fail(one_line(err) + ("" if is_expected(err) else f"; traceback in {where} (--debug prints it)"))
    log.info("done: %s", cfg.output_dir)
    close_log(log)
    print_summaries([summary])


@app.command()
def partition(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """Print per-client sizes, label histograms and the mean pairwise JS divergence; save a heatmap."""
    cfg = checked_config(config, set_)
    import numpy as np

    from fedpeft.data import partition as P
    from fedpeft.data.sources import load_corpus
    from fedpeft.data.split import make_split

    try:
        corpus = load_corpus(cfg.data, cfg.seed)
        split = make_split(cfg, corpus)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        fail(err)
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
    common.console.print(table)
    common.console.print(f"mean pairwise Jensen-Shannon divergence: [bold]{P.mean_pairwise_js(hist):.4f}[/]")
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    P.plot_label_heatmap(hist, out / "partition_heatmap.png", corpus.class_names, cfg.name)
    common.console.print(f"heatmap: {out / 'partition_heatmap.png'}")


#: ``fedpeft methods``' short forms, with their legend under the table
TASK_LETTERS = {"classification": "C", "causal_lm": "L", "token_classification": "N", "extractive_qa": "Q"}
COHORT_CODES = {"vmap, folded": "v,f", "vmap": "v", "folded": "f", "one at a time": "1"}


@app.command()
def methods(config: ConfigArg = None, set_: SetOpt = None) -> None:
    """List the registered methods with their parameter counts on the configured backbone.

    One line per method (an 80-column terminal shows it whole), reasons as notes below."""
    cfg = checked_config(config, set_)
    import copy

    from rich import box

    from fedpeft.data.sources import load_corpus
    from fedpeft.experiment import param_counts
    from fedpeft.methods import REGISTRY, build_method, capabilities
    from fedpeft.models.backbone import build_model
    from fedpeft.report.tables import Column

    try:
        num_classes = load_corpus(cfg.data, cfg.seed).num_classes
        base, _ = build_model(cfg.model, num_classes, cfg.seed, cfg.data.task)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        fail(err)
    task, quantized = cfg.data.task, cfg.model.quantization != "none"
    columns = [Column("method", name=True, justify="left"), *map(Column, ("sent", "personal", "% model")),
               *(Column(col, justify="left") for col in ("cohorts", "tasks", "notes"))]  # fmt: skip
    rows: list[list[str]] = []
    notes: list[str] = []

    def note(text: str) -> str:
        notes.append(text)
        return str(len(notes))

    for name, cls in REGISTRY.items():
        tasks = "".join(TASK_LETTERS[t] for t in capabilities.tasks(cls))
        reasons: dict[str, list[str]] = {}  # one note per reason, naming every task it rules out
        for t in capabilities.TASKS:
            if why := capabilities.refusal(cls, t):
                reasons.setdefault(why, []).append(t)
        marks = [note(f"{name}: not {', '.join(ts)}: {why}") for why, ts in reasons.items()]
        if why := capabilities.refusal(cls, "fp16"):
            marks.append(note(f"{name}: not train.precision fp16 ({why}): bf16 or fp32"))
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
    common.console.print(
        f"methods on {cfg.model.backbone}, task {task}, {num_classes} classes or domains", soft_wrap=True
    )
    print_fitted(None, columns, rows, box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False)
    common.console.print(
        "sent: trained parameters shared with the server; personal: trained and kept on the client; "
        "cohorts (train.cohort_mode): v vmap, f folded (the frozen backbone once on the folded batch; on a "
        "quantised backbone the only way), 1 one at a time; tasks: C classification, L causal LM, N NER "
        "(token classification), Q extractive QA"
    )
    for number, text in enumerate(notes, 1):
        common.console.print(f"{number}. {text}")


def cohorts(method, model, quantized: bool) -> str:
    """How ``method`` (prepared on ``model``) trains a cohort: ``fedpeft methods``' cell."""
    from fedpeft.engines.local import fold_refusal

    folds = not fold_refusal(method, model)
    if quantized:
        return "folded" if folds else "one at a time"
    return "vmap, folded" if folds else "vmap"


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
        fail(err)
    print_summaries(summaries)
    name = summaries[0].get("headline", "accuracy")
    targets = target or [max((s.get(f"best_global_{name}") or 0.0) for s in summaries)]
    link = Link(bandwidth, latency)
    for goal in targets:
        print_time_to_target(records, goal, name, link, time_to_target)
    if base is not None:
        methods = {label: s["method"] for label, s in zip(labels, summaries, strict=True)}
        for goal in targets:
            print_rounds_to_target(records, methods, goal, name, base)
    out.mkdir(parents=True, exist_ok=True)
    for path in [*plot_accuracy(records, out), plot_variation(records, out), plot_drift(records, out)]:
        if path is not None:
            common.console.print(f"plot: {path}")
    if html is not None:
        from fedpeft.report.html import write_report

        common.console.print(f"report: {write_report(runs, labels, html)}")


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
        points = S.expand(config, S.parse_grid(grid), parse_overrides(set_))
    except (ConfigError, ValueError) as err:
        fail(err)
    from fedpeft.experiment import run as run_experiment

    common.console.print(f"sweep: {len(points)} runs")
    done = S.run_sweep(points, lambda cfg: run_experiment(cfg))
    rows = S.aggregate(done)
    out = Path(points[0][1].output_dir).parent
    S.write_summary(out, rows)
    print_sweep(rows, S.METRICS)
    for path in S.plot_sweep(rows, out):
        common.console.print(f"plot: {path}")
