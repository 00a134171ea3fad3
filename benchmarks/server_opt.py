"""Server optimisers, FedProx and SCAFFOLD against FedAvg, and robust aggregation against
sign-flipping clients (issue 32), for FedLR and FeDeRA on the bundled MiniLM.

Two splits of the built-in WordNet glosses (45 topic classes, ``--examples`` of them):

- ``dirichlet``: label skew, Dirichlet(0.1) per class over 20 clients, 10 a round;
- ``natural``: one client per part of speech (``partition.scheme: natural``,
  ``data.group_column: pos``): four organisations whose label sets do not overlap
  (noun topics, verb topics, adjectives, adverbs), all four every round.

Every row runs the same clients, rounds, local steps and batch (the same examples each
round); rows differ in the layer only. What each row tunes, on seed 3 (which the table
does not use), by the accuracy on the clients' pooled validation data (20 % of each client's data held
out) after the last round:

- FedAvg: the client rate (AdamW, reset or kept state);
- FedAvgM, FedAdam, FedYogi, FedAdagrad: the server rate, at FedAvg's tuned client setting,
  then the client rate (FedAvg's halved, as it is, doubled, and further past a best one at
  an end) at that server rate: client and server rates tuned per row, one after the other
  (Reddi et al. search both on a grid; coordinate-wise costs a third of that);
- FedProx: mu, at FedAvg's tuned client setting, then the client rate as above;
- FedAvg (SGD) and SCAFFOLD: the client rate, under plain SGD (SCAFFOLD's control is the
  mean gradient only under SGD steps): FedAvg (SGD) is the row SCAFFOLD corrects. SCAFFOLD's
  global rate stays 1, as in the paper's experiments.

The grid grows past a best value at its end (``tuning.tune_method``). The table: global
test accuracy after the last round (mean ± sample std over seeds), rounds to a target
(90 % of FedAvg's accuracy in its tuning run: fixed before the table, one per method and
split) and MB sent per client per round. A run that fails (diverges) is named in its
row's cells; the others go on.

Robustness (``--robust``): FedLR on the Dirichlet split, 0, 2 and 6 of the 20 clients
(0, 10, 30 %; a seed's 2 are among its 6) flipping the sign of their updates
(``faults.attack: sign_flip``), under each aggregator: the mean, the coordinate-wise
median, the trimmed mean (``server.trim`` 0.3, so up to 3 of a round's 10 updates at
either end are dropped), Krum and Multi-Krum (``server.byzantine`` 3). Each aggregator
trains at its own client rate, tuned without faulty clients on seed 3 (``--tune
--robust``: FedAvg's halved, as it is and doubled); the mean's is FedAvg's, and its
no-fault cell is the table's FedAvg run.

    .venv/bin/python benchmarks/server_opt.py --tune [--methods fedlr] [--splits dirichlet] [--rows ...]
    .venv/bin/python benchmarks/server_opt.py --tune --robust [--aggregators median,krum]
    .venv/bin/python benchmarks/server_opt.py [--seeds 0,1,2] [--robust]

Runs are picked up from ``--out`` when finished (``tuning.run_or_reuse``); tuned settings
live in ``--tuned-file`` (``benchmarks/tuned/server_opt.json``, keyed
``<method>/<split>/<row>``). Set ``OMP_NUM_THREADS`` for the CPU threads.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from records import read_records
from tuning import (
    LR_GRID,
    TUNED_DIR,
    failed_cell,
    mean_std,
    read_tuned,
    run_all,
    run_or_reuse,
    tune_method,
    validation_accuracy,
    write_tuned,
)

from fedpeft.config import ExperimentConfig, load_config

METHODS = {
    "fedlr": ("FedLR", {"name": "fedlr", "lora": {"r": 8, "alpha": 16}}),
    "federa": ("FeDeRA", {"name": "federa", "lora": {"r": 8, "alpha": 16}}),
}
SPLITS = {
    "dirichlet": (
        "Dirichlet 0.1, 20 clients, 10 a round",
        {"scheme": "dirichlet", "num_clients": 20, "alpha": 0.1, "min_size": 10},
        10,
    ),
    "natural": (
        "natural: one client per part of speech, 4 clients, all each round",
        {"scheme": "natural", "num_clients": 4},
        4,
    ),
}
SGD_GRID = [0.05, 0.1, 0.2]
SERVER_GRID = {"fedavgm": [0.125, 0.25, 0.5, 1.0], "fedadam": [3e-3, 1e-2, 3e-2],
               "fedyogi": [3e-3, 1e-2, 3e-2], "fedadagrad": [3e-3, 1e-2, 3e-2]}  # fmt: skip
MU_GRID = [1e-3, 1e-2, 1e-1]
# key: (label, what it tunes, grid); "client": train.lr (and optimizer state), "server":
# server.lr, "mu": train.prox_mu; the last two at FedAvg's tuned client setting
ROWS = {
    "fedavg": ("FedAvg", "client", LR_GRID),
    **{
        name: (label, "server", SERVER_GRID[name])
        for name, label in (
            ("fedavgm", "FedAvgM"),
            ("fedadam", "FedAdam"),
            ("fedyogi", "FedYogi"),
            ("fedadagrad", "FedAdagrad"),
        )
    },
    "fedprox": ("FedProx", "mu", MU_GRID),
    "fedavg_sgd": ("FedAvg (SGD)", "client", SGD_GRID),
    "scaffold": ("SCAFFOLD (SGD)", "client", SGD_GRID),
}
AGGREGATORS = {"mean": "mean", "median": "median", "trimmed_mean": "trimmed mean (0.3)", "krum": "Krum (f 3)",
               "multi_krum": "Multi-Krum (f 3)"}  # fmt: skip
BYZANTINE = (0, 2, 6)  # of 20 clients
TUNING_SEED, VAL_FRACTION = 3, 0.2
TUNED_FILE = TUNED_DIR / "server_opt.json"


def layer(row: str, setting: dict, base: dict) -> tuple[dict, dict]:
    """``(train overrides, server overrides)`` of ``row`` with its knob at ``setting["lr"]``
    (``base``: FedAvg's tuned client setting, for the rows that tune a server knob or mu;
    their client rate is ``setting["client_lr"]`` once tuned, else FedAvg's)."""
    value, knob = setting["lr"], ROWS[row][1]
    if row == "fedavg":
        return {"lr": value, "optimizer_state": setting["optimizer_state"]}, {}
    if knob == "client":  # the SGD rows
        return {
            "optimizer": "sgd",
            "lr": value,
            **({"correction": "scaffold"} if row == "scaffold" else {}),
        }, {}
    client = {"lr": setting.get("client_lr", base["lr"]), "optimizer_state": base["optimizer_state"]}
    if knob == "mu":
        return {**client, "prox_mu": value}, {}
    return client, {"optimizer": row, "lr": value}


def config(
    method: str, split: str, seed: int, out: Path, args: argparse.Namespace, train: dict, server: dict,
    tuning: bool = False, faults: dict | None = None, final_only: bool = False,
) -> ExperimentConfig:  # fmt: skip
    _, partition, per_round = SPLITS[split]
    data = {"source": "wordnet", "max_samples": args.examples, "max_test_samples": args.test_examples,
            "max_length": args.max_length}  # fmt: skip
    if split == "natural":
        data["group_column"] = "pos"
    scored = {"every": args.rounds if final_only else 1, "local": False}
    if tuning:
        scored, partition = {"every": args.rounds, "local": True}, {**partition, "val_fraction": VAL_FRACTION}
    return load_config(
        None,
        {
            "name": f"server-opt-{method}-{split}",
            "seed": seed,
            "output_dir": str(out),
            "method": METHODS[method][1],
            "data": data,
            "partition": partition,
            "train": {"rounds": args.rounds, "clients_per_round": per_round, "local_steps": args.steps,
                      "batch_size": 16, **train},
            "server": server,
            "faults": faults or {},
            "eval": scored,
            "log": {"plots": False},  # the records are the result; figures cost seconds a run
        },
    )  # fmt: skip


def key(method: str, split: str, row: str) -> str:
    return f"{method}/{split}/{row}"


def tuning_score(args: argparse.Namespace, method: str, split: str, row: str, base: dict | None):
    """``score(setting)`` for ``tune_method``: ``row`` run on the tuning seed with its knob at
    ``setting["lr"]`` (and the client rate at ``setting["client_lr"]``, if given); the
    accuracy on the clients' pooled validation data after the last round."""

    def score(setting: dict) -> float:
        train, server = layer(row, setting, base or {})
        out = tuning_dir(args, method, split, row, setting, train)
        run_or_reuse(config(method, split, TUNING_SEED, out, args, train, server, tuning=True))
        return validation_accuracy(out)

    return score


def tuning_dir(args, method: str, split: str, row: str, setting: dict, train: dict) -> Path:
    """Where ``row``'s tuning run at ``setting`` lives: named by its knob's value, the
    optimizer state it trains with (a server row's is FedAvg's) and its client rate when
    that is not FedAvg's."""
    tag = f"{setting['lr']:g}" + ("-keep" if train.get("optimizer_state") == "keep" else "")
    if "client_lr" in setting:  # FedAvg's client rate is the knob's own run
        tag += f"-client{setting['client_lr']:g}"
    return args.out / "tune-pooled" / f"{method}-{split}-{row}-{tag}"


def target_accuracy(args, method: str, split: str, fedavg: dict) -> float:
    """The rounds-to-target line of ``method`` on ``split``: 90 % of FedAvg's accuracy in
    its chosen tuning run (seed 3, pooled validation data), fixed before any table run, the
    same for every row and seed."""
    train, _ = layer("fedavg", fedavg, fedavg)
    return 0.9 * validation_accuracy(tuning_dir(args, method, split, "fedavg", fedavg, train))


def tune_client_rate(args, method: str, split: str, row: str, base: dict, knob: dict) -> tuple[dict, str]:
    """The client rate of ``row`` at its tuned knob ``knob``: FedAvg's (``base``) halved, as
    it is and doubled (the grid grows past a best rate at an end), ``base``'s optimizer state."""
    knob_score = tuning_score(args, method, split, row, base)

    def score(setting: dict) -> float:
        at = {"lr": knob["lr"], "optimizer_state": base["optimizer_state"]}
        if not math.isclose(setting["lr"], base["lr"], rel_tol=1e-9):
            at["client_lr"] = setting["lr"]
        return knob_score(at)

    grid = [base["lr"] / 2, base["lr"], base["lr"] * 2]
    best, report = at_state(
        *tune_method(score, grid, extend=args.extend, keep=False), base["optimizer_state"]
    )
    return {**knob, "client_lr": best["lr"], "client_grid": best["grid"]}, report


def at_state(best: dict, report: str, state: str) -> tuple[dict, str]:
    """``tune_method``'s result relabelled with the optimizer state its runs trained at
    (it labels its rates ``reset``; a row tuned at FedAvg's setting trains at FedAvg's)."""
    relabel = lambda text: text.replace("/reset", f"/{state}").replace(", reset", f", {state}")  # noqa: E731
    return {**best, "grid": relabel(best["grid"]), "optimizer_state": state}, relabel(report)


def tune(args: argparse.Namespace, methods: list[str], splits: list[str], rows: list[str]) -> None:
    print(f"tuning on seed {TUNING_SEED}: the accuracy on the clients' pooled validation data"
          f" ({100 * VAL_FRACTION:g} % "
          f"of each client's data held out) after round {args.rounds}")  # fmt: skip
    for method in methods:
        for split in splits:
            base = None  # FedAvg's tuned client setting, tuned first
            for row in ["fedavg", *[r for r in rows if r != "fedavg"]]:
                _, knob, grid = ROWS[row]
                score = tuning_score(args, method, split, row, base)
                best, report = tune_method(score, grid, extend=args.extend, keep=row == "fedavg")
                if knob in ("server", "mu"):  # its runs train at FedAvg's optimizer state
                    best, report = at_state(best, report, base["optimizer_state"])
                print(f"  {method} {split} {row}: {report}", flush=True)
                if knob in ("server", "mu"):  # then the client rate, at the knob's best value
                    best, report = tune_client_rate(args, method, split, row, base, best)
                    print(
                        f"  {method} {split} {row} client rate at {knob} {best['lr']:g}: {report}", flush=True
                    )
                write_tuned(args.tuned_file, {key(method, split, row): {**best, "knob": knob}})
                if row == "fedavg":
                    base = best


def final_accuracy(outs: list[Path]) -> np.ndarray:
    return np.array([read_records(out)[-1]["global"]["accuracy"] for out in outs])


def mb_per_client_round(out: Path) -> float:
    records = read_records(out)
    sent = sum(r["bytes_up"] + r["bytes_down"] for r in records)
    return sent / sum(len(r["clients"]) for r in records) / 1e6


def table_dir(args, method: str, split: str, row: str, seed: int) -> Path:
    return args.out / f"{method}-{split}-{row}-seed{seed}"


def table_runs(args, methods, splits, rows, seeds) -> tuple[dict[tuple[str, str, str], list[Path]], dict]:
    """Every table run (reused when finished), and the failed ones' errors. The targets
    are read first: a missing tuning run stops the table before it trains."""
    keys = [key(m, s, r) for m in methods for s in splits for r in ["fedavg", *rows]]
    tuned = read_tuned(args.tuned_file, keys)
    for method in methods:
        for split in splits:
            target_accuracy(args, method, split, tuned[key(method, split, "fedavg")])
    runs, configs = {}, []
    for method in methods:
        for split in splits:
            base = tuned[key(method, split, "fedavg")]
            for row in rows:
                train, server = layer(row, tuned[key(method, split, row)], base)
                outs = [table_dir(args, method, split, row, seed) for seed in seeds]
                configs += [config(method, split, seed, out, args, train, server)
                            for seed, out in zip(seeds, outs, strict=True)]  # fmt: skip
                runs[(method, split, row)] = outs
    return runs, run_all(configs, args.jobs, keep_going=True)


def print_tables(runs, failed, args, methods, splits, rows, seeds) -> None:
    from fedpeft.report.efficiency import first_round_reaching

    tuned = read_tuned(
        args.tuned_file, [key(m, s, r) for m in methods for s in splits for r in ["fedavg", *rows]]
    )
    for split in splits:
        targets = {m: target_accuracy(args, m, split, tuned[key(m, split, "fedavg")]) for m in methods}
        lines = ", ".join(f"{METHODS[m][0]} {100 * t:.1f} %" for m, t in targets.items())
        print(f"\n{SPLITS[split][0]}; MiniLM, WordNet topics ({args.examples} glosses), "
              f"{args.rounds} rounds x {args.steps} steps x batch 16; seeds {seeds}; global test accuracy "
              "(%) after the last round, mean ± sample std over seeds; rounds to the target (90 % of "
              f"FedAvg's tuning-run accuracy, fixed before the table: {lines}), per seed\n")  # fmt: skip
        print("| Method | Layer | tuned | Accuracy (%) | Rounds to target | MB per client per round |")
        print("|---|---|---|---|---|---|")
        for method in methods:
            for row in rows:
                outs = runs[(method, split, row)]
                setting = tuned[key(method, split, row)]
                knob = {"client": "lr", "server": "server lr", "mu": "mu"}[ROWS[row][1]]
                state = f", {setting['optimizer_state']}" if row == "fedavg" else ""
                if "client_lr" in setting:
                    state = f", client lr {setting['client_lr']:g}"
                cells = [METHODS[method][0], ROWS[row][0], f"{knob} {setting['lr']:g}{state}"]
                if bad := failed_cell(outs, failed):
                    cells += [bad, "", ""]
                else:
                    reached = [first_round_reaching(read_records(o), targets[method]) for o in outs]
                    cells += [mean_std(final_accuracy(outs), scale=100, digits=1),
                              " / ".join(str(r) if r is not None else f"> {args.rounds}" for r in reached),
                              f"{mb_per_client_round(outs[0]):.2f}"]  # fmt: skip
                print("| " + " | ".join(cells) + " |", flush=True)


def robust_server(rule: str) -> dict:
    return {"aggregation": rule, **({"trim": 0.3} if rule == "trimmed_mean" else {}),
            **({"byzantine": 3} if "krum" in rule else {})}  # fmt: skip


def robust_settings(args) -> dict[str, dict]:
    """Each aggregator's client setting: the mean's is FedAvg's (the mean is FedAvg), the
    others' their own tuned ones (``--tune --robust``)."""
    row = {rule: "fedavg" if rule == "mean" else f"robust-{rule}" for rule in AGGREGATORS}
    keys = [key("fedlr", "dirichlet", r) for r in row.values()]
    done = json.loads(args.tuned_file.read_text()) if args.tuned_file.is_file() else {}
    if missing := [k for k in keys if k not in done]:
        raise SystemExit(f"{args.tuned_file}: no tuned setting for {missing}; run --tune --methods fedlr "
                         "--splits dirichlet (FedAvg), then --tune --robust (the aggregators)")  # fmt: skip
    tuned = read_tuned(args.tuned_file, keys)
    return {rule: tuned[key("fedlr", "dirichlet", r)] for rule, r in row.items()}


def tune_robust(args) -> None:
    """Each robust aggregator's client rate, without faulty clients, on the tuning seed:
    FedAvg's halved, as it is and doubled (grown past a best rate at an end), at FedAvg's
    optimizer state; a rule that ignores some clients' updates (Krum keeps one) may want
    another rate than the mean."""
    base = read_tuned(args.tuned_file, [key("fedlr", "dirichlet", "fedavg")])[
        key("fedlr", "dirichlet", "fedavg")
    ]
    print(f"tuning each aggregator's client rate on seed {TUNING_SEED}, FedLR, Dirichlet, no faulty clients")
    for rule in args.aggregators.split(","):

        def score(setting: dict, rule: str = rule) -> float:
            train = {"lr": setting["lr"], "optimizer_state": base["optimizer_state"]}
            out = tuning_dir(args, "fedlr", "dirichlet", rule, setting, train)
            run_or_reuse(
                config("fedlr", "dirichlet", TUNING_SEED, out, args, train, robust_server(rule), tuning=True)
            )
            return validation_accuracy(out)

        grid = [base["lr"] / 2, base["lr"], base["lr"] * 2]
        best, report = at_state(
            *tune_method(score, grid, extend=args.extend, keep=False), base["optimizer_state"]
        )
        print(f"  fedlr dirichlet {rule}: {report}", flush=True)
        write_tuned(
            args.tuned_file, {key("fedlr", "dirichlet", f"robust-{rule}"): {**best, "knob": "client"}}
        )


def robustness(args, seeds) -> None:
    settings = robust_settings(args)
    tuned = ", ".join(f"{AGGREGATORS[r]} {s['lr']:g}" for r, s in settings.items())
    print(f"\nRobustness: FedLR, Dirichlet 0.1, 20 clients, 10 a round, each aggregator at its own client "
          f"rate tuned without faulty clients on seed {TUNING_SEED} ({tuned}; "
          f"{settings['mean']['optimizer_state']} state); sign-flipping clients (of 20; a seed's fewer are "
          f"among its more); global test accuracy (%) after the last round, mean ± sample std over seeds "
          f"{seeds}\n")  # fmt: skip
    print("| Aggregator | " + " | ".join(f"{100 * b / 20:g} % ({b})" for b in BYZANTINE) + " |")
    print("|---|" + "---|" * len(BYZANTINE))
    outs: dict[tuple[str, int], list[Path]] = {}
    configs = []
    for rule, setting in settings.items():
        train = {"lr": setting["lr"], "optimizer_state": setting["optimizer_state"]}
        for bad in BYZANTINE:
            for seed in seeds:
                if rule == "mean" and not bad:  # the table's FedAvg run: the very same training
                    out = table_dir(args, "fedlr", "dirichlet", "fedavg", seed)
                    configs.append(config("fedlr", "dirichlet", seed, out, args, train, {}))
                else:
                    out = args.out / f"robust-{rule}-byz{bad}-seed{seed}"
                    faults = {"byzantine_clients": bad, "attack": "sign_flip"} if bad else {}
                    configs.append(config("fedlr", "dirichlet", seed, out, args, train, robust_server(rule),
                                          faults=faults, final_only=True))  # fmt: skip
                outs.setdefault((rule, bad), []).append(out)
    failed = run_all(configs, args.jobs, keep_going=True)
    for rule, label in AGGREGATORS.items():
        cells = [
            failed_cell(outs[(rule, bad)], failed)
            or mean_std(final_accuracy(outs[(rule, bad)]), scale=100, digits=1)
            for bad in BYZANTINE
        ]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help=f"tune each row's knob (seed {TUNING_SEED})")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--splits", default=",".join(SPLITS))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--robust", action="store_true", help="the robustness table (with --tune: each aggregator's rate)"
    )
    ap.add_argument("--aggregators", default=",".join(r for r in AGGREGATORS if r != "mean"),
                    help="--tune --robust: the aggregators to tune (the mean's is FedAvg's)")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="local steps a round")
    ap.add_argument("--examples", type=int, default=3000, help="training pool (all clients)")
    ap.add_argument("--test-examples", type=int, default=500)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument(
        "--extend", type=int, default=3, help="--tune: grid extensions past a best value at an end"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/server_opt"))
    ap.add_argument("--tuned-file", type=Path, default=TUNED_FILE)
    ap.add_argument("--jobs", type=int, default=1,
                    help="table runs at once, each in its own process (a GPU's share)")  # fmt: skip
    args = ap.parse_args()
    methods, splits, rows = args.methods.split(","), args.splits.split(","), args.rows.split(",")
    for given, known, what in (
        (methods, METHODS, "methods"),
        (splits, SPLITS, "splits"),
        (rows, ROWS, "rows"),
    ):
        if unknown := [x for x in given if x not in known]:
            ap.error(f"--{what}: unknown {unknown}; choose from {list(known)}")
    if unknown := [a for a in args.aggregators.split(",") if a not in AGGREGATORS or a == "mean"]:
        ap.error(f"--aggregators: {unknown} not tuned; choose from {[a for a in AGGREGATORS if a != 'mean']}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if TUNING_SEED in seeds:
        ap.error(f"--seeds: {TUNING_SEED} is the tuning seed; a table reports other seeds")
    if args.tune:
        tune_robust(args) if args.robust else tune(args, methods, splits, rows)
        return
    if args.robust:
        robustness(args, seeds)
        return
    runs, failed = table_runs(args, methods, splits, rows, seeds)
    print_tables(runs, failed, args, methods, splits, rows, seeds)


if __name__ == "__main__":
    main()
