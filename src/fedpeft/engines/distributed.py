"""Rounds over ``torch.distributed`` ranks (``fedpeft run --nproc N``, or ``torchrun``).

Every rank builds the same experiment (one config and seed: the same backbone, clients
and initial adapters) and runs the same rounds:

1. every rank draws the same clients (the seeded sampler) and takes its share of them,
   dealt by cost (a client's rows a step times its steps; the costliest first, each to
   the least loaded rank: :func:`shares`);
2. it trains its share in cohorts, as one process would (``InProcessEngine``);
3. the clients' updates meet: where the server takes their weighted mean and nothing
   else (:func:`summable`), one all-reduce of each rank's weighted sum (float64), the
   mean standing for the round's clients as one update; otherwise one all-gather of the
   updates as the server receives them, put back in the order the clients were drawn.
   Every rank runs the one round pipeline (``engines/round.py``) on the same inputs in
   the same order: the server state is the same on every rank without being sent, and
   the server's noise (user-level DP) is one draw from the run's seed, the same on each,
   never a draw per rank.

A client's personal state stays with the rank that trained it: it is written to the
run's client store (``output_dir/clients``, which every rank must see: checked as the
run starts), and the ranks exchange the store's index entries of the clients they
trained. Rank 0 alone keeps the index (on disk, commit by commit) and hands every rank
the entries of the clients it is to train or score, so whichever rank draws a client
next reads its state from there. Each rank scores a contiguous slice of the clients, does
its part of scoring the global test set (``fedpeft.metrics.scorers``) and measures the
client drift (``eval.drift``) of the clients it trained; only rank 0 writes the run's
records, checkpoints, exports, plots and trackers. A checkpoint does not depend on the
number of ranks, so a run resumes with any ``--nproc``.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from fedpeft.engines.round import Returned
from fedpeft.methods.base import ClientData, FitResult, Method, local_steps
from fedpeft.methods.capabilities import refusal

if TYPE_CHECKING:
    from fedpeft.config import ServerConfig, TrainConfig
    from fedpeft.engines.store import ClientStore

T = TypeVar("T")


class RanksError(RuntimeError):
    """The ranks of a run cannot work together; the message says why and what to change."""


@dataclass
class Share:
    """What one rank's share of a round's clients brings back: their updates as the server
    receives them, and the round's figures of them."""

    returned: list[Returned] = field(default_factory=list)
    #: the clients' results as the round's records read them (their uplinks left out),
    #: where ``returned`` is their weighted mean (:meth:`Ranks.combine` ``summed``)
    reported: list[FitResult] | None = None
    fit_times: list[float] = field(default_factory=list)
    readouts: dict[str, dict] = field(default_factory=dict)
    dropped: dict[int, str] = field(default_factory=dict)
    down: int = 0
    up: int = 0


