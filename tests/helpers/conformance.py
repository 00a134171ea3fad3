"""The conformance checks of one registered method: 2 rounds x a few clients on a tiny model
(tests/methods/test_conformance.py runs them for every registered method;
tests/methods/test_adding_a_method.py for a method registered by a test).

Shared invariants: the frozen backbone stays bit-identical; the method trains exactly
the parameters it claims; bytes accounted equal the tensors exchanged; personal state
never appears in an uplink; the checkpoint round-trips.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedpeft.engines.checkpoint import load_checkpoint
from fedpeft.experiment import build, fingerprint, run
from fedpeft.flower import replies
from fedpeft.methods.base import tensor_bytes

PRIVATE = ("opt.", "own.")  # personal-state entries that are not parameters

#: What a method of each kind of trainable tensors (its ``trainable_kind()``) may train,
#: beside the classification head: a predicate over parameter names
KIND_CLAIMS: dict[str, Callable[[str], bool]] = {
    "full": lambda n: True,
    "bitfit": lambda n: n.endswith("bias"),
    "adapter": lambda n: ".adapter." in n,
    "lora": lambda n: "lora_" in n,
}


def kind_claim(method) -> Callable[[str], bool] | None:
    """What ``method`` may train by its kind of trainable tensors (and its head); None for
    a method without a kind."""
    kind = method.trainable_kind() if hasattr(method, "trainable_kind") else None
    if kind not in KIND_CLAIMS:
        return None
    return lambda n: KIND_CLAIMS[kind](n) or n.startswith("head.")


def assert_conforms(name: str, tiny_config, claim: Callable[[str], bool] | None = None) -> None:
    """Method ``name`` (registered) runs 2 rounds of 3 clients and keeps every invariant of
    the module docstring; ``claim``: what it may train (default: by its kind)."""
    cfg = tiny_config(**{"method": {"name": name}, "train.rounds": 2, "partition.num_clients": 3})
    setup = build(cfg)
    model, method = setup.model, setup.method
    claim = claim or kind_claim(method)
    assert claim is not None, f"{name}: no kind of trainable tensors; say what it trains (CLAIMS)"
    # A method may rewrite frozen weights once, as every client does on joining (FeDeRA's
    # residual); from then on the backbone must not move, but for the frozen tensors the
    # server holds and hands down (FedEx-LoRA's frozen weights, which take its residuals)
    method.join(model, method.join_message(method.init_server(model)))
    carried = set(method.server_frozen_names())
    frozen = {
        n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad and n not in carried
    }
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    # record every message of training: what each client received and what it sent back
    sent_down, sent_up, reported, readouts = [], [], set(), set()
    real_fit_cohort = method.fit_cohort

    def fit_cohort(model, jobs):
        sent_down.extend({n: t.clone() for n, t in job.received.items()} for job in jobs)
        results = real_fit_cohort(model, jobs)
        sent_up.extend(result.uplink for result in results)
        reported.update(name for result in results for name in result.metrics)
        readouts.update(name for result in results for name in method.readout(result))
        return results

    method.fit_cohort = fit_cohort
    summary = run(cfg, setup=setup)
    # what its clients report is what a deployed server accepts (it refuses unknown names)
    assert reported <= replies.FIT_METRICS, sorted(reported - replies.FIT_METRICS)
    assert readouts <= replies.READOUTS, sorted(readouts - replies.READOUTS)
    assert not list(cfg.output_dir.glob("*.png"))  # log.plots: false (tests/conftest.py) draws none

    # trains exactly what it claims, and something; all of the backbone only by full fine-tuning
    assert trainable and all(claim(n) for n in trainable), trainable[:5]
    full = kind_claim(method) is not None and method.trainable_kind() == "full"
    assert (len(frozen) == 0) if full else (len(frozen) > 0)
    # frozen backbone bit-identical
    params = dict(model.named_parameters())
    for n, t in frozen.items():
        assert torch.equal(params[n], t), n
    # training changed the trainable tensors of the clients that trained
    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    states = [ckpt.server.tensors] + list(ckpt.personal.values())
    assert any(not torch.equal(s[n], before[n]) for s in states for n in s)
    # bytes accounted == bytes of the tensors exchanged, plus, down, the one-time join
    # message at each client's first contact; never more than the shared state (float32)
    shared_bytes = sum(params[n].numel() * 4 for n in method.shared_names)
    carried_bytes = sum(params[n].numel() * 4 for n in carried)
    join_bytes = tensor_bytes(method.join_message(ckpt.server))
    per_round = 1 if method.pooled else cfg.train.clients_per_round
    seen: set[int] = set()
    for i, r in enumerate(ckpt.records):
        down = sum(tensor_bytes(m) for m in sent_down[i * per_round : (i + 1) * per_round])
        up = sum(tensor_bytes(m) for m in sent_up[i * per_round : (i + 1) * per_round])
        first_contacts = len(set(r["clients"]) - seen)
        seen |= set(r["clients"])
        if method.pooled:
            assert r["bytes_down"] == r["bytes_up"] == 0
            continue
        assert r["bytes_up"] == up <= per_round * shared_bytes
        assert r["bytes_down"] == down + first_contacts * join_bytes
        assert down <= per_round * (shared_bytes + carried_bytes)
    # personal tensors never sent; shared and personal partition the trainable set
    assert sent_up and sent_down
    for message in sent_up + sent_down:
        assert set(message).isdisjoint(method.personal_names)
    assert all(set(message).isdisjoint(carried) for message in sent_up)  # handed down, never back
    assert set(method.shared_names).isdisjoint(method.personal_names)
    assert set(method.shared_names) | set(method.personal_names) == set(trainable)
    # the checkpoint holds the final server state and every trained client's personal state:
    # its personal parameters, plus only private entries (kept optimizer state, HETLoRA's own model)
    for state in ckpt.personal.values():
        assert {n for n in state if not n.startswith(PRIVATE)} == set(method.personal_names)
    assert set(ckpt.server.tensors) == set(method.shared_names) | carried
    assert summary["params"]["trainable"] == sum(params[n].numel() for n in trainable)
