"""Many clients on one machine: 1,000 to 100,000 clients, each holding a PF2LoRA
personal adapter, with their states in the client store (RAM budget, spill to disk).

Every client first gets a personal adapter of its own (as if each had trained once):
this is the state that must fit. Then a few rounds of the in-process engine sample a
few dozen clients each (their states are read back from disk, trained and written
again) and checkpoint the store's index. Printed per population: peak resident memory
beyond the backbone (sampled every 10 ms; the model loaded before the baseline is
taken), against the store's budget; disk used; seconds to populate; seconds per round.
Target (issue 11): memory beyond the backbone within 10 % of the budget.

Clients' data are the same few synthetic rows for every client (one shared tensor), so
that what is measured is the personal state, not the corpus.

    .venv/bin/python benchmarks/scale.py [--clients 1000,10000,100000] [--budget-mb 256]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from gpu_throughput import PeakMemory  # the same peak-memory sampler

from fedpeft.config import load_config
from fedpeft.data.task import Encoded
from fedpeft.engines.checkpoint import STORE_DIR, Checkpoint, save_checkpoint
from fedpeft.engines.inprocess import InProcessEngine, Schedule
from fedpeft.engines.store import ClientStore
from fedpeft.experiment import attach_method, place
from fedpeft.methods.base import ClientData
from fedpeft.models.backbone import build_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1000,10000,100000")
    ap.add_argument("--budget-mb", type=float, default=256)
    ap.add_argument("--per-round", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="where the stores go (default: a temporary folder)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = load_config(None, {
        "method": {"name": "pf2lora"},
        "train": {"local_steps": args.steps, "batch_size": 8, "lr": 0.01, "device": "cpu"},
    })  # fmt: skip
    model, _ = build_model(cfg.model, 45, cfg.seed)
    method, initial = attach_method(cfg, model)
    place(model, cfg.train)
    g = torch.Generator().manual_seed(0)
    rows = Encoded(
        torch.randint(1000, 30000, (8, 16), generator=g), torch.full((8,), 16), torch.randint(0, 45, (8,))
    )
    per_client = sum(initial[n].numel() * initial[n].element_size() for n in method.personal_names)
    budget = int(args.budget_mb * 2**20)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fedpeft-scale-"))
    # Warm-up: one round on a few clients, so that training's own buffers are in the baseline.
    warm = Schedule(rounds=1, clients_per_round=args.per_round, seed=0, eval_every=10**9)
    engine = InProcessEngine(
        model, method, [ClientData(c, rows, rows) for c in range(args.per_round)], rows, warm
    )
    engine.train_round(method.init_server(model), 1)
    out = []
    for count in [int(c) for c in args.clients.split(",")]:
        directory = work / f"{count}" / STORE_DIR
        shutil.rmtree(directory.parent, ignore_errors=True)
        clients = [ClientData(cid, rows, rows) for cid in range(count)]
        schedule = Schedule(rounds=args.rounds, clients_per_round=args.per_round, seed=0, eval_every=10**9)
        store = ClientStore(directory, budget)
        engine = InProcessEngine(model, method, clients, rows, schedule, store=store)
        with PeakMemory(torch.device("cpu")) as mem:
            t0 = time.perf_counter()
            for cid in range(count):  # every client holds a personal adapter of its own
                noise = torch.Generator().manual_seed(cid)
                store[cid] = {n: initial[n] + 0.01 * torch.randn(initial[n].shape, generator=noise)
                              for n in method.personal_names}  # fmt: skip
            store.commit()
            t_populate = time.perf_counter() - t0
            server, times = method.init_server(model), []
            for rnd in range(1, args.rounds + 1):
                t0 = time.perf_counter()
                server, _, _ = engine.train_round(server, rnd)
                ckpt = Checkpoint(rnd, "scale", server, store, [], [])
                save_checkpoint(directory.parent / "checkpoint.pt", ckpt)
                times.append(time.perf_counter() - t0)
        beyond = mem.peak  # above the resident memory at the start: the backbone and all else
        out.append(
            (count, count * per_client, beyond, store.disk_bytes(), t_populate, sum(times) / len(times))
        )
        print(f"  {count:,} clients: {beyond / 2**20:,.0f} MiB beyond the backbone, "
              f"{store.spilled:,} spills, {store.loaded:,} loads", flush=True)  # fmt: skip
        del engine, store, clients

    print(f"\nPF2LoRA personal adapter: {per_client / 1024:.0f} KiB per client; store budget "
          f"{args.budget_mb:g} MiB; {args.per_round} clients x {args.steps} step(s) per round, "
          f"{args.rounds} rounds; CPU, 1 thread\n")  # fmt: skip
    print("| clients | personal state in all (MiB) | peak memory beyond the backbone (MiB) | / budget "
          "| disk used (MiB) | populate (s) | s / round |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for count, total, beyond, disk, t_pop, t_round in out:
        print(f"| {count:,} | {total / 2**20:,.0f} | {beyond / 2**20:,.0f} | {beyond / budget:.2f} "
              f"| {disk / 2**20:,.0f} | {t_pop:.0f} | {t_round:.1f} |")  # fmt: skip
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
