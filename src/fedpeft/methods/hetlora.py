"""HETLoRA: heterogeneous LoRA ranks across clients (a baseline of PF2LoRA).

Paper: Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
Models", EMNLP 2024; a baseline of PF2LoRA (docs/personalized.md). Four parts:

1. **Rank initialisation**: client ``i`` gets a fixed rank ``r_i`` in ``[r_min, r_max]``
   (a uniform draw seeded by the experiment seed, ``rank_seed`` and the client id; or
   ``method.ranks``, the setting HETLoRA shares with FlexLoRA and FLoRA), the server
   keeps rank ``r_max``.
2. **Truncation on the way down**: client ``i`` receives ``B[:, :r_i]`` and ``A[:r_i, :]``
   (fewer bytes for smaller ranks).
3. **Local training with self-pruning**: the loss gets
   ``lambda * sum ||B[:, q:r_i]||_F ||A[q:r_i, :]||_F`` with ``q = floor(gamma r_i)``, which
   pushes the last ``r_i - q`` rank components towards zero; after training the client
   drops them when they are small (the *pruning rule* below): ``r_i <- q`` (never below
   ``r_min``), and sends the smaller matrices.
4. **Zero-padding and sparsity-weighted aggregation on the way up**: the server pads
   every client's ``A, B`` back to ``r_max`` and averages them with weights proportional
   to the Frobenius norm of the client's update ``||B_i A_i||`` (over all adapted
   matrices); the head is averaged by client size, as in FedAvg.

**The pruning rule.** The paper's text is not among fedpeft's sources; what is known of
it is that the client prunes columns whose norm falls below a ratio. Component ``j`` of an adapter
is the rank-one term ``b_j a_j^T`` (column ``j`` of ``B``, row ``j`` of ``A``); its energy is
``e_j = sum over adapted modules of ||b_j|| ||a_j||`` (the Frobenius norm of the term).
``prune_rule`` compares the tail ``T = {q, ..., r_i - 1}`` with the kept components
``K = {0, ..., q - 1}``:

- ``mean`` (default): prune when ``mean_{j in T} e_j < prune_ratio * mean_{j in K} e_j``,
  i.e. a tail component is on average under ``prune_ratio`` of a kept one. Scale-free in
  the rank: with every component of equal energy it never fires.
- ``share`` (fedpeft before 2026-11-22): prune when ``sum_T e_j < prune_ratio * sum_j e_j``.
  With ``r_i = 8, gamma = 0.9`` the tail is one component in eight, so an adapter of
  equal-energy components (a share of 0.125) sits just above the default 0.1 and the rule
  fires as soon as the penalty nudges the tail.

``benchmarks/hetlora_pruning.py`` shows the sensitivity to the rule and the ratio. Other
readings where the text is silent: one prune step per round at most, and the LoRA scale
``alpha / r_max`` for every client.

**The client's model** (PF2LoRA paper: HETLoRA is a personalised baseline). Each client
keeps its last locally trained adapter and head (after pruning) in its personal state
(``own.*``, never sent) and is scored with it (``personal_model: own``); the global
adapter truncated to its rank is scored beside it and reported as ``local_global``
(``personal_model: global`` swaps the two). A client that has not trained yet has no
adapter of its own and is scored with what it receives, the global adapter truncated to
its rank (as a client of FedLR that has not trained holds the global model). Zero-padded rank
components stay exactly zero during local training (their gradients vanish because
both their ``A`` row and ``B`` column are zero), so a client trains exactly rank ``r_i``.
The current ranks are server state (``rank.<client>`` in its extras), updated from the
shapes of what clients send.
"""

from __future__ import annotations

import math

import torch

from fedpeft.config.methods.hetlora import HETLoRAConfig
from fedpeft.engines.local import (
    OPT,
    OWN,
    GradientFn,
    ModelLossGradients,
    Start,
    optimizer_state,
)
from fedpeft.methods.base import (
    ClientData,
    FitResult,
    Job,
    ServerState,
    Tensors,
    local_steps,
    weighted_mean,
)
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.lora_ranks import (
    client_rank,
    is_a,
    is_b,
    mask_components,
    pad,
    padded_uplink,
    pairs,
    rank_of,
    truncate,
)
from fedpeft.methods.registry import register_method


