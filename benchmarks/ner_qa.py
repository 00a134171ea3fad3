"""FeDeRA against FedLR and FedFT on NER and extractive QA (FeDeRA paper, sec. 5: its
CoNLL-2003 and SQuAD comparisons), on the bundled MiniLM.

NER: CoNLL-2003 English (built in), partitioned by each sentence's set of entity types
(Dirichlet). QA: the built-in WordNet usage-example QA set, partitioned by k-means
clusters of the questions' embeddings (Dirichlet), as the paper partitions SQuAD. LoRA
r = 8 on query/value at scale 1 (alpha = r, the paper's beta = r) for FedLR and FeDeRA;
the same rounds, clients and local steps for all. Each method's ``train.lr`` and
optimizer state are tuned (``--tune``) on seed 3, which the table does not use, by the
task's headline score (entity F1; QA F1) on the global test set.

    .venv/bin/python benchmarks/ner_qa.py --tune [--tasks ner,qa] [--methods ...]
    .venv/bin/python benchmarks/ner_qa.py [--seeds 0,1] [--out benchmarks/results/ner_qa]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from records import read_records
from tuning import LR_GRID, TUNED_DIR, mean_std, read_tuned, run_or_reuse, tune_method, write_tuned

from fedpeft.config import load_config

METHODS = {
    "fedft": {"name": "fedft"},
    "fedlr": {"name": "fedlr", "lora": {"r": 8, "alpha": 8}},
    "federa": {"name": "federa", "lora": {"r": 8, "alpha": 8}},
}
GRIDS = {"fedft": [2e-5, 5e-5, 1e-4]}  # full fine-tuning wants far smaller rates; the others: LR_GRID
TASKS = {
    "ner": ({"task": "token_classification", "source": "conll2003", "max_length": 64}, "entity_f1"),
    "qa": ({"task": "extractive_qa", "source": "wordnet", "max_length": 96, "stride": 32,
            "question_clusters": 10}, "f1"),
}  # fmt: skip
TUNING_SEED = 3
TUNED_FILE = TUNED_DIR / "ner_qa.json"


def config(task: str, name: str, seed: int, out: Path, args: argparse.Namespace, train: dict):
    data, _ = TASKS[task]
    return load_config(
        None,
        {
            "name": f"{task}-{name}",
            "seed": seed,
            "output_dir": str(out),
            "method": METHODS[name],
            "data": {**data, "max_samples": args.examples, "max_test_samples": args.test_examples},
            "partition": {"scheme": "dirichlet", "num_clients": args.clients, "alpha": 0.5},
            "train": {"rounds": args.rounds, "clients_per_round": args.per_round,
                      "local_steps": args.steps, "batch_size": 16, **train},
            "eval": {"every": args.rounds, "local": False},
        },
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tasks", default="ner,qa")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--examples", type=int, default=3000)
    ap.add_argument("--test-examples", type=int, default=400)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/ner_qa"))
    args = ap.parse_args()
    tasks, names = args.tasks.split(","), args.methods.split(",")
    if args.tune:
        for task in tasks:
            metric = TASKS[task][1]
            for name in names:

                def score(train: dict, task=task, name=name, metric=metric) -> float:
                    out = args.out / "tune" / f"{task}-{name}-{train['lr']:g}-{train['optimizer_state']}"
                    run_or_reuse(config(task, name, TUNING_SEED, out, args, train))
                    return read_records(out)[-1]["global"][metric]

                best, report = tune_method(score, GRIDS.get(name, LR_GRID))
                print(f"{task} {name}: {report}", flush=True)
                write_tuned(TUNED_FILE, {f"{task}-{name}": best})
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    tuned = read_tuned(TUNED_FILE, [f"{t}-{n}" for t in tasks for n in names])
    print(f"\nMiniLM, {args.clients} clients ({args.per_round} a round), {args.rounds} rounds x "
          f"{args.steps} steps x 16 examples; seeds {seeds}; final global score, "
          "mean ± sample std over seeds\n")  # fmt: skip
    print("| task | method | lr, optimizer state | headline | score | MB sent |")
    print("|---|---|---|---|---|---|")
    for task in tasks:
        metric = TASKS[task][1]
        for name in names:
            setting = tuned[f"{task}-{name}"]
            scores, sent = [], []
            for seed in seeds:
                out = args.out / f"{task}-{name}-seed{seed}"
                summary = run_or_reuse(config(task, name, seed, out, args, setting))
                scores.append(summary["final_global"][metric])
                sent.append(summary["total_bytes"] / 1e6)
            cells = [task, name, f"{setting['lr']:g}, {setting['optimizer_state']}", metric,
                     mean_std(scores, digits=2), f"{np.mean(sent):.1f}"]  # fmt: skip
            print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
