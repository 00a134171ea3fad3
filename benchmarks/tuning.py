"""Per-method tuning for the benchmarks: ``train.lr`` on a grid, then the optimizer state.

A fair table gives every method its own learning rate, tuned on a seed the table does
not use (the PF2LoRA paper grid-searches each method's rate). ``tune_method`` scores
each rate of a grid with a fresh optimizer every round (``optimizer_state: reset``),
extending the grid while any best rate (tied rates included) is at an end, then ``keep``
at the best rates, and returns the best of those settings (ties: the lowest rate, reset
before keep).

The chosen settings live in ``benchmarks/tuned/<benchmark>.json`` (committed, so a table
can be re-run without re-tuning); a benchmark refuses to run a method that has none
there unless it is told to use the defaults.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from records import diverged_row, finished_row, locate, put, read_records, row

from fedpeft.config import ExperimentConfig, parse_config
from fedpeft.engines.guard import DivergedError
from fedpeft.experiment import fingerprint, run

LR_GRID = [1e-3, 2e-3, 5e-3]
TUNED_DIR = Path(__file__).parent / "tuned"
DIVERGED_SCORE = -math.inf  # a diverged run's tuning score: below every run that trained


class Busy(RuntimeError):
    """Another process holds the run directory (:func:`only_writer`)."""


class Diverged(RuntimeError):
    """A run stopped with no finite update (:class:`fedpeft.engines.guard.DivergedError`);
    recorded in the benchmark's records, so a rerun of the benchmark does not train it again."""


def mean_std(values, scale: float = 1.0, digits: int = 3) -> str:
    """``mean ± std`` of a score over seeds, times ``scale``: the *sample* standard
    deviation (``ddof = 1``, the estimate of the spread a new seed would show), a lone
    value alone. Tables say "sample std over seeds" in their header."""
    values = [scale * float(v) for v in values]
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def tune_method(
    score: Callable[[dict], float], grid: list[float] = LR_GRID, extend: int = 2, keep: bool = True
) -> tuple[dict, str]:
    """``(best setting, one-line report)``; ``score(setting)`` runs the method with
    ``train`` overrides ``setting`` on the tuning seed and returns the score to maximise.

    Every rate of ``grid`` is scored with ``optimizer_state: reset``. While any of the
    best-scoring rates (all of them, when rates tie) sits at an end of the grid, the grid
    grows by a factor of 2 past that end (past both, when tied rates sit at both ends;
    ``extend`` times at most), so the best rates are bracketed unless one is still at an
    end after the last extension (the report then shows it at the grid's end). A flat grid
    (every rate scoring alike: a method at chance, under heavy noise) has nothing to follow
    and is not extended. Then ``keep`` at each best rate, unless ``keep`` is False (a
    method whose kept per-client state does not fit the machine) or the grid is flat. The
    tie rule: of the settings that share the best score, the lowest rate, and ``reset``
    before ``keep``. A rate whose run diverged is the worst of all (the report says
    "diverged"); when every rate diverged the grid grows downwards, and if none ever
    trains the tuning stops, naming the grid."""
    rates = sorted(grid)
    score = _diverged_scores_worst(score)
    scores = {(lr, "reset"): score({"lr": lr, "optimizer_state": "reset"}) for lr in rates}

    def best_rates() -> list[float]:
        top = max(scores[(x, "reset")] for x in rates)
        if top == DIVERGED_SCORE:  # every rate diverged: follow the grid down
            return rates[:1]
        return [x for x in rates if scores[(x, "reset")] == top]

    for _ in range(extend):
        ends = [end for end in (rates[0], rates[-1]) if end in best_rates()]
        if not ends or len(best_rates()) == len(rates):  # bracketed, or flat: no signal to follow
            break
        for end in ends:
            new = end * 2 if end == rates[-1] else end / 2
            rates = sorted([*rates, new])
            scores[(new, "reset")] = score({"lr": new, "optimizer_state": "reset"})
    flat = len(rates) > 1 and len(best_rates()) == len(rates)
    for lr in best_rates() if keep and not flat else []:
        scores[(lr, "keep")] = score({"lr": lr, "optimizer_state": "keep"})
    top = max(scores.values())
    shown = lambda acc: "diverged" if acc == DIVERGED_SCORE else f"{acc:.3f}"  # noqa: E731
    report = ", ".join(f"{x:g}/{st}: {shown(acc)}" for (x, st), acc in sorted(scores.items()))
    if top == DIVERGED_SCORE:
        raise SystemExit(f"every setting diverged ({report}); start the grid lower")
    best_lr, state = min((k for k, v in scores.items() if v == top), key=lambda k: (k[0], k[1] != "reset"))
    return {"lr": best_lr, "optimizer_state": state, "grid": report}, f"{report} -> lr {best_lr:g}, {state}"


