"""The in-process simulation engine: every client on one frozen backbone in this process.

A client is only its state. Training client ``i`` = load the tensors it received and
its personal tensors into the one shared model, train, read them back out. Memory
therefore grows with the number of clients by their personal state only.

Per round ``t``:  sample S of M clients (seeded by ``(seed, t)``) -> each fits with
generators seeded by ``(seed, t, i)`` -> the method aggregates -> evaluate every
``eval.every`` rounds. Seeding per round and client (rather than carrying one RNG)
makes a resumed run identical to an uninterrupted one.

With ``eval.drift`` every round also records client drift, the C2A paper's analysis
(sec. 2.2, 5.5): the linear CKA between the logits of each sampled client's model after
its local round and those of the global model it started the round from, on one probe
batch of the global test set drawn once (:mod:`fedpeft.engines.drift`), measured as the
clients' round ends (``time_drift``, within ``time_train``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fedpeft.config import CommConfig, FaultsConfig, PrivacyConfig, ServerConfig, TrainConfig
from fedpeft.data.split import Clients
from fedpeft.data.task import Encoded
from fedpeft.engines import compress, guard, privacy, scaffold
from fedpeft.engines.checkpoint import Checkpoint, Checkpoints, load_checkpoint
from fedpeft.engines.distributed import Ranks, Share, client_cost, summable
from fedpeft.engines.drift import DriftProbe, drift_probe_rows
from fedpeft.engines.faults import corrupt
from fedpeft.engines.local import RoundContext, SampleDP, derive_seed
from fedpeft.engines.memory import check_memory, choose_cohort_mode, probe_cohort_size
from fedpeft.engines.round import (
    Returned,
    Round,
    ServerRound,
    fit_record,
    poisson_rate,
    receive,
    sample_clients,
    send,
)
from fedpeft.engines.run_loop import NOBODY_DRAWN, Fitted, RunLoop
from fedpeft.engines.store import ClientStore, StoreError
from fedpeft.methods.base import (
    ClientData,
    FitResult,
    Job,
    Method,
    ServerState,
    Tensors,
    load_tensors,
    read_tensors,
    restrict_heads,
    tensor_bytes,
)
from fedpeft.metrics.classification import mean_scores, pooled, spread
from fedpeft.metrics.scorers import ClassificationScorer, Scorer


@dataclass
class ClientScores:
    """Clients' own models' scores, client after client: on the global test set (when
    there is no global model), on their validation splits (with their sizes), on their test
    splits, and of the other models a method names (:meth:`Method.extra_eval_states`)."""

    global_: list[dict] = field(default_factory=list)
    val: list[dict] = field(default_factory=list)
    val_sizes: list[int] = field(default_factory=list)
    local: list[dict] = field(default_factory=list)
    extra: dict[str, list[dict]] = field(default_factory=dict)

    @classmethod
    def join(cls, parts: list[ClientScores]) -> ClientScores:
        """The scores of consecutive slices of the clients, as one."""
        names = [name for part in parts for name in part.extra]
        return cls(
            [s for p in parts for s in p.global_],
            [s for p in parts for s in p.val],
            [n for p in parts for n in p.val_sizes],
            [s for p in parts for s in p.local],
            {name: [s for p in parts for s in p.extra.get(name, [])] for name in dict.fromkeys(names)},
        )


@dataclass
class RunPlan:
    """What the engine needs to know of the experiment: counts and seeds, nothing else."""

    rounds: int
    clients_per_round: int
    seed: int
    eval_every: int = 1
    eval_local: bool = True
    eval_batch_size: int = 128
    cohort_size: int | None = 1  # clients trained at once (None: probe the device's memory)
    per_client_scores: bool = False  # record each client's local-test scores (the cross-silo table)
    drift_probe: int = 0  # eval.drift: examples in the client-drift probe batch (0: no drift)
    poisson: bool = False  # train.client_sampling: poisson (each client with probability S / M)
    min_results: int = 1  # deploy.min_results: fewer updates skip the round
    max_skipped_rounds: int = 3  # deploy.max_skipped_rounds: so many skipped in a row stop the run


class InProcessEngine:
    """Runs a method over simulated clients that share one model in memory."""

    def __init__(
        self,
        model: torch.nn.Module,
        method: Method,
        clients: list[ClientData],
        global_test: Encoded,
        plan: RunPlan,
        *,
        eval_clients: list[ClientData] | None = None,
        checkpoints: Checkpoints | None = None,
        fingerprint: str = "",
        on_round: Callable[[dict], None] | None = None,
        on_start: Callable[[list[dict]], None] | None = None,
        analyzers: dict[str, Callable[[Tensors, Tensors], dict]] | None = None,
        store: ClientStore | None = None,
        scorer: Scorer | None = None,
        on_corrupt_state: str = "stop",
        train: TrainConfig | None = None,
        memory_check: bool = True,
        server: ServerConfig | None = None,
        faults: FaultsConfig | None = None,
        faulty: Sequence[int] = (),
        comm: CommConfig | None = None,
        privacy_cfg: PrivacyConfig | None = None,
        ranks: Ranks | None = None,
    ):
        self.model, self.method, self.clients = model, method, clients
        # several processes share the rounds (fedpeft.engines.distributed); None: this one alone
        self.ranks = ranks
        self.eval_clients = eval_clients if eval_clients is not None else clients
        self.global_test, self.plan = global_test, plan
        self.checkpoints, self.fingerprint = checkpoints, fingerprint
        # train.on_corrupt_state: a stored personal state that cannot be read stops the run
        # (StoreError) or is reset to the method's initial one ("reset"), recorded per round
        self.on_corrupt_state, self.resets = on_corrupt_state, {}
        # the clients' training settings (the method's, or a pooled reference's steps); each
        # round's come from them (its rate under train.lr_schedule: round.Round.train)
        self.train = train or method.train
        self.memory_check = memory_check  # train.memory_check: probe the peak before training
        self.server_cfg = server or ServerConfig()  # the server's step after the method aggregates
        # simulated faulty clients (faults.*): whose uplinks a model attack corrupts
        self.faults, self.faulty = faults or FaultsConfig(), set(faulty)
        self.comm = comm or CommConfig()  # the codecs of the uplink and the downlink (comm.*)
        # differential privacy (privacy.*): the clip on the clients, the noise, the accountant
        self.privacy = privacy_cfg or PrivacyConfig()
        # the server's half of every round (noise, aggregate, server step, SCAFFOLD, guard)
        self.rounds = ServerRound(
            method,
            self.train,
            self.server_cfg,
            self.privacy,
            seed=plan.seed,
            clients=len(clients),
            accountant=privacy.user_accountant(
                self.privacy, len(clients), plan.clients_per_round, plan.rounds, plan.poisson
            ),
            analyzers=analyzers,  # name -> f(previous global tensors, new global tensors)
        )
        self.sample_dp: SampleDP | None = None  # privacy.mode sample: DP-SGD inside every client's steps
        if self.privacy.mode == "sample":
            sizes = {c.cid: len(c.train) for c in clients}
            accountant = privacy.dp_sgd_accountant(self.privacy, sizes, method, self.train, plan.rounds)
            self.rounds.sample_accountant = accountant
            self.sample_dp = SampleDP(self.privacy.clip, accountant.sigma, self.train.batch_size)
        self.on_round = on_round or (lambda record: None)
        self.on_start = on_start or (lambda records: None)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        covered = set(method.shared_names) | set(method.personal_names)
        if covered != set(trainable):
            missing = sorted(set(trainable) - covered)[:3]
            raise RuntimeError(
                f"method {method.name}: trainable tensors neither shared nor personal: {missing}"
            )
        self.initial: Tensors = read_tensors(model, trainable)
        self.trainable = set(trainable)
        # every client's personal state (in RAM within a budget, the rest on disk)
        self.personal: ClientStore = store if store is not None else ClientStore()
        self.joined: set[int] = set()  # clients that have received the join message
        self.setup_info: dict[str, float] = {}
        self.server: ServerState | None = None  # the final state, once run() returns
        self._loaded: tuple[torch.Tensor, ...] = ()
        self.cohort_size = plan.cohort_size or 1  # with None, probed when the run starts
        self.scorer = scorer or ClassificationScorer(plan.eval_batch_size)
        self.drift: DriftProbe | None = None  # eval.drift: on a probe batch, the same every round
        if plan.drift_probe:
            rows = drift_probe_rows(plan.seed, len(global_test), plan.drift_probe)
            self.drift = DriftProbe(self, global_test.subset(rows))

    # ------------------------------------------------------------ state helpers
    def personal_of(self, client: ClientData) -> Tensors:
        """Client ``client``'s personal state: what it kept from its last round or, if it
        has not trained yet, the method's initial personal state (not stored: a client
        that never trains never holds state)."""
        return self.stored(client)[0]

    def probed_state(self, client: ClientData) -> Tensors:
        """:meth:`personal_of` for a probe, read without its side effects: a state that
        cannot be read is neither dropped nor reported here (the client's round does that)
        and counts as the initial one."""
        if client.cid in self.personal:
            try:
                return compress.residual_of(self.personal[client.cid])[0]
            except StoreError:
                pass
        return self.initial_state(client)

    def initial_state(self, client: ClientData) -> Tensors:
        """The method's initial personal state of ``client`` (its heads cut to its classes)."""
        return restrict_heads(self.method.init_client(self.model, self.initial, client), client.classes)

    def stored(self, client: ClientData) -> tuple[Tensors, Tensors]:
        """What client ``client`` keeps: its personal state (:meth:`personal_of`) and the
        residual of its compressed uplink (error feedback; empty without it)."""
        if client.cid in self.personal:
            try:
                return compress.residual_of(self.personal[client.cid])
            except StoreError as err:
                if self.on_corrupt_state != "reset":
                    raise
                del self.personal[client.cid]
                self.resets[client.cid] = str(err)
        return self.initial_state(client), {}

    def load(self, tensors: Tensors) -> None:
        """Load tensors into the model unless exactly these are loaded already: every
        trainable tensor, and any frozen one a method's state holds (FedEx-LoRA's frozen
        weights)."""
        # Holding the tensors themselves (not their ids) keeps the identity test sound.
        same = len(tensors) == len(self._loaded) and all(
            a is b for a, b in zip(tensors.values(), self._loaded, strict=True)
        )
        if not same:
            if missing := sorted(self.trainable - set(tensors))[:3]:  # would leave another client's values
                raise RuntimeError(f"method {self.method.name}: state to load lacks {missing}")
            load_tensors(self.model, tensors)
            self._loaded = tuple(tensors.values())

    def forget_loaded(self) -> None:
        """The model's tensors may have changed outside :meth:`load` (a fit, a scorer, a
        memory probe loads its own): the next ``load`` loads whatever it is given."""
        self._loaded = ()

    # ------------------------------------------------------------ one round
    def context(self, step: Round) -> RoundContext:
        """The settings of round ``step``'s local training: its ``train`` (the round's rate)
        and DP-SGD's (``privacy.mode: sample``)."""
        return RoundContext(step.train, self.sample_dp)

    def job(self, server: ServerState, step: Round, cid: int) -> tuple[Job, Tensors, int]:
        """Client ``cid``'s local round in round ``step``, the residual its uplink carries
        (error feedback) and the bytes it receives for it: the downlink as encoded
        (``comm.downlink``) and decoded on the client; the join message and SCAFFOLD's
        control as they are."""
        message = compress.encode(self.method.downlink(server, cid), self.comm.downlink)
        received = compress.decode(message, self.comm.downlink)
        down = tensor_bytes(message)
        if cid not in self.joined:  # first contact: the method's one-time join message too
            down += tensor_bytes(self.method.join_message(server))
            self.joined.add(cid)
        client = self.clients[cid]
        control = scaffold.server_control(server, self.method) if scaffold.enabled(self.method) else {}
        seed = derive_seed(self.plan.seed, step.number, cid)
        personal, residual = self.stored(client)
        job = Job(received, personal, client, seed, step.number, control, context=self.context(step))
        return job, residual, down + tensor_bytes(control)

    def sent(self, step: Round, job: Job, result: FitResult, residual: Tensors) -> tuple[Returned, int]:
        """Client ``result.cid``'s uplink as the round's pipeline sends it (clipped, noised,
        encoded on the client: :func:`~fedpeft.engines.round.send`) and the server decodes
        it; its new residual stored with its personal state. The update as returned and
        the bytes sent."""
        sigma = self.rounds.accountant.sigma if self.rounds.accountant is not None else 0.0
        out = send(self.method, self.privacy, self.comm.uplink, job.received, result.uplink, residual,
                   clip=step.clip, sigma=sigma, seed=job.seed)  # fmt: skip
        result.uplink = receive(out.message, job.received, self.comm.uplink, job.seed)
        self.personal[result.cid] = compress.with_residual(result.personal, out.residual)
        reference = privacy.reference(self.method, job.received, result.uplink)
        returned = Returned(result, reference, out.fitted)
        return returned, tensor_bytes(out.message) + tensor_bytes(result.control)

    def fit_round(self, server: ServerState, step: Round) -> tuple[list[Returned], dict]:
        """The sampled clients' local rounds, in cohorts of up to ``cohort_size`` clients
        trained at once (a client's round does not depend on its cohort), and their
        updates as the server receives them."""
        s, rnd = self.plan, step.number
        rate = poisson_rate(s.clients_per_round, len(self.clients), s.poisson)
        sampled = sample_clients(s.seed, rnd, len(self.clients), s.clients_per_round, rate)
        if not sampled:  # Poisson sampling may draw no client
            return [], fit_record([], [], [], {}, bytes_down=0, bytes_up=0, time_fit_max=0.0)
        exchange, mine = {}, sampled
        if self.ranks is not None:  # this process's share of the clients
            costs = [client_cost(self.clients[cid], self.train) for cid in sampled]
            entries = self.ranks.from_leader(lambda: self.personal.publish(sampled))
            if not self.ranks.leader:  # where the drawn clients' states are (rank 0 keeps the index)
                self.personal.adopt(entries)
            mine = self.ranks.mine(sampled, costs)
        share = self.train_clients(server, step, mine)
        drift = self.measure_drift(server, share, sampled)  # where the clients' new states are
        if self.ranks is not None:  # every rank's updates, in the order drawn
            t0 = time.perf_counter()  # the exchange: waiting for the slowest rank, then the all-gather
            device = next(self.model.parameters()).device
            share = self.ranks.combine(share, sampled, self.personal, device, self.summed_weight())
            exchange = {"time_exchange": time.perf_counter() - t0}
            self.joined.update(sampled)
        results, dropped, down, up = share.returned, share.dropped, share.down, share.up
        if not results:
            raise guard.all_dropped(rnd, dropped, step.lr, server)
        if self.method.pooled:  # pooled training: nothing crossed a network
            down = up = 0
        fits = share.reported if share.reported is not None else [r.result for r in results]
        return results, fit_record(
            sampled,
            [r.metrics for r in fits],
            [r.num_examples for r in fits],
            dropped,
            **({"byzantine": sorted(self.faulty & set(sampled))} if self.faulty else {}),
            bytes_down=down,
            bytes_up=up,
            # the slowest cohort: what a round takes when cohorts train in parallel
            time_fit_max=max(share.fit_times, default=0.0),
            **exchange,
            **({"client_readout": share.readouts} if share.readouts else {}),
            **drift,
        )

    def measure_drift(self, server: ServerState, share: Share, sampled: list[int]) -> dict:
        """With ``eval.drift``, the round's client drift (:mod:`fedpeft.engines.drift`), measured
        where the clients' new states are (over ranks, each rank its share, then gathered),
        and the time it took."""
        if self.drift is None:
            return {}
        start = time.perf_counter()
        results = [r.result for r in share.returned]
        measured = {} if self.drift.skipped(server) else self.drift.clients(server, results)
        if self.ranks is not None:
            measured = {k: v for part in self.ranks.gather(measured) for k, v in part.items()}
        return {
            "drift": self.drift.record(server, measured, sampled),
            "time_drift": time.perf_counter() - start,
        }

    def summed_weight(self) -> Callable[[FitResult], float] | None:
        """Over ranks, a client's weight in the mean its server takes of the uplinks, where
        it takes that and nothing else: the ranks then sum their updates, not gather each
        (:meth:`~fedpeft.engines.distributed.Ranks.combine`); None where the server needs each."""
        if self.ranks is None or summable(self.method, self.server_cfg, self.privacy.mode):
            return None
        uniform = self.server_cfg.weighting == "uniform"
        return lambda result: 1.0 if uniform else float(result.num_examples)

    def train_clients(self, server: ServerState, step: Round, cids: list[int]) -> Share:
        """Clients ``cids``' local rounds in round ``step``, in cohorts of up to
        ``cohort_size`` trained at once (a client's round does not depend on its cohort),
        and their updates as the server receives them, in the order of ``cids``."""
        jobs, residuals, out = [], {}, Share()
        for cid in cids:
            job, residuals[cid], received_bytes = self.job(server, step, cid)
            jobs.append(job)
            out.down += received_bytes
        self.forget_loaded()  # a fit may load its own tensors
        for start in range(0, len(jobs), self.cohort_size):
            cohort = jobs[start : start + self.cohort_size]
            t0 = time.perf_counter()
            fitted = self.method.fit_cohort(self.model, cohort)
            for job, result in zip(cohort, fitted, strict=True):
                result.cid = job.client.cid
            fitted = [self.attacked(job, r, step.number) for job, r in zip(cohort, fitted, strict=True)]
            kept, cut = guard.screen(fitted)  # a diverged client keeps its last finite state
            by_client = {job.client.cid: job for job in cohort}
            for result in kept:  # sent and stored at once, as each cohort ends
                if readout := self.method.readout(result):  # on the client, of what it trained
                    out.readouts[str(result.cid)] = readout
                returned, sent_bytes = self.sent(step, by_client[result.cid], result, residuals[result.cid])
                out.returned.append(returned)
                out.up += sent_bytes
            out.dropped.update(cut)
            out.fit_times.append(time.perf_counter() - t0)
        return out

    def train_round(self, server: ServerState, rnd: int) -> tuple[ServerState, list[FitResult], dict]:
        """Round ``rnd`` from ``server`` without its evaluation (what the benchmarks time): the
        clients' local rounds and the server's update through the round pipeline; the new
        state, the results as aggregated and the round's record so far."""
        step = self.rounds.begin(rnd, server)
        returned, record = self.fit_round(server, step)
        skip = None if returned else NOBODY_DRAWN
        new = self.rounds.finish(step, server, returned, record, [], skip=skip)
        self.forget_loaded()
        return new, [r.result for r in returned], record

    def attacked(self, job: Job, result: FitResult, rnd: int) -> FitResult:
        """``result`` as a faulty client sends it (``faults.attack``, a model attack), else as it is."""
        if result.cid not in self.faulty or self.faults.attack == "label_flip":
            return result
        return corrupt(self.faults, result, job.received, self.plan.seed, rnd, self.method.name)

    def client_model(self, server: ServerState, client: ClientData) -> tuple[Tensors, dict[str, Tensors]]:
        """The tensors client ``client`` is scored with (:meth:`Method.eval_state`: the
        global model and its personal part) and any other models of it the method names."""
        received = self.method.downlink(server, client.cid)
        personal = self.personal_of(client)
        self.forget_loaded()  # eval_state may use the model (Per-FedAvg adapts one step)
        extra = self.method.extra_eval_states(self.model, received, personal, client)
        self.forget_loaded()
        return self.method.eval_state(self.model, received, personal, client), extra

    def evaluate(self, server: ServerState, rnd: int | None = None, final: bool = False) -> dict:
        """Global-test scores of the global model (or the clients' mean when there is none)
        and every client's scores on its local test split: all clients, so that every
        method is scored on the same ones (a client that never trained holds the global
        model and its initial personal state). Clients' own models are scored in cohorts
        of ``cohort_size``, their forward passes vmapped; over ranks, each rank scores a
        contiguous slice of the clients and of the global test set. Each client's own
        scores are kept (``local_by_client``, clients with a test split in order) in the
        ``final`` round, and in every round when the plan asks (``rnd``: the round)."""
        self.forget_loaded()  # the round's aggregate may have used the model
        out, ranks = {}, self.ranks
        global_tensors = self.method.global_state(server)
        if global_tensors is not None and len(self.global_test):
            out.update(self.global_scores(global_tensors))
        clients = self.eval_clients
        if ranks is None:
            scores = self.client_scores(server, clients, global_tensors is None)
        else:
            lo, hi = (len(clients) * r // ranks.world for r in (ranks.rank, ranks.rank + 1))
            # where the clients' states are (rank 0 keeps the index); a client's id is its
            # place among the experiment's clients, which are made only to be scored
            cids = range(len(clients)) if isinstance(clients, Clients) else [c.cid for c in clients]
            entries = ranks.from_leader(lambda: self.personal.publish(cids))
            if not ranks.leader:
                self.personal.adopt({cid: entries[cid] for cid in cids[lo:hi]})
            scores = ClientScores.join(
                ranks.gather(self.client_scores(server, clients[lo:hi], global_tensors is None))
            )
        out["clients_evaluated"] = len(clients)
        if scores.global_:
            out["global"] = mean_scores(scores.global_)
        if scores.local:
            out["local"] = spread(scores.local)
            if self.plan.per_client_scores or final:
                out["local_by_client"] = scores.local
        if scores.val:
            out["val"] = {**spread(scores.val), **pooled(scores.val, scores.val_sizes)}
        for name, values in scores.extra.items():
            out[f"local_{name}"] = spread(values)
        return out

    def global_scores(self, tensors: Tensors) -> dict:
        """The global model (``tensors``) on the global test set. Over ranks, each does its
        part of the scoring (:mod:`fedpeft.metrics.scorers`) and the parts are gathered, so
        every rank has the figures one process has."""
        self.load(tensors)
        if self.ranks is None:
            return {"global": self.scorer.score(self.model, self.global_test)}
        part = self.scorer.predictions(self.model, self.global_test, (self.ranks.rank, self.ranks.world))
        return {"global": self.scorer.from_predictions(self.ranks.gather(part), self.global_test)}

    def client_scores(
        self, server: ServerState, clients: list[ClientData], on_global_test: bool
    ) -> ClientScores:
        """``clients``' own models' scores, in cohorts of ``cohort_size``: on the global test
        set (``on_global_test``: there is no global model), their validation and test splits."""
        out, size, scorer = ClientScores(), self.cohort_size, self.scorer
        score_all = lambda states, data: scorer.score_clients(self.model, states, data, self.load)  # noqa: E731
        for start in range(0, len(clients), size):
            cohort = clients[start : start + size]
            models = [self.client_model(server, client) for client in cohort]
            self.forget_loaded()  # the scorer may load clients' tensors
            if on_global_test and len(self.global_test):  # no global model: each client's own
                out.global_ += score_all([m for m, _ in models], self.global_test)
            if not self.plan.eval_local:
                continue
            validated = [i for i, c in enumerate(cohort) if c.val is not None and len(c.val)]
            if validated:
                out.val += score_all([models[i][0] for i in validated], [cohort[i].val for i in validated])
                out.val_sizes += [len(cohort[i].val) for i in validated]
            tested = [i for i, c in enumerate(cohort) if len(c.test)]
            if not tested:
                continue
            data = [cohort[i].test for i in tested]
            out.local += score_all([models[i][0] for i in tested], data)
            for name in models[tested[0]][1]:
                out.extra.setdefault(name, []).extend(score_all([models[i][1][name] for i in tested], data))
        self.forget_loaded()
        return out

    # ------------------------------------------------------------ the run (a backend of RunLoop)
    def loop(self) -> RunLoop:
        """The run loop over this engine (:mod:`fedpeft.engines.run_loop`)."""
        s = self.plan
        return RunLoop(
            self, s.rounds, s.eval_every, s.min_results, s.max_skipped_rounds, self.checkpoints,
            self.fingerprint, self.on_start, self.on_round,
            hint="Rerun with --resume to go on, or lower deploy.min_results.",
        )  # fmt: skip

    def run(self, resume: bool = False, resume_from: int | None = None) -> list[dict]:
        """Every round still to run, from the start or (``resume``) from the newest readable
        checkpoint or round ``resume_from``'s (:meth:`RunLoop.run`); the records of all rounds."""
        return self.loop().run(resume, resume_from)

    def start(self, resume: bool, resume_from: int | None = None) -> tuple[ServerState, list[dict]]:
        """The server state and records the run goes on from (:meth:`RunLoop.start`)."""
        return self.loop().start(resume, resume_from)

    def open_store(self) -> None:
        """Close the store before the run's own is opened (checked to be shared, over ranks)."""
        self.personal.close()
        if self.ranks is not None and self.personal.directory is not None:
            self.ranks.check_shared(self.personal.directory.parent)

    def load_checkpoint(self, checkpoints: Checkpoints, resume_from: int | None) -> Checkpoint:
        """The checkpoint to go on from, its clients' states, join messages and state resets
        taken back. Over ranks rank 0 picks it (and tidies); the others read the one it picked."""
        self.open_store()
        ranks, budget = self.ranks, self.personal.budget
        fingerprint, on_corrupt = self.fingerprint, self.on_corrupt_state
        load = lambda: checkpoints.load(fingerprint, budget, resume_from, on_corrupt)  # noqa: E731
        if ranks is None:
            ckpt = load()
        else:
            path = checkpoints.path
            read = lambda: load_checkpoint(path, fingerprint, budget, on_corrupt, owner=False)  # noqa: E731
            ckpt = ranks.leader_first(load, read)
        self.resets.update(ckpt.resets or {})
        self.joined = set(ckpt.joined)
        if isinstance(ckpt.personal, ClientStore):
            self.personal = ckpt.personal
        else:  # a checkpoint that holds the states themselves
            self.personal = self.fresh_store(self.leader)
            for cid, state in ckpt.personal.items():
                self.personal[cid] = state
        return ckpt

    def fresh(self) -> None:
        self.open_store()
        self.personal = self.fresh_store(self.leader)  # no state of an earlier run

    @property
    def leader(self) -> bool:
        return self.ranks is None or self.ranks.leader

    def prepare(self, server: ServerState) -> None:
        """The cohort size and mode, probed where asked, and the memory check, on ``server``."""
        if self.ranks is not None:
            self.setup_info["ranks"] = float(self.ranks.world)
            self.setup_info["ranks_summed"] = float(self.summed_weight() is not None)
        if self.plan.cohort_size is None:
            self.cohort_size = probe_cohort_size(self, server)
            self.setup_info["cohort_size"] = float(self.cohort_size)
        self.setup_info.update(choose_cohort_mode(self, server))  # cohort_mode auto on a GPU: the faster
        if self.memory_check:  # refuses (InsufficientMemory) a run that would not fit
            figures = check_memory(self, server)
            self.setup_info.update({f"memory_{k}": v for k, v in figures.items() if isinstance(v, float)})

    def fit(self, server: ServerState, step: Round) -> Fitted:
        returned, record = self.fit_round(server, step)
        return Fitted(server, returned, record)

    def amend(self, record: dict) -> None:
        """Clients whose stored state could not be read, started afresh this round."""
        if self.resets:
            record["state_resets"] = {str(c): why for c, why in sorted(self.resets.items())}
            self.resets = {}

    def held(self) -> tuple[ClientStore, list[int]]:
        return self.personal, sorted(self.joined)

    def settle(self) -> None:
        """The store at the end of a round without a checkpoint of this process's: its
        entries committed (where it keeps the index), the files no kept checkpoint names
        deleted, a rank's entries of other ranks' clients forgotten."""
        store = self.personal
        if store.index is not None and self.checkpoints is None:
            store.commit()
        store.collect(self.checkpoints.keep if self.checkpoints else 1)
        if not self.leader:
            store.forget()

    def fresh_store(self, leader: bool) -> ClientStore:
        """An empty store like the engine's (on its directory, emptied; rank 0's indexed)."""
        store = self.personal
        if store.directory is None:
            return store
        return ClientStore.open(store.directory, 0, store.budget, durable=leader)[0]
