"""Personalised federated LoRA methods side by side (PF2LoRA paper, sec. 6 and the s ablation).

The WordNet corpus on the bundled MiniLM, SCAFFOLD-style partition at heterogeneity
s = 0.6, 0.9, 1.0, 8 clients all taking part in every round (as in the paper), the same
rounds and local steps (the communication interval I) for every method. Personalised
accuracy is each client's own model on its own test split (mean ± sample std over seeds of the
mean over clients, and the worst decile of clients); the global model's accuracy on the
global test set beside it. Also prints the measured cost of PF2LoRA's hypergradient:
seconds per local step with the bilevel coupling against the same steps with it
switched off (``bilevel: false``, the paper's ablation).

    .venv/bin/python benchmarks/personalized.py --tune [--head shared|personal]   # on seed 2, s = 0.9
    .venv/bin/python benchmarks/personalized.py [--seeds 0,1,3] [--s 0.6,0.9,1.0] [--head shared|personal]
        [--tuned-head shared|personal]
        [--methods local,...] [--set KEY=VALUE ...] [--out benchmarks/results/personalized]

Fair footing: the same clients (all 8 scored, every round), the same rounds and local
steps, the same examples per step (``perfedavg-eq``: Per-FedAvg with ``split_batch``; the
paper's ``perfedavg`` reads twice the examples and is listed for reference), and for each
method its own ``train.lr`` and ``train.optimizer_state``, tuned by ``--tune`` on seed 2
at s = 0.9, which the table does not use, for each head setting (``--tune`` prints the
grid and writes ``benchmarks/tuned/personalized.json``; the ablation ``pf2lora-nobilevel``
runs at PF2LoRA's setting, the reference ``perfedavg`` at ``perfedavg-eq``'s;
``--tuned-head shared`` runs a personal-head table at the shared-head settings, saying so
in its header). The SGD step sizes of PF2LoRA and Per-FedAvg were tuned on the same seed
(docs/personalized.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import yaml
from records import read_records, read_summary
from tuning import TUNED_DIR, mean_std, read_tuned, run_or_reuse, tune_method, write_tuned

from fedpeft.config import load_config

LORA = {"r": 8, "alpha": 16}
PF2 = {"name": "pf2lora", "lora": LORA, "client_rank": 2, "client_alpha": 4, "lower_lr": 0.1}
METHODS = {
    "local": {"name": "local"},
    "homlora": {"name": "fedlr", "lora": LORA},
    "perfedavg": {"name": "perfedavg", "order": 1, "inner_lr": 0.3, "lora": LORA},
    "perfedavg-eq": {"name": "perfedavg", "order": 1, "inner_lr": 0.3, "lora": LORA, "split_batch": True},
    "hetlora": {"name": "hetlora", "lora": LORA, "r_min": 2},
    "pf2lora": PF2,
    "pf2lora-nobilevel": {**PF2, "bilevel": False},
}


TUNING_SEED, TUNING_S = 2, 0.9
TUNED_FILE = TUNED_DIR / "personalized.json"
# An ablation runs at its method's setting; the paper's Per-FedAvg (two batches per step,
# listed for reference) at that of Per-FedAvg with the same examples per step.
TUNED_AS = {"pf2lora-nobilevel": "pf2lora"}
DEFAULT_TRAIN = {"lr": 0.002, "optimizer_state": "reset"}


def tuned_key(name: str, head: str) -> str:
    """The key of a method's tuned setting in ``TUNED_FILE``: one per head setting."""
    name = TUNED_AS.get(name, name)
    return name if head == "shared" else f"{name}@{head}-head"


