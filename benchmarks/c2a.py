"""C2A against the PEFT baselines of its paper (C2A paper, sec. 4, Tables 1, 3 and 4,
Figure 4's client drift), on the bundled MiniLM and the built-in WordNet corpus.

The paper's setup (sec. 4.3): 100 clients, 25 % of them each round, one local epoch,
batch 16, AdamW, FedAvg (here 20 rounds on a 4,000-gloss pool, about 3 local steps a
client and round, where the paper's Table 4 counts up to 100 rounds: a CPU budget);
labels Dirichlet(beta)-partitioned as FedNLP does (``partition.dirichlet_mode:
per_class_capped``) at beta = 5.0, 1.0 and 0.1. Methods: full fine-tuning (``fedft``),
Houlsby adapters (``fedap``, bottleneck 16), LoRA (``fedlr``, r 4 on query/value),
Compacter, prompt tuning, BitFit (``fedbf``), AdaMix and C2A (and beside them
``c2a_code``, C2A as its authors' code has it: docs/c2a.md), each with its trainable
share of the model (bottleneck and rank as the paper's shares imply: 0.455 % of
DistilBERT is Houlsby bottleneck 16, 0.111 % LoRA r 4; Compacter and AdaMix at
bottleneck 16, C2A r 16, t 8, s 64). Each method's ``train.lr`` and optimizer state are tuned
(``--tune``) on seed 3, which the tables do not use, at beta 1.0 (the middle setting),
by the clients' mean accuracy on validation splits after the last round (20 % of each
client's data, held out in the tuning runs only; the test set is never scored there);
every table run uses the same clients, rounds and examples per round as the others.

Printed: Table 1's layout (accuracy %, mean ± sample std over seeds, per beta); the ablation
table (Table 3: without label embedding, context embedding, both, factorisation,
normalisation) at the hardest beta; rounds to a target accuracy with the speed-up over
the adapter baseline (Table 4, from ``fedpeft report``'s table); the client drift (CKA
between each participating client's logits and the global model's on a fixed probe
batch, per round: ``eval.drift``) plotted to ``--out/drift.png``; then whether the
paper's claim held: C2A the best, and the least hurt as beta falls.

    .venv/bin/python benchmarks/c2a.py --tune [--methods ...]
    .venv/bin/python benchmarks/c2a.py [--seeds 0,1,2] [--betas 5.0,1.0,0.1] [--rounds 20]
        [--examples 4000] [--out benchmarks/results/c2a]

Runs are picked up from ``--out`` when finished (``tuning.run_or_reuse``); tuned settings
live in ``--tuned-file`` (``benchmarks/tuned/c2a.json``). Set ``OMP_NUM_THREADS`` for the CPU threads.
"""

from __future__ import annotations

import argparse
import multiprocessing
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import numpy as np
from records import read_records, read_summary
from tuning import LR_GRID, TUNED_DIR, mean_std, read_tuned, run_all, run_or_reuse, tune_method, write_tuned

from fedpeft.config import ExperimentConfig, load_config

METHODS = {  # key: (row label, method config)
    "fedft": ("Full Fine-tuning", {"name": "fedft"}),
    "fedap": ("Adapter", {"name": "fedap", "adapter": {"bottleneck": 16}}),
    "fedlr": ("LoRA", {"name": "fedlr", "lora": {"r": 4, "alpha": 8}}),
    "compacter": ("Compacter", {"name": "compacter"}),
    "prompt_tuning": ("Prompt-tuning", {"name": "prompt_tuning"}),
    "fedbf": ("BitFit", {"name": "fedbf"}),
    # AdaMix's recipe (its paper and released BERT code): FFN sites only, 4 down-projection
    # experts sharing one up-projection
    "adamix_paper": (
        "AdaMix",
        {"name": "adamix", "adapter": {"sites": [r"layer\.\d+\.output\.dense$"], "share_up": True}},
    ),
    # beside it, labelled: both Houlsby sites, 4 down and 4 up experts (an earlier row, at
    # about ten times the paper's share)
    "adamix": ("AdaMix (both sites, 4 + 4 experts)", {"name": "adamix"}),
    "c2a": ("C2A", {"name": "c2a"}),
    # beside the paper's rows: C2A as the authors' code has it (docs/c2a.md lists how it
    # departs from the paper's equations), tuned like every row
    "c2a_code": (
        "C2A (authors' code readings)",
        {
            "name": "c2a",
            "hyper": {
                "normalise_scope": "slice",
                "generator_bias": True,
                "tie": "view",
                "adapter_bias": True,
                "context_pool": "mean",
            },
        },
    ),
}
OPT_IN = {"adamix"}  # not in the default table: run with --methods adamix,...
C2A_ROWS = ("c2a", "c2a_code")
ABLATIONS = {  # the paper's Table 3
    "c2a": ("C2A", {}),
    "c2a-no-le": ("w/o LE", {"label_embedding": False}),
    "c2a-no-ce": ("w/o CE", {"context_embedding": False}),
    "c2a-no-le-ce": ("w/o LE,CE", {"label_embedding": False, "context_embedding": False}),
    "c2a-no-fact": ("w/o Factorization", {"factorise": False}),
    "c2a-no-norm": ("w/o Normalization", {"normalise": False}),
}
# others: LR_GRID. Full FT (about 20 min a run here) starts where cross_silo.py's tuning
# ended (2e-4); the tuner still extends the grid past whichever end wins
GRIDS = {"fedft": [5e-5, 1e-4, 2e-4], "prompt_tuning": [5e-3, 1e-2, 2e-2]}
# Full FT with ``optimizer_state: keep`` holds 100 clients' whole-model Adam states (18 GB
# on disk; a cohort's 25 of them in memory: the run was killed for memory on 24 GiB): reset only
RESET_ONLY = {"fedft"}
TUNING_SEED, TUNING_BETA = 3, 1.0
VAL_FRACTION = 0.2  # of each client's data, held out in tuning runs
TUNED_FILE = TUNED_DIR / "c2a.json"


