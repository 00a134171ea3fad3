"""Operations a local step issues: the plain loop (autograd, torch.optim.AdamW), a cohort
of one, vmapped and folded cohorts, in fp32 and bf16, on the same model and job (issue
64, item 1).

On a GPU each ATen operation that computes something is a kernel launch (or more), and
a small adapter's step is launch-bound: a few microseconds of host time per operation,
whatever its size. Counting them needs no GPU: a ``TorchDispatchMode`` sees every
operation as it is dispatched (inside ``vmap``, the batched operations it runs), and
views (which launch nothing) are counted apart. The counts do not depend on the machine.

    .venv/bin/python benchmarks/step_operations.py [--steps 5] [--cohort 4]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from functools import partial
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_throughput import cohort, make_clients, make_model, one_at_a_time  # noqa: E402


class Operations(TorchDispatchMode):
    """The ATen operations dispatched while active: ``computed`` (by name) and ``views``."""

    def __init__(self):
        super().__init__()
        self.computed: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.computed[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count(run, steps: int) -> Operations:
    run()  # once untimed: caches, lazy set-up
    with Operations() as ops:
        run()
    ops.computed = Counter({k: v / steps for k, v in ops.computed.items()})
    ops.views /= steps
    return ops


def layouts(precision: str, args) -> dict:
    """Each layout's round of ``args.steps`` steps, on a fresh model of ``precision``."""
    model, method, initial, train, device = make_model("minilm-shape", precision, "cpu", args.steps, 32)
    clients = make_clients(args.cohort, 64, 32, device)
    layouts.trained = sum(1 for p in model.parameters() if p.requires_grad)
    return {
        "plain loop": partial(one_at_a_time, model, method, initial, train, clients[:1], device),
        "cohort of 1": partial(cohort, model, method, initial, clients[:1], device, "vmap"),
        f"vmap {args.cohort}": partial(cohort, model, method, initial, clients, device, "vmap"),
        f"folded {args.cohort}": partial(cohort, model, method, initial, clients, device, "folded"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cohort", type=int, default=4)
    ap.add_argument("--top", type=int, default=8, help="the operations whose count differs most, shown")
    ap.add_argument("--precisions", default="fp32,bf16")
    args = ap.parse_args()
    torch.set_num_threads(1)
    counted = {}
    for precision in args.precisions.split(","):
        for name, run in layouts(precision, args).items():
            counted[(name, precision)] = count(run, args.steps)
    trained = layouts.trained
    print(f"MiniLM-shaped BERT, FedLR ({trained} trained tensors), a step of 32 x 32 tokens a client; "
          f"per step, averaged over a round of {args.steps}\n")  # fmt: skip
    print("| layout | precision | operations computed | views |")
    print("|---|---|---|---|")
    for (name, precision), ops in counted.items():
        print(f"| {name} | {precision} | {sum(ops.computed.values()):,.0f} | {ops.views:,.0f} |")
    for a, b in (
        (("plain loop", "fp32"), ("cohort of 1", "fp32")),
        (("plain loop", "fp32"), ("plain loop", "bf16")),
    ):
        if a in counted and b in counted:
            x, y = counted[a].computed, counted[b].computed
            print(f"\n| operation | {' '.join(a)} | {' '.join(b)} |\n|---|---|---|")
            for name in sorted(set(x) | set(y), key=lambda k: -abs(y[k] - x[k]))[: args.top]:
                print(f"| `{name}` | {x[name]:.0f} | {y[name]:.0f} |")


if __name__ == "__main__":
    main()
