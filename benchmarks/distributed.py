"""Rounds over ranks (``fedpeft run --nproc N``) against one process, and against the same
job on Flower's simulation engine with as many workers (issue 63).

One FedLR job (bundled MiniLM + LoRA; the same clients, local steps, batch and
evaluation), each contender in a fresh process tree so that end-to-end time includes
imports and set-up:

- ``ranks-N``: ``fedpeft run CONFIG --nproc N`` (torch's elastic launcher, gloo on CPUs,
  NCCL on GPUs), every rank with ``train.threads`` torch threads;
- ``flower-sim-N``: fedpeft's ServerApp/ClientApp on ``flwr.simulation.run_simulation``
  (Ray backend, one virtual SuperNode per client) with N workers of one CPU each
  (``client_resources.num_cpus: 1`` of N: N clients train at once).

Printed side by side: end to end, the steady round (median over rounds 2..R of train +
aggregate + evaluate), the scaling efficiency of a steady round (``t(1) / (N t(N))``
against the one-worker run of the same engine) and, over ranks, the time in the exchange
(``time_exchange``: from a rank's end of training to the end of the all-gather, the wait
for the slowest rank included; median over rounds and rank 0's view).

    .venv/bin/python benchmarks/distributed.py [--ranks 1,2] [--clients 8] [--rounds 4] [--steps 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def job_config(args, out: Path):
    from vs_flower_sim import job_config as flower_comparison_job

    return flower_comparison_job(args, out, name="distributed")


def records(out: Path) -> list[dict]:
    from fedpeft.report.results import read_records

    return read_records(out)


def run_ranks(args, out: Path, n: int) -> float:
    """``fedpeft run --nproc n`` on the job; its wall time."""
    from fedpeft.config import dump_config

    path = out.with_suffix(".yaml")
    path.write_text(dump_config(job_config(args, out)))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    t0 = time.perf_counter()
    command = [sys.executable, "-m", "fedpeft", "run", str(path), "--nproc", str(n)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"ranks-{n} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return wall


def flower_child(args, out: Path, workers: int) -> None:
    """The job on Flower's simulation runtime with ``workers`` one-CPU workers (in this process)."""
    from vs_flower_sim import run_flower_sim

    run_flower_sim(job_config(args, out), workers)


def run_flower(args, out: Path, n: int, argv: list[str]) -> float:
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run([sys.executable, __file__, "--child", str(n), "--out", str(out), *argv], env=env)
    if done.returncode != 0:
        raise SystemExit(f"flower-sim-{n} failed with exit code {done.returncode}")
    return time.perf_counter() - t0


def summary(name: str, wall: float, out: Path) -> dict:
    rs = records(out)
    rounds = [r["time_train"] + r["time_aggregate"] + r["time_eval"] for r in rs]
    exchange = [r["time_exchange"] for r in rs[1:] if "time_exchange" in r]
    return {
        "name": name,
        "wall": wall,
        "steady": statistics.median(rounds[1:] or rounds),
        "exchange": statistics.median(exchange) if exchange else None,
        "global": rs[-1].get("global", {}).get("accuracy"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2", help="numbers of ranks (and Flower workers) to compare")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each rank or worker")
    ap.add_argument("--no-flower", action="store_true")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    argv = [f"--clients={args.clients}", f"--rounds={args.rounds}", f"--steps={args.steps}",
            f"--batch={args.batch}", f"--samples={args.samples}", f"--threads={args.threads}"]  # fmt: skip
    if args.child:
        flower_child(args, args.out, args.child)
        return
    root = Path(tempfile.mkdtemp(prefix="distributed-"))
    rows = []
    for n in [int(x) for x in args.ranks.split(",")]:
        out = root / f"ranks-{n}"
        rows.append(summary(f"ranks-{n}", run_ranks(args, out, n), out))
        print(rows[-1], flush=True)
        if not args.no_flower:
            out = root / f"flower-sim-{n}"
            rows.append(summary(f"flower-sim-{n}", run_flower(args, out, n, argv), out))
            print(rows[-1], flush=True)
    job = f"{args.clients} clients a round x {args.steps} steps x batch {args.batch}, {args.rounds} rounds"
    each = f"{args.threads} torch thread(s) a rank or worker, {psutil.cpu_count()} cores"
    print(f"\nFedLR, bundled MiniLM, {job}, {each}\n")
    header = [
        "",
        "ranks or workers",
        "end to end (s)",
        "steady round (s)",
        "scaling efficiency",
        "exchange (s)",
    ]
    print("| " + " | ".join([*header, "accuracy"]) + " |")
    print("|---|---|---|---|---|---|---|")
    steady_of_one = {r["name"].rsplit("-", 1)[0]: r["steady"] for r in rows if r["name"].endswith("-1")}
    for row in rows:
        engine, n = row["name"].rsplit("-", 1)
        one = steady_of_one.get(engine)
        cells = [
            engine,
            n,
            f"{row['wall']:.1f}",
            f"{row['steady']:.2f}",
            f"{one / (int(n) * row['steady']):.2f}" if one else "-",
            f"{row['exchange']:.3f}" if row["exchange"] is not None else "-",
            f"{row['global']:.3f}" if row["global"] is not None else "-",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
