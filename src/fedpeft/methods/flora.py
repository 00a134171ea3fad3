"""FLoRA: clients of any rank; the server stacks their LoRA factors, so that the product of
the stacks is exactly the weighted sum of the clients' updates; every client merges it
into its frozen weights and starts a fresh LoRA each round.

Paper: Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with
Heterogeneous Low-Rank Adaptations", NeurIPS 2024 (docs/lora_family.md states it, with
where fedpeft departs; the authors' code, ATP-1010/FederatedLLM, was read for the
stacking).

Round ``t``: client ``k`` (rank ``r_k``, ``method.ranks``) merges what it has not merged
yet into its frozen weights, draws a fresh LoRA (``A`` Kaiming-uniform as PEFT's, from
its own seeded stream; ``B = 0``), trains it and sends ``A_k, B_k`` at its rank and the
head. The server stacks, per adapted module, ``A_t = [p_1 A_1; ...; p_K A_K]`` (rows) and
``B_t = [B_1, ..., B_K]`` (columns), ``p_k = |D_k| / sum |D|``, so ``s B_t A_t = sum_k p_k
s B_k A_k`` exactly (the authors weight ``A``), merges it into its own copy of the frozen
weights (the global model: those weights, no LoRA) and averages the head.

**What travels down.** In the paper the stack of the last round goes to every client,
every round (the authors call that a limitation). fedpeft sends each client, when it is
next picked, the stacks of every round since it last trained (``stack.<round>.<module>``,
tagged by round; the client merges those it lacks, in order), or, when they would be
larger, the server's merged weights themselves (``merged.<module>``, which replace the
client's): the same weights at the same rounds, counted as sent. The server keeps only the
stacks some client could still need that way (newest first, while their sum is smaller
than the dense weights). The downlink grows with the clients of each round: the bytes
records show it.

Each client keeps its merged frozen weights in its personal state (``frozen.<module>``,
never sent; one dense matrix per adapted module and client, on the client store's disk)
with the round it merged up to (``own.merged_round``).
"""

from __future__ import annotations

import math

import torch

from fedpeft.config.methods.flora import FLoRAConfig
from fedpeft.engines.local import OPT, OWN, GradientFn, Start, group_backprop, optimizer_state
from fedpeft.methods.base import (
    ClientData,
    FitResult,
    Job,
    ServerState,
    Tensors,
    local_steps,
    read_tensors,
)
from fedpeft.methods.fedavg import FedAvgPeft
from fedpeft.methods.lora_ranks import client_rank, is_a, is_b, pad, padded_uplink, truncate
from fedpeft.methods.registry import register_method
from fedpeft.peft.lora import LoraTerm, full_rank_terms, lora_layers

STACK, MERGED = "stack.", "merged."
#: a client's personal copy of its merged frozen weights: own.<frozen weight's name>
FROZEN = OWN
#: a client's personal entry: the last round whose stack it has merged (0: none)
FROZEN_ROUND = OWN + "merged_round"
#: the server's extras: the last round whose stack client ``<cid>`` has merged, and the
#: last round merged into the server's weights
SEEN, LAST = "seen.", "merged_round"
PRUNED = "pruned_round"  # the newest round whose stack the server no longer keeps (0: none)


