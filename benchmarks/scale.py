"""Many clients on one machine: 1,000 to 1,000,000 clients, a PF2LoRA personal adapter
each once drawn, their states in the client store (RAM budget, spilled to disk).

Each population gets a fresh store; its first ``--populate`` clients are given a personal
adapter of their own (as if each had trained once: states to exceed the budget, so that
the store spills), then it runs the same rounds of the in-process engine:
the same number of clients a round (seeded draws), each client's personal state created
the first time it is drawn, read back (from memory or disk) when it is drawn again, and a
checkpoint every round (the store's index committed: one row per client trained). The
clients are the engine's own lazy sequence (``fedpeft.data.split.Clients``) over a
partition held as arrays (``Shards``), so a population costs its arrays, not an object a
client. Printed per population: the partition's arrays, peak resident memory above the
start of the rounds (sampled every 10 ms; model, warm-up round and arrays already in it)
against the store's budget, the median round and checkpoint time and their ratio to the
smallest population's, the index's rows written a round, disk used.

Targets (issue 63): memory beyond the backbone within 10 % of the store's budget; a round
at 1,000,000 clients within 1.2x a round at 1,000.

Every client's examples are 4 of the same 64 synthetic rows (client i: rows 4i..4i+3,
modulo 64), so that what is measured is the population, not the corpus.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale.py [--clients 1000,10000,100000,1000000]
        [--budget-mb 64] [--populate 2000] [--rounds 8] [--per-round 32]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
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
from fedpeft.engines.inprocess import InProcessEngine, Schedule
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1000,10000,100000,1000000")
    ap.add_argument("--budget-mb", type=float, default=64)
    ap.add_argument("--populate", type=int, default=2000, help="clients given a state before the rounds")
    ap.add_argument("--per-round", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where the stores go (default: a temporary folder)")
    args = ap.parse_args()
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
    per_client = sum(initial[n].numel() * initial[n].element_size() for n in method.personal_names)
    budget = int(args.budget_mb * 2**20)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fedpeft-scale-"))
    schedule = Schedule(rounds=args.rounds, clients_per_round=args.per_round, seed=0, eval_every=10**9)
    # Warm-up: one round on a small population, so that training's own buffers are in the baseline.
    InProcessEngine(
        model, method, population(args.per_round, pool), pool.subset(range(8)), schedule
    ).train_round(method.init_server(model), 1)
    out = []
    for count in [int(c) for c in args.clients.split(",")]:
        directory = work / f"{count}" / STORE_DIR
        shutil.rmtree(directory.parent, ignore_errors=True)
        clients = population(count, pool)
        arrays = sum(a.nbytes for s in (clients.split.train, clients.split.test) for a in (s.rows, s.offsets))
        store = ClientStore(directory, budget)
        engine = InProcessEngine(model, method, clients, pool.subset(range(8)), schedule, store=store)
        checkpoints = Checkpoints(directory.parent / "checkpoint.pt", keep=2)
        server, rounds, saves, rows = method.init_server(model), [], [], []
        with PeakMemory(torch.device("cpu")) as mem:
            for cid in range(min(args.populate, count)):
                noise = torch.Generator().manual_seed(cid)
                store[cid] = {n: initial[n] + 0.01 * torch.randn(initial[n].shape, generator=noise)
                              for n in method.personal_names}  # fmt: skip
            for rnd in range(1, args.rounds + 1):
                t0 = time.perf_counter()
                server, _, _ = engine.train_round(server, rnd)
                t1 = time.perf_counter()
                changes = store.index.db.total_changes
                checkpoints.save(Checkpoint(rnd, "scale", server, store, [], []))
                rows.append(store.index.db.total_changes - changes)
                rounds.append(time.perf_counter() - t0)
                saves.append(time.perf_counter() - t1)
        out.append((count, arrays, mem.peak, statistics.median(rounds), statistics.median(saves),
                    statistics.median(rows), len(store), store.disk_bytes()))  # fmt: skip
        times = " ".join(f"{t:.2f}" for t in rounds)
        print(
            f"  {count:,} clients: rounds {times} s; {store.spilled:,} spills, {store.loaded:,} loads",
            flush=True,
        )
        store.close()
        del engine, store, clients

    print(f"\nPF2LoRA personal adapter: {per_client / 1024:.0f} KiB per client; store budget "
          f"{args.budget_mb:g} MiB; {args.per_round} clients x {args.steps} step(s) a round, {args.rounds} "
          f"rounds, a checkpoint each; CPU, 1 thread\n")  # fmt: skip
    print("| clients | partition arrays (MiB) | peak memory beyond the start (MiB) | / budget | s / round "
          "| x the first | checkpoint (s) | index rows a round | states | disk (MiB) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    first = out[0][3]
    for count, arrays, beyond, t_round, t_save, rows, states, disk in out:
        print(f"| {count:,} | {arrays / 2**20:,.1f} | {beyond / 2**20:,.0f} | {beyond / budget:.2f} "
              f"| {t_round:.2f} | {t_round / first:.2f} | {t_save:.3f} | {rows:.0f} | {states:,} "
              f"| {disk / 2**20:,.0f} |")  # fmt: skip
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
