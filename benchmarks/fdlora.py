"""FDLoRA against its paper's baselines (FDLoRA paper, sec. 4: Local, FedAvg, FedKD,
FedAMP, FedRep, FedRoD; plus Ditto), at Dirichlet alpha = 0.1, 0.5 and 1.0, with the
fusion comparison (AdaFusion against random, average and sum weights and the two modules
alone), on the bundled MiniLM and the WordNet topic task; ``--lm`` adds a causal-LM run
(SmolLM2, WordNet definition generation: FDLoRA, Local, FedAvg), its paper's task.

The paper's setting, scaled to a CPU: a few clients, every one in every round, each
client's data split 8:2 into training and local test, LoRA r = 8 on query/value for
every method (FedKD: mentee r = 8, mentor r = 32; FDLoRA: both modules r = 8), the same
rounds, local steps and batch size for all. Scores are personalised: each client's own
model on its local test split, as mean, standard deviation and worst decile (10th
percentile) over clients, averaged over seeds. FDLoRA's round 1 is its local-learning
stage, counted in the same rounds. FedRep's round reads the same examples as the others':
its ``--steps`` are split between its head phase (half, rounded down) and its body phase
(the rest); its paper's 10 head epochs would read some 30 times the others' examples.

Every method's ``train.lr`` (and optimizer-state policy) is tuned with ``--tune`` on
seed 3, which the tables do not use, at alpha 0.5, by the clients' mean accuracy on a
validation split (20 % of each client's data, held out in the tuning runs only);
FDLoRA keeps its paper's outer optimiser (lr 1e-3, Nesterov momentum 0.5), and the row
``fdlora-fedavg-outer`` shows it with the FedAvg outer step (lr 1, no momentum). The row
``fdlora-long-stage1`` gives stage 1 the paper's three local epochs (45 steps, a client of
mean size) where the other rows give it one round's steps: it reads more examples in
round 1 than any other method, so it stands beside the comparison, not in it. With
``--lm``, ``--tune`` also tunes the causal-LM rows, in their own setting on seed 3, by
their clients' mean validation loss.

    .venv/bin/python benchmarks/fdlora.py --tune [--methods ...] [--lm]
    .venv/bin/python benchmarks/fdlora.py [--alphas 0.1,0.5,1.0] [--seeds 0,1] [--lm]
    .venv/bin/python benchmarks/fdlora.py --methods "" --lm [--tune]   # the causal-LM rows alone
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from records import read_records
from tuning import LR_GRID, TUNED_DIR, read_tuned, run_or_reuse, tune_method, write_tuned

from fedpeft.config import load_config

LORA = {"r": 8, "alpha": 16, "target_modules": ["query", "value"]}
STAGE1_STEPS = 45  # the paper's 3 local epochs of stage 1, for a client of mean size (240 / 16 x 3)
METHODS = {
    "fdlora": {"name": "fdlora", "lora": LORA, "compare_fusions": True},
    "fdlora-fedavg-outer": {"name": "fdlora", "lora": LORA, "outer_lr": 1.0, "outer_momentum": 0.0},
    "fdlora-long-stage1": {"name": "fdlora", "lora": LORA, "personal_steps": STAGE1_STEPS},
    "local": {"name": "local", "lora": LORA},
    "fedavg": {"name": "fedlr", "lora": LORA},
    "fedrep": {"name": "fedrep", "trainable": "lora", "lora": LORA},
    "fedrod": {"name": "fedrod", "trainable": "lora", "lora": LORA},
    "fedamp": {"name": "fedamp", "trainable": "lora", "lora": LORA},
    "fedkd": {"name": "fedkd", "lora": LORA, "mentor_rank": 32},
    "ditto": {"name": "ditto", "trainable": "lora", "lora": LORA},
}
FUSIONS = ("adafusion", "random", "average", "sum", "personal", "global")
TUNING_SEED, TUNING_ALPHA = 3, 0.5
VAL_FRACTION = 0.2  # of each client's data, held out in tuning runs
TUNED_FILE = TUNED_DIR / "fdlora.json"


def config(
    name: str, alpha: float, seed: int, out: Path, args: argparse.Namespace, train: dict, tuning: bool = False
):
    """A table run; a tuning run holds out a validation split (``partition.val_fraction``) of
    each client's training data and is scored on it, never on a test split."""
    method, steps = METHODS[name], args.steps
    if name == "fedrep":  # one round's examples split between its phases (its paper's 10 head
        head = args.steps // 2  # epochs would read some 30x the others' examples a round)
        method, steps = {**method, "head_steps": head}, args.steps - head
    partition = {"val_fraction": VAL_FRACTION} if tuning else {}
    return load_config(
        None,
        {
            "name": f"{name}-a{alpha:g}",
            "seed": seed,
            "output_dir": str(out),
            "method": method,
            "data": {"source": "wordnet", "max_samples": args.examples, "max_test_samples": 200,
                     "max_length": 32},
            "partition": {"scheme": "dirichlet", "num_clients": args.clients, "alpha": alpha,
                          "min_size": 20, "local_test_fraction": 0.2, **partition},
            "train": {"rounds": args.rounds, "clients_per_round": args.clients, "local_steps": steps,
                      "batch_size": 16, **train},
            "eval": {"every": args.rounds},
        },
    )  # fmt: skip


