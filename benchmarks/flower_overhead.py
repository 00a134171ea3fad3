"""What Flower's deployment engine costs: the same job in-process and over loopback.

One FedLR job (bundled MiniLM + LoRA by default) runs on the in-process engine and then
on a real deployment on this machine: a SuperLink and one SuperNode per client as
separate processes, talking HTTP on 127.0.0.1 (``fedpeft.flower.deploy``). Both record
the same per-round times (train + aggregate + evaluate) and reach the same metrics.

Printed, side by side from this one run:
- wall time per round (first round, and the median of the later ones) and the ratio;
- bytes: the tensor payload fedpeft accounts in-process, the bytes Flower serialised for
  the same messages (its object framing on top), and the traffic the SuperLink itself
  counted for the run (``flwr ls``), with their ratios to the payload.

    .venv/bin/python benchmarks/flower_overhead.py [--clients 3] [--rounds 3] [--steps 10]
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


def round_times(records: list[dict]) -> list[float]:
    return [r["time_train"] + r["time_aggregate"] + r["time_eval"] for r in records]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--samples", type=int, default=1500)
    ap.add_argument("--method", default="fedlr")
    ap.add_argument("--backbone", default="bundled-minilm")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="flower-overhead-"))

    def config(name: str):
        return load_config(None, {
            "name": name,
            "method": {"name": args.method},
            "model.backbone": args.backbone,
            "output_dir": str(root / name),
            "data.max_samples": args.samples,
            "data.max_test_samples": 400,
            "partition": {"scheme": "dirichlet", "num_clients": args.clients, "alpha": 0.5},
            "train": {"rounds": args.rounds, "clients_per_round": args.clients, "local_steps": args.steps,
                      "batch_size": args.batch, "threads": 1},
            "eval.every": 1,
        })  # fmt: skip

    t0 = time.perf_counter()
    run(config("inproc"))
    t_inproc = time.perf_counter() - t0
    t0 = time.perf_counter()
    with deploy.local_federation(root / "federation", args.clients) as fed:
        status = deploy.submit(config("flower"), fed.address, workdir=root / "submit", echo=False)
    t_flower = time.perf_counter() - t0

    a, b = read_records(root / "inproc"), read_records(root / "flower")
    ta, tb = round_times(a), round_times(b)
    later = lambda t: statistics.median(t[1:] or t)  # noqa: E731
    print(f"{args.method} on {args.backbone}: {args.clients} clients (one SuperNode each), "
          f"{args.rounds} rounds x {args.steps} steps x batch {args.batch}, torch threads 1\n")  # fmt: skip
    print("| | in-process | Flower (loopback) | Flower / in-process |")
    print("|---|---|---|---|")
    print(f"| first round (s) | {ta[0]:.2f} | {tb[0]:.2f} | {tb[0] / ta[0]:.2f}x |")
    print(f"| later rounds, median (s) | {later(ta):.2f} | {later(tb):.2f} | {later(tb) / later(ta):.2f}x |")
    print(f"| whole job incl. set-up (s) | {t_inproc:.1f} | {t_flower:.1f} | {t_flower / t_inproc:.2f}x |")
    acc_a, acc_b = a[-1]["global"]["accuracy"], b[-1]["global"]["accuracy"]
    print(f"| final global accuracy | {acc_a:.4f} | {acc_b:.4f} | |")

    payload = sum(r["bytes_down"] + r["bytes_up"] for r in a)
    flower_payload = sum(r["payload_bytes_down"] + r["payload_bytes_up"] for r in b)
    wire = sum(r["bytes_down"] + r["bytes_up"] for r in b)
    traffic = status["network-traffic"]["total-bytes"]
    print("\n| bytes (training messages, all rounds) | bytes | / tensor payload |")
    print("|---|---|---|")
    print(f"| tensor payload, in-process accounting | {payload:,} | 1.000 |")
    print(f"| tensor payload, Flower run | {flower_payload:,} | {flower_payload / payload:.3f} |")
    print(f"| serialised by Flower (objects of each message) | {wire:,} | {wire / payload:.3f} |")
    what = "counted by the SuperLink (whole run, incl. roll call and evaluation)"
    print(f"| {what} | {traffic:,} | {traffic / payload:.3f} |")


if __name__ == "__main__":
    main()
