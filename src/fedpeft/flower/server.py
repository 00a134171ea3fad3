"""The server side of a deployment: fedpeft's round loop driven over a Flower ``Grid``.

Each round:

1. **roll call**: a ``query`` message to every node not seen before; the replies map
   node ids to client ids and say which nodes still need the method's join message (a
   restarted node comes back under a new node id, possibly with a fresh backbone);
2. **sample** S of the clients that answered, with the same seeded draw as the
   in-process engine (so with every node up both engines train the same clients);
3. **train**: one ``train`` message per sampled client; a client that errs, crashes or
   has not answered within ``deploy.round_timeout`` is dropped from the round, and a
   reply that fails its checks (:mod:`fedpeft.flower.replies`: its fields, counts and
   metrics, its update's size and claimed shapes before anything is decoded, then its
   tensors' exact names, shapes and dtypes) is refused whole;
4. **aggregate** through the method when at least ``deploy.min_results`` updates came
   back (otherwise the round is recorded as skipped and the global state is kept); under
   ``server.weighting: examples`` each client weighs no more than the examples its node
   gave at the roll call and no more than ``deploy.max_weight_share`` of the round;
5. **evaluate**: the global model on the global test set here, and each client's own
   model on its local test split on its node (``evaluate`` messages).

A reply that fails a check drops its client (``dropped``, ``eval_failed``) or, at the
roll call, leaves its node out of the round (``ignored_nodes``); it never stops the
server. With SuperNode authentication a client id stays with its node
(:class:`~fedpeft.flower.members.ClientIds`).

Bytes are those Flower serialises (:func:`~fedpeft.flower.codec.wire_bytes`); the
tensor payload the in-process engine counts is recorded beside them. The server
state is checkpointed every round, so ``--resume`` continues a stopped run; personal
state lives only on the nodes, which keep it per round (see :mod:`fedpeft.flower.node`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid

from fedpeft.config import DeployConfig
from fedpeft.engines import compress, guard, lr_schedule, privacy, scaffold
from fedpeft.engines.checkpoint import Checkpoint, Checkpoints
from fedpeft.engines.local import derive_seed
from fedpeft.engines.round import (
    Returned,
    Round,
    ServerRound,
    fit_record,
    poisson_rate,
    receive,
    sample_clients,
)
from fedpeft.engines.run_loop import Fitted, RunLoop, SkippedRoundsError
from fedpeft.experiment import Setup
from fedpeft.flower import codec, members, replies, secure
from fedpeft.methods.base import FitResult, ServerState, Tensors, load_tensors, tensor_bytes
from fedpeft.metrics.classification import mean_scores, spread
from fedpeft.metrics.scorers import scorer_for

ROLL_CALL, TRAIN, EVALUATE = "query", "train", "evaluate"
POLL_SECONDS = 0.1  # how often the server asks the SuperLink for replies
OFFLINE = object()  # stands in for the reply of a node that dropped off the SuperLink


class DeploymentError(RuntimeError):
    """The federation cannot go on (too few nodes, too many skipped rounds, a clash)."""


@dataclass
class Peer:
    node_id: int
    joined: bool
    num_examples: int = 0


class FlowerServer:
    """Runs ``setup``'s method over the nodes reachable through ``grid``."""

    def __init__(
        self,
        setup: Setup,
        grid: Grid,
        *,
        checkpoints: Checkpoints | None,
        fingerprint: str,
        on_round: Callable[[dict], None] = lambda record: None,
        on_start: Callable[[list[dict]], None] = lambda records: None,
        analyzers: dict[str, Callable[[Tensors, Tensors], dict]] | None = None,
        log: Callable[[str], None] = print,
        context: Context | None = None,
    ):
        from fedpeft.composition import refusal  # what a deployment composes with: its rules

        if why := refusal(setup.cfg, setup.method, engine="deployment"):
            raise DeploymentError(why)
        self.setup, self.grid, self.method, self.context = setup, grid, setup.method, context
        # differential privacy (privacy.*): the nodes clip (and, local mode, noise); the server
        # adds its noise to the sum (user mode) and keeps the accountant; under DP-SGD
        # (sample mode) the nodes noise their own steps and the server accounts for them
        cfg = self.cfg = setup.cfg
        # the server's half of every round (noise, aggregate, server step, SCAFFOLD, guard);
        # a reply can be lost, so SCAFFOLD's clients hear which control updates were applied
        self.rounds = ServerRound(
            self.method,
            cfg.train,
            cfg.server,
            cfg.privacy,
            seed=cfg.seed,
            clients=cfg.partition.num_clients,
            accountant=privacy.accountant_for(cfg),
            confirms_controls=True,
            analyzers=analyzers,
        )
        self.deploy: DeployConfig = cfg.deploy
        self.checkpoints, self.fingerprint = checkpoints, fingerprint
        self.on_round, self.on_start, self.log = on_round, on_start, log
        self.server: ServerState | None = None
        self.model, self.ranks = setup.model, None  # the server's backbone; one process
        self.setup_info: dict[str, float] = {}
        self.uplink_like: Tensors = {}
        self.peers: dict[int, Peer] = {}  # client id -> the node that holds it
        self.strangers: set[int] = set()  # nodes that answered with an unusable client id
        self.ids = members.ClientIds(log)  # under node authentication, who holds which client id
        self.ignored: dict[int, str] = {}  # this round's roll-call replies refused, by node
        self.score_names = replies.score_names(self.cfg.data.task)  # what an evaluation reply holds
        # the global model's scorer: the in-process engine's, for this task
        self.scorer = scorer_for(self.cfg.data.task, setup.tokenizer, self.cfg.eval, setup.corpus)

    # ------------------------------------------------------------ messaging
    def exchange(self, messages: list[Message], timeout: float) -> tuple[dict[int, Message], dict[int, str]]:
        """Send ``messages`` and wait up to ``timeout`` s; returns the good replies and,
        per node that failed, why (error reply or no reply in time)."""
        if not messages:
            return {}, {}
        by_id = self.collect(messages, timeout)
        good, failed = {}, {}
        for m in messages:
            node = m.metadata.dst_node_id
            reply = by_id.get(m.metadata.message_id)
            if reply is OFFLINE:
                failed[node] = "its node went offline (missed its heartbeats)"
            elif reply is None:
                failed[node] = f"no reply within {timeout:g} s"
            elif reply.has_error():
                failed[node] = f"error {reply.error.code}: {(reply.error.reason or '').strip()[-300:]}"
            else:
                good[node] = reply
        return good, failed

    def collect(self, messages: list[Message], timeout: float) -> dict[str, Message | object]:
        """Push ``messages``, then pull replies until all are in, ``timeout`` s have
        passed, or the nodes still owing one have dropped off the SuperLink's list (a
        crashed node stops its heartbeats; there is no point waiting out the timeout).
        Replies are matched by message id: an error the SuperLink writes for an offline
        node comes from the SuperLink, not from the node."""
        ids = list(self.grid.push_messages(messages))  # fills in each message's id
        pending = dict(zip(ids, messages, strict=True))
        replies: dict[str, Message | object] = {}
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(pending)):
                key = reply.metadata.reply_to_message_id
                if pending.pop(key, None) is not None:
                    replies[key] = reply
            if pending:
                online = set(self.grid.get_node_ids())
                for key in [k for k, m in pending.items() if m.metadata.dst_node_id not in online]:
                    replies[key] = OFFLINE
                    del pending[key]
                time.sleep(POLL_SECONDS)
        return replies

    def message(self, node_id: int, kind: str, records: dict, ttl: float) -> Message:
        return Message(RecordDict(records), dst_node_id=node_id, message_type=kind, ttl=ttl)

    def roll_call(self, rnd: int) -> dict[int, Peer]:
        """Client id -> its node. Nodes seen before are known; a node id not seen before
        (a new or restarted SuperNode) is asked who it is, with ``deploy.query_timeout``
        to answer; a reply that fails its checks leaves its node out of this round. A node
        that claims a client id already held replaces the older node (a restarted SuperNode
        comes back under a new node id, while the old id lingers until its heartbeat
        lapses), unless nodes are authenticated: then the id's holder keeps it
        (:class:`members.ClientIds`)."""
        listed = set(self.grid.get_node_ids())
        self.peers = {cid: p for cid, p in self.peers.items() if p.node_id in listed}
        for cid in self.ids.start(rnd, {cid: p.node_id for cid, p in self.peers.items()}):
            del self.peers[cid]  # the operator assigned it to another node
        known = {p.node_id for p in self.peers.values()} | self.strangers
        ask = ConfigRecord({"round": rnd, "class_names": list(self.setup.corpus.class_names)})
        timeout = self.deploy.query_timeout
        messages = [self.message(n, ROLL_CALL, {"ask": ask}, timeout) for n in sorted(listed - known)]
        good, failed = self.exchange(messages, timeout)
        for node, why in failed.items():
            self.log(f"round {rnd}: node {node} did not answer the roll call ({why})")
        for node, reply in sorted(good.items()):
            try:
                info = replies.read_roll_call(reply)
            except codec.ReplyError as err:
                self.ignored[node] = f"refused: {err}"
                self.log(f"round {rnd}: node {node}'s roll-call reply refused ({err}); ignored this round")
                continue
            cid = info.cid
            if not 0 <= cid < self.cfg.partition.num_clients:
                self.strangers.add(node)
                self.log(
                    f"node {node}: partition-id={cid} outside 0..{self.cfg.partition.num_clients - 1} "
                    f"(partition.num_clients={self.cfg.partition.num_clients}); ignored"
                )
                continue
            if (why := self.ids.claim(cid, node)) is not None:
                self.ignored[node] = why
                self.log(f"round {rnd}: {why}")
                continue
            if cid in self.peers and self.peers[cid].node_id != node:
                self.log(f"node {node} replaces node {self.peers[cid].node_id} as client {cid}")
            self.peers[cid] = Peer(node, info.joined, info.num_examples)
        return dict(sorted(self.peers.items()))

    def wait_for_nodes(self) -> None:
        want = self.deploy.min_nodes or self.cfg.train.clients_per_round
        deadline = time.monotonic() + self.deploy.connect_timeout
        told = -1
        while (have := len(list(self.grid.get_node_ids()))) < want:
            if have != told:
                self.log(
                    f"waiting for nodes: {have} of deploy.min_nodes={want} connected (clients join with "
                    f"`fedpeft join`; deploy.connect_timeout={self.deploy.connect_timeout:g} s)"
                )
                told = have
            if time.monotonic() > deadline:
                raise DeploymentError(
                    f"{have} of deploy.min_nodes={want} nodes connected within "
                    f"deploy.connect_timeout={self.deploy.connect_timeout:g} s"
                )
            time.sleep(0.5)

    def downlink_records(
        self, server: ServerState, cid: int, peer: Peer, *, train: bool = False
    ) -> tuple[dict, int, Tensors]:
        """The records a client receives (plus the join message if its node needs it),
        their tensor payload in bytes, and what the client will hold once it decodes them:
        a training message's downlink goes through ``comm.downlink`` (an evaluation's
        carries the model as it is, as in-process)."""
        sent = self.method.downlink(server, cid)
        if train:
            sent = compress.encode(sent, self.cfg.comm.downlink)
        records, payload = {"downlink": codec.to_record(sent)}, tensor_bytes(sent)
        if not peer.joined and (join := self.method.join_message(server)):
            records["join"] = codec.to_record(join)
            payload += tensor_bytes(join)
        return records, payload, compress.decode(sent, self.cfg.comm.downlink) if train else sent

    def uplink_of(self, message: Tensors, cid: int, rnd: int, held: Tensors) -> Tensors:
        """Client ``cid``'s update (``message``, as encoded, its claims checked by
        :func:`replies.read_fit`) decoded (``comm.uplink``) onto ``held``, what it was sent."""
        seed = derive_seed(self.cfg.seed, rnd, cid)
        try:
            return receive(message, held, self.cfg.comm.uplink, seed)
        except (KeyError, IndexError, RuntimeError, ValueError, TypeError) as err:
            raise codec.ReplyError(
                f"its {self.cfg.comm.uplink.codec} update does not decode: {err}"
            ) from None

    # ------------------------------------------------------------ one round
    def fit_round(
        self, server: ServerState, step: Round, peers: dict[int, Peer]
    ) -> tuple[list[Returned], dict]:
        """The sampled clients' local rounds on their nodes, and their updates as decoded
        here (a reply that does not fit what was asked is refused whole)."""
        train, rnd = self.cfg.train, step.number
        poisson = train.client_sampling == "poisson"
        rate = poisson_rate(train.clients_per_round, self.cfg.partition.num_clients, poisson)
        sampled = sample_clients(self.cfg.seed, rnd, list(peers), train.clients_per_round, rate)
        if self.deploy.secure_aggregation and sampled:  # none drawn (Poisson): the plain path's empty round
            return self.fit_round_secure(server, step, peers, sampled)
        messages, payload_down, held = [], 0, {}
        control = scaffold.server_control(server, self.method) if scaffold.enabled(self.method) else {}
        orders = self.orders(step)
        adaptive = self.cfg.privacy.adaptive_clip  # only then does a node say whether it fitted
        for cid in sampled:
            records, payload, held[cid] = self.downlink_records(server, cid, peers[cid], train=True)
            records["config"] = ConfigRecord(orders.as_config())
            if control:  # SCAFFOLD: the server's control, with every training message, and the
                # last round whose control update of this client it applied
                applied = scaffold.applied_round(server, cid)
                records["config"] = ConfigRecord(replace(orders, control_applied=applied).as_config())
                records["control"] = codec.to_record(control)
                payload += tensor_bytes(control)
            messages.append(self.message(peers[cid].node_id, TRAIN, records, self.deploy.round_timeout))
            payload_down += payload
        down = sum(codec.wire_bytes(m) for m in messages)
        good, failed = self.exchange(messages, self.deploy.round_timeout)
        cid_of = {peers[c].node_id: c for c in sampled}
        dropped = {cid_of[n]: why for n, why in failed.items()}
        diverged: dict[int, str] = {}  # the clients whose loss or update is not finite
        results, readouts, fit_times, up, payload_up = [], {}, [], 0, 0
        for node, reply in sorted(good.items(), key=lambda kv: cid_of[kv[0]]):
            cid = cid_of[node]
            up += codec.wire_bytes(reply)
            like = self.round_uplink_like(rnd, held[cid])
            try:  # every field checked, and the update's size and claims, before it is decoded
                known, uplink_cfg = peers[cid].num_examples, self.cfg.comm.uplink
                fit = replies.read_fit(reply, known=known, like=like, uplink=uplink_cfg, control_like=control)
                uplink = self.uplink_of(fit.message, cid, rnd, held[cid])
                result = FitResult(uplink, {}, fit.num_examples, fit.metrics, cid)
                if control:  # SCAFFOLD: the update of the client's control
                    result.control = fit.control
                if (reason := guard.nonfinite_reason(result)) is not None:  # the in-process engine's rule
                    dropped[cid] = diverged[cid] = f"non-finite: {reason}"
                    continue
                codec.check_tensors(self.method.uplink_as_shared(uplink), like, f"client {cid} update")
                codec.check_tensors(result.control, control, f"client {cid} control update")
            except codec.ReplyError as err:
                dropped[cid] = f"refused: {err}"
                continue
            fit_times.append(fit.time_fit)
            peers[cid].joined = True
            reference = privacy.reference(self.method, held[cid], uplink)
            # privacy user mode: whether the update fitted within the clip bound
            results.append(Returned(result, reference, fit.fitted if adaptive else None))
            payload_up += tensor_bytes(fit.message) + tensor_bytes(result.control)
            if fit.readout:
                readouts[str(cid)] = fit.readout
        for cid, why in sorted(dropped.items()):
            self.log(f"round {rnd}: client {cid} dropped ({why})")
        if diverged and not results:  # every update that came back diverged: as in-process, stop
            raise guard.all_dropped(rnd, diverged, step.lr, server)
        fits = [r.result for r in results]
        capped = replies.cap_results(fits, self.cfg.server.weighting, self.deploy.max_weight_share)
        return results, fit_record(
            sampled,
            [r.metrics for r in fits],
            [r.num_examples for r in fits],
            dropped,
            clients_returned=[r.cid for r in fits],
            **({"capped_weights": capped} if capped else {}),
            nodes=len(peers),
            bytes_down=down,
            bytes_up=up,
            payload_bytes_down=payload_down,
            payload_bytes_up=payload_up,
            time_fit_max=max(fit_times, default=float("nan")),
            **({"client_readout": readouts} if readouts else {}),
        )

    def fit_round_secure(
        self, server: ServerState, step: Round, peers: dict[int, Peer], sampled: list[int]
    ) -> tuple[list[Returned], dict]:
        """The round's training through SecAgg+: one result, the unmasked mean update (of
        what every client received: the same downlink)."""
        rnd, instructions, payload_down, orders = step.number, {}, 0, self.orders(step)
        for cid in sampled:
            received = self.method.downlink(server, cid)
            join = None if peers[cid].joined else (self.method.join_message(server) or None)
            instructions[peers[cid].node_id] = (cid, secure.fit_instructions(received, join, orders))
            payload_down += tensor_bytes(received) + (tensor_bytes(join) if join else 0)
        uniform = self.cfg.privacy.mode == "user"  # user-level DP: weights 1
        max_weight = 1 if uniform else max(max(peers[c].num_examples for c in sampled), 1)
        like = self.round_uplink_like(rnd, received)
        # each stage's replies checked as they come (replies.check_secure_reply); a refused
        # one counts as its node dropping out, which the protocol recovers from
        expect = replies.SecureRound(
            {peers[c].node_id: peers[c].num_examples for c in sampled}, like, uniform
        )
        outcome, counted = secure.secure_round(
            self.grid, self.context, rnd, instructions, like, max_weight, self.deploy.round_timeout, expect
        )
        returned = outcome.returned
        for cid in returned:
            peers[cid].joined = True
        dropped = {c: counted.why_dropped(peers[c].node_id) for c in sampled if c not in returned}
        for cid, why in dropped.items():
            self.log(f"round {rnd}: client {cid} dropped ({why})")
        results = []
        if outcome.result is not None:  # the mean stands for its clients: its update is of what they received
            outcome.result.cid = returned[0]
            reference = privacy.reference(self.method, received, self.round_uplink_like(rnd, received))
            results.append(Returned(outcome.result, reference))
        per_client = outcome.metrics
        readouts = {
            str(cid): {k.removeprefix("readout."): v for k, v in m.items() if k.startswith("readout.")}
            for cid, m in zip(returned, per_client, strict=True)
        }
        # the figures the clients report, less what the protocol and the readouts carry;
        # weighted by examples, as a plain round and the in-process engine weigh them
        kept = lambda k: k not in ("time_fit", "num_examples") and not k.startswith("readout.")  # noqa: E731
        told = [{k: v for k, v in m.items() if kept(k)} for m in per_client]
        weights = [m.get("num_examples", w) for m, w in zip(per_client, outcome.num_examples, strict=True)]
        return results, fit_record(
            sampled,
            told,
            weights,
            dropped,
            clients_returned=returned,
            nodes=len(peers),
            secure_aggregation=True,
            bytes_down=counted.down,
            bytes_up=counted.up,
            payload_bytes_down=payload_down,
            payload_bytes_up=len(returned) * tensor_bytes(self.round_uplink_like(rnd, received)),
            time_fit_max=max((m["time_fit"] for m in per_client), default=float("nan")),
            **({"client_readout": readouts} if any(readouts.values()) else {}),
        )

    def dp_sgd(self, server: ServerState, peers: dict[int, Peer]) -> ServerState:
        """``privacy.mode sample``: DP-SGD's accountant over the clients known so far (their
        training rows as their nodes said at a roll call). Its noise multiplier is
        ``privacy.noise_multiplier``, or calibrated once, on the clients of the first round,
        to the budget (as in-process, on the worst case). Both the noise multiplier and the
        clients' rows are kept in the server state: a resumed run steps at the same noise
        and accounts for every client that trained, its node back or not. A client it did
        not know that would spend more refuses to train
        (:func:`fedpeft.engines.privacy.check_client_plan`)."""
        p, train = self.cfg.privacy, self.cfg.train
        # every client known: those of earlier rounds (kept, so a resumed run counts the
        # ones whose nodes are not back) and those of this roll call
        sizes = {**privacy.known_rows(server.extras), **{c: peer.num_examples for c, peer in peers.items()}}
        steps = {cid: self.method.private_steps(n, train) for cid, n in sizes.items()}
        every, first = {c: k for c, (k, _) in steps.items()}, {c: k for c, (_, k) in steps.items()}
        if privacy.SIGMA in server.extras:
            sigma = float(server.extras[privacy.SIGMA])
        else:
            sigma = privacy.sample_accountant(p, sizes, every, train.batch_size, train.rounds, first).sigma
        kept = {
            **server.extras,
            privacy.SIGMA: torch.tensor(sigma, dtype=torch.float64),
            privacy.ROWS: privacy.rows_extra(sizes),
        }
        accountant = privacy.dp_sgd_accountant(p, sizes, self.method, train, train.rounds, sigma)
        self.rounds.sample_accountant = accountant
        return ServerState(server.tensors, kept)

    def orders(self, step: Round) -> codec.Orders:
        """What round ``step``'s training messages tell their nodes besides the tensors (set
        after DP-SGD's accountant)."""
        dp_sgd = self.rounds.sample_accountant
        return codec.Orders(
            step.number,
            clip=step.clip if self.rounds.accountant is not None else None,
            lr=step.lr if lr_schedule.scheduled(self.cfg.train) else None,  # train.lr_schedule
            sigma=dp_sgd.sigma if dp_sgd is not None else None,  # DP-SGD
        )

    def round_uplink_like(self, rnd: int, received: Tensors) -> Tensors:
        """The names, shapes and dtypes of the update in round ``rnd`` of a client that was
        sent ``received``."""
        return self.method.uplink_like(rnd, self.uplink_like, received)

    def evaluate(self, server: ServerState, rnd: int, final: bool) -> dict:
        """Global-test scores of the global model (or the clients' mean when there is
        none), and each client's scores on its local test split, computed on its node
        (each client's own in the ``final`` round, as in-process)."""
        setup, out, peers = self.setup, {}, self.peers
        global_tensors = self.method.global_state(server)
        if global_tensors is not None:
            load_tensors(setup.model, global_tensors)
            out["global"] = self.scorer.score(setup.model, setup.global_test)
        ask_global = global_tensors is None
        if not (self.cfg.eval.local or ask_global):
            return out
        messages, join_bytes, join_payload = [], 0, 0
        for cid, peer in sorted(peers.items()):
            records, payload, _ = self.downlink_records(server, cid, peer)
            if "join" in records:  # one-time setup traffic: counted, unlike evaluation traffic
                join_bytes += codec.wire_bytes(records["join"])
                join_payload += payload - tensor_bytes(self.method.downlink(server, cid))
                peer.joined = True
            records["config"] = ConfigRecord({"round": rnd, "global_test": ask_global})
            messages.append(self.message(peer.node_id, EVALUATE, records, self.deploy.query_timeout))
        good, failed = self.exchange(messages, max(self.deploy.query_timeout, self.deploy.round_timeout))
        cid_of = {p.node_id: c for c, p in peers.items()}
        per_client_global, per_client_local, extra_local, evaluated = [], [], {}, 0
        failed = {cid_of[n]: why for n, why in failed.items()}
        for node, reply in sorted(good.items(), key=lambda kv: cid_of[kv[0]]):
            try:  # exactly the scorer's scores, or the reply is left out of the means
                ev = replies.read_evaluation(reply, self.score_names)
            except codec.ReplyError as err:
                failed[cid_of[node]] = f"refused: {err}"
                self.log(f"round {rnd}: client {cid_of[node]}'s evaluation refused ({err})")
                continue
            evaluated += 1  # every client, trained or not, as in-process
            if ev.local is not None:
                per_client_local.append(ev.local)
            for key, scores in ev.extra.items():
                extra_local.setdefault(key, []).append(scores)
            if ev.global_ is not None:
                per_client_global.append(ev.global_)
        out["clients_evaluated"] = evaluated
        out["join_bytes_down"], out["join_payload_bytes_down"] = join_bytes, join_payload
        if failed:
            out["eval_failed"] = {str(c): why for c, why in sorted(failed.items())}
        if per_client_global:
            out["global"] = mean_scores(per_client_global)
        if per_client_local and self.cfg.eval.local:
            out["local"] = spread(per_client_local)
            if final:  # each client's own scores, as in-process
                out["local_by_client"] = per_client_local
            out.update({key: spread(values) for key, values in extra_local.items()})
        return out

    # ------------------------------------------------------------ the run (a backend of RunLoop)
    def run(self, resume: bool = False, resume_from: int | None = None) -> list[dict]:
        """Every round still to run, from the start or (``resume``) from the newest readable
        checkpoint or round ``resume_from``'s (:meth:`RunLoop.run`); the records of all rounds."""
        cfg = self.cfg
        loop = RunLoop(
            self, cfg.train.rounds, cfg.eval.every, self.deploy.min_results, self.deploy.max_skipped_rounds,
            self.checkpoints, self.fingerprint, self.on_start, self.on_round, self.log,
            hint="Rerun with --resume once enough nodes are up.",
        )  # fmt: skip
        try:
            return loop.run(resume, resume_from)
        except SkippedRoundsError as err:
            raise DeploymentError(str(err)) from None

    def load_checkpoint(self, checkpoints: Checkpoints, resume_from: int | None) -> Checkpoint:
        return checkpoints.load(self.fingerprint, None, resume_from)  # personal state is on the nodes

    def fresh(self) -> None:
        pass  # the server keeps nothing of a run but its checkpoints

    def prepare(self, server: ServerState) -> None:
        """What an update looks like, who holds which client id (a resumed run keeps it),
        and the nodes the first round needs."""
        self.uplink_like = {n: t for n, t in self.setup.initial.items() if n in set(self.method.shared_names)}
        self.ids.resume(server)
        self.wait_for_nodes()

    def fit(self, server: ServerState, step: Round) -> Fitted:
        """Round ``step``'s training: the roll call, then the sampled clients' rounds."""
        peers = self.peers = self.roll_call(step.number)
        ignored, self.ignored = self.ignored, {}
        server = self.ids.kept_in(server)  # node authentication: who holds which client id
        if self.cfg.privacy.mode == "sample":
            server = self.dp_sgd(server, peers)
        returned, record = self.fit_round(server, step, peers)
        if ignored:
            record["ignored_nodes"] = {str(n): why for n, why in sorted(ignored.items())}
        secure_count = len(record["clients_returned"]) if record.get("secure_aggregation") else None
        return Fitted(server, returned, record, secure_count)

    def amend(self, record: dict) -> None:
        """The join messages an evaluation carried count as the round's downlink."""
        record["bytes_down"] += record.pop("join_bytes_down", 0)
        record["payload_bytes_down"] += record.pop("join_payload_bytes_down", 0)

    def held(self) -> tuple[dict, list[int]]:
        return {}, []  # personal state lives on the nodes

    def settle(self) -> None:
        pass
