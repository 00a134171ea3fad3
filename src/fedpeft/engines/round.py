"""One federated round's pipeline: the order every engine runs a round's messages in.

The uplink's order is part of the design (docs/architecture.md, "One round, written
once"): the guarantees of differential privacy, compression and the server's
optimiser each hold only in it. It is written here once; an engine owns only how its
clients are reached and how their replies come back.

    the client  (:func:`send`)
        its trained uplink -> clipped to the round's bound, noised in ``local`` mode
        (``privacy.*``) -> encoded as an update of what it received (``comm.uplink``)

    the server  (:func:`receive`, then :meth:`ServerRound.finish`)
        decoded onto what it sent -> its noise on the sum (``privacy.mode user``) ->
        the method's aggregate (``server.weighting``) -> the server optimiser
        (``server.optimizer``) -> the next clip bound (adaptive clipping) -> SCAFFOLD's
        control -> the guard (a non-finite aggregate stops the run) -> the round's
        records (its rate, its privacy, the analyzers' figures)

A round that aggregates nothing (Poisson sampling drew no client; a deployment heard
from fewer than ``deploy.min_results``) keeps the global state as it is and says why.

Engines differ in one thing the pipeline is told rather than guesses: whether a
client's control update can be lost on its way (``confirms_controls``). Over a network
a reply can be lost or refused after the client moved its SCAFFOLD control, so the
server records which rounds' control updates it applied and tells the client
(:mod:`fedpeft.engines.scaffold`); in one process nothing is lost between a client and
the server, and clients keep their controls at once.

Every engine also draws a round's clients (:func:`sample_clients`) and writes its
training record (:func:`fit_record`) here; the run loop completes it (:func:`close_record`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fedpeft.config import CodecConfig, PrivacyConfig, ServerConfig, TrainConfig
from fedpeft.engines import compress, guard, lr_schedule, privacy, scaffold
from fedpeft.engines.local import derive_seed
from fedpeft.engines.server_opt import as_weighted, server_step
from fedpeft.methods.base import FitResult, Method, ServerState, Tensors

#: user- and local-level DP: the clients clip their updates, the accountant counts rounds
CLIPPED_MODES = ("user", "local")


# ---------------------------------------------------------------- the client's side


@dataclass
class Outgoing:
    """A client's update as it leaves: the encoded ``message``, the ``residual`` it keeps
    (error feedback; empty without it) and whether its update fitted within the clip
    bound (the report adaptive clipping counts; True when nothing was clipped)."""

    message: Tensors
    residual: Tensors
    fitted: bool = True


def send(
    method: Method,
    privacy_cfg: PrivacyConfig,
    codec: CodecConfig,
    received: Tensors,
    uplink: Tensors,
    residual: Tensors,
    *,
    clip: float,
    sigma: float,
    seed: int,
) -> Outgoing:
    """The client's side of round's uplink: ``uplink`` (what it trained) clipped to ``clip``
    and, in ``local`` mode, noised at ``sigma`` (``privacy.*``), then encoded as an update
    of ``received`` plus the client's ``residual`` (``comm.uplink``). ``seed``: the
    client's round seed (:func:`~fedpeft.engines.local.derive_seed`)."""
    fitted = True
    if privacy_cfg.mode in CLIPPED_MODES:
        origin = privacy.reference(method, received, uplink)
        out = privacy.privatise(privacy_cfg, uplink, origin, clip, sigma, seed, method.name)
        uplink, fitted = out.uplink, out.fitted
    sent = compress.send_update(uplink, received, residual, codec, compress.message_seed(seed))
    return Outgoing(sent.message, sent.residual, fitted)


def receive(message: Tensors, sent: Tensors, codec: CodecConfig, seed: int) -> Tensors:
    """The server's side: a client's ``message`` decoded onto ``sent``, what the client
    received (``seed``: the client's round seed, as :func:`send` had it)."""
    return compress.receive_update(message, sent, codec, compress.message_seed(seed))


# ---------------------------------------------------------------- the server's side


@dataclass
class Round:
    """What round ``number`` runs under, fixed as it starts: its training settings (its rate
    under ``train.lr_schedule``), the clip bound its clients clip to, and the epsilon spent
    once it is released (user and local DP; None otherwise)."""

    number: int
    train: TrainConfig
    clip: float
    spent: float | None = None

    @property
    def lr(self) -> float:
        return self.train.lr