def run_all(
    seeds: list[int],
    levels: list[float],
    names: list[str],
    rounds: int,
    out: Path,
    method_extra: dict,
    train: dict[str, dict],
) -> None:
    """Run (or pick up) every (seed, s, method); ``train[name]``: its lr and optimizer state."""
    for seed in seeds:
        for s in levels:
            for name in names:
                target = run_dir(out, name, s, seed)
                setting = train[name]
                cfg = load_config(None, {
                    "name": name,
                    "seed": seed,
                    "method": {**METHODS[name], **method_extra},
                    "output_dir": str(target),
                    "data.max_samples": 2000,
                    "data.max_test_samples": 400,
                    "partition": {"scheme": "similarity", "similarity": s, "num_clients": 8},
                    "train": {"rounds": rounds, "clients_per_round": 8, "local_steps": 5, "batch_size": 16,
                              **setting},
                    "eval.every": rounds,
                })  # fmt: skip
                summary = run_or_reuse(cfg)
                acc = summary["final_local"]["accuracy_mean"]
                print(f"[s={s} {name} seed {seed} {setting}] personalised {acc:.4f}", flush=True)


def tune(names: list[str], rounds: int, out: Path, method_extra: dict) -> dict[str, dict]:
    """Each method's ``train.lr`` and optimizer state (``tuning.tune_method``), by
    personalised accuracy on the tuning seed and level."""
    best = {}
    print(f"\ntuning on seed {TUNING_SEED}, s = {TUNING_S}: personalised accuracy")
    for name in names:

        def score(setting: dict, name: str = name) -> float:
            sub = out / f"lr{setting['lr']}-{setting['optimizer_state']}"
            run_all([TUNING_SEED], [TUNING_S], [name], rounds, sub, method_extra, {name: setting})
            return read_summary(run_dir(sub, name, TUNING_S, TUNING_SEED))["final_local"]["accuracy_mean"]

        best[tuned_key(name, method_extra["head"])], report = tune_method(score)
        print(f"  {name}: {report}", flush=True)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,3")
    ap.add_argument("--s", default="0.6,0.9,1.0")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument(
        "--tune", action="store_true", help="tune train.lr and optimizer_state per method (seed 2)"
    )
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/personalized"))
    ap.add_argument(
        "--untuned", action="store_true",
        help=f"run methods with no tuned setting at lr {DEFAULT_TRAIN['lr']} (not a fair comparison)",
    )  # fmt: skip
    ap.add_argument(
        "--head", choices=["shared", "personal"], default="shared",
        help="the classification head: averaged like the adapters, or kept on each client",
    )  # fmt: skip
    ap.add_argument(
        "--tuned-head", choices=["shared", "personal"], default=None,
        help="run at the settings tuned for this head setting (default: --head's own)",
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
    if args.tune:
        tuned = [n for n in names if n not in TUNED_AS]
        write_tuned(TUNED_FILE, tune(tuned, args.rounds, args.out / f"tune-{args.head}-head", method_extra))
        print(f"written: {TUNED_FILE}")
        return
    keys = {n: tuned_key(n, args.tuned_head or args.head) for n in names}
    settings = read_tuned(TUNED_FILE, sorted(set(keys.values())), DEFAULT_TRAIN if args.untuned else None)
    run_all(
        seeds, levels, names, args.rounds, args.out, method_extra, {n: settings[k] for n, k in keys.items()}
    )

    pers = {
        n: {s: [read_summary(run_dir(args.out, n, s, seed)) for seed in seeds] for s in levels} for n in names
    }
    head = args.head
    if args.tuned_head not in (None, args.head):
        head += f" (at {args.tuned_head}-head settings)"
    print(f"\n8 clients, all per round, {args.rounds} rounds x 5 steps, {head} head, seeds {seeds}\n")
    print_table(pers)
    print_other_model(names, levels, seeds, args.out)
    print_claim(pers)
    plot(pers, args.out / "personalized.png", f"{args.head} head, seeds {seeds}")
    print(f"plot: {args.out / 'personalized.png'}")
    print_step_times(names, levels, seeds, args.out)


def run_dir(out: Path, name: str, s: float, seed: int) -> Path:
    return out / f"s{s}" / f"{name}-seed{seed}"


def personalised(summaries: list[dict]) -> np.ndarray:
    return np.array([x["final_local"]["accuracy_mean"] for x in summaries])


def print_table(pers: dict[str, dict[float, list[dict]]]) -> None:
    levels = list(next(iter(pers.values())))
    head = " | ".join(
        f"s = {s}: personalised ± sample std over seeds (worst decile) / global" for s in levels
    )
    print(f"| method | {head} |")
    print("|---|" + "---|" * len(levels))
    for name, by_s in pers.items():
        cells = []
        for sums in by_s.values():
            acc = personalised(sums)
            worst = np.mean([x["final_local"]["accuracy_p10"] for x in sums])
            glob = np.mean([x["final_global"]["accuracy"] for x in sums])
            cells.append(f"{mean_std(acc)} ({worst:.3f}) / {glob:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def print_other_model(names: list[str], levels: list[float], seeds: list[int], out: Path) -> None:
    """The second personalised score a method reports beside its own (HETLoRA: each client
    scored with the global adapter truncated to its rank, ``local_global``), same runs."""
    for name in names:
        finals = {
            s: [[r for r in read_records(run_dir(out, name, s, x)) if "local_global" in r] for x in seeds]
            for s in levels
        }
        if not all(all(runs) for runs in finals.values()):
            continue
        cells = []
        for runs in finals.values():
            acc = np.array([recs[-1]["local_global"]["accuracy_mean"] for recs in runs])
            worst = np.mean([recs[-1]["local_global"]["accuracy_p10"] for recs in runs])
            cells.append(f"{mean_std(acc)} ({worst:.3f})")
        print(f"| {name}, scored with the truncated global adapter | " + " | ".join(cells) + " |")


def seed_std(values: np.ndarray) -> float:
    """The sample std over seeds (0 for one seed), as the tables print."""
    return float(values.std(ddof=1)) if len(values) > 1 else 0.0


def print_claim(pers: dict[str, dict[float, list[dict]]]) -> None:
    """The paper's claim: PF2LoRA best (of the federated methods) at every s, its margin growing with s."""
    # Per-FedAvg at the paper's two batches per step reads twice the examples: not a rival
    rivals = [n for n in pers if n not in ("pf2lora", "pf2lora-nobilevel", "local", "perfedavg")]
    if "pf2lora" not in pers or not rivals:
        return
    print("\nPF2LoRA against the best other federated method (Local-only is not federated):")
    for s, sums in pers["pf2lora"].items():
        ours = personalised(sums)
        best = max(rivals, key=lambda n: personalised(pers[n][s]).mean())
        theirs = personalised(pers[best][s])
        wins = int(sum(o > max(personalised(pers[n][s])[i] for n in rivals) for i, o in enumerate(ours)))
        margin = ours.mean() - theirs.mean()
        print(f"  s = {s}: PF2LoRA {ours.mean():.3f}, best rival {best} {theirs.mean():.3f}, "
              f"margin {margin:+.3f}; PF2LoRA best in {wins} of {len(ours)} seeds")  # fmt: skip
    if "local" in pers:
        for s, sums in pers["local"].items():
            gap = personalised(sums).mean() - personalised(pers["pf2lora"][s]).mean()
            print(f"  s = {s}: Local-only minus PF2LoRA {gap:+.3f}")


def plot(pers: dict[str, dict[float, list[dict]]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, by_s in pers.items():
        accs = [personalised(sums) for sums in by_s.values()]
        means, stds = [a.mean() for a in accs], [seed_std(a) for a in accs]
        ax.errorbar(list(by_s), means, yerr=stds, marker="o", capsize=3, label=name)
    ax.set(xlabel="heterogeneity s", ylabel="personalised accuracy", title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)  # the runs' directory: absent when every run was reused
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_step_times(names: list[str], levels: list[float], seeds: list[int], out: Path) -> None:
    step_time = {
        name: [r["fit"]["time_step"] for s in levels for seed in seeds
               for r in read_records(run_dir(out, name, s, seed)) if "time_step" in r.get("fit", {})]
        for name in names
    }  # fmt: skip
    print("\nseconds per local step in these runs (mean over rounds and clients), where reported")
    print("(benchmarks/hypergradient_cost.py measures PF2LoRA's hypergradient side by side):")
    for name, times in step_time.items():
        if times:
            print(f"  {name}: {np.mean(times):.3f}")


if __name__ == "__main__":
    main()
