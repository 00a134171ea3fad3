"""The extra compute of PF2LoRA's hypergradient, measured side by side.

One client's local round of PF2LoRA on the bundled MiniLM, timed with the bilevel
coupling (the upper gradient through the lower SGD step: a Hessian-vector product by
double backward) and without it (``bilevel: false``: plain gradients for both adapters,
the paper's ablation), on the same batches, alternating the two, several repeats.
Both run under the math attention kernel that double backward needs, so the ratio is
the hypergradient's own cost.

    .venv/bin/python benchmarks/hypergradient_cost.py [--steps 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedpeft.config import load_config
from fedpeft.engines.local import Job, RoundContext
from fedpeft.experiment import build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    cfg = load_config(None, {
        "method": {"name": "pf2lora", "lora": {"r": 8, "alpha": 16}, "client_rank": 2, "client_alpha": 4},
        "data.max_samples": 1000,
        "partition": {"scheme": "iid", "num_clients": 4},
        "train": {"local_steps": args.steps, "batch_size": args.batch, "clients_per_round": 1},
    })  # fmt: skip
    setup = build(cfg)
    method, client = setup.method, setup.clients[0]
    received = {n: setup.initial[n] for n in method.shared_names}
    personal = method.init_client(setup.model, setup.initial, client)

    def local_round(bilevel: bool) -> float:
        method.cfg = method.cfg.model_copy(update={"bilevel": bilevel})
        (result,) = method.fit_cohort(
            setup.model, [Job(received, personal, client, seed=0, context=RoundContext(method.train))]
        )
        return result.metrics["time_step"]

    local_round(True)  # warm-up
    with_hyper, without = [], []
    for _ in range(args.repeats):
        with_hyper.append(local_round(True))
        without.append(local_round(False))
    ratios = [a / b for a, b in zip(with_hyper, without, strict=True)]
    threads = torch.get_num_threads()
    print(f"PF2LoRA on bundled MiniLM, {args.steps} steps x batch {args.batch}, torch threads {threads}")
    print(f"s per step, bilevel (hypergradient): {' '.join(f'{t:.3f}' for t in with_hyper)}")
    print(f"s per step, plain gradients:         {' '.join(f'{t:.3f}' for t in without)}")
    print(f"hypergradient cost: median {statistics.median(ratios):.2f}x the plain step "
          f"(runs: {' '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.0f} s)")
