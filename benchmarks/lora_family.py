"""The federated LoRA family (issue 33, docs/lora_family.md) beside FedLR, FeDeRA and
HETLoRA on the bundled MiniLM: accuracy, bytes up and down, and each paper's headline
claim re-tested.

The built-in WordNet glosses (45 topic classes, ``--examples`` of them), Dirichlet label
skew at 0.1 and 1.0 over 20 clients, 10 a round, the same rounds, local steps and batch
for every row (the same examples each round). Two rank settings:

- ``equal``: every client at rank 8 (``lora.r`` 8, alpha 16; HETLoRA's ranks set to 8,
  which it would otherwise draw from 2..8);
- ``hetero``: clients at ranks 2, 4, 8 and 16 (``method.ranks: [2, 4, 8, 16]``, a quarter
  of the clients at each; ``lora.r`` 16, alpha 32: the same scale 2 as ``equal``) for the
  methods that take heterogeneous ranks (HETLoRA, FlexLoRA, FLoRA); every other method
  runs at rank 2, the rank every client can afford (the setting the FLoRA and FlexLoRA
  papers compare homogeneous baselines in).

Each row's rate (and optimizer state) is tuned per method and rank setting on seed 3
(which the table does not use) at Dirichlet 0.1, by the accuracy on the clients' pooled
validation data (20 % of each client's data held out) after the last round, from the grid
``GRID`` (0.005, 0.01, 0.02), which grows past a best rate at its end
(``tuning.tune_method``). Fed-SB runs at rank 64 in ``equal`` (its own default; ``R``
costs ``r^2`` a module, 4,096, under FedLR's 6,144 at rank 8: the point its claim is made
at) and at rank 2 in ``hetero``, alpha = r as its authors set it, and its
first round is its setup round (gradient sums up, nothing trained).

Every run records (every 5 rounds and the last) the global model's accuracy on the global
test set and the clients' own models' on their local test data (what a personalised method
such as FedSA-LoRA, whose ``B`` stays on the clients, is for); the table prints both. A
claim holds where every margin it names is beyond two standard errors over the seeds, fails
where one is beyond two the other way, and is inconclusive otherwise; FedSA-LoRA's on the clients' own models.

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
from records import read_records
from tuning import (
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
#: the rates every row's tuning starts from: LoRA on this model, data and schedule tuned to
#: 0.01 in every row of benchmarks/compression.py (FedLR, FeDeRA; the same 20 rounds of 5
#: steps), so tuning.LR_GRID (0.001-0.005) would spend two runs a row climbing to it
GRID = [5e-3, 1e-2, 2e-2]
TUNED_FILE = TUNED_DIR / "lora_family.json"
#: Fed-SB's rank at equal ranks: its uplink, r^2 a module (4,096), under FedLR's at rank 8
#: (2 x 8 x 384 = 6,144), the operating point of its claim (the paper's r is 64 to 200)
FEDSB_EQUAL_R = 64
#: score the runs every this many rounds (and the last): a coarse curve in metrics.jsonl
EVAL_EVERY = 5
#: a claim's margin counts only beyond this many standard errors of the difference of means
SE_MARGIN = 2.0

#: each paper's headline claim, re-tested on this table: (method, rank settings, the rows
#: it claims to beat, "beats" or "matches" (matches or beats), the claim in words)
CLAIMS = [
    ("ffalora", ("equal",), ("fedlr",), "matches",
     "FFA-LoRA matches or beats LoRA under heterogeneous data, at half the uplink (Sun et al., ICLR 2024)"),
    ("fedsalora", ("equal",), ("fedlr", "ffalora"), "beats",
     "FedSA-LoRA beats LoRA and FFA-LoRA (Guo et al., ICLR 2025)"),
    ("rolora", ("equal",), ("fedlr", "ffalora"), "beats",
     "RoLoRA beats LoRA and FFA-LoRA (Chen et al., NeurIPS 2025)"),
    ("fedexlora", ("equal",), ("fedlr", "ffalora"), "beats",
     "exact aggregation beats FedAvg of the factors (Singhal et al., ACL 2025)"),
    ("flexlora", ("hetero",), ("hetlora", "fedlr"), "beats",
     "FlexLoRA beats HETLoRA's zero-padding and FedIT at heterogeneous ranks (Bai et al., NeurIPS 2024)"),
    ("flora", ("equal", "hetero"), ("fedlr", "hetlora"), "beats",
     "FLoRA beats FedIT and zero-padding, homogeneous and heterogeneous (Wang et al., NeurIPS 2024)"),
    ("lorafair", ("equal",), ("fedlr", "ffalora", "flora", "flexlora"), "beats",
     "LoRA-FAIR beats FedIT, FFA-LoRA, FLoRA and FlexLoRA (Bian et al., ICCV 2025)"),
    ("fedsb", ("equal",), ("fedlr", "ffalora", "fedexlora"), "beats",
     "Fed-SB beats FedIT, FFA-LoRA and FedEx-LoRA at a fraction of their uplink (Singhal et al., 2025)"),
]  # fmt: skip


def method_config(method: str, ranks: str) -> dict:
    """``method``'s config in rank setting ``ranks``."""
    _, lora, per_client = RANKS[ranks]
    if method == "fedsb":  # the authors' alpha = r (s = 1)
        r = FEDSB_EQUAL_R if per_client is None else min(per_client)
        return {"name": method, "lora": {"r": r, "alpha": r}}
    if per_client is None:  # HETLoRA's ranks would be drawn from r_min..r: every client at r
        return {"name": method, "lora": dict(lora), **({"ranks": [lora["r"]]} if method == "hetlora" else {})}
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
    # local: the clients' own models too (FedSA-LoRA's B is personal); scored every EVAL_EVERY
    # rounds and the last (the table reads the last; scoring is ~40 % of a CPU run every round)
    scored = {"every": EVAL_EVERY, "local": True}
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
            "log": {"plots": False},  # the records are the result; figures cost seconds a run
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

    best, report = tune_method(score, GRID, extend=args.extend)
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