@dataclass(frozen=True)
class Ranks:
    """This process's place among the run's ranks (``torch.distributed``'s group)."""

    rank: int
    world: int
    local_rank: int

    @property
    def leader(self) -> bool:
        """Rank 0: the one that writes."""
        return self.rank == 0

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order, on every rank (picklable, on the CPU)."""
        out: list = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def from_leader(self, make: Callable[[], T]) -> T:
        """``make()`` run on rank 0, its value handed to every rank (picklable)."""
        box = [make() if self.leader else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def leader_first(self, run: Callable[[], T], others: Callable[[], T]) -> T:
        """``run()`` on rank 0, then ``others()`` on the other ranks once it is done (what
        rank 0 changes on the shared disk, the others then read)."""
        if self.leader:
            out = run()
            self.barrier()
            return out
        self.barrier()
        return others()

    def check_shared(self, directory: Path) -> None:
        """That ``directory`` is one filesystem every rank sees (the client store and the
        checkpoints live there): rank 0 writes a token, every rank reads it."""
        token = self.gather(uuid.uuid4().hex if self.leader else None)[0]
        path = directory / f".ranks-{token}"
        if self.leader:
            directory.mkdir(parents=True, exist_ok=True)
            path.write_text(token)
        self.barrier()
        seen = path.is_file() and path.read_text() == token
        everyone = self.gather(seen)
        self.barrier()
        if self.leader:
            path.unlink(missing_ok=True)
        if not all(everyone):
            blind = [r for r, ok in enumerate(everyone) if not ok]
            raise RanksError(
                f"output_dir {directory}: rank(s) {blind} cannot see what rank 0 writes there; the clients' "
                "states and the checkpoints live in it, so it must be a filesystem every rank mounts"
            )

    # ----- a round over ranks
    def mine(self, sampled: Sequence[int], costs: Sequence[float]) -> list[int]:
        """This rank's clients of ``sampled`` (each with its cost), in the order drawn."""
        return [sampled[i] for i in shares(costs, self.world)[self.rank]]

    def combine(
        self,
        share: Share,
        sampled: Sequence[int],
        store: ClientStore,
        device: torch.device,
        weight: Callable[[FitResult], float] | None = None,
    ) -> Share:
        """Every rank's share of the round as one: the updates in the order the clients
        were drawn (on ``device``), the figures summed (bytes) or joined; and ``store``'s
        index brought up to date with the clients the other ranks trained.

        ``weight`` (a server that takes the weighted mean of the uplinks and nothing else,
        :func:`summable`): instead of every update, their mean by ``weight``, from one
        all-reduce of each rank's weighted sum in float64 (so the order of the ranks
        changes it by rounding at most), as one update; the clients' results without their
        uplinks in ``reported``."""
        mine = sorted({r.result.cid for r in share.returned} | set(share.dropped))
        entries = store.publish(mine)
        if weight is None:
            sent = replace(
                share, returned=[_on(r, torch.device("cpu"), personal=False) for r in share.returned]
            )
        else:
            bare = [replace(r.result, uplink={}, personal={}, control={}) for r in share.returned]
            sent = replace(share, returned=[], reported=bare)
        # the uplinks' names, shapes and dtypes (for a summing rank that trained no client)
        spec = (
            {n: (t.shape, t.dtype) for n, t in share.returned[0].result.uplink.items()}
            if share.returned
            else None
        )
        everyone = self.gather((sent, entries, spec))
        gathered = [(s, e) for s, e, _ in everyone]
        for rank, (_, theirs) in enumerate(gathered):
            if rank != self.rank:
                store.adopt(theirs)
        order = {cid: i for i, cid in enumerate(sampled)}
        if weight is None:
            returned, reported = [_on(r, device) for s, _ in gathered for r in s.returned], None
        else:
            reported = sorted((r for s, _ in gathered for r in s.reported), key=lambda r: order[r.cid])
            spec = next((spec for _, _, spec in everyone if spec is not None), None)
            returned = self._mean(share.returned, reported, spec, weight, device)
        return Share(
            sorted(returned, key=lambda r: order[r.result.cid]),
            reported,
            [t for s, _ in gathered for t in s.fit_times],
            {k: v for s, _ in gathered for k, v in s.readouts.items()},
            {k: v for s, _ in gathered for k, v in s.dropped.items()},
            sum(s.down for s, _ in gathered),
            sum(s.up for s, _ in gathered),
        )

    def _mean(
        self,
        mine: list[Returned],
        everyone: list[FitResult],
        spec: dict[str, tuple[torch.Size, torch.dtype]] | None,
        weight: Callable[[FitResult], float],
        device: torch.device,
    ) -> list[Returned]:
        """The weighted mean of every rank's uplinks (``mine``: this rank's; ``everyone``:
        all the round's results, in the order drawn; ``spec``: the uplinks' names, shapes and
        dtypes) as one update, standing for the first client drawn; none when no rank has one."""
        if spec is None:
            return []
        names = sorted(spec)
        sizes = [math.prod(spec[n][0]) for n in names]
        on = device if dist.get_backend() == "nccl" else torch.device("cpu")
        total = torch.zeros(sum(sizes) + 1, dtype=torch.float64, device=on)  # the sums, then the weights'
        for r in mine:
            w = weight(r.result)
            total[:-1] += torch.cat([r.result.uplink[n].to(on, torch.float64).flatten() for n in names]) * w
            total[-1] += w
        dist.all_reduce(total)
        mean = (total[:-1] / total[-1]).split(sizes)
        uplink = {
            n: part.view(spec[n][0]).to(device, spec[n][1]) for n, part in zip(names, mean, strict=True)
        }
        first = everyone[0]
        return [Returned(FitResult(uplink, {}, first.num_examples, first.metrics, first.cid), {})]


