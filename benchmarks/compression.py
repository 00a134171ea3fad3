"""Accuracy against bytes for each codec of ``comm.uplink`` (issue 34), for FedLR and
FeDeRA on the bundled MiniLM.

The split is the server-optimiser benchmark's Dirichlet one: label skew, Dirichlet(0.1)
per class over 20 clients of the built-in WordNet glosses (45 topic classes), 10 a round.
Every row runs the same clients, rounds, local steps and batch (the same examples each
round); rows differ in how the update crosses the network:

- ``none``: the tensors as they are (float32);
- ``fp16``, ``bf16``: each value rounded;
- ``int8``, ``nf4``: blockwise (64 values a float32 absmax), 8 and 4 bits a value;
- ``topk10``, ``topk1``: the 10 % / 1 % largest values with their positions, error feedback;
- ``randk10``: 10 % of the values at seeded positions, error feedback;
- ``int8both``: int8 on the downlink too.

Each row's client rate (AdamW, reset or kept state) is tuned on seed 3, which the table
does not use, by the accuracy on the clients' pooled validation data (20 % of each client's data held
out) after the last round; the grid grows past a best value at its end
(``tuning.tune_method``). The table: global test accuracy after the last round (mean ±
sample std over seeds), the MB each client sends and receives a round as recorded (the
encoded messages), and the uplink's size against ``none``'s.

    .venv/bin/python benchmarks/compression.py --tune [--methods fedlr] [--rows int8,topk10]
    .venv/bin/python benchmarks/compression.py [--seeds 0,1,2]

Runs are picked up from ``--out`` when finished (``tuning.run_or_reuse``); tuned settings
live in ``--tuned-file`` (``benchmarks/tuned/compression.json``, keyed ``<method>/<row>``).
Cost: 2 methods x 9 rows x (about 4 to 6 tuning runs + 3 seeds), some 130 to 160 runs of about
5 minutes each on one thread. Set ``OMP_NUM_THREADS`` for the CPU threads.
"""

from __future__ import annotations

import argparse
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
# row -> (label, comm section)
ROWS = {
    "none": ("float32 (none)", {}),
    "fp16": ("fp16", {"uplink": "fp16"}),
    "bf16": ("bf16", {"uplink": "bf16"}),
    "int8": ("int8, block 64", {"uplink": "int8"}),
    "nf4": ("NF4, block 64", {"uplink": "nf4"}),
    "topk10": ("top-k 10 %, error feedback", {"uplink": {"codec": "topk", "fraction": 0.1}}),
    "topk1": ("top-k 1 %, error feedback", {"uplink": {"codec": "topk", "fraction": 0.01}}),
    "randk10": ("rand-k 10 %, error feedback", {"uplink": {"codec": "randk", "fraction": 0.1}}),
    "int8both": ("int8 up and down", {"uplink": "int8", "downlink": "int8"}),
}
PARTITION = {"scheme": "dirichlet", "num_clients": 20, "alpha": 0.1, "min_size": 10}
PER_ROUND = 10
TUNING_SEED, VAL_FRACTION = 3, 0.2
TUNED_FILE = TUNED_DIR / "compression.json"


def config(
    method: str, row: str, seed: int, out: Path, args, setting: dict, tuning: bool = False
) -> ExperimentConfig:
    partition, scored = PARTITION, {"every": 1, "local": False}
    if tuning:
        partition, scored = {**PARTITION, "val_fraction": VAL_FRACTION}, {"every": args.rounds, "local": True}
    return load_config(
        None,
        {
            "name": f"compression-{method}-{row}",
            "seed": seed,
            "output_dir": str(out),
            "method": METHODS[method][1],
            "data": {"source": "wordnet", "max_samples": args.examples,
                     "max_test_samples": args.test_examples, "max_length": args.max_length},
            "partition": partition,
            "train": {"rounds": args.rounds, "clients_per_round": PER_ROUND, "local_steps": args.steps,
                      "batch_size": 16, "lr": setting["lr"], "optimizer_state": setting["optimizer_state"]},
            "comm": ROWS[row][1],
            "eval": scored,
            "log": {"plots": False},  # the records are the result; figures cost seconds a run
        },
    )  # fmt: skip


def key(method: str, row: str) -> str:
    return f"{method}/{row}"