LM_METHODS = {
    "fdlora": {"name": "fdlora", "lora": {"r": 8, "alpha": 16}, "compare_fusions": True},
    "local": {"name": "local", "lora": {"r": 8, "alpha": 16}},
    "fedavg": {"name": "fedlr", "lora": {"r": 8, "alpha": 16}},
}


def lm_config(name: str, seed: int, out: Path, train: dict, tuning: bool = False):
    """The causal-LM run: a tuning run holds out a validation split and is scored by its
    loss only (one token generated)."""
    generation = {"samples": 1, "max_new_tokens": 1} if tuning else {"samples": 16, "max_new_tokens": 24}
    partition = {"val_fraction": VAL_FRACTION} if tuning else {}
    return load_config(
        None,
        {
            "name": f"lm-{name}",
            "seed": seed,
            "output_dir": str(out),
            "method": LM_METHODS[name],
            "model.backbone": "bundled-smollm2",
            "data": {"task": "causal_lm", "source": "wordnet", "max_samples": 300, "max_test_samples": 16,
                     "max_length": 64, "system_prompt": "Answer with one short line."},
            "partition": {"scheme": "dirichlet", "num_clients": 3, "alpha": 0.5, "min_size": 20, **partition},
            "train": {"rounds": 4, "clients_per_round": 3, "local_steps": 4, "batch_size": 8, **train},
            "eval": {"every": 4, "generation": generation},
        },
    )  # fmt: skip


def personal(last: dict, key: str = "local") -> tuple[float, float, float]:
    """Mean, std and worst decile of the clients' local-test accuracy in a final record."""
    scores = last[key]
    return scores["accuracy_mean"], scores["accuracy_std"], scores["accuracy_p10"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--alphas", default="0.1,0.5,1.0")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--examples", type=int, default=1500)
    ap.add_argument("--lm", action="store_true", help="also the causal-LM runs (SmolLM2; slow on a CPU)")
    ap.add_argument(
        "--extend", type=int, default=2, help="--tune: grid extensions past a best rate at an end"
    )
    ap.add_argument("--tuned-file", type=Path, default=TUNED_FILE)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/fdlora"))
    args = ap.parse_args()
    names = [n for n in args.methods.split(",") if n]  # --methods "" --lm: the causal-LM rows alone
    if args.tune:
        for name in names:

            def score(train: dict, name=name) -> float:
                out = args.out / "tune-val" / f"{name}-{train['lr']:g}-{train['optimizer_state']}"
                run_or_reuse(config(name, TUNING_ALPHA, TUNING_SEED, out, args, train, tuning=True))
                return read_records(out)[-1]["val"]["accuracy_mean"]

            best, report = tune_method(score, LR_GRID, extend=args.extend)
            print(f"{name}: {report}", flush=True)
            write_tuned(args.tuned_file, {name: best})
        if args.lm:
            tune_lm(args)
        return
    seeds, alphas = [int(s) for s in args.seeds.split(",")], [float(a) for a in args.alphas.split(",")]
    if names:
        table(names, seeds, alphas, args)
    if args.lm:
        lm_table(args, seeds[0])


def table(names: list[str], seeds: list[int], alphas: list[float], args: argparse.Namespace) -> None:
    """The classification table, FDLoRA's fusions and the paper's claims."""
    tuned = read_tuned(args.tuned_file, names)
    print(f"\nMiniLM, WordNet topics, {args.clients} clients (all every round), {args.rounds} rounds x "
          f"{args.steps} steps x 16 examples; seeds {seeds}; personalised accuracy on the clients' local "
          "test splits: mean ± std over clients / worst decile (means over seeds); FedRep: a round's\n"
          f"{args.steps} steps split {args.steps // 2} head + {args.steps - args.steps // 2} body\n"
    )  # fmt: skip
    print("| method | lr | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |")
    print("|---|---|" + "---|" * len(alphas))
    fusion_rows: dict[float, list[dict]] = {a: [] for a in alphas}
    means: dict[str, dict[float, float]] = {}
    for name in names:
        cells = []
        for alpha in alphas:
            last = []
            for seed in seeds:
                out = args.out / f"{name}-a{alpha:g}-seed{seed}"
                run_or_reuse(config(name, alpha, seed, out, args, tuned[name]))
                last.append(read_records(out)[-1])
            m, s, p = np.mean([personal(x) for x in last], axis=0)
            means.setdefault(name, {})[alpha] = m
            cells.append(f"{m:.3f} ± {s:.3f} / {p:.3f}")
            if name == "fdlora":
                fusion_rows[alpha] = last
        print(f"| {name} | {tuned[name]['lr']:g} | " + " | ".join(cells) + " |", flush=True)
    if "fdlora" in names:
        print("\nFDLoRA's fusions, same runs (mean local accuracy / worst decile):\n")
        print("| fusion | " + " | ".join(f"alpha {a:g}" for a in alphas) + " |")
        print("|---|" + "---|" * len(alphas))
        for fusion in FUSIONS:
            key = "local" if fusion == "adafusion" else f"local_{fusion}"
            cells = []
            for alpha in alphas:
                m, _, p = np.mean([personal(x, key) for x in fusion_rows[alpha]], axis=0)
                cells.append(f"{m:.3f} / {p:.3f}")
            print(f"| {fusion} | " + " | ".join(cells) + " |")
        fusion_verdict(fusion_rows, alphas)
    verdict(means, alphas)


