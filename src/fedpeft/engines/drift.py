"""Client drift (``eval.drift``), the C2A paper's analysis (sec. 2.2, 5.5): each round, the
linear CKA between the logits of each sampled client's model after its local round and
those of the global model it started the round from, on one probe batch of the global
test set drawn once from the run's seed."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from fedpeft.data.task import Encoded, make_batch
from fedpeft.methods.base import FitResult, ServerState, Tensors
from fedpeft.metrics.cka import linear_cka

if TYPE_CHECKING:
    from fedpeft.engines.inprocess import InProcessEngine

#: The random stream of the drift probe batch (beside ``[seed, rnd]``, the clients sampled in round rnd).
DRIFT_STREAM = 0x44524946


def drift_probe_rows(seed: int, available: int, size: int) -> np.ndarray:
    """The global test rows of the client-drift probe batch: ``size`` of ``available``
    (all when there are fewer), drawn without replacement, seeded by ``seed`` alone, sorted."""
    rng = np.random.default_rng([seed, DRIFT_STREAM])
    return np.sort(rng.choice(available, size=min(size, available), replace=False))


class DriftProbe:
    """Client drift of an engine's rounds on ``probe``, the global test rows of
    :func:`drift_probe_rows`: ``probe(server, results)`` is a round's figure."""

    def __init__(self, engine: InProcessEngine, probe: Encoded):
        self.engine, self.probe = engine, probe

    @torch.no_grad()
    def logits(self, tensors: Tensors) -> torch.Tensor:
        """``(P, C)`` float64 logits of the model holding ``tensors`` on the probe batch."""
        engine, size = self.engine, self.engine.schedule.eval_batch_size
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
        (``method.messages.uplink_as_shared``) in place of the shared tensors, and its new personal
        state, combined as the method scores a client (:meth:`Method.eval_state`)."""
        engine, method = self.engine, self.engine.method
        received = {**method.downlink(server, result.cid), **method.messages.uplink_as_shared(result.uplink)}
        engine.forget_loaded()  # eval_state may use the model (Per-FedAvg adapts one step)
        state = method.eval_state(engine.model, received, result.personal, engine.clients[result.cid])
        engine.forget_loaded()
        return state

    def __call__(self, server: ServerState, results: list[FitResult]) -> dict:
        """Client drift of this round's clients: per client, the linear CKA between the logits
        of its model after its local round (:meth:`local_model`) and those of the global
        model ``server`` it started from (:meth:`Method.global_state`) on the probe batch;
        their mean and minimum. 1 when a client did not move. Skipped, with the reason, when
        there is no single global model or a client's update is not its trained tensors
        (only then can its model be rebuilt from the update)."""
        method = self.engine.method
        if len(self.probe) < 2:  # CKA compares how examples relate: it needs two at least
            return {"skipped": f"the probe batch has {len(self.probe)} example(s) (the global test set's)"}
        global_tensors = method.global_state(server)
        if global_tensors is None:
            why = f"method {method.name} has no single global model (Method.global_state is None)"
            return {"skipped": why}
        shared = set(method.shared_names)
        for r in results:
            if not set(r.uplink) <= shared:
                sent = sorted(set(r.uplink) - shared)[0]
                return {
                    "skipped": f"method {method.name}: client {r.cid}'s update is not its trained tensors "
                    f"(it sends {sent!r}, no shared parameter), so its local model cannot be rebuilt from it"
                }
        reference = self.logits(global_tensors)
        per_client = {}
        for r in results:
            per_client[str(r.cid)] = float(linear_cka(self.logits(self.local_model(server, r)), reference))
        self.engine.forget_loaded()
        values = list(per_client.values())
        return {
            "mean": float(np.mean(values)),
            "min": float(np.min(values)),
            "clients": per_client,
            "probe": len(self.probe),
        }
