"""The FedAvg-family baselines against Local-only (and Centralized) on one config.

Same data, partition, seed, rounds, clients per round and local schedule for every
method; only the method (and its learning rate, tuned per method as the papers do:
full fine-tuning needs a far smaller one) changes. Prints a markdown table of the
final global-test scores, the clients' local-test accuracy and the bytes sent, and
says whether each federated method beats Local-only on the global test set.

    .venv/bin/python benchmarks/baselines.py [--rounds 12] [--seeds 0] [--out runs/baselines]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from tuning import mean_std

from fedpeft.config import load_config
from fedpeft.experiment import run

LR = {
    "fedft": 5e-5,
    "fedbf": 3e-3,
    "fedap": 2e-3,
    "fedlr": 2e-3,
    "local": 2e-3,
    "centralized": 2e-3,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--methods", default="local,fedbf,fedlr,fedap,fedft")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=Path("runs/baselines"))
    ap.add_argument("--set", action="append", default=[], help="extra KEY=VALUE overrides (YAML values)")
    args = ap.parse_args()

    import yaml

    rows: dict[str, list[dict]] = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.methods.split(","):
            overrides = {
                "name": name,
                "seed": seed,
                "method": {"name": name},
                "partition.alpha": args.alpha,
                "train.rounds": args.rounds,
                "train.lr": LR[name],
                "data.max_test_samples": 500,
                "eval.every": max(1, args.rounds // 2),
                "output_dir": str(args.out / f"{name}-s{seed}"),
            }
            for item in args.set:
                key, _, value = item.partition("=")
                overrides[key] = yaml.safe_load(value)
            summary = run(load_config(None, overrides))
            rows.setdefault(name, []).append(summary)
            g = summary["final_global"]
            print(
                f"[{name} seed {seed}] global acc {g['accuracy']:.4f}  train {summary['time_train']:.0f}s",
                flush=True,
            )

    print("\nmean ± sample std over seeds\n")
    print("\n| method | lr | global acc | macro-F1 | MCC | local acc (mean) | MB sent | train s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, summaries in rows.items():
        acc = [s["final_global"]["accuracy"] for s in summaries]
        f1 = [s["final_global"]["macro_f1"] for s in summaries]
        mcc = [s["final_global"]["mcc"] for s in summaries]
        loc = [s["final_local"]["accuracy_mean"] for s in summaries]
        mb = np.mean([s["total_bytes"] for s in summaries]) / 1e6
        ts = np.mean([s["time_train"] for s in summaries])
        print(
            f"| {name} | {LR[name]:g} | {mean_std(acc)} | {mean_std(f1)} | {mean_std(mcc)} | "
            f"{mean_std(loc)} | {mb:,.1f} | {ts:.0f} |"
        )
    if "local" in rows:
        base = np.mean([s["final_global"]["accuracy"] for s in rows["local"]])
        for name, summaries in rows.items():
            if name != "local":
                acc = np.mean([s["final_global"]["accuracy"] for s in summaries])
                verdict = "beats" if acc > base else "does NOT beat"
                print(f"{name} {verdict} Local-only on the global test set ({acc:.3f} vs {base:.3f})")


if __name__ == "__main__":
    main()
