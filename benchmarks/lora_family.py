"""The federated LoRA family (issue 33, docs/lora_family.md) beside FedLR, FeDeRA and
HETLoRA on the bundled MiniLM: accuracy, bytes up and down, and each paper's headline
claim re-tested.

The built-in WordNet glosses (45 topic classes, ``--examples`` of them), Dirichlet label
skew at 0.1 and 1.0 over 20 clients, 10 a round, the same rounds, local steps and batch
for every row (the same examples each round). Two rank settings:

- ``equal``: every client at rank 8 (``lora.r`` 8, alpha 16);
- ``hetero``: clients at ranks 2, 4, 8 and 16 (``method.ranks: [2, 4, 8, 16]``, a quarter
  of the clients at each; ``lora.r`` 16, alpha 32: the same scale 2 as ``equal``) for the
  methods that take heterogeneous ranks (HETLoRA, FlexLoRA, FLoRA); every other method
  runs at rank 2, the rank every client can afford (the setting the FLoRA and FlexLoRA
  papers compare homogeneous baselines in).

Each row's rate (and optimizer state) is tuned per method and rank setting on seed 3
(which the table does not use) at Dirichlet 0.1, by the accuracy on the clients' pooled validation data
(20 % of each client's data held out) after the last round; the grid grows past a best
rate at its end (``tuning.tune_method``). Fed-SB runs at the table's rank too (its own
default is 64: ``R`` costs ``r^2`` a module), alpha = r as its authors set it, and its
first round is its setup round (gradient sums up, nothing trained).

    .venv/bin/python benchmarks/lora_family.py --tune [--methods ...] [--ranks equal,hetero] [--jobs 2]
    .venv/bin/python benchmarks/lora_family.py [--seeds 0,1,2] [--jobs 2]

Runs are picked up from ``--out`` when finished (``tuning.run_or_reuse``); tuned settings
live in ``--tuned-file`` (``benchmarks/tuned/lora_family.json``, keyed ``<method>/<ranks>``).
Set ``OMP_NUM_THREADS`` for the CPU threads.
"""

from __future__ import annotations

import argparse
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from tuning import (
    LR_GRID,
    TUNED_DIR,
    mean_std,
    read_tuned,
    run_all,
    run_or_reuse,
    tune_method,
    validation_accuracy,
    write_tuned,
)

from fedpeft.config import ExperimentConfig, load_config
from fedpeft.report.results import read_records

METHODS = {  # key: (row label, takes heterogeneous ranks)
    "fedlr": ("FedLR (FedIT)", False),
    "federa": ("FeDeRA", False),
    "hetlora": ("HETLoRA", True),
    "ffalora": ("FFA-LoRA", False),
    "fedsalora": ("FedSA-LoRA", False),
    "rolora": ("RoLoRA", False),
    "fedexlora": ("FedEx-LoRA", False),
    "flexlora": ("FlexLoRA", True),
    "flora": ("FLoRA", True),
    "lorafair": ("LoRA-FAIR", False),
    "fedsb": ("Fed-SB", False),
}
RANKS = {
    "equal": ("every client at rank 8", {"r": 8, "alpha": 16}, None),
    "hetero": (
        "ranks 2, 4, 8, 16 (a quarter of the clients each; the others at rank 2)",
        {"r": 16, "alpha": 32},
        [2, 4, 8, 16],
    ),  # fmt: skip
}
ALPHAS = (0.1, 1.0)
CLIENTS, PER_ROUND = 20, 10
TUNING_SEED, TUNING_ALPHA, VAL_FRACTION = 3, 0.1, 0.2
TUNED_FILE = TUNED_DIR / "lora_family.json"