def _diverged_scores_worst(score: Callable[[dict], float]) -> Callable[[dict], float]:
    """``score``, with a setting whose run diverged scoring ``DIVERGED_SCORE`` (said once)."""

    def scored(setting: dict) -> float:
        try:
            return score(setting)
        except Diverged as err:
            print(f"  {err}; the worst score of its grid", flush=True)
            return DIVERGED_SCORE

    return scored


def validation_accuracy(out: Path) -> float:
    """The tuning score of the run in ``out``: its global model's (or its clients' own
    models') accuracy on the union of the clients' validation splits after the last round
    (``val.accuracy_pooled``), which weighs each client by its data as the global test set
    does; the mean over clients would weigh a client of a few examples (a natural split's
    adverbs, one class) as much as one of thousands."""
    val = read_records(out)[-1].get("val", {})
    if "accuracy_pooled" not in val:
        raise SystemExit(
            f"{out}: its records predate the pooled validation accuracy; remove the run to re-run it"
        )
    return val["accuracy_pooled"]


def write_tuned(path: Path, best: dict[str, dict]) -> None:
    """Merge ``best`` into the JSON file ``path`` (tuning runs in parallel, a few methods
    each: one writer at a time, under a lock beside it, and the file replaced whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = json.loads(path.read_text()) if path.is_file() else {}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**done, **best}, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)


def read_tuned(path: Path, keys: list[str], untuned: dict | None = None) -> dict[str, dict]:
    """The ``train`` overrides (lr, optimizer_state) tuned for each of ``keys``. A key with
    none is an error naming the file, unless ``untuned`` (the defaults to use instead) is given."""
    done = json.loads(path.read_text()) if path.is_file() else {}
    missing = [k for k in keys if k not in done]
    if missing and untuned is None:
        raise SystemExit(f"{path}: no tuned setting for {missing}; run the benchmark with --tune first "
                         "(or --untuned to use the defaults, which is not a fair comparison)")  # fmt: skip
    return {
        k: {x: v for x, v in done[k].items() if x != "grid"} if k in done else dict(untuned) for k in keys
    }


#: Options added with a default that changes what a method computed before: a recorded
#: run of that method whose config lacks the option was made the old way (its
#: fingerprint, which leaves out options at their defaults, cannot tell) and is re-run.
BEHAVIOUR_CHANGES = {
    ("fdlora", "average"): "FDLoRA's server mean became uniform over clients (the paper's Algorithm 1; "
    "issue 30), where it was weighted by examples",
}


def made_the_old_way(recorded: dict) -> str | None:
    """Why a recorded run (its resolved config, as stored) predates a change of behaviour, or None."""
    method = recorded.get("method") or {}
    for (name, key), why in BEHAVIOUR_CHANGES.items():
        if method.get("name") == name and key not in method:
            return why
    return None


@contextlib.contextmanager
def only_writer(out: Path):
    """Hold ``out``'s lock (a file beside it) while a run writes there; a second process
    that would write the same run directory stops, named, instead of corrupting it. The
    lock goes with its process, however that ends (``flock``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"{out}: another process is running it; run each table from one process") from None
        yield


