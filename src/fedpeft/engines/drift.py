"""Client drift (``eval.drift``), the C2A paper's analysis (sec. 2.2, 5.5): each round, the
linear CKA between the logits of each sampled client's model after its local round and
those of the global model it started the round from, on one probe batch of the global
test set drawn once from the run's seed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from fedpeft.data.task import Encoded, make_batch
from fedpeft.data.types import ClientData
from fedpeft.methods.base import FitResult, Method, ServerState, Tensors
from fedpeft.metrics.cka import linear_cka

#: The random stream of the drift probe batch (beside ``[seed, rnd]``, the clients sampled in round rnd).
DRIFT_STREAM = 0x44524946


def drift_probe_rows(seed: int, available: int, size: int) -> np.ndarray:
    """The global test rows of the client-drift probe batch: ``size`` of ``available``
    (all when there are fewer), drawn without replacement, seeded by ``seed`` alone, sorted."""
    rng = np.random.default_rng([seed, DRIFT_STREAM])
    return np.sort(rng.choice(available, size=min(size, available), replace=False))


class EvalBatch(Protocol):
    """How many rows a forward pass takes (the engine's ``plan``)."""

    eval_batch_size: int


class ProbedEngine(Protocol):
    """What the drift probe reads of the engine whose rounds it measures (the in-process
    engine): its model, method and clients, and its hold on the model."""

    model: torch.nn.Module
    method: Method
    clients: Sequence[ClientData]
    plan: EvalBatch  # the experiment's counts: how many rows a forward pass takes

    def load(self, tensors: Tensors) -> None: ...

    def forget_loaded(self) -> None: ...


class DriftProbe:
    """Client drift of an engine's rounds on ``probe``, the global test rows of
    :func:`drift_probe_rows`: ``probe(server, results)`` is a round's figure."""

    def __init__(self, engine: ProbedEngine, probe: Encoded):
        self.engine, self.probe = engine, probe

    @torch.no_grad()
    def logits(self, tensors: Tensors) -> torch.Tensor:
        """``(P, C)`` float64 logits of the model holding ``tensors`` on the probe batch."""
        engine, size = self.engine, self.engine.plan.eval_batch_size
        engine.load(tensors)
        engine.model.eval()
        out = []
        for start in range(0, len(self.probe), size):
            batch = make_batch(self.probe, torch.arange(start, min(start + size, len(self.probe))))
            out.append(engine.model(batch["input_ids"], batch["attention_mask"]).double().cpu())
        return torch.cat(out)

    def local_model(self, server: ServerState, result: FitResult) -> Tensors:
        """Client ``result.cid``'s model after its local round (``server``: the state the
        round started from), rebuilt from its result alone: what it received with its update
        (``method.uplink_as_shared``) in place of the shared tensors, and its new personal
        state, combined as the method scores a client (:meth:`Method.eval_state`)."""
        engine, method = self.engine, self.engine.method
        received = {**method.downlink(server, result.cid), **method.uplink_as_shared(result.uplink)}
        engine.forget_loaded()  # eval_state may use the model (Per-FedAvg adapts one step)
        state = method.eval_state(engine.model, received, result.personal, engine.clients[result.cid])
        engine.forget_loaded()
        return state

    def skipped(self, server: ServerState) -> str | None:
        """Why no client's drift can be measured this round, or None."""
        method = self.engine.method
        if len(self.probe) < 2:  # CKA compares how examples relate: it needs two at least
            return f"the probe batch has {len(self.probe)} example(s) (the global test set's)"
        if method.global_state(server) is None:
            return f"method {method.name} has no single global model (Method.global_state is None)"
        return None

    def clients(self, server: ServerState, results: list[FitResult]) -> dict[str, float | str]:
        """Each of ``results``' clients' drift, by client id: the linear CKA between the
        logits of its model after its local round (:meth:`local_model`) and those of the
        global model ``server`` it started from (:meth:`Method.global_state`) on the probe
        batch; 1 when it did not move. A client whose update is not its trained tensors (only
        then can its model be rebuilt from the update) gets why instead, and then nothing is
        computed. Over ranks, each rank measures the clients it trained."""
        method, shared = self.engine.method, set(self.engine.method.shared_names)
        why = {}
        for r in results:
            if not set(r.uplink) <= shared:
                sent = sorted(set(r.uplink) - shared)[0]
                why[str(r.cid)] = (
                    f"method {method.name}: client {r.cid}'s update is not its trained tensors "
                    f"(it sends {sent!r}, no shared parameter), so its local model cannot be rebuilt from it"
                )
        if why or not results:
            return why
        reference = self.logits(method.global_state(server))
        out = {
            str(r.cid): float(linear_cka(self.logits(self.local_model(server, r)), reference))
            for r in results
        }
        self.engine.forget_loaded()
        return out

    def record(self, server: ServerState, measured: dict[str, float | str], order: list[int]) -> dict:
        """The round's drift record from its clients' (``measured``: :meth:`clients`, of
        every rank) in the order they were drawn (``order``): per client, their mean and
        minimum; or, with the reason, skipped (:meth:`skipped`, or the first client in
        ``order`` that cannot be measured)."""
        if why := self.skipped(server):
            return {"skipped": why}
        per_client = {str(c): measured[str(c)] for c in order if str(c) in measured}
        if why := next((v for v in per_client.values() if isinstance(v, str)), None):
            return {"skipped": why}
        if not per_client:  # every client dropped out (the round then stops, saying why)
            return {"skipped": "no client returned an update"}
        values = list(per_client.values())
        return {
            "mean": float(np.mean(values)),
            "min": float(np.min(values)),
            "clients": per_client,
            "probe": len(self.probe),
        }

    def __call__(self, server: ServerState, results: list[FitResult]) -> dict:
        """Client drift of this round's clients (``results``), in one process."""
        measured = {} if self.skipped(server) else self.clients(server, results)
        return self.record(server, measured, [r.cid for r in results])