def final_accuracy(outs: list[Path], local: bool = False) -> np.ndarray:
    """Each run's accuracy after the last round: the global model's on the global test set,
    or (``local``) the mean over clients of their own models' on their local test data."""
    last = [read_records(out)[-1] for out in outs]
    return np.array([r["local"]["accuracy_mean"] if local else r["global"]["accuracy"] for r in last])


def kb_per_client_round(out: Path, direction: str, skip: int = 0) -> float:
    """kB a client sent (``up``) or received (``down``) per round it took part in, the
    first ``skip`` rounds left out."""
    records = read_records(out)[skip:]
    return sum(r[f"bytes_{direction}"] for r in records) / sum(len(r["clients"]) for r in records) / 1e3


def table(args, methods, rank_settings, seeds) -> tuple[dict[tuple[str, str, float], list[Path]], dict]:
    """Every table run (reused when finished) and the table; returns the runs and the
    failed ones' errors."""
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
    failed = run_all(configs, args.jobs, keep_going=True)
    for ranks in rank_settings:
        print(f"\n{RANKS[ranks][0]}; MiniLM, WordNet topics ({args.examples} glosses), {CLIENTS} clients, "
              f"{PER_ROUND} a round, {args.rounds} rounds x {args.steps} steps x batch 16; seeds {seeds}; "
              "accuracy (%) after the last round, mean ± sample std over seeds: the global model's on the "
              "global test set, and the clients' own models' on their local test data (mean over clients); "
              "kB per client per round, up and down (seed 0)\n")  # fmt: skip
        alphas = " | ".join(f"{w} Dirichlet {a:g}" for w in ("global", "own") for a in ALPHAS)
        print(f"| Method | tuned | {alphas} | kB up | kB down |")
        print("|---|---|" + "---|" * 2 * len(ALPHAS) + "---|---|")
        for method in methods:
            setting = tuned[key(method, ranks)]
            cells = [
                failed_cell(runs[(method, ranks, a)], failed)
                or mean_std(final_accuracy(runs[(method, ranks, a)], local), scale=100, digits=1)
                for local in (False, True)
                for a in ALPHAS
            ]
            first = runs[(method, ranks, ALPHAS[0])][0]
            kb = {
                d: "" if first in failed else f"{kb_per_client_round(first, d):.1f}" for d in ("up", "down")
            }
            sent = f"| {kb['up']} | {kb['down']} |"
            print(f"| {METHODS[method][0]} | lr {setting['lr']:g}, {setting['optimizer_state']} | "
                  + " | ".join(cells) + f" {sent}", flush=True)  # fmt: skip
    return runs, failed