@dataclass
class Returned:
    """One client's decoded update, as the server aggregates it: the ``result`` (its uplink
    decoded), what it is an update of (``reference``: what the client received, with
    zeros for the method's messages) and, when the client reported it, whether its
    update fitted within the clip bound (adaptive clipping's report; None: not said)."""

    result: FitResult
    reference: Tensors
    fitted: bool | None = None


class ServerRound:
    """The server's half of every round, for one method and one run's settings.

    ``accountant``: user or local DP's (:func:`fedpeft.engines.privacy.accountant_for`);
    ``clients``: all N clients (SCAFFOLD's control moves by ``sum(dc_i) / N``);
    ``confirms_controls``: see the module's docstring; ``analyzers``: name -> f(previous
    global tensors, new ones), recorded every round that aggregates."""

    def __init__(
        self,
        method: Method,
        train: TrainConfig,
        server: ServerConfig,
        privacy_cfg: PrivacyConfig,
        *,
        seed: int,
        clients: int,
        accountant: privacy.Accountant | None = None,
        confirms_controls: bool = False,
        analyzers: dict[str, Callable[[Tensors, Tensors], dict]] | None = None,
    ):
        self.method, self.train, self.server_cfg, self.privacy = method, train, server, privacy_cfg
        self.seed, self.clients, self.accountant = seed, clients, accountant
        self.confirms_controls = confirms_controls
        self.analyzers = analyzers or {}
        #: privacy.mode sample: DP-SGD's accountant (the engine builds it from its clients)
        self.sample_accountant: privacy.SampleAccountant | None = None

    def begin(self, rnd: int, server: ServerState) -> Round:
        """Round ``rnd``'s settings; a :class:`~fedpeft.engines.privacy.PrivacyBudgetExceeded`
        when releasing it would spend more than the budget allows."""
        spent = None
        if self.accountant is not None and self.privacy.mode in CLIPPED_MODES:
            spent = privacy.check_budget(self.privacy, self.accountant, rnd)
        clip = privacy.current_clip(self.privacy, server)
        return Round(rnd, lr_schedule.for_round(self.train, rnd), clip, spent)

    def finish(
        self,
        step: Round,
        server: ServerState,
        returned: list[Returned],
        record: dict,
        done: list[dict],
        *,
        skip: str | None = None,
        count: int | None = None,
    ) -> ServerState:
        """The global state after round ``step``: ``returned`` aggregated in the pipeline's
        order, or ``server`` unchanged when the engine says why not (``skip``). Writes the
        round's figures into ``record`` (``done``: the records before it); ``count``: the
        clients behind ``returned`` when they outnumber its results (SecAgg+ returns their
        mean as one result)."""
        if lr_schedule.scheduled(self.train):
            record["lr"] = step.lr
        if self.sample_accountant is not None:  # what the clients' own DP-SGD steps spent
            record["privacy"] = privacy.sample_record(self.privacy, self.sample_accountant, done, record)
        if skip is not None:
            record["skipped"] = skip
            if self.privacy.mode in CLIPPED_MODES:  # released all the same: the unchanged model
                record["privacy"] = {"epsilon": step.spent, "delta": self.privacy.delta, "clip": step.clip}
            return server
        new = self._aggregate(step, server, returned, record, count)
        for name, analyze in self.analyzers.items():  # of what was aggregated: none in a skipped round
            record[name] = analyze(server.tensors, new.tensors)
        return new

    def _aggregate(
        self, step: Round, server: ServerState, returned: list[Returned], record: dict, count: int | None
    ) -> ServerState:
        results, next_clip = [r.result for r in returned], None
        if self.privacy.mode in CLIPPED_MODES:  # the server's noise, before the method aggregates
            results, noted, next_clip = self._noised(step, returned, count)
            record["privacy"] = {"epsilon": step.spent, "delta": self.privacy.delta, **noted}
        aggregated = self.method.aggregate(server, as_weighted(self.server_cfg, results), step.number)
        new = server_step(self.server_cfg, server, aggregated)
        if next_clip is not None:  # adaptive clipping's bound: server state, never sent
            new = privacy.with_clip(new, next_clip)
        if scaffold.enabled(self.method):
            updates = [r.control for r in results]
            new = scaffold.update_control(self.method, server, new, updates, self.clients)
            if self.confirms_controls:
                new = scaffold.mark_applied(new, [r.result.cid for r in returned], step.number)
        guard.check_aggregate(step.number, new, step.lr, server)
        return new

    def _noised(
        self, step: Round, returned: list[Returned], count: int | None
    ) -> tuple[list[FitResult], dict, float | None]:
        """The results after the server's side of ``privacy.mode``, its record (``clipped``
        only when every client said whether it fitted) and the next clip bound."""
        assert self.accountant is not None
        said = [r.fitted for r in returned]
        seed = derive_seed(self.seed, step.number, privacy.SERVER_STREAM)
        results, noted, next_clip = privacy.server_side(
            self.privacy,
            [r.result for r in returned],
            [r.reference for r in returned],
            [True if f is None else f for f in said],
            step.clip,
            self.accountant.per_round,
            self.accountant.sigma,
            seed,
            count,
        )
        if None in said:  # the count of clipped updates is not the server's to know
            noted.pop("clipped")
        return results, {"noise_multiplier": self.accountant.sigma, **noted}, next_clip


