"""Engine overhead: one federated round versus a plain training loop doing the same steps.

Both sides run in this process on the same model (bundled MiniLM + LoRA by default),
the same clients and the very same mini-batches. The engine's round adds what
federation costs: loading each client's tensors into the shared model, a fresh
optimizer per client, reading the tensors back out, byte accounting and the
weighted aggregation. Repetitions alternate the two sides; the median ratio is printed.
Target: engine / plain <= 1.05.

    .venv/bin/python benchmarks/overhead.py [--clients 5] [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from plain_loop import plain_optimizer, plain_steps

from fedpeft.config import load_config
from fedpeft.data.task import take_steps
from fedpeft.engines.inprocess import InProcessEngine, RunPlan, derive_seed, sample_clients
from fedpeft.experiment import build


def plain_loop(setup, clients: list[int], steps: int, seed: int, rnd: int) -> None:
    """The same optimizer steps on the same batches, with nothing federated around them:
    one optimizer for the whole loop, no loading or reading of client tensors."""
    model, cfg = setup.model, setup.cfg.train
    opt, params = plain_optimizer(model, cfg.lr)
    for cid in clients:
        s = derive_seed(seed, rnd, cid)
        torch.manual_seed(s)
        batches = take_steps(
            setup.clients[cid].train, cfg.batch_size, steps, torch.Generator().manual_seed(s)
        )
        plain_steps(model, batches, opt, params, cfg.max_grad_norm)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--method", default="fedlr")
    args = ap.parse_args()

    cfg = load_config(
        None,
        {
            "method": {"name": args.method},
            "train.clients_per_round": args.clients,
            "train.local_steps": args.steps,
            "train.rounds": 1,
            "checkpoint": False,
        },
    )
    setup = build(cfg)
    plan = RunPlan(rounds=1, clients_per_round=args.clients, seed=cfg.seed)
    engine = InProcessEngine(setup.model, setup.method, setup.clients, setup.global_test, plan)
    server = setup.method.init_server(setup.model)
    sampled = sample_clients(cfg.seed, 1, len(setup.clients), args.clients)

    def engine_round() -> None:
        engine.train_round(server, 1)

    engine_round()  # warm-up: first-touch allocations, kernel selection
    t_engine, t_plain = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        plain_loop(setup, sampled, args.steps, cfg.seed, 1)
        t1 = time.perf_counter()
        engine_round()
        t2 = time.perf_counter()
        t_plain.append(t1 - t0)
        t_engine.append(t2 - t1)
    ratios = [e / p for e, p in zip(t_engine, t_plain, strict=True)]
    print(
        f"method {args.method}: {args.clients} clients x {args.steps} steps, batch {cfg.train.batch_size}, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(f"plain loop   s/round: {' '.join(f'{t:.2f}' for t in t_plain)}")
    print(f"engine round s/round: {' '.join(f'{t:.2f}' for t in t_engine)}")
    print(
        f"overhead ratio engine/plain: median {statistics.median(ratios):.3f} "
        f"(runs: {' '.join(f'{r:.3f}' for r in ratios)}; target <= 1.05)"
    )


if __name__ == "__main__":
    main()
