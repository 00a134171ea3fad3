"""Many clients on one machine: 1,000 to 1,000,000 clients, a PF2LoRA personal adapter
each once drawn, their states in the client store (RAM budget, spilled to disk).

Each population gets a fresh process and store; its first ``--populate`` clients are
given a personal adapter of their own (as if each had trained once: states to exceed the
budget, so that the store spills), then it runs the same rounds of the in-process engine:
the same number of clients a round (seeded draws), each client's personal state created
the first time it is drawn, read back (from memory or disk) when it is drawn again, and a
checkpoint every round (the store's index committed: one row per client trained). The
clients are the engine's own lazy sequence (``fedpeft.data.split.Clients``) over a
partition held as arrays (``Shards``), so a population costs its arrays, not an object a
client. Printed per population: the partition's arrays, peak resident memory above the
start of the populating (sampled every 10 ms; model, warm-up round, arrays already in it)
against the store's budget, the median round and checkpoint time and their ratio to the
smallest population's, the index's rows written a round, disk used.

Targets (issue 63): memory beyond the backbone within 10 % of the store's budget; a round
at 1,000,000 clients within 1.2x a round at 1,000.

Every client's examples are 4 of the same 64 synthetic rows (client i: rows 4i..4i+3,
modulo 64), so that what is measured is the population, not the corpus.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale.py [--clients 1000,10000,100000,1000000]
        [--budget-mb 256] [--populate 5000] [--rounds 8] [--per-round 32]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from gpu_throughput import PeakMemory  # the same peak-memory sampler

from fedpeft.config import load_config
from fedpeft.data.split import Clients, Shards, Split
from fedpeft.data.task import Encoded
from fedpeft.engines.checkpoint import STORE_DIR, Checkpoint, Checkpoints
from fedpeft.engines.inprocess import InProcessEngine, RunPlan
from fedpeft.engines.store import ClientStore
from fedpeft.experiment import attach_method, place
from fedpeft.models.backbone import build_model

POOL, TRAIN, TEST = 64, 4, 2  # synthetic rows in all; each client's train and test rows


def population(count: int, pool: Encoded) -> Clients:
    """``count`` clients over ``pool``: client i's train rows 4i..4i+3 and test rows the two
    after, modulo the pool."""
    train = (np.arange(count)[:, None] * TRAIN + np.arange(TRAIN)) % POOL
    test = (np.arange(count)[:, None] * TRAIN + TRAIN + np.arange(TEST)) % POOL
    split = Split(
        Shards(train.reshape(-1), np.arange(0, count * TRAIN + 1, TRAIN)),
        Shards(test.reshape(-1), np.arange(0, count * TEST + 1, TEST)),
    )
    return Clients(pool, split)


def measure(args: argparse.Namespace, count: int) -> dict:
    """One population's figures, in this process (a fresh one: the baseline is not raised
    by an earlier population's heap)."""
    torch.set_num_threads(1)
    cfg = load_config(None, {
        "method": {"name": "pf2lora"},
        "train": {"local_steps": args.steps, "batch_size": 4, "lr": 0.01, "device": "cpu"},
    })  # fmt: skip
    model, _ = build_model(cfg.model, 45, cfg.seed)
    method, initial = attach_method(cfg, model)
    place(model, cfg.train)
    g = torch.Generator().manual_seed(0)
    pool = Encoded(
        torch.randint(1000, 30000, (POOL, 16), generator=g),
        torch.full((POOL,), 16),
        torch.randint(0, 45, (POOL,)),
    )
    budget = int(args.budget_mb * 2**20)
    plan = RunPlan(rounds=args.rounds, clients_per_round=args.per_round, seed=0, eval_every=10**9)
    # Warm-up: one round on a small population, so that training's own buffers are in the baseline.
    warm = InProcessEngine(model, method, population(args.per_round, pool), pool.subset(range(8)), plan)
    warm.train_round(method.init_server(model), 1)
    directory = Path(args.workdir) / f"{count}" / STORE_DIR
    shutil.rmtree(directory.parent, ignore_errors=True)
    clients = population(count, pool)
    arrays = sum(a.nbytes for s in (clients.split.train, clients.split.test) for a in (s.rows, s.offsets))
    store = ClientStore(directory, budget)
    engine = InProcessEngine(model, method, clients, pool.subset(range(8)), plan, store=store)
    checkpoints = Checkpoints(directory.parent / "checkpoint.pt", keep=2)
    server, rounds, saves, rows = method.init_server(model), [], [], []
    with PeakMemory(torch.device("cpu")) as mem:
        t0 = time.perf_counter()
        for cid in range(min(args.populate, count)):
            noise = torch.Generator().manual_seed(cid)
            store[cid] = {n: initial[n] + 0.01 * torch.randn(initial[n].shape, generator=noise)
                          for n in method.personal_names}  # fmt: skip
        populate = time.perf_counter() - t0
        for rnd in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            server, _, _ = engine.train_round(server, rnd)
            t1 = time.perf_counter()
            changes = store.index.db.total_changes
            checkpoints.save(Checkpoint(rnd, "scale", server, store, [], []))
            rows.append(store.index.db.total_changes - changes)
            rounds.append(time.perf_counter() - t0)
            saves.append(time.perf_counter() - t1)
    per_client = sum(initial[n].numel() * initial[n].element_size() for n in method.personal_names)
    return {
        "clients": count, "arrays": arrays, "beyond": mem.peak, "populate": populate, "rounds": rounds,
        "saves": saves, "rows": rows, "states": len(store), "disk": store.disk_bytes(),
        "spilled": store.spilled, "loaded": store.loaded, "per_client": per_client,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1000,10000,100000,1000000")
    ap.add_argument("--budget-mb", type=float, default=256)
    ap.add_argument("--populate", type=int, default=5000, help="clients given a state before the rounds")
    ap.add_argument("--per-round", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where the stores go (default: a temporary folder)")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a population, in a child
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args, args.one)))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fedpeft-scale-"))
    out = []
    for count in [int(c) for c in args.clients.split(",")]:
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("clients", "one")]
        command = [sys.executable, __file__, *flags, f"--workdir={work}", f"--one={count}"]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        times = " ".join(f"{t:.2f}" for t in figures["rounds"])
        print(f"  {count:,} clients: rounds {times} s; populated in {figures['populate']:.0f} s; "
              f"{figures['spilled']:,} spills, {figures['loaded']:,} loads", flush=True)  # fmt: skip
        out.append(figures)

    budget = args.budget_mb * 2**20
    print(f"\nPF2LoRA personal adapter: {out[0]['per_client'] / 1024:.0f} KiB per client; store budget "
          f"{args.budget_mb:g} MiB; the first {args.populate:,} clients given a state, then {args.per_round} "
          f"clients x {args.steps} step(s) a round, {args.rounds} rounds, a checkpoint each; CPU, 1 thread, "
          "a process a population\n")  # fmt: skip
    print("| clients | partition arrays (MiB) | peak memory beyond the start (MiB) | / budget | s / round "
          "| x the first | checkpoint (s) | index rows a round | states | disk (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    first = statistics.median(out[0]["rounds"])
    for f in out:
        t_round = statistics.median(f["rounds"])
        print(f"| {f['clients']:,} | {f['arrays'] / 2**20:,.1f} | {f['beyond'] / 2**20:,.0f} "
              f"| {f['beyond'] / budget:.2f} | {t_round:.2f} | {t_round / first:.2f} "
              f"| {statistics.median(f['saves']):.3f} | {statistics.median(f['rows']):.0f} | {f['states']:,} "
              f"| {f['disk'] / 2**20:,.0f} |")  # fmt: skip
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