def method_config(name: str) -> dict:
    if name in METHODS:
        return METHODS[name][1]
    return {"name": "c2a", "hyper": ABLATIONS[name][1]}


def config(
    name: str, beta: float, seed: int, out: Path, args: argparse.Namespace, train: dict, tuning: bool = False
) -> ExperimentConfig:
    """A table run scores every round (rounds to target) and records drift; a tuning run
    holds out a validation split of each client's data (``partition.val_fraction``) and is
    scored on it after its last round only, never on the test set."""
    scored, partition = {"every": 1, "drift": True, "drift_probe": 32, "local": False}, {}
    if tuning:
        scored, partition = (
            {"every": args.rounds, "drift": False, "local": True},
            {"val_fraction": VAL_FRACTION},
        )
    if method_config(name)["name"] == "c2a":
        # C2A's adapters depend on the batch (its context is pooled over it): the authors
        # evaluate in batches of the training size; other methods do not depend on it
        scored["batch_size"] = 16
    return load_config(
        None,
        {
            "name": f"c2a-bench-{name}-beta{beta:g}",
            "seed": seed,
            "output_dir": str(out),
            "method": method_config(name),
            "data": {"source": "wordnet", "max_samples": args.examples,
                     "max_test_samples": args.test_examples, "max_length": args.max_length},
            "partition": {"scheme": "dirichlet", "num_clients": args.clients, "alpha": beta,
                          "dirichlet_mode": "per_class_capped", **partition},
            "train": {"rounds": args.rounds, "clients_per_round": args.clients // 4, "local_epochs": 1,
                      "local_steps": None, "batch_size": 16, **train},
            "eval": scored,
        },
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true", help=f"tune lr and optimizer state (seed {TUNING_SEED})")
    ap.add_argument("--methods", default=",".join(m for m in METHODS if m not in OPT_IN))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--betas", default="5.0,1.0,0.1")
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--examples", type=int, default=4000, help="training pool (all clients)")
    ap.add_argument("--test-examples", type=int, default=500)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--target", type=float, default=None,
                    help="accuracy for the rounds-to-target table (default: 90%% of the adapter "
                    "baseline's final accuracy at the hardest beta)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/c2a"))
    ap.add_argument(
        "--extend", type=int, default=3, help="--tune: grid extensions past a best rate at an end"
    )
    ap.add_argument("--tuned-file", type=Path, default=TUNED_FILE)
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, each in its own process (on a GPU they share the device); "
                    "--tune: methods at once")  # fmt: skip
    args = ap.parse_args()
    names = args.methods.split(",")
    if unknown := [n for n in names if n not in METHODS]:
        ap.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    if args.tune:
        tune(names, args)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    betas = [float(b) for b in args.betas.split(",")]
    settings = read_tuned(args.tuned_file, names)
    runs: dict[str, dict[float, list[Path]]] = {}
    configs = []
    for name in names:
        for beta in betas:
            for seed in seeds:
                out = args.out / f"{name}-beta{beta:g}-seed{seed}"
                configs.append(config(name, beta, seed, out, args, settings[name]))
                runs.setdefault(name, {}).setdefault(beta, []).append(out)
    hardest = min(betas)
    ablation: dict[str, list[Path]] = {}
    if not args.no_ablation and "c2a" in names:
        for name in ABLATIONS:
            for seed in seeds:
                out = args.out / f"{name}-beta{hardest:g}-seed{seed}"
                configs.append(config(name, hardest, seed, out, args, settings["c2a"]))
                ablation.setdefault(name, []).append(out)
    run_all(configs, args.jobs)
    print(f"\nMiniLM, WordNet topics ({args.examples} training glosses), {args.clients} clients, "
          "25 % a round, "
          f"{args.rounds} rounds x 1 epoch x batch 16; Dirichlet (FedNLP capped); seeds {seeds}; global test "
          "accuracy (%) after the last round, mean ± sample std over seeds\n")  # fmt: skip
    print_table(runs, settings, betas)
    if ablation:
        print_ablation(ablation, hardest)
    print_rounds_to_target(runs, hardest, args.target)
    plot_drift(runs, hardest, args.out / "drift.png")
    print_claim(runs, betas)


