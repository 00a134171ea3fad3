"""What a deployed round costs against a simulated one, and where the difference goes.

The same config runs simulated (``fedpeft run``: one process) and deployed (a SuperLink
and one SuperNode per client on loopback, ``fedpeft.flower.deploy.local_federation``),
one torch thread each, in this one run; with ``--cold`` also deployed with
``deploy.warm_nodes: false`` (every message builds the node's model in a fresh process,
as before warm nodes). Printed side by side:

- end to end (set-up included) and the median steady round (rounds 2..n: training,
  aggregation and evaluation, as the server records them);
- a round's training split: the node's fit (the slowest node's ``time_fit``: from the
  message reaching fedpeft's client to its reply), of it the local steps
  (``time_step`` x steps) and the rest, and the time the server waited beyond the
  slowest fit (transport, polling, a message's process);
- the bytes each client receives and sends a round: the tensors in-process, the objects
  Flower serialises deployed (median over rounds).

    .venv/bin/python benchmarks/deploy_overhead.py                 # examples/my.yaml, 6 rounds
    .venv/bin/python benchmarks/deploy_overhead.py --lm            # the bundled SmolLM2, instruction tuning
    .venv/bin/python benchmarks/deploy_overhead.py --task ner      # or qa: MiniLM, the other tasks
    .venv/bin/python benchmarks/deploy_overhead.py --cold          # also the cold deployment
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fedpeft.config import load_config
from fedpeft.experiment import run
from fedpeft.flower import deploy
from fedpeft.report.results import read_records

ROOT = Path(__file__).resolve().parents[1]
LM = {  # SmolLM2 on WordNet definitions as instructions, a few seconds a step on a CPU
    "model.backbone": "bundled-smollm2",
    "data": {"task": "causal_lm", "source": "wordnet", "max_samples": 240, "max_test_samples": 24,
             "max_length": 64, "system_prompt": "Answer with one short line."},
    "method": {"name": "fedlr", "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
    "train.local_steps": 2, "train.batch_size": 4, "train.lr": 1e-3,
    "eval.local": False, "eval.generation": {"max_new_tokens": 1, "samples": 1},
}  # fmt: skip
TASKS = {  # the other tasks on MiniLM, as benchmarks/ner_qa.py sets them up
    "classification": {},
    "causal_lm": LM,
    "ner": {"data": {"task": "token_classification", "source": "conll2003", "max_length": 64,
                     "max_samples": 600, "max_test_samples": 200}},
    "qa": {"data": {"task": "extractive_qa", "source": "wordnet", "max_length": 96, "stride": 32,
                    "max_samples": 600, "max_test_samples": 200}},
}  # fmt: skip


def config(args: argparse.Namespace, out: Path, mode: str):
    overrides = {
        "output_dir": str(out / mode),
        "train.rounds": args.rounds,
        "train.threads": 1,
        "eval.every": args.rounds,
        "deploy.warm_nodes": mode != "cold",
        **TASKS[args.task],
    }
    return load_config(args.config, overrides)


def steady(records: list[dict], key) -> float:
    return statistics.median(key(r) for r in records[1:] or records)


def round_time(r: dict) -> float:
    return r["time_train"] + r["time_aggregate"] + r["time_eval"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=ROOT / "examples/my.yaml")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--task", choices=list(TASKS), default="classification")
    ap.add_argument("--lm", action="store_true", help="the bundled SmolLM2 (--task causal_lm)")
    ap.add_argument("--cold", action="store_true", help="also deploy with deploy.warm_nodes: false")
    args = ap.parse_args()
    args.task = "causal_lm" if args.lm else args.task
    out = Path(tempfile.mkdtemp(prefix="deploy-overhead-"))
    modes = ["simulated", "warm", *(["cold"] if args.cold else [])]
    wall, records = {}, {}
    for mode in modes:
        cfg = config(args, out, mode)
        t0 = time.perf_counter()
        if mode == "simulated":
            run(cfg)
        else:
            with deploy.local_federation(out / f"federation-{mode}", cfg.partition.num_clients) as fed:
                status = deploy.submit(cfg, fed.address, workdir=out / f"submit-{mode}", echo=False)
            assert status["status"] == "finished:completed", status
        wall[mode], records[mode] = time.perf_counter() - t0, read_records(cfg.output_dir)

    cfg = config(args, out, "simulated")
    steps = cfg.train.local_steps
    shape = f"{cfg.partition.num_clients} clients x {steps} steps x batch {cfg.train.batch_size}"
    print(f"{cfg.method.name} on {cfg.model.backbone} ({cfg.data.task}), {shape}, {args.rounds} rounds, "
          "one torch thread each\n")  # fmt: skip
    names = {"simulated": "simulated", "warm": "deployed, warm nodes", "cold": "deployed, cold nodes"}
    print("| | " + " | ".join(names[m] for m in modes) + " |")
    print("|---|" + "---|" * len(modes))

    def row(label: str, values: dict[str, float], fmt: str = "{:.2f}", ratio: bool = True) -> None:
        cells = []
        for m in modes:
            if m not in values:
                cells.append("")
                continue
            cell = fmt.format(values[m])
            if ratio and m != "simulated" and "simulated" in values:
                cell += f" ({values[m] / values['simulated']:.2f}x)"
            cells.append(cell)
        print(f"| {label} | " + " | ".join(cells) + " |")

    deployed = [m for m in modes if m != "simulated"]

    def median(key, among: list[str]) -> dict[str, float]:
        return {m: steady(records[m], key) for m in among}

    steps_time = lambda r: r["fit"]["time_step"] * steps  # noqa: E731 - a client's steps, mean step time
    row("end to end, set-up included (s)", wall, "{:.1f}")
    row("steady round, median (s)", median(round_time, modes))
    row("  of it training (s)", median(lambda r: r["time_train"], modes))
    row("  the slowest node's fit (s)", median(lambda r: r["time_fit_max"], deployed), ratio=False)
    row("    a client's local steps (s)", median(steps_time, modes), ratio=False)
    rest = median(lambda r: r["time_fit_max"] - steps_time(r), deployed)
    row("    the rest of the fit (s)", rest, ratio=False)
    waiting = median(lambda r: r["time_train"] - r["time_fit_max"], deployed)
    row("  waiting beyond the slowest fit (s)", waiting, ratio=False)
    row("  evaluation (s)", {m: steady(records[m], lambda r: r["time_eval"]) for m in modes}, ratio=False)
    for way in ("down", "up"):  # per client and round: tensors in-process, Flower's objects deployed
        per_client = lambda r, way=way: r[f"bytes_{way}"] / len(r["clients"])  # noqa: E731
        row(f"bytes {way} per client a round", median(per_client, modes), "{:,.0f}")
    final = {m: records[m][-1].get("global", {}) for m in modes}
    key = next(iter(final["simulated"]), None)
    if key is not None:
        row(
            f"final global {key}", {m: final[m][key] for m in modes if key in final[m]}, "{:.4f}", ratio=False
        )
    print(f"\nrecords under {out}")


if __name__ == "__main__":
    main()