def margin(ours: np.ndarray, theirs: np.ndarray) -> tuple[float, float]:
    """(difference of the mean accuracies in points, its standard error over seeds)."""
    se = np.sqrt(ours.var(ddof=1) / len(ours) + theirs.var(ddof=1) / len(theirs)) if len(ours) > 1 else 0.0
    return 100 * (ours.mean() - theirs.mean()), 100 * float(se)


def print_claims(runs: dict, failed: dict, methods: list[str], rank_settings: list[str]) -> None:
    """Each paper's headline claim, in every rank setting and Dirichlet level it names,
    against every row it claims to beat: *held* where each margin is above ``SE_MARGIN``
    standard errors (a "matches or beats" claim: none is below minus that), *did not hold*
    where one is below (above, for "matches") the opposite, else *inconclusive* at these
    seeds. FedSA-LoRA's claim is on the clients' own models (its ``B`` is personal); every
    other on the global model. The uplink beside it, as a share of each beaten row's (and
    from round 2 on, where that differs)."""
    print(f"\nThe papers' headline claims, on this table (margins of the mean accuracy over seeds, "
          f"points ± standard error; a margin counts beyond {SE_MARGIN:g} standard errors):")  # fmt: skip
    for method, settings, beaten, kind, words in CLAIMS:
        if not all(m in methods for m in [method, *beaten]) or not all(r in rank_settings for r in settings):
            print(f"- {words}: not re-tested (rows or settings missing)")
            continue
        involved = [o for m in [method, *beaten] for r in settings for a in ALPHAS for o in runs[(m, r, a)]]
        if bad := failed_cell(involved, failed):
            print(f"- {words}: not re-tested ({bad})")
            continue
        local = method == "fedsalora"
        margins = [
            (
                r,
                a,
                b,
                *margin(final_accuracy(runs[(method, r, a)], local), final_accuracy(runs[(b, r, a)], local)),
            )
            for r in settings
            for a in ALPHAS
            for b in beaten
        ]
        above = [m > SE_MARGIN * se for *_, m, se in margins]
        below = [m < -SE_MARGIN * se for *_, m, se in margins]
        if kind == "matches":
            verdict = "did not hold" if any(below) else "held"
        else:
            verdict = "held" if all(above) else "did not hold" if any(below) else "inconclusive"
        first = {m: runs[(m, settings[0], ALPHAS[0])][0] for m in [method, *beaten]}
        ratios = [[kb_per_client_round(first[method], "up", skip) / kb_per_client_round(first[b], "up", skip)
                   for b in beaten] for skip in (0, 1)]  # fmt: skip
        shares = [
            ", ".join(f"{x:.2f} of {METHODS[b][0]}'s" for x, b in zip(r, beaten, strict=True)) for r in ratios
        ]
        # a first round unlike the others (Fed-SB's setup round sends gradient sums): both
        setup = any(abs(a - b) > 0.05 * b for a, b in zip(*ratios, strict=True))
        share = f"{shares[0]}; from round 2: {shares[1]}" if setup else shares[0]
        detail = "; ".join(f"{r} {a:g} vs {METHODS[b][0]} {m:+.1f} ± {se:.1f}" for r, a, b, m, se in margins)
        print(f"- {words}: {verdict} ({detail}; uplink {share})")


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
    runs, failed = table(args, methods, rank_settings, seeds)
    print_claims(runs, failed, methods, rank_settings)


if __name__ == "__main__":
    main()