def tune(names: list[str], args: argparse.Namespace) -> None:
    print(
        f"tuning on seed {TUNING_SEED}, beta {TUNING_BETA:g}: the clients' mean validation accuracy "
        f"({100 * VAL_FRACTION:g} % of each client's data held out) after round {args.rounds}"
    )
    if args.jobs <= 1:
        for name in names:
            record_tuned(args.tuned_file, *tune_one(name, args))
        return
    # one method per worker (a method's grid is walked in order); only this process writes
    # the tuned file
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for done in as_completed([pool.submit(tune_one, name, args) for name in names]):
            record_tuned(args.tuned_file, *done.result())


def tune_one(name: str, args: argparse.Namespace) -> tuple[str, dict, str]:
    """``name``'s tuned setting and the grid's report."""

    def score(train: dict) -> float:
        out = args.out / "tune-val" / f"{name}-{train['lr']:g}-{train['optimizer_state']}"
        run_or_reuse(config(name, TUNING_BETA, TUNING_SEED, out, args, train, tuning=True))
        return read_records(out)[-1]["val"]["accuracy_mean"]

    # three extensions: in 20 short rounds the best rates sit high, past two
    grid = GRIDS.get(name, LR_GRID)
    best, report = tune_method(score, grid, extend=args.extend, keep=name not in RESET_ONLY)
    return name, best, report


def record_tuned(path: Path, name: str, best: dict, report: str) -> None:
    print(f"  {name}: {report}", flush=True)
    write_tuned(path, {name: best})


def final_accuracy(outs: list[Path]) -> np.ndarray:
    return np.array([read_records(out)[-1]["global"]["accuracy"] for out in outs])


def late_accuracy(outs: list[Path], last: int = 5) -> np.ndarray:
    """Each run's mean global accuracy over its last ``last`` rounds: under heavy skew the
    global accuracy swings from round to round with the sampled cohort's labels."""
    return np.array([np.mean([r["global"]["accuracy"] for r in read_records(out)[-last:]]) for out in outs])


def pm(values: np.ndarray) -> str:
    return mean_std(values, scale=100, digits=1)


def params_share(out: Path) -> float:
    params = read_summary(out)["params"]
    return 100 * params["trainable"] / params["total"]


def print_table(runs: dict[str, dict[float, list[Path]]], settings: dict, betas: list[float]) -> None:
    print("| Methods | Params (%) | lr, optimizer state | " + " | ".join(f"beta={b:g}" for b in betas) + " |")
    print("|---|---|---|" + "---|" * len(betas))
    for name, by_beta in runs.items():
        first = by_beta[betas[0]][0]
        cells = [METHODS[name][0], f"{params_share(first):.3f}%",
                 f"{settings[name]['lr']:g}, {settings[name]['optimizer_state']}"]  # fmt: skip
        cells += [pm(final_accuracy(by_beta[b])) for b in betas]
        print("| " + " | ".join(cells) + " |", flush=True)
    print("\nParams: trainable parameters (head included) / all parameters of the trained model.")


def print_ablation(ablation: dict[str, list[Path]], beta: float) -> None:
    print(f"\nAblation (the paper's Table 3), beta {beta:g}, C2A's tuned rate for every variant\n")
    print("| Methods | Params (%) | Accuracy (%) | mean of the last 5 rounds (%) |")
    print("|---|---|---|---|")
    for name, outs in ablation.items():
        share, final, late = params_share(outs[0]), pm(final_accuracy(outs)), pm(late_accuracy(outs))
        print(f"| {ABLATIONS[name][0]} | {share:.3f}% | {final} | {late} |")


