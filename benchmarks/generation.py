"""WordNet definition generation with SmolLM2-135M-Instruct: FedLR, FeDeRA, PF2LoRA and
Local-only against the untuned model (issue 12).

The bundled SmolLM2 (GGUF, dequantised to float32), a handful of clients split over the
lexicographer domains (Dirichlet, alpha 0.1: each client mostly a few domains), LoRA
r = 8 on q/v for every method (PF2LoRA: common r = 8 plus client r = 2), the same rounds,
local steps and batches. Each method's learning rate is tuned with ``--tune`` on seed 3,
which the table does not use, by the response NLL after the last round on a validation
split (``VAL_FRACTION`` of each client's data, held out in tuning runs only; the clients'
mean, each scored with its own model), which needs no generation. Scores: BLEU, chrF,
ROUGE-L of greedy generations (the first ``--samples`` examples of each test set) and
the response perplexity over all of it, of the global model on the global test set and
of each client's own model on its local test split (mean over clients).

Also measured, on whatever device the runs use, side by side in this one process:
training tokens/s of each method (prompt and response tokens through its local step:
one client's local round of ``--steps`` steps, methods interleaved, the median of
``--repeats`` rounds after a warm-up one) and generation tokens/s (new tokens of greedy
decoding with the KV cache, batch ``--eval-batch``). The runs' own round times are not
used for speed: runs made at different times on a shared machine are not comparable.

    .venv/bin/python benchmarks/generation.py --tune     # seed 3 -> benchmarks/tuned/generation.json
    .venv/bin/python benchmarks/generation.py [--seeds 0] [--out benchmarks/results/generation]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from records import read_records
from tuning import TUNED_DIR, read_tuned, run_or_reuse, tune_method, write_tuned

from fedpeft.config import load_config

METHODS = {
    "fedlr": {"name": "fedlr", "lora": {"r": 8, "alpha": 16}},
    "federa": {"name": "federa", "lora": {"r": 8, "alpha": 16}},
    "pf2lora": {"name": "pf2lora", "lora": {"r": 8, "alpha": 16}, "client_rank": 2, "client_alpha": 4},
    "local": {"name": "local", "lora": {"r": 8, "alpha": 16}},
}
TABLE = ["fedlr", "federa", "pf2lora", "local"]
GRID = [5e-4, 1e-3, 2e-3]
TUNING_SEED = 3
TUNED_FILE = TUNED_DIR / "generation.json"
VAL_FRACTION = 0.2  # of each client's data, held out in tuning runs


def config(name: str, seed: int, out: Path, args: argparse.Namespace, train: dict, tuning: bool = False):
    """A run's config; a tuning run holds out a validation split and scores perplexity
    only (one token generated)."""
    scored = {"samples": 1, "max_new_tokens": 1} if tuning else {"samples": args.samples}
    partition = {"val_fraction": VAL_FRACTION} if tuning else {}
    return load_config(
        None,
        {
            "name": name,
            "seed": seed,
            "output_dir": str(out),
            "method": METHODS[name],
            "model.backbone": "bundled-smollm2",
            "data": {
                "task": "causal_lm",
                "source": "wordnet",
                "max_samples": args.examples,
                "max_test_samples": args.samples,
                "max_length": 64,
                "system_prompt": "Answer with one short line.",
            },
            "partition": {
                "scheme": "dirichlet",
                "num_clients": args.clients,
                "alpha": 0.1,
                "min_size": 20,
                **partition,
            },
            "train": {
                "rounds": args.rounds,
                "clients_per_round": args.clients,
                "local_steps": args.steps,
                "batch_size": 8,
                "threads": args.threads,
                **train,
            },
            "eval": {
                "every": args.rounds,
                "local": True,  # the clients' local test splits, and validation splits when tuning
                "batch_size": args.eval_batch,
                "generation": {"max_new_tokens": 32, **scored},
            },
        },
    )


def untuned(args: argparse.Namespace, out: Path) -> dict:
    """The pretrained model's scores (LoRA's B = 0: the adapted model is the pretrained
    one), and the generation speed."""
    from fedpeft.experiment import build
    from fedpeft.metrics.scorers import scorer_for
    from fedpeft.models.causal import generate

    cfg = config("fedlr", 0, out / "untuned", args, {"lr": 1e-3})
    setup = build(cfg)
    scores = scorer_for("causal_lm", setup.tokenizer, cfg.eval, setup.corpus).score(
        setup.model, setup.global_test
    )
    shown = setup.global_test.subset(range(min(args.samples, len(setup.global_test))))
    t0 = time.perf_counter()
    texts = generate(setup.model, shown, setup.tokenizer, cfg.eval.generation, args.eval_batch)
    seconds = time.perf_counter() - t0
    new_tokens = sum(len(ids) + 1 for ids in setup.tokenizer(texts, add_special_tokens=False)["input_ids"])
    return {"global": scores, "seconds": seconds, "new_tokens": new_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--methods", default=",".join(TABLE))
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--examples", type=int, default=800, help="training pool (all clients)")
    ap.add_argument("--samples", type=int, default=32, help="test examples generated per test set")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="timed local rounds per method (speed)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/generation"))
    args = ap.parse_args()
    names = args.methods.split(",")
    if args.tune:

        def score(name: str):
            def run_with(train: dict) -> float:
                out = args.out / "tune-val" / f"{name}-{train['lr']:g}-{train['optimizer_state']}"
                run_or_reuse(config(name, TUNING_SEED, out, args, train, tuning=True))
                return -read_records(out)[-1]["val"]["nll_mean"]

            return run_with

        for name in names:
            best, report = tune_method(score(name), GRID)
            print(f"{name}: {report}", flush=True)
            write_tuned(TUNED_FILE, {name: best})
        return
    tuned = read_tuned(TUNED_FILE, names)
    rows = {}
    for name in names:
        for seed in [int(s) for s in args.seeds.split(",")]:
            out = args.out / f"{name}-seed{seed}"
            summary = run_or_reuse(config(name, seed, out, args, tuned[name]))
            records = read_records(out)
            rows.setdefault(name, []).append((summary, records))
    base = untuned(args, args.out)
    print(f"\nSmolLM2-135M-Instruct, WordNet definition generation, {args.clients} clients "
          f"(Dirichlet 0.1 over 45 domains), {args.rounds} rounds x {args.steps} steps x 8 examples; "
          f"greedy, first {args.samples} test examples\n")  # fmt: skip
    header = "| model | lr | global BLEU | global chrF | global ROUGE-L | global ppl | local ROUGE-L |"
    print(header + "\n|---|---|---|---|---|---|---|")
    g = base["global"]
    print(f"| untuned | - | {g['bleu']:.2f} | {g['chrf']:.2f} | {g['rouge_l']:.2f} | {g['perplexity']:.1f} "
          f"| - |")  # fmt: skip
    for name, runs in rows.items():
        print(table_row(name, tuned[name]["lr"], [records for _, records in runs]))
    print(f"\ngeneration: {base['new_tokens'] / base['seconds']:.1f} new tokens/s (greedy, KV cache, batch "
          f"{args.eval_batch}, {base['new_tokens']} tokens)")  # fmt: skip
    print_throughput(args, names, tuned)


def print_throughput(
    args: argparse.Namespace, names: list[str], tuned: dict, repeats: int | None = None
) -> None:
    """Training tokens/s of each method's local step, measured side by side: one client's
    local round per method, methods interleaved, a warm-up round then the median of
    ``args.repeats``."""
    import torch

    from fedpeft.engines.local import Job, RoundContext, derive_seed
    from fedpeft.experiment import build

    torch.set_num_threads(args.threads)
    setups, jobs = {}, {}
    for name in names:
        setup = build(config(name, 0, args.out / "throughput", args, tuned[name]))
        method, client = setup.method, setup.clients[0]
        server = method.init_server(setup.model)
        method.join(setup.model, method.join_message(server))
        personal = method.init_client(setup.model, setup.initial, client)
        setups[name] = setup
        seed, context = derive_seed(0, 1, client.cid), RoundContext(method.train)
        jobs[name] = Job(method.downlink(server, client.cid), personal, client, seed, rnd=1, context=context)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, float] = {}
    for rep in range(1 + args.repeats):
        for name in names:
            setup = setups[name]
            start = time.perf_counter()
            (result,) = setup.method.fit_cohort(setup.model, [jobs[name]])
            if rep:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
                tokens[name] = result.metrics["tokens"]
    speed = {n: tokens[n] / float(np.median(seconds[n])) for n in names}
    print(f"\ntraining speed, side by side ({torch.get_num_threads()} threads, {args.steps} steps "
          f"x 8 examples of client 0, median of {args.repeats} rounds):")  # fmt: skip
    for name in names:
        print(f"  {name}: {speed[name]:.0f} tokens/s ({speed[name] / speed[names[0]]:.2f}x {names[0]})")


def table_row(name: str, lr: float, runs: list[list[dict]]) -> str:
    """One method's row: its final scores (mean over seeds)."""
    last = [records[-1] for records in runs]
    scores = [x.get("global") for x in last]

    def mean(key: str) -> float:
        return float(np.mean([x[key] for x in scores])) if all(scores) else float("nan")

    local = float(np.mean([x["local"]["rouge_l_mean"] for x in last]))
    return (f"| {name} | {lr:g} | {mean('bleu'):.2f} | {mean('chrf'):.2f} | {mean('rouge_l'):.2f} "
            f"| {mean('perplexity'):.1f} | {local:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