BASELINES = ("local", "fedavg", "fedrep", "fedrod", "fedamp", "fedkd", "ditto")


def verdict(means: dict[str, dict[float, float]], alphas: list[float]) -> None:
    """The paper's claim: FDLoRA the highest mean accuracy at every alpha (each FDLoRA row
    against the baselines run here)."""
    others = [b for b in BASELINES if b in means]
    if not others:
        return
    for name in [n for n in means if n.startswith("fdlora")]:
        held = []
        for alpha in alphas:
            best = max(others, key=lambda b: means[b][alpha])
            gap = 100 * (means[name][alpha] - means[best][alpha])
            held.append(gap > 0)
            print(f"  {name} at alpha {alpha:g}: {100 * means[name][alpha]:.1f} vs the best baseline "
                  f"{best} {100 * means[best][alpha]:.1f} ({gap:+.1f} points)")  # fmt: skip
        print(
            f"The paper's claim, FDLoRA the best at every alpha, for {name}: "
            f"{'held' if all(held) else 'did not hold'} ({sum(held)} of {len(alphas)} alphas)\n"
        )


def fusion_verdict(rows: dict[float, list[dict]], alphas: list[float]) -> None:
    """The paper's fusion claim: AdaFusion above the random, average and sum weights."""
    wins = 0
    for alpha in alphas:
        score = {}
        for fusion in ("adafusion", "random", "average", "sum"):
            key = "local" if fusion == "adafusion" else f"local_{fusion}"
            score[fusion] = np.mean([personal(x, key)[0] for x in rows[alpha]])
        best = max(score, key=score.get)
        wins += best == "adafusion"
        print(f"  alpha {alpha:g}: best fusion {best} ({100 * score[best]:.1f}; "
              f"AdaFusion {100 * score['adafusion']:.1f})")  # fmt: skip
    print(
        f"The paper's fusion claim, AdaFusion above random, average and sum: "
        f"{'held' if wins == len(alphas) else 'did not hold'} ({wins} of {len(alphas)} alphas)\n"
    )


def tune_lm(args: argparse.Namespace) -> None:
    """Each causal-LM method's rate on seed 3, by its clients' mean validation loss."""
    for name in LM_METHODS:

        def score(train: dict, name=name) -> float:
            out = args.out / "tune-val" / f"lm-{name}-{train['lr']:g}-{train['optimizer_state']}"
            run_or_reuse(lm_config(name, TUNING_SEED, out, train, tuning=True))
            return -read_records(out)[-1]["val"]["nll_mean"]

        best, report = tune_method(score, LR_GRID, extend=args.extend)
        print(f"lm-{name}: {report}", flush=True)
        write_tuned(args.tuned_file, {f"lm-{name}": best})


def lm_table(args: argparse.Namespace, seed: int) -> None:
    """FDLoRA, Local and FedAvg on definition generation, each at its rate tuned on that
    task (``--tune --lm``)."""
    tuned = read_tuned(args.tuned_file, [f"lm-{name}" for name in LM_METHODS])
    print("\nSmolLM2, WordNet definition generation, 3 clients (alpha 0.5), 4 rounds x 4 steps x 8: "
          "clients' own models on their local test splits (mean over clients)\n")  # fmt: skip
    print("| method | lr | ROUGE-L | BLEU | perplexity |")
    print("|---|---|---|---|---|")
    for name in LM_METHODS:
        train = tuned[f"lm-{name}"]
        out = args.out / f"lm-{name}-seed{seed}"
        run_or_reuse(lm_config(name, seed, out, train))
        local = read_records(out)[-1]["local"]
        print(f"| {name} | {train['lr']:g} | {local['rouge_l_mean']:.3f} | {local['bleu_mean']:.2f} | "
              f"{local['perplexity_mean']:.1f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