def print_rounds_to_target(
    runs: dict[str, dict[float, list[Path]]], beta: float, target: float | None
) -> None:
    """Per seed, ``fedpeft report``'s rounds-to-target table (``rounds_to_target``) of every
    method's run against the adapter's."""
    from fedpeft.report.efficiency import rounds_to_target

    if "fedap" not in runs:
        return
    if target is None:
        target = 0.9 * final_accuracy(runs["fedap"][beta]).mean()
    seeds = len(runs["fedap"][beta])
    tables = [
        {row["run"]: row for row in rounds_to_target(
            {n: read_records(by_beta[beta][i]) for n, by_beta in runs.items()}, target, "fedap")}
        for i in range(seeds)
    ]  # fmt: skip
    print(f"\nRounds to {100 * target:.1f} % global accuracy (the paper's Table 4), beta {beta:g}; per seed; "
          "speed-up = the adapter's rounds / the method's (`fedpeft report <runs> --target "
          f"{target:.4f} --baseline fedap` on one seed's runs)\n")  # fmt: skip
    print("| Methods | rounds | speed-up |")
    print("|---|---|---|")
    for name in runs:
        rows = [t[name] for t in tables]
        rounds = " / ".join(
            str(r["round"]) if r["round"] is not None else f"> {r['rounds_run']}" for r in rows
        )
        speed = " / ".join(
            "-" if r["speedup"] is None else f"{'' if r['bound'] == '=' else r['bound']}{r['speedup']:.2f}x"
            for r in rows
        )
        print(f"| {METHODS[name][0]} | {rounds} | {speed} |")


def drift_curve(outs: list[Path]) -> tuple[list[int], list[float]] | None:
    """Rounds and the mean over seeds of the mean client drift (CKA) each round."""
    per_seed = []
    for out in outs:
        records = [r for r in read_records(out) if isinstance(r.get("drift"), dict) and "mean" in r["drift"]]
        per_seed.append({r["round"]: r["drift"]["mean"] for r in records})
    rounds = sorted(set.intersection(*(set(s) for s in per_seed))) if per_seed else []
    if not rounds:
        return None
    return rounds, [float(np.mean([s[k] for s in per_seed])) for k in rounds]


def plot_drift(runs: dict[str, dict[float, list[Path]]], beta: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4))
    for name, by_beta in runs.items():
        curve = drift_curve(by_beta[beta])
        if curve:
            ax.plot(*curve, marker="o", label=METHODS[name][0])
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax.set_ylabel("CKA(client logits, global logits)")
    ax.set_title(f"Client drift, beta {beta:g} (higher: less drift)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the curves
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)  # the runs' directory: absent when every run was reused
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"\ndrift plot: {path}")
    for name, by_beta in runs.items():
        curve = drift_curve(by_beta[beta])
        if curve:
            print(f"  {METHODS[name][0]}: mean drift CKA over rounds {np.mean(curve[1]):.3f}")


def print_claim(runs: dict[str, dict[float, list[Path]]], betas: list[float]) -> None:
    """The paper's claims (sec. 4.4): C2A is the best PEFT method at every beta and loses
    the least accuracy as beta falls; checked for each C2A row against the other PEFT rows."""
    peft = [n for n in runs if n not in (*C2A_ROWS, "fedft")]
    easy, hard = max(betas), min(betas)
    drops = {n: final_accuracy(runs[n][easy]).mean() - final_accuracy(runs[n][hard]).mean() for n in runs}
    print(f"\naccuracy lost from beta {easy:g} to {hard:g} (points): "
          + ", ".join(f"{METHODS[n][0]} {100 * d:.1f}" for n, d in drops.items()))  # fmt: skip
    late = {n: late_accuracy(runs[n][easy]).mean() - late_accuracy(runs[n][hard]).mean() for n in runs}
    print("the same, on each run's mean accuracy over its last 5 rounds (points): "
          + ", ".join(f"{METHODS[n][0]} {100 * d:.1f}" for n, d in late.items()))  # fmt: skip
    for row in (n for n in C2A_ROWS if n in runs):
        label = METHODS[row][0]
        print(f"\nThe paper's claim, for {label}:")
        for beta in betas:
            ours = final_accuracy(runs[row][beta]).mean()
            best = max(peft, key=lambda n: final_accuracy(runs[n][beta]).mean()) if peft else None
            if best:
                theirs = final_accuracy(runs[best][beta]).mean()
                print(f"  beta {beta:g}: {label} {100 * ours:.1f} vs best other PEFT {METHODS[best][0]} "
                      f"{100 * theirs:.1f} -> {'held' if ours > theirs else 'did not hold'}")  # fmt: skip
        for what, lost in (("smallest loss", drops), ("smallest loss, last 5 rounds", late)):
            least = min([*peft, row], key=lost.get)
            print(f"  the most robust PEFT method ({what}): {'held' if least == row else 'did not hold'} "
                  f"(smallest: {METHODS[least][0]})")  # fmt: skip


if __name__ == "__main__":
    main()