def summable(method: Method, server: ServerConfig, privacy_mode: str) -> str:
    """Why the ranks of a run must gather every update rather than sum them ("" when they
    may sum: the server takes the weighted mean of the uplinks and nothing else)."""
    if why := refusal(method, "secure_aggregation"):
        return f"method {method.name}: {why}"
    if server.aggregation != "mean":
        return f"server.aggregation {server.aggregation}: needs each update"
    if privacy_mode in ("user", "local"):
        return f"privacy.mode {privacy_mode}: the server clips and counts each update"
    if method.train.correction == "scaffold":
        return "train.correction scaffold: the server sums each client's control update"
    return ""


def shares(costs: Sequence[float], world: int) -> list[list[int]]:
    """Indices ``0..len(costs)-1`` dealt to ``world`` ranks, balanced by cost: the costliest
    first, each to the rank with the least cost so far (the lower rank on a tie); each
    rank's indices in order. (Graham's longest-processing-time rule: the most loaded rank
    carries at most 4/3 of the best split's most loaded one.)"""
    loads, out = [0.0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        out[rank].append(i)
        loads[rank] += costs[i]
    return [sorted(s) for s in out]


def client_cost(client: ClientData, train: TrainConfig) -> float:
    """What a client's local round costs, to balance the ranks' shares: the rows of a step
    times its steps (``train``'s batch and local steps or epochs)."""
    rows = len(client.train)
    return float(min(train.batch_size, rows) * local_steps(rows, train))


def _on(returned: Returned, device: torch.device, personal: bool = True) -> Returned:
    """``returned`` with its tensors on ``device`` (without the client's personal state
    unless ``personal``: it stays with the rank that trained the client)."""
    r = returned.result
    move = lambda tensors: {n: t.to(device) for n, t in tensors.items()}  # noqa: E731
    result = replace(
        r, uplink=move(r.uplink), personal=move(r.personal) if personal else {}, control=move(r.control)
    )
    return replace(returned, result=result, reference=move(returned.reference))


def joined() -> Ranks | None:
    """The ranks this process is one of, when a launcher started several (``WORLD_SIZE``
    above 1: ``torchrun``, ``fedpeft run --nproc``), after joining their process group
    (each rank on ``cuda:LOCAL_RANK`` modulo the GPUs there are; :func:`backend`);
    None for a process on its own."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local % torch.cuda.device_count())
        # the launcher's store outlives a restart: the group's keys (each rank's address)
        # live under this attempt's prefix, or a restarted rank could read a dead one's
        store, rank, world = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"fedpeft/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        dist.init_process_group(backend(local_world), store=store, rank=rank, world_size=world)
    return Ranks(dist.get_rank(), dist.get_world_size(), local)


def backend(local_world: int) -> str:
    """The process group's backend for ``local_world`` ranks on this machine: NCCL where
    each has a GPU of its own; gloo on CPUs, and where ranks share a GPU (NCCL refuses two
    ranks on one device), the exchange then passing through host memory."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus and local_world <= gpus else "gloo"