def tune(args, methods: list[str], rows: list[str]) -> None:
    print(f"tuning on seed {TUNING_SEED}: the accuracy on the clients' pooled validation data"
          f" ({100 * VAL_FRACTION:g} % "
          f"of each client's data held out) after round {args.rounds}")  # fmt: skip
    for method in methods:
        for row in rows:

            def score(setting: dict, method: str = method, row: str = row) -> float:
                tag = f"{setting['lr']:g}-{setting['optimizer_state']}"
                out = args.out / "tune-pooled" / f"{method}-{row}-{tag}"
                run_or_reuse(config(method, row, TUNING_SEED, out, args, setting, tuning=True))
                return validation_accuracy(out)

            best, report = tune_method(score, LR_GRID, extend=args.extend)
            print(f"  {method} {row}: {report}", flush=True)
            write_tuned(args.tuned_file, {key(method, row): best})


def per_client_round_mb(out: Path, field: str) -> float:
    records = read_records(out)
    return sum(r[field] for r in records) / sum(len(r["clients"]) for r in records) / 1e6


def table(args, methods: list[str], rows: list[str], seeds: list[int]) -> None:
    tuned = read_tuned(args.tuned_file, [key(m, r) for m in methods for r in rows])
    print(f"\nDirichlet 0.1, 20 clients, 10 a round; MiniLM, WordNet topics ({args.examples} glosses), "
          f"{args.rounds} rounds x {args.steps} steps x batch 16; seeds {seeds}; global test accuracy (%) "
          "after the last round, mean ± sample std over seeds; MB a client sends (up) and receives (down) "
          "a round, as recorded\n")  # fmt: skip
    print("| Method | Uplink | tuned | Accuracy (%) | MB up | MB down | up / float32 |")
    print("|---|---|---|---|---|---|---|")
    outs_of = {(m, r): [args.out / f"{m}-{r}-seed{seed}" for seed in seeds] for m in methods for r in rows}
    failed = run_all(
        [config(m, r, seed, out, args, tuned[key(m, r)]) for (m, r), outs in outs_of.items()
         for seed, out in zip(seeds, outs, strict=True)],
        args.jobs,
        keep_going=True,
    )  # fmt: skip
    for method in methods:
        plain_up = None
        for row in rows:
            setting, outs = tuned[key(method, row)], outs_of[(method, row)]
            tuned_at = f"lr {setting['lr']:g}, {setting['optimizer_state']}"
            if bad := failed_cell(outs, failed):
                print(f"| {METHODS[method][0]} | {ROWS[row][0]} | {tuned_at} | {bad} | | | |", flush=True)
                continue
            accuracy = np.array([read_records(o)[-1]["global"]["accuracy"] for o in outs])
            up, down = per_client_round_mb(outs[0], "bytes_up"), per_client_round_mb(outs[0], "bytes_down")
            plain_up = up if row == "none" else plain_up
            ratio = f"{up / plain_up:.3f}" if plain_up else ""
            cells = [METHODS[method][0], ROWS[row][0], tuned_at,
                     mean_std(accuracy, scale=100, digits=1), f"{up:.3f}", f"{down:.3f}", ratio]  # fmt: skip
            print("| " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help=f"tune each row's client rate (seed {TUNING_SEED})")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="local steps a round")
    ap.add_argument("--examples", type=int, default=3000, help="training pool (all clients)")
    ap.add_argument("--test-examples", type=int, default=500)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--extend", type=int, default=3, help="--tune: grid extensions past an end's best rate")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compression"))
    ap.add_argument("--tuned-file", type=Path, default=TUNED_FILE)
    ap.add_argument("--jobs", type=int, default=1,
                    help="table runs at once, each in its own process (a GPU's share)")  # fmt: skip
    args = ap.parse_args()
    methods, rows = args.methods.split(","), args.rows.split(",")
    for given, known, what in ((methods, METHODS, "methods"), (rows, ROWS, "rows")):
        if unknown := [x for x in given if x not in known]:
            ap.error(f"--{what}: unknown {unknown}; choose from {list(known)}")
    if args.tune:
        tune(args, methods, rows)
        return
    table(args, methods, rows, [int(s) for s in args.seeds.split(",")])


if __name__ == "__main__":
    main()