def update_norm(tensors: Tensors) -> float:
    """Frobenius norm of the client's whole update ``[B A]`` over its adapted modules."""
    return math.sqrt(sum(float((b @ a).pow(2).sum()) for a, b in pairs(tensors)))


def tail_penalty(mods: list[tuple[torch.Tensor, torch.Tensor]], tail: torch.Tensor) -> torch.Tensor:
    """``sum ||B[:, T]||_F ||A[T, :]||_F`` over ``(A, B)`` pairs, ``T`` the components where the
    0/1 mask ``tail`` is 1 (a mask rather than a slice, so that clients of different ranks
    vmap together; the norm of zeros has gradient 0)."""
    return sum(
        torch.linalg.vector_norm(b * tail) * torch.linalg.vector_norm(a * tail[:, None]) for a, b in mods
    )


def component_energies(mods: list[tuple[torch.Tensor, torch.Tensor]], rank: int) -> list[float]:
    """``e_j = sum over modules of ||B[:, j]|| ||A[j, :]||`` for ``j < rank``: the Frobenius
    norm of each rank-one term, summed over the adapted modules."""
    return [sum(float(b[:, j].norm() * a[j].norm()) for a, b in mods) for j in range(rank)]


def pruned_rank(
    mods: list[tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    gamma: float,
    r_min: int,
    ratio: float,
    rule: str = "mean",
) -> int:
    """``floor(gamma rank)`` if the tail components are small by ``rule`` (module
    docstring) and that stays >= r_min, else ``rank``."""
    q = math.floor(gamma * rank)
    if q < r_min or q == rank:
        return rank
    energy = component_energies(mods, rank)
    kept, tail = energy[:q], energy[q:]
    if rule == "mean":
        small = sum(tail) / len(tail) < ratio * sum(kept) / len(kept)
    else:
        small = sum(tail) < ratio * sum(energy)
    return q if sum(energy) > 0 and small else rank


def sparsity_weighted_mean(padded: list[Tensors], norms: list[float]) -> Tensors:
    """The LoRA tensors averaged with weights ``||B_i A_i|| / sum_j ||B_j A_j||``."""
    if sum(norms) <= 0:  # nothing learned yet anywhere: a plain mean
        norms = [1.0] * len(norms)
    return weighted_mean(padded, norms)


@register_method(HETLoRAConfig)
class HETLoRA(FedAvgPeft):
    kind = "lora"
    refuses = {
        "dora": "",  # DoRA's magnitudes: trained and averaged, as the head is
        "robust": "its server weighs the clients' adapters by their update norms (its own rule)",
        "correction": "each client trains its own rank of the shared adapter, so no one control fits all of "
        "them",
        "secure_aggregation": "its server weighs the clients' adapters by their update norms (its own rule)",
    }

    # ----- messages: an update of a client's own rank reaches the server's checks zero-padded
    def uplink_as_shared(self, uplink: Tensors) -> Tensors:
        return padded_uplink(uplink, self.cfg.lora.r)

    def initial_rank(self, cid: int) -> int:
        return client_rank(self.cfg.rank_draw(), cid, self.seed, self.cfg.lora.r)

    def rank(self, server: ServerState, cid: int) -> int:
        key = f"rank.{cid}"
        return int(server.extras[key]) if key in server.extras else self.initial_rank(cid)

    # ----- server
    def downlink(self, server: ServerState, cid: int) -> Tensors:
        return truncate(server.tensors, self.rank(server, cid))

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        r_max = self.cfg.lora.r
        lora = [pad({n: t for n, t in r.uplink.items() if is_a(n) or is_b(n)}, r_max) for r in results]
        rest = [{n: t for n, t in r.uplink.items() if not (is_a(n) or is_b(n))} for r in results]
        tensors = sparsity_weighted_mean(lora, [update_norm(s) for s in lora])
        if rest[0]:
            tensors.update(weighted_mean(rest, [r.num_examples for r in results]))
        extras = dict(server.extras)
        for r in results:
            extras[f"rank.{r.cid}"] = torch.tensor(rank_of(r.uplink))
        return ServerState(tensors, extras)

    # ----- client: the local step as pure functions (vectorised over a cohort by the engine)
    def tail_mask(self, rank: int) -> torch.Tensor:
        """``(r_max,)``: 1 on the components ``q..rank-1`` the penalty pushes down
        (``q = floor(gamma rank)``), 0 elsewhere (all 0 when there is no penalty)."""
        mask = torch.zeros(self.cfg.lora.r)
        if self.cfg.penalty > 0:
            mask[math.floor(self.cfg.gamma * rank) : rank] = 1.0
        return mask

    def cohort_start(self, model, job: Job) -> Start:
        """The received adapter zero-padded to ``r_max`` (padded components have zero
        gradients, so they stay zero: the client trains rank ``r_i`` exactly), and the
        client's tail mask as a constant of its step."""
        rank, r_max = rank_of(job.received), self.cfg.lora.r
        params = {**pad(job.received, r_max), **self.params_of(job.personal)}
        opt = optimizer_state(mask_components(job.personal, rank), params, job.context.train)
        steps = local_steps(len(job.client.train), job.context.train)
        return Start(params, opt, {"tail": self.tail_mask(rank)}, steps)

    def step_gradients(self, model) -> GradientFn:
        """Backprop of the model's loss plus ``lambda * sum ||B[:, tail]|| ||A[tail, :]||``
        (:meth:`_penalty`: of the client's tensors alone, so a cohort can fold)."""
        return ModelLossGradients(model, penalty=self._penalty)

    def _penalty(self, params: Tensors, consts: Tensors) -> torch.Tensor:
        """The rank-tail regulariser of a client's adapters (its tail mask in ``consts``)."""
        names = [n for n in self.shared_names if is_a(n)]
        mods = [(params[n], params[n.replace(".lora_A.", ".lora_B.")]) for n in names]
        return self.cfg.penalty * tail_penalty(mods, consts["tail"])

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """Self-pruning, then the (possibly smaller) adapter up; the client keeps it as its
        own model, and its kept optimizer state masked to the new rank."""
        rank, r_max = rank_of(job.received), self.cfg.lora.r
        trained = {n: params[n] for n in self.shared_names}
        new_rank = self.pruned_rank(trained, rank)
        uplink = truncate(trained, new_rank)
        own = {OWN + n: t for n, t in pad(uplink, r_max).items()}
        kept = {OPT + k: v for k, v in opt.items()} if job.context.train.optimizer_state == "keep" else {}
        return FitResult(
            uplink=uplink,
            personal={
                **{n: params[n] for n in self.personal_names},
                **own,
                **mask_components(kept, new_rank),
            },
            num_examples=len(job.client.train),
            metrics={**metrics, "rank": float(new_rank)},
        )

    def pruned_rank(self, tensors: Tensors, rank: int) -> int:
        cfg = self.cfg
        return pruned_rank(pairs(tensors), rank, cfg.gamma, cfg.r_min, cfg.prune_ratio, cfg.prune_rule)

    def readout(self, result: FitResult) -> dict[str, float]:
        return {"rank": float(rank_of(result.uplink))}

    def own_state(self, received: Tensors, personal: Tensors) -> Tensors:
        """The client's own model: its last trained adapter (and head) plus personal
        parameters; before it first trains, the truncated global adapter it received."""
        own = {n.removeprefix(OWN): t for n, t in personal.items() if n.startswith(OWN)}
        return {**own, **self.params_of(personal)} if own else self.truncated_global(received, personal)

    def truncated_global(self, received: Tensors, personal: Tensors) -> Tensors:
        return {**pad(received, self.cfg.lora.r), **self.params_of(personal)}

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        """The client's own adapter (``personal_model: own``) or the truncated global one."""
        if self.cfg.personal_model == "own":
            return self.own_state(received, personal)
        return self.truncated_global(received, personal)

    def extra_eval_states(self, model, received: Tensors, personal: Tensors, client: ClientData) -> dict:
        if self.cfg.personal_model == "own":
            return {"global": self.truncated_global(received, personal)}
        return {"own": self.own_state(received, personal)}