# ---------------------------------------------------------------- every engine's draws and records


#: The random stream of Poisson client sampling (beside ``[seed, rnd]``).
POISSON_STREAM = 0x504F4953


def poisson_rate(per_round: int, clients: int, poisson: bool) -> float | None:
    """Poisson sampling's rate q = S / M (``train.client_sampling: poisson``; M: all the
    experiment's clients, available or not), or None when a round draws exactly S."""
    return per_round / clients if poisson else None


def sample_clients(
    seed: int, rnd: int, population: int | Sequence[int], per_round: int, poisson_rate: float | None = None
) -> list[int]:
    """S client ids without replacement from ``population`` (M, meaning ids ``0..M-1``, or
    the ids available), reproducible from ``(seed, rnd)``. With all M ids available both
    forms draw the same clients. ``poisson_rate`` q: instead, each id independently with
    probability q (``train.client_sampling: poisson``; a round may draw none)."""
    ids = np.arange(population) if isinstance(population, int) else np.asarray(sorted(population))
    if poisson_rate is not None:
        rng = np.random.default_rng([seed, rnd, POISSON_STREAM])
        return [int(c) for c in ids[rng.random(len(ids)) < poisson_rate]]  # ids are sorted
    rng = np.random.default_rng([seed, rnd])
    return sorted(int(c) for c in rng.choice(ids, size=min(per_round, len(ids)), replace=False))


def fit_record(
    clients: list[int], metrics: list[dict], weights: list[float], dropped: dict[int, str], **figures
) -> dict:
    """A round's training record, as every engine writes it: the ``clients`` drawn, those
    ``dropped`` and why, the loss of the clients that returned (their ``metrics``, weighted
    by ``weights``, their examples), the mean of every other figure they report (steps, time
    per step, rank), then the engine's own ``figures`` (bytes, times, readouts)."""
    names = sorted({k for m in metrics for k in m} - {"loss"})
    loss = [m.get("loss", np.nan) for m in metrics]
    return {
        "clients": clients,
        **({"dropped": {str(c): why for c, why in sorted(dropped.items())}} if dropped else {}),
        "loss": float(np.average(loss, weights=weights)) if metrics else float("nan"),
        "fit": {k: float(np.mean([m[k] for m in metrics if k in m])) for k in names},
        **figures,
    }


def close_record(rnd: int, record: dict, done: list[dict], times: Sequence[float], setup_info: dict) -> dict:
    """Round ``rnd``'s record, completed: cumulative bytes (continuing ``done``, the
    records so far), the time spent training, aggregating and evaluating (from the
    four timestamps ``times``) and, in round 1, the one-time set-up figures."""
    cum_down = (done[-1]["cum_bytes_down"] if done else 0) + record["bytes_down"]
    cum_up = (done[-1]["cum_bytes_up"] if done else 0) + record["bytes_up"]
    t0, t1, t2, t3 = times
    return {
        "round": rnd,
        **record,
        "cum_bytes_down": cum_down,
        "cum_bytes_up": cum_up,
        "cum_bytes": cum_down + cum_up,
        "time_train": t1 - t0,
        "time_aggregate": t2 - t1,
        "time_eval": t3 - t2,
        **({"setup": setup_info} if rnd == 1 else {}),
    }