def run_or_reuse(cfg: ExperimentConfig) -> dict:
    """The summary of ``cfg``'s run: the recorded one when the benchmark's records
    (``records.py``) hold a finished run of this very config for ``cfg.output_dir`` (a
    benchmark resumes where it stopped, also on another machine), else a fresh run in that
    directory (picking up a cut-off one from its checkpoint), recorded when it finishes. A
    finished run of another config is an error: its figures must not stand in for these.
    One process at a time runs a directory (:func:`only_writer`); a finished one is read
    by any number at once (processes tuning rows beside each other all reuse FedAvg's)."""
    if (summary := _recorded(cfg)) is not None:
        return summary
    with only_writer(cfg.output_dir):
        if (summary := _recorded(cfg)) is not None:  # finished while this process waited
            return summary
        return _run(cfg)


def _recorded(cfg: ExperimentConfig) -> dict | None:
    """The summary of the recorded run of ``cfg``, or None; a recorded divergence raises
    :class:`Diverged`. A run that finished in its directory but was cut off before its
    record was written is recorded now."""
    out = cfg.output_dir
    recorded = row(out)
    if recorded is None and (out / "summary.json").is_file():
        recorded = put(out, finished_row(out))
    if recorded is None:
        return None
    store, key = locate(out)
    where = f"{store}: {key}"
    if "diverged" in recorded:
        if recorded["fingerprint"] == fingerprint(cfg):
            raise Diverged(f"{where}: diverged: {recorded['diverged']}")
        return None
    drop = f"drop it (python benchmarks/records.py drop {out}) or use another --out"
    if fingerprint(parse_config(recorded["config"], where)) != fingerprint(cfg):
        raise SystemExit(f"{where}: holds a finished run of another config; {drop}")
    if (why := made_the_old_way(recorded["config"])) is not None:
        raise SystemExit(f"{where}: a run made before {why}; {drop} to re-run it")
    return recorded["summary"]


def _run(cfg: ExperimentConfig) -> dict:
    """A fresh run of ``cfg`` (resumed from its checkpoint), recorded once it finished or diverged."""
    out = cfg.output_dir
    try:
        summary = run(cfg, resume=(out / "checkpoint.pt").is_file())
    except DivergedError as err:
        put(out, diverged_row(out, fingerprint(cfg), str(err)))
        raise Diverged(f"{out}: diverged: {err}") from err
    put(out, finished_row(out))
    return summary


def failed_cell(outs: list[Path], failed: dict[Path, str]) -> str | None:
    """A table cell naming the runs of ``outs`` that failed (``run_all(keep_going=True)``),
    or None when every one finished."""
    bad = [o.name for o in outs if o in failed]
    return f"failed: {', '.join(bad)}" if bad else None


def run_all(configs: list[ExperimentConfig], jobs: int = 1, keep_going: bool = False) -> dict[Path, str]:
    """Every run of ``configs`` finished (or reused), ``jobs`` at a time in worker processes
    (spawned: each holds its own model; on a GPU they share the device). A run directory is
    only ever written by one: configs naming the same directory run once. A failed run
    stops the table, naming its error; with ``keep_going`` the others go on and the
    failures come back, ``{output_dir: error}`` (a table prints them in their cells)."""
    configs = list({cfg.output_dir: cfg for cfg in configs}.values())
    failed: dict[Path, str] = {}

    def settle(out: Path, outcome: Callable[[], object]) -> None:
        try:
            outcome()
        except Exception as err:  # noqa: BLE001 - named and returned, or raised
            if not keep_going:
                raise
            failed[out] = f"{type(err).__name__}: {err}"
            print(f"{out}: failed: {failed[out]}", flush=True)

    if jobs <= 1:
        for cfg in configs:
            settle(cfg.output_dir, lambda cfg=cfg: run_or_reuse(cfg))
        return failed
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(run_or_reuse, cfg): cfg.output_dir for cfg in configs}
        for done in as_completed(futures):
            settle(futures[done], done.result)
    return failed
