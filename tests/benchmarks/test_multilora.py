"""The hand-written multi-LoRA step (``benchmarks/multilora.py``), the yardstick of
``gpu_throughput.py``, trains each client as the plain loop trains it alone: it is the
same job, so its speed is a fair one to hold the engine to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from gpu_throughput import make_clients, make_model  # noqa: E402
from multilora import MultiLoRA, stack  # noqa: E402
from plain_loop import plain_steps  # noqa: E402

from fedpeft.data.task import take_steps  # noqa: E402
from fedpeft.methods.base import load_tensors, read_tensors  # noqa: E402

STEPS, BATCH, CLIENTS = 3, 4, 3


def job(precision: str, clients: int):
    """The benchmark's model and its clients' batches, as ``one_at_a_time`` draws them."""
    model, _, initial, train, device = make_model("minilm-shape", precision, "cpu", STEPS, BATCH)
    batches = [
        list(take_steps(c.train, BATCH, STEPS, torch.Generator().manual_seed(c.cid)))
        for c in make_clients(clients, 2 * BATCH, 16, device)
    ]
    return model, initial, train, batches


def multilora(model, initial, train, batches) -> tuple[MultiLoRA, torch.Tensor]:
    """The clients trained at once by hand, and their first step's losses."""
    load_tensors(model, initial)
    multi = MultiLoRA(model, initial, len(batches), train.lr, train.max_grad_norm)
    losses = [multi.step(stack(list(step))) for step in zip(*batches, strict=True)]
    return multi, losses[0]


def off_by(trained: dict, expected: dict, initial: dict) -> float:
    """The largest difference of two trainings' tensors, as a share of the update."""
    return max(float((trained[n] - expected[n]).abs().max() / update(expected, initial, n)) for n in expected)


def update(trained: dict, initial: dict, name: str) -> torch.Tensor:
    return (trained[name] - initial[name]).abs().max()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_client_ends_where_the_plain_loop_takes_it_alone(precision):
    model, initial, train, batches = job(precision, CLIENTS)
    assert len({steps[0]["input_ids"].shape[1] for steps in batches}) > 1  # widths differ: padded

    alone, first = [], []
    for steps in batches:
        load_tensors(model, initial)
        with torch.no_grad():
            first.append(torch.nn.functional.cross_entropy(model(**steps[0]), steps[0]["labels"]))
        params = [p for p in model.parameters() if p.requires_grad]
        plain_steps(model, steps, torch.optim.AdamW(params, lr=train.lr, weight_decay=0.0), params,
                    train.max_grad_norm)  # fmt: skip
        alone.append(read_tensors(model, list(initial)))

    multi, losses = multilora(model, initial, train, batches)
    tol = {"fp32": 1e-5, "bf16": 2e-2}[precision]
    torch.testing.assert_close(losses, torch.stack(first), atol=tol, rtol=tol)
    if precision == "fp32":  # bf16's rounding differs with the order of its sums; Adam's first
        # steps (about lr times the gradient's sign) then amplify it: the losses are the check
        for c, expected in enumerate(alone):
            trained = {n: t[c].detach() for n, t in multi.params.items()}
            assert off_by(trained, expected, initial) < 0.05  # 0.019 measured


def test_a_client_given_another_clients_batches_ends_elsewhere():
    """The check above can fail: swapping two clients' batches moves their tensors."""
    model, initial, train, batches = job("fp32", 2)
    runs = [multilora(model, initial, train, order)[0] for order in (batches, batches[::-1])]
    first, swapped = ({n: t[0].detach() for n, t in run.params.items()} for run in runs)
    assert off_by(swapped, first, initial) > 0.5