#: each paper's headline claim, re-tested on this table: (method, rank settings, the rows
#: it claims to beat, the claim in words)
CLAIMS = [
    ("ffalora", ("equal",), ("fedlr",), "FFA-LoRA matches or beats LoRA under heterogeneous data, at half "
     "the uplink (Sun et al., ICLR 2024)"),
    ("fedsalora", ("equal",), ("fedlr", "ffalora"), "FedSA-LoRA beats LoRA and FFA-LoRA "
     "(Guo et al., ICLR 2025)"),
    ("rolora", ("equal",), ("fedlr", "ffalora"), "RoLoRA beats LoRA and FFA-LoRA "
     "(Chen et al., NeurIPS 2025)"),
    ("fedexlora", ("equal",), ("fedlr", "ffalora"), "exact aggregation beats FedAvg of the factors "
     "(Singhal et al., ACL 2025)"),
    ("flexlora", ("hetero",), ("hetlora", "fedlr"), "FlexLoRA beats HETLoRA's zero-padding and FedIT at "
     "heterogeneous ranks (Bai et al., NeurIPS 2024)"),
    ("flora", ("equal", "hetero"), ("fedlr", "hetlora"), "FLoRA beats FedIT and zero-padding, homogeneous "
     "and heterogeneous (Wang et al., NeurIPS 2024)"),
    ("lorafair", ("equal",), ("fedlr", "ffalora", "flora", "flexlora"), "LoRA-FAIR beats FedIT, FFA-LoRA, "
     "FLoRA and FlexLoRA (Bian et al., ICCV 2025)"),
    ("fedsb", ("equal",), ("fedlr", "ffalora", "fedexlora"), "Fed-SB beats FedIT, FFA-LoRA and FedEx-LoRA "
     "at a fraction of their uplink (Singhal et al., 2025)"),
]  # fmt: skip


def method_config(method: str, ranks: str) -> dict:
    """``method``'s config in rank setting ``ranks``."""
    _, lora, per_client = RANKS[ranks]
    if per_client is None and method != "fedsb":
        return {"name": method, "lora": dict(lora)}
    if method == "fedsb":  # the authors' alpha = r (s = 1)
        r = lora["r"] if per_client is None else min(per_client)
        return {"name": method, "lora": {"r": r, "alpha": r}}
    if METHODS[method][1]:
        extra = {"r_min": min(per_client)} if method == "hetlora" else {}
        return {"name": method, "lora": dict(lora), "ranks": list(per_client), **extra}
    r = min(per_client)
    return {"name": method, "lora": {"r": r, "alpha": lora["alpha"] * r / lora["r"]}}


def config(
    method: str, ranks: str, alpha: float, seed: int, out: Path, args: argparse.Namespace, train: dict,
    tuning: bool = False,
) -> ExperimentConfig:  # fmt: skip
    partition = {"scheme": "dirichlet", "num_clients": CLIENTS, "alpha": alpha, "min_size": 10}
    scored = {"every": 1, "local": False}
    if tuning:
        scored, partition = {"every": args.rounds, "local": True}, {**partition, "val_fraction": VAL_FRACTION}
    return load_config(
        None,
        {
            "name": f"lora-family-{method}-{ranks}",
            "seed": seed,
            "output_dir": str(out),
            "method": method_config(method, ranks),
            "data": {"source": "wordnet", "max_samples": args.examples,
                     "max_test_samples": args.test_examples, "max_length": args.max_length},
            "partition": partition,
            "train": {"rounds": args.rounds, "clients_per_round": PER_ROUND, "local_steps": args.steps,
                      "batch_size": 16, **train},
            "eval": scored,
        },
    )  # fmt: skip


def key(method: str, ranks: str) -> str:
    return f"{method}/{ranks}"


def tune_one(method: str, ranks: str, args: argparse.Namespace) -> tuple[str, dict, str]:
    def score(setting: dict) -> float:
        tag = f"{setting['lr']:g}" + ("-keep" if setting["optimizer_state"] == "keep" else "")
        out = args.out / "tune-pooled" / f"{method}-{ranks}-{tag}"
        run_or_reuse(config(method, ranks, TUNING_ALPHA, TUNING_SEED, out, args, setting, tuning=True))
        return validation_accuracy(out)

    best, report = tune_method(score, LR_GRID, extend=args.extend)
    return key(method, ranks), best, report


def tune(args: argparse.Namespace, methods: list[str], rank_settings: list[str]) -> None:
    print(f"tuning on seed {TUNING_SEED}, Dirichlet {TUNING_ALPHA:g}: the accuracy on the clients' pooled "
          "validation data "
          f"({100 * VAL_FRACTION:g} % of each client's data held out) after round {args.rounds}")  # fmt: skip
    jobs = [(m, r) for m in methods for r in rank_settings]
    if args.jobs <= 1:
        done = (tune_one(m, r, args) for m, r in jobs)
    else:  # one (method, ranks) per worker, its grid walked in order; only this process writes the file
        pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"))
        done = (f.result() for f in as_completed([pool.submit(tune_one, m, r, args) for m, r in jobs]))
    for name, best, report in done:
        print(f"  {name}: {report}", flush=True)
        write_tuned(args.tuned_file, {name: best})


