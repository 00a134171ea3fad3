"""Personalised federated LoRA methods side by side (PF2LoRA paper, sec. 6 and the s ablation).

The WordNet corpus on the bundled MiniLM, SCAFFOLD-style partition at heterogeneity
s = 0.6, 0.9, 1.0, 8 clients all taking part in every round (as in the paper), the same
rounds and local steps (the communication interval I) for every method. Personalised
accuracy is each client's own model on its own test split (mean ± std over seeds of the
mean over clients, and the worst decile of clients); the global model's accuracy on the
global test set beside it. Also prints the measured cost of PF2LoRA's hypergradient:
seconds per local step with the bilevel coupling against the same steps with it
switched off (``bilevel: false``, the paper's ablation).

    .venv/bin/python benchmarks/personalized.py [--seeds 0,1,3] [--s 0.6,0.9,1.0] [--head shared|personal]
        [--methods local,...] [--set KEY=VALUE ...] [--out runs/personalized]

Seed 2 is left out of the default seeds: it is the seed the learning rates were tuned on.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml

from fedpeft.config import load_config
from fedpeft.experiment import run
from fedpeft.report.results import read_records, read_summary

LORA = {"r": 8, "alpha": 16}
PF2 = {"name": "pf2lora", "lora": LORA, "client_rank": 2, "client_alpha": 4, "lower_lr": 0.3}
METHODS = {
    "local": {"name": "local"},
    "homlora": {"name": "fedlr", "lora": LORA},
    "perfedavg": {"name": "perfedavg", "order": 1, "inner_lr": 0.01, "lora": LORA},
    "hetlora": {"name": "hetlora", "lora": LORA, "r_min": 2},
    "pf2lora": PF2,
    "pf2lora-nobilevel": {**PF2, "bilevel": False},
}


def run_all(
    seeds: list[int], levels: list[float], names: list[str], rounds: int, out: Path, method_extra: dict
) -> None:
    for seed in seeds:
        for s in levels:
            for name in names:
                run_dir = out / f"s{s}" / f"{name}-seed{seed}"
                if (run_dir / "summary.json").is_file():
                    continue  # resumable
                cfg = load_config(None, {
                    "name": name,
                    "seed": seed,
                    "method": {**METHODS[name], **method_extra},
                    "output_dir": str(run_dir),
                    "data.max_samples": 2000,
                    "data.max_test_samples": 400,
                    "partition": {"scheme": "similarity", "similarity": s, "num_clients": 8},
                    "train": {"rounds": rounds, "clients_per_round": 8, "local_steps": 5, "batch_size": 16,
                              "lr": 0.002},
                    "eval.every": rounds,
                })  # fmt: skip
                summary = run(cfg, resume=(run_dir / "checkpoint.pt").is_file())  # pick up a cut-off run
                acc = summary["final_local"]["accuracy_mean"]
                print(f"[s={s} {name} seed {seed}] personalised {acc:.4f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,3")
    ap.add_argument("--s", default="0.6,0.9,1.0")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("runs/personalized"))
    ap.add_argument(
        "--head", choices=["shared", "personal"], default="shared",
        help="the classification head: averaged like the adapters, or kept on each client",
    )  # fmt: skip
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="a method setting for every method run (for tuning; give it its own --out), e.g. inner_lr=0.1",
    )  # fmt: skip
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    levels = [float(x) for x in args.s.split(",")]
    names = args.methods.split(",")
    method_extra = {"head": args.head}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        method_extra[key] = yaml.safe_load(value)
    run_all(seeds, levels, names, args.rounds, args.out, method_extra)

    print(f"\n8 clients, all per round, {args.rounds} rounds x 5 local steps, {args.head} head, seeds {seeds}\n")
    head = " | ".join(f"s = {s}: personalised (worst decile) / global" for s in levels)
    print(f"| method | {head} |")
    print("|---|" + "---|" * len(levels))
    step_time: dict[str, list[float]] = {}
    for name in names:
        cells = []
        for s in levels:
            dirs = [args.out / f"s{s}" / f"{name}-seed{seed}" for seed in seeds]
            sums = [read_summary(d) for d in dirs]
            pers = [x["final_local"]["accuracy_mean"] for x in sums]
            worst = np.mean([x["final_local"]["accuracy_p10"] for x in sums])
            glob = np.mean([x["final_global"]["accuracy"] for x in sums])
            cells.append(f"{np.mean(pers):.3f} ± {np.std(pers):.3f} ({worst:.3f}) / {glob:.3f}")
            for d in dirs:
                step_time.setdefault(name, []).extend(
                    r["fit"]["time_step"] for r in read_records(d) if "time_step" in r.get("fit", {})
                )
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nseconds per local step (mean over rounds and clients), where the method reports it:")
    for name, times in step_time.items():
        if times:
            print(f"  {name}: {np.mean(times):.3f}")
    if "pf2lora" in step_time and "pf2lora-nobilevel" in step_time:
        ratio = np.mean(step_time["pf2lora"]) / np.mean(step_time["pf2lora-nobilevel"])
        print(f"PF2LoRA hypergradient cost: {ratio:.2f}x the step without the bilevel coupling")


if __name__ == "__main__":
    main()
