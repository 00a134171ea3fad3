"""The run loop, written once: every engine's rounds, from the first or a checkpoint to the last.

    start       a fresh state (the method's ``init_server``), or a checkpoint's: the newest
                that reads (``--resume``) or round N's (``--resume-from N``); the method's
                join message applied to the server's backbone
    each round  begin (:class:`~fedpeft.engines.round.ServerRound`) -> the backend's fit ->
                the round pipeline's finish, or a skipped round -> evaluation every
                ``eval.every`` rounds and in the last -> the record -> the checkpoint ->
                the callback

A round whose clients sent back fewer than ``deploy.min_results`` updates keeps the
global state and is recorded as skipped; ``deploy.max_skipped_rounds`` such rounds in a
row stop the run (:class:`SkippedRoundsError`), which ``--resume`` continues. A round in
which Poisson sampling drew no client is skipped too, by design, and does not count.

What differs between engines is a :class:`Backend`: how a round's clients are reached
and their updates come back, how clients are scored, what a checkpoint holds besides the
server state and the records. The in-process engine (its ranks included) and Flower's
ServerApp are backends (docs/architecture.md, "The run loop, written once").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch

from fedpeft.engines.checkpoint import Checkpoint, Checkpoints, ResumeError
from fedpeft.engines.distributed import Ranks
from fedpeft.engines.round import Returned, Round, ServerRound, close_record
from fedpeft.methods.base import Method, ServerState, Tensors

#: the reason a round in which Poisson sampling drew nobody is skipped
NOBODY_DRAWN = "no client drawn (train.client_sampling: poisson)"


class SkippedRoundsError(RuntimeError):
    """``deploy.max_skipped_rounds`` rounds in a row had too few updates to aggregate."""


class Fitted(NamedTuple):
    """A round's training as a backend returns it: the server state the round goes on from
    (a deployment's may note who holds which client, DP-SGD's accountant), the updates as
    the server decoded them, the round's record so far, and the clients behind the updates
    when they outnumber them (SecAgg+ returns their mean as one; None: one each)."""

    server: ServerState
    returned: list[Returned]
    record: dict
    count: int | None = None


class Backend(Protocol):
    """What an engine does its own way; :class:`RunLoop` does the rest."""

    method: Method
    model: torch.nn.Module  # the server's backbone (the join message is applied to it)
    rounds: ServerRound  # the server's half of every round
    ranks: Ranks | None  # several processes sharing the rounds (None: one)
    setup_info: dict[str, float]  # one-time figures, recorded with round 1
    server: ServerState | None  # the newest global state (the last good one if a round fails)

    def load_checkpoint(self, checkpoints: Checkpoints, resume_from: int | None) -> Checkpoint:
        """The checkpoint to go on from (the newest that reads, or round ``resume_from``'s),
        with what the backend keeps besides the server state taken back from it."""
        ...

    def fresh(self) -> None:
        """Start with no state of an earlier run."""
        ...

    def prepare(self, server: ServerState) -> None:
        """Once the run's state is known, before its first round (probes, waiting for nodes)."""
        ...

    def fit(self, server: ServerState, step: Round) -> Fitted:
        """Round ``step``'s training: the clients drawn, their updates back."""
        ...

    def evaluate(self, server: ServerState, rnd: int, final: bool) -> dict:
        """The round's scores (``final``: the run's last round)."""
        ...

    def amend(self, record: dict) -> None:
        """The backend's last word on the round's record, once it is evaluated."""
        ...

    def held(self) -> tuple[dict[int, Tensors] | object, list[int]]:
        """What a checkpoint holds besides the server state and the records: the clients'
        personal states (or their store) and the clients that received the join message."""
        ...

    def settle(self) -> None:
        """The end of a round of which this process wrote no checkpoint."""
        ...


@dataclass
class RunLoop:
    """The rounds of one run over ``backend``: ``rounds`` in all, evaluated every
    ``eval_every``, skipping a round with fewer than ``min_results`` updates and stopping
    after ``max_skipped_rounds`` such rounds in a row (``hint``: what to do then)."""

    backend: Backend
    rounds: int
    eval_every: int = 1
    min_results: int = 1
    max_skipped_rounds: int = 3
    checkpoints: Checkpoints | None = None
    fingerprint: str = ""
    on_start: Callable[[list[dict]], None] = lambda records: None
    on_round: Callable[[dict], None] = lambda record: None
    log: Callable[[str], None] = lambda line: None
    hint: str = "Rerun with --resume to go on."
    skipped: int = field(default=0, init=False)  # rounds skipped in a row

    @property
    def leader(self) -> bool:
        """Whether this process writes the run's files (one process, or rank 0)."""
        return self.backend.ranks is None or self.backend.ranks.leader

    def start(self, resume: bool, resume_from: int | None = None) -> tuple[ServerState, list[dict]]:
        """The server state and records to continue from (a checkpoint's, with ``resume``
        or ``resume_from``), or the method's initial state; the join message applied."""
        b = self.backend
        if resume or resume_from is not None:
            if self.checkpoints is None:
                raise ResumeError("--resume needs checkpoints, but the config sets checkpoint: false")
            ckpt = b.load_checkpoint(self.checkpoints, resume_from)
            server, records = ckpt.server, ckpt.records
        else:
            b.fresh()
            if self.checkpoints is not None and self.leader:
                self.checkpoints.clear()
            if b.ranks is not None:
                b.ranks.barrier()  # nothing of this run is written before every rank has started
            t0 = time.perf_counter()
            server, records = b.method.init_server(b.model), []
            b.setup_info = {"time_init_server": time.perf_counter() - t0, **b.method.setup_info}
        # Every client applies the join message to its backbone; the server's copy too.
        b.method.join(b.model, b.method.join_message(server))
        b.prepare(server)
        return server, records

    def run(self, resume: bool = False, resume_from: int | None = None) -> list[dict]:
        """Every round still to run; returns the records of all rounds. A round in which
        every client diverges, or whose aggregate is not finite, stops the run with
        :class:`~fedpeft.engines.guard.DivergedError` (the backend's ``server`` is then the
        last good state)."""
        b = self.backend
        server, records = self.start(resume, resume_from)
        b.server = server
        self.on_start(records)
        for rnd in range(len(records) + 1, self.rounds + 1):
            step = b.rounds.begin(rnd, server)
            t0 = time.perf_counter()
            server, returned, record, count = b.fit(server, step)
            t1 = time.perf_counter()
            skip = self.why_skipped(rnd, record, count if count is not None else len(returned))
            server = b.rounds.finish(step, server, returned, record, records, skip=skip, count=count)
            t2 = time.perf_counter()
            if rnd % self.eval_every == 0 or rnd == self.rounds:
                record.update(b.evaluate(server, rnd, final=rnd == self.rounds))
            b.amend(record)
            record = close_record(rnd, record, records, (t0, t1, t2, time.perf_counter()), b.setup_info)
            records.append(record)
            if self.checkpoints is not None and self.leader:
                personal, joined = b.held()
                self.checkpoints.save(Checkpoint(rnd, self.fingerprint, server, personal, records, joined))
            else:
                b.settle()
            b.server = server
            self.on_round(record)
            if self.skipped >= self.max_skipped_rounds:
                raise SkippedRoundsError(
                    f"{self.skipped} consecutive rounds skipped (deploy.max_skipped_rounds="
                    f"{self.max_skipped_rounds}); last: {record['skipped']}. {self.hint}"
                )
        return records

    def why_skipped(self, rnd: int, record: dict, updates: int) -> str | None:
        """Why round ``rnd`` aggregates nothing (None: it aggregates), counting the rounds
        skipped in a row for too few updates."""
        if not record["clients"]:  # Poisson sampling may draw nobody: by design, not counted
            return NOBODY_DRAWN
        if updates >= self.min_results:
            self.skipped = 0
            return None
        self.skipped += 1
        why = f"{updates} of deploy.min_results={self.min_results} updates"
        self.log(f"round {rnd}: skipped, {why}; the global state is unchanged")
        return why
