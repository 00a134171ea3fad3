"""HETLoRA's self-pruning: how the rule and its threshold change ranks and accuracy.

The setting of ``benchmarks/personalized.py`` (WordNet on MiniLM, SCAFFOLD s = 0.9, 8
clients all in every round, 8 rounds x 5 steps), HETLoRA with ranks drawn in [2, 8],
``gamma`` 0.9 and penalty 1e-3, under each pruning rule (``method.prune_rule``, see
``fedpeft.methods.hetlora``) and threshold. Prints, per setting: the clients' mean rank
after the first and the last round, how many prunes happened, and the personalised
accuracy of the clients' own adapters beside that of the truncated global adapter.

    .venv/bin/python benchmarks/hetlora_pruning.py [--seed 0] [--out benchmarks/results/hetlora-pruning]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from personalized import DEFAULT_TRAIN, TUNED_FILE, run_all, run_dir
from records import read_records
from tuning import read_tuned

SETTINGS = {
    "no pruning": {"prune_rule": "mean", "prune_ratio": 1e-9},
    "mean 0.05": {"prune_rule": "mean", "prune_ratio": 0.05},
    "mean 0.1 (default)": {"prune_rule": "mean", "prune_ratio": 0.1},
    "mean 0.3": {"prune_rule": "mean", "prune_ratio": 0.3},
    "share 0.1 (before)": {"prune_rule": "share", "prune_ratio": 0.1},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--s", type=float, default=0.9)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hetlora-pruning"))
    args = ap.parse_args()
    train = {"hetlora": read_tuned(TUNED_FILE, ["hetlora"], DEFAULT_TRAIN)["hetlora"]}
    print(f"HETLoRA, s = {args.s}, seed {args.seed}, train {train['hetlora']}\n")
    columns = ["pruning", "mean rank after round 1", "after the last", "prunes after round 1", "own adapter"]
    print("| " + " | ".join([*columns, "truncated global"]) + " |")
    print("|---|---|---|---|---|---|")
    for label, extra in SETTINGS.items():
        out = args.out / label.split(" (")[0].replace(" ", "-")
        run_all([args.seed], [args.s], ["hetlora"], 8, out, extra, train)
        records = read_records(run_dir(out, "hetlora", args.s, args.seed))
        ranks = [[v["rank"] for v in r["client_readout"].values()] for r in records]
        prunes, last = 0, {}
        for r in records:
            for cid, v in r["client_readout"].items():
                prunes += cid in last and v["rank"] < last[cid]
                last[cid] = v["rank"]
        final = records[-1]
        print(
            f"| {label} | {np.mean(ranks[0]):.2f} | {np.mean(ranks[-1]):.2f} | {prunes} | "
            f"{final['local']['accuracy_mean']:.3f} | {final['local_global']['accuracy_mean']:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