def stack(
    results: list[FitResult], weights: torch.Tensor, a: str, b: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A_t, B_t)`` of one module: the clients' ``p_k A_k`` stacked by rows and their
    ``B_k`` by columns, so that ``B_t A_t = sum_k p_k B_k A_k`` (float64)."""
    rows = [w * r.uplink[a].double() for w, r in zip(weights, results, strict=True)]
    return torch.cat(rows), torch.cat([r.uplink[b].double() for r in results], dim=1)


@register_method(FLoRAConfig)
class FLoRA(FedAvgPeft):
    kind = "lora"
    refuses = {
        "dora": "each round merges the clients' stacked LoRA into the frozen weight and starts a fresh one; "
        "under DoRA the model is a magnitude times a normalised direction, so that merge would not be the "
        "clients' weighted update",
        "server_step": "its clients restart LoRA every round from the merged weights; there are no factors "
        "to step",
        "lossy_downlink": "each client merges the stacks it receives into its own frozen weights for the "
        "rest of the run, so the rounding would add up round after round and the client's model would leave "
        "the server's",
        "local_dp": "its clients send a fresh LoRA's factors each round, not updates of tensors they "
        "received",
        "robust": "its server stacks every client's factors into the merged weights, not a mean of them",
        "secure_aggregation": "its server stacks every client's factors into the merged weights, not a mean "
        "of them",
    }

    # ----- messages: the merged frozen weights, handed to clients with the shared tensors; an
    # update of a client's own rank zero-padded to the largest
    def server_frozen_names(self) -> list[str]:
        return [w for w, *_ in self.modules.values()]

    def uplink_as_shared(self, uplink: Tensors) -> Tensors:
        return padded_uplink(uplink, self.cfg.lora.r)

    def prepare(self, model) -> None:
        if any(not p.is_floating_point() for p in model.parameters()):
            raise ValueError(
                "method flora merges each round's stacked update into the frozen weights, which a quantised "
                "backbone (model.quantization) cannot hold: use model.quantization none"
            )
        super().prepare(model)
        #: per adapted module: its frozen weight's name, A's, B's, and LoRA's scale s
        self.modules = {
            name: (
                f"{name}.base_layer.weight",
                f"{name}.lora_A.default.weight",
                f"{name}.lora_B.default.weight",
                layer.scaling["default"],
            )
            for name, layer in lora_layers(model).items()
        }
        #: the shapes of every A and B at r_max (a model with no LoRA holds zeros of them)
        self.lora_shapes = {
            n: t.shape for n, t in read_tensors(model, self.shared_names).items() if is_a(n) or is_b(n)
        }
        frozen = read_tensors(model, [w for w, *_ in self.modules.values()])
        self.pretrained = {n: t.float() for n, t in frozen.items()}  # W0

    def rank(self, cid: int) -> int:
        return client_rank(self.cfg.ranks, cid, self.seed, self.cfg.lora.r)

    # ----- server: the merged frozen weights (the global model), the head, the stacks' log
    def init_server(self, model) -> ServerState:
        tensors = read_tensors(model, self.shared_names)
        for _, a, b, _ in self.modules.values():
            tensors[a], tensors[b] = torch.zeros_like(tensors[a]), torch.zeros_like(tensors[b])
        return ServerState({**tensors, **dict(self.pretrained)})

    def aggregate(self, server: ServerState, results: list[FitResult], rnd: int) -> ServerState:
        weights = torch.tensor([float(r.num_examples) for r in results], dtype=torch.float64)
        weights /= weights.sum()
        uplinks = [pad(r.uplink, self.cfg.lora.r) for r in results]
        rest = [{n: t for n, t in u.items() if not (is_a(n) or is_b(n))} for u in uplinks]
        tensors, extras = dict(server.tensors), dict(server.extras)
        if PRUNED not in extras:  # the first aggregate: none; a checkpoint from before the
            # mark: every round before its oldest stack, as far as it can tell
            extras[PRUNED] = torch.tensor(
                [float(min(stack_rounds(extras), default=1) - 1 if LAST in extras else 0)]
            )
        if rest[0]:
            tensors.update(self.mean(rest, [r.num_examples for r in results]))
        for w, a, b, scale in self.modules.values():
            a_t, b_t = stack(results, weights, a, b)
            tensors[w] = (tensors[w].double() + scale * b_t @ a_t).to(tensors[w].dtype)
            extras[f"{STACK}{rnd}.{a}"], extras[f"{STACK}{rnd}.{b}"] = a_t.float(), b_t.float()
        for r in results:  # each merged every stack before this round's
            extras[f"{SEEN}{r.cid}"] = torch.tensor([float(rnd - 1)])
        extras[LAST] = torch.tensor([float(rnd)])
        return ServerState(tensors, prune_stacks(extras, self.dense_bytes()))

    def dense_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.pretrained.values())

    def downlink(self, server: ServerState, cid: int) -> Tensors:
        """The head, and what client ``cid`` lacks of the frozen weights: the stacks of the
        rounds since it last trained, or the merged weights when smaller (or when a stack
        it lacks is no longer kept)."""
        head = {
            n: t for n, t in server.tensors.items() if n in self.shared_names and not (is_a(n) or is_b(n))
        }
        seen = int(server.extras[f"{SEEN}{cid}"]) if f"{SEEN}{cid}" in server.extras else 0
        last = int(server.extras[LAST]) if LAST in server.extras else 0
        stacks = {n: t for n, t in server.extras.items() if n.startswith(STACK) and round_of(n) > seen}
        if PRUNED in server.extras:  # pruning drops the oldest stacks: none it dropped is missed
            complete = int(server.extras[PRUNED]) <= seen
        else:  # a checkpoint from before the mark: every round since `seen` left a stack
            complete = {round_of(n) for n in stacks} == set(range(seen + 1, last + 1))
        if complete and sum(t.numel() * 4 for t in stacks.values()) <= self.dense_bytes():
            return {**head, **stacks}
        merged = {MERGED + w: server.tensors[w] for w, *_ in self.modules.values()}
        return {**head, **merged, f"{MERGED}round": torch.tensor([float(last)])}

    # ----- client
    def init_client(self, model, initial: Tensors, client: ClientData) -> Tensors:
        """Every client starts from the pretrained weights, having merged nothing."""
        return {
            **super().init_client(model, initial, client),
            **{FROZEN + n: t.clone() for n, t in self.pretrained.items()},
            FROZEN_ROUND: torch.zeros(1),
        }

    def frozen_weights(self, received: Tensors, personal: Tensors) -> tuple[Tensors, float]:
        """The client's frozen weights after merging what it received that it lacks, and the
        round it has merged up to."""
        done = float(personal[FROZEN_ROUND])
        weights = {n: personal[FROZEN + n] for n in self.pretrained}
        if f"{MERGED}round" in received:
            weights = {n: received[MERGED + n] for n in self.pretrained}
            done = float(received[f"{MERGED}round"])
        for rnd in sorted({round_of(n) for n in received if n.startswith(STACK)}):
            if rnd <= done:
                continue  # merged already (a stack sent again)
            weights = {
                w: (weights[w].double() + scale * received[f"{STACK}{rnd}.{b}"].double()
                    @ received[f"{STACK}{rnd}.{a}"].double()).to(weights[w].dtype)
                for w, a, b, scale in self.modules.values()
            }  # fmt: skip
            done = float(rnd)
        return weights, done

    def fresh_lora(self, rank: int, generator: torch.Generator) -> Tensors:
        """LoRA as PEFT starts it, at ``rank`` inside ``r_max``: ``A`` Kaiming-uniform (PEFT's
        ``a = sqrt(5)``: bound ``1 / sqrt(d_in)``) on its first ``rank`` rows, zero elsewhere;
        ``B = 0``."""
        out = {}
        for w, a, b, _ in self.modules.values():
            d_out, d_in = self.pretrained[w].shape
            bound = 1 / math.sqrt(d_in)
            rows = (torch.rand(rank, d_in, generator=generator, dtype=torch.float64) * 2 - 1) * bound
            out[a] = pad({a: rows.float()}, self.cfg.lora.r)[a]
            out[b] = torch.zeros(d_out, self.cfg.lora.r)
        return out

    def cohort_start(self, model, job: Job) -> Start:
        weights, _ = self.frozen_weights(job.received, job.personal)
        head = {n: t for n, t in job.received.items() if n in self.shared_names}
        fresh = self.fresh_lora(self.rank(job.client.cid), job.generator())
        params = {**head, **fresh, **self.params_of(job.personal), **weights}
        opt = optimizer_state(job.personal, {n: params[n] for n in self.optimised_names()}, job.context.train)
        return Start(params, opt, {}, local_steps(len(job.client.train), job.context.train))

    def step_gradients(self, model) -> GradientFn:
        return group_backprop(model, set(self.optimised_names()))

    def cohort_finish(self, job: Job, params: Tensors, opt: Tensors, metrics: dict[str, float]) -> FitResult:
        """The fresh LoRA, trained, up at the client's rank (with the head); the merged
        frozen weights stay with the client. A kept optimizer state would belong to a LoRA
        that is gone next round: only the head's is kept."""
        rank = self.rank(job.client.cid)
        _, done = self.frozen_weights(job.received, job.personal)
        kept = {}
        if job.context.train.optimizer_state == "keep":
            kept = {OPT + k: v for k, v in opt.items() if not any(x in k for x in (".lora_A.", ".lora_B."))}
        return FitResult(
            uplink=truncate({n: params[n] for n in self.shared_names}, rank),
            personal={
                **{n: params[n] for n in self.personal_names},
                **{FROZEN + n: params[n] for n in self.pretrained},
                FROZEN_ROUND: torch.tensor([done]),
                **kept,
            },
            num_examples=len(job.client.train),
            metrics={**metrics, "rank": float(rank)},
        )

    def eval_state(self, model, received: Tensors, personal: Tensors, client: ClientData) -> Tensors:
        """The client's merged frozen weights with the head and, where ``received`` holds
        them (a model just trained), its LoRA; else no LoRA (``B = 0``): the global model."""
        weights, _ = self.frozen_weights(received, personal)
        lora = {n: received.get(n, torch.zeros(shape)) for n, shape in self.lora_shapes.items()}
        head = {n: t for n, t in received.items() if n in self.shared_names and n not in lora}
        return {**head, **lora, **self.params_of(personal), **weights}

    def readout(self, result: FitResult) -> dict[str, float]:
        return {"rank": float(next(t.shape[0] for n, t in result.uplink.items() if is_a(n)))}

    # ----- export: the merged weights as one full-rank term on W0
    def lora_terms(self, model, tensors: Tensors) -> dict[str, list[LoraTerm]]:
        """``s B A`` (zero in the global model) and ``W - W0``, the updates merged so far, as a
        term of rank ``min(d_out, d_in)`` (its SVD), zero-padded to one rank for all modules:
        on the pretrained backbone, the trained model."""
        terms = super().lora_terms(model, tensors)
        merged = {
            name: tensors[w].double() - self.pretrained[w].double() for name, (w, *_) in self.modules.items()
        }
        for name, term in full_rank_terms(merged).items():
            terms[name].append(term)
        return terms


def round_of(name: str) -> int:
    """The round of a ``stack.<round>.<tensor>`` entry."""
    return int(name.removeprefix(STACK).split(".", 1)[0])


def stack_rounds(extras: Tensors) -> list[int]:
    return sorted({round_of(n) for n in extras if n.startswith(STACK)})


def prune_stacks(extras: Tensors, dense: int) -> Tensors:
    """``extras`` without the stacks no client would be sent: keeping the newest rounds
    while their stacks together stay within ``dense`` bytes (a client lacking more gets
    the merged weights); :data:`PRUNED` marks the newest round dropped (a round that drew
    no client leaves no stack, and is not a gap)."""
    kept, total = set(), 0
    for rnd in reversed(stack_rounds(extras)):
        size = sum(t.numel() * 4 for n, t in extras.items() if n.startswith(STACK) and round_of(n) == rnd)
        if total + size > dense:
            break
        kept.add(rnd)
        total += size
    pruned = max([int(extras[PRUNED]) if PRUNED in extras else 0, *(set(stack_rounds(extras)) - kept)])
    out = {n: t for n, t in extras.items() if not n.startswith(STACK) or round_of(n) in kept}
    return {**out, PRUNED: torch.tensor([float(pruned)])}