def final_accuracy(outs: list[Path]) -> np.ndarray:
    return np.array([read_records(out)[-1]["global"]["accuracy"] for out in outs])


def kb_per_client_round(out: Path, direction: str) -> float:
    records = read_records(out)
    return sum(r[f"bytes_{direction}"] for r in records) / sum(len(r["clients"]) for r in records) / 1e3


def table(args, methods, rank_settings, seeds) -> dict[tuple[str, str, float], list[Path]]:
    tuned = read_tuned(args.tuned_file, [key(m, r) for m in methods for r in rank_settings])
    runs, configs = {}, []
    for method in methods:
        for ranks in rank_settings:
            for alpha in ALPHAS:
                outs = [args.out / f"{method}-{ranks}-a{alpha:g}-seed{seed}" for seed in seeds]
                configs += [
                    config(method, ranks, alpha, seed, out, args, tuned[key(method, ranks)])
                    for seed, out in zip(seeds, outs, strict=True)
                ]
                runs[(method, ranks, alpha)] = outs
    run_all(configs, args.jobs)
    for ranks in rank_settings:
        print(f"\n{RANKS[ranks][0]}; MiniLM, WordNet topics ({args.examples} glosses), {CLIENTS} clients, "
              f"{PER_ROUND} a round, {args.rounds} rounds x {args.steps} steps x batch 16; seeds {seeds}; "
              "global test accuracy (%) after the last round, mean ± sample std over seeds; kB per client "
              "per round, up and down (seed 0)\n")  # fmt: skip
        alphas = " | ".join(f"Dirichlet {a:g}" for a in ALPHAS)
        print(f"| Method | tuned | {alphas} | kB up | kB down |")
        print("|---|---|" + "---|" * len(ALPHAS) + "---|---|")
        for method in methods:
            setting = tuned[key(method, ranks)]
            cells = [mean_std(final_accuracy(runs[(method, ranks, a)]), scale=100, digits=1) for a in ALPHAS]
            first = runs[(method, ranks, ALPHAS[0])][0]
            print(f"| {METHODS[method][0]} | lr {setting['lr']:g}, {setting['optimizer_state']} | "
                  + " | ".join(cells)
                  + f" | {kb_per_client_round(first, 'up'):.1f} | {kb_per_client_round(first, 'down'):.1f} |",
                  flush=True)  # fmt: skip
    return runs


def print_claims(runs: dict, methods: list[str], rank_settings: list[str]) -> None:
    """Each paper's headline claim: held where its method's mean accuracy is above every
    row it claims to beat, in every rank setting and Dirichlet level it names."""
    print("\nThe papers' headline claims, on this table (mean accuracy over seeds):")
    for method, settings, beaten, words in CLAIMS:
        needed = [method, *beaten]
        if not all(m in methods for m in needed) or not all(r in rank_settings for r in settings):
            print(f"- {words}: not re-tested (rows or settings missing)")
            continue
        mean = lambda m, r, a: 100 * final_accuracy(runs[(m, r, a)]).mean()  # noqa: E731
        margins = [
            (r, a, b, mean(method, r, a) - mean(b, r, a)) for r in settings for a in ALPHAS for b in beaten
        ]
        held = all(m > 0 for *_, m in margins)
        detail = "; ".join(f"{r} {a:g} vs {METHODS[b][0]} {m:+.1f}" for r, a, b, m in margins)
        print(f"- {words}: {'held' if held else 'did not hold'} ({detail})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help=f"tune each row's rate (seed {TUNING_SEED})")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--ranks", default=",".join(RANKS), help="rank settings: equal, hetero")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5, help="local steps a round")
    ap.add_argument("--examples", type=int, default=3000, help="training pool (all clients)")
    ap.add_argument("--test-examples", type=int, default=500)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument(
        "--extend", type=int, default=3, help="--tune: grid extensions past a best rate at an end"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/lora_family"))
    ap.add_argument("--tuned-file", type=Path, default=TUNED_FILE)
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, each in its own process")
    args = ap.parse_args()
    methods, rank_settings = args.methods.split(","), args.ranks.split(",")
    for given, known, what in ((methods, METHODS, "methods"), (rank_settings, RANKS, "ranks")):
        if unknown := [x for x in given if x not in known]:
            ap.error(f"--{what}: unknown {unknown}; choose from {list(known)}")
    if args.tune:
        tune(args, methods, rank_settings)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = table(args, methods, rank_settings, seeds)
    print_claims(runs, methods, rank_settings)


if __name__ == "__main__":
    main()
