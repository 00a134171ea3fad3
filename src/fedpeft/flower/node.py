"""One client of a deployment: its own data, its own model copy, its personal state on
its own disk. Transport-free: the Flower ClientApp turns messages into these calls.

A node is identified by its client id (Flower's ``partition-id`` node config). Its data
is either that partition of the experiment's corpus (a deployment that mirrors a
simulation, e.g. the integration tests) or a file of its own (``data-file``: a real
deployment), whose labels are mapped onto the federation's class list.

Personal state never leaves the node. After each local round it is saved per round
(``state_dir/client-<cid>-personal.pt``, written atomically, the states of its last
``checkpoint.keep`` rounds kept, and at least two), so a restarted node rejoins with its
state and a resumed server that repeats round ``t`` (``--resume``, or ``--resume-from``
any kept checkpoint) gets exactly what an uninterrupted run would: a fit for round ``t``
starts from the newest snapshot older than ``t``. A round whose state the node no longer
keeps is refused, never trained from another.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from fedpeft.config import ExperimentConfig
from fedpeft.data import partition as P
from fedpeft.data.encoding import encode_corpus
from fedpeft.data.sources import load_client_file, load_corpus
from fedpeft.data.split import make_split
from fedpeft.data.task import Encoded, encode
from fedpeft.engines import compress, guard, privacy, scaffold
from fedpeft.engines.inprocess import derive_seed
from fedpeft.engines.local import RoundContext, SampleDP
from fedpeft.engines.round import send
from fedpeft.experiment import attach_method, fingerprint, place
from fedpeft.flower.codec import Orders
from fedpeft.methods.base import ClientData, FitResult, Job, Method, Tensors, load_tensors
from fedpeft.metrics.scorers import Scorer, SpanScorer, scorer_for
from fedpeft.models.backbone import TaskModel, build_model, load_tokenizer
from fedpeft.models.device import resolve_device
from fedpeft.optional import bitsandbytes_unless, uses_bitsandbytes

KEEP_SNAPSHOTS = 2


@dataclass
class Evaluation:
    trained: bool
    local: dict[str, float]
    global_: dict[str, float]
    extra: dict[str, dict[str, float]] = field(default_factory=dict)  # local_<name>: another client model


def pack(data: Encoded) -> dict:
    """``data`` as a node saves it: its tensors and its per-row extras (QA's offsets)."""
    return {"fields": data.fields(), "aux": dict(data.aux)}


def unpack(saved: dict | list) -> Encoded:
    """The inverse of :func:`pack` (a list: the tensors alone, as nodes saved them before)."""
    if isinstance(saved, list):
        return Encoded(*saved)
    return Encoded(*saved["fields"], aux=saved["aux"])


def scoring_facts(corpus, sets: list[Encoded]) -> dict:
    """What a node's scorer needs of the corpus besides its own rows: NER's tag names;
    for extractive QA the passage and gold answers of each example its rows come from
    (by the corpus-wide example id its features carry)."""
    if corpus.tag_names is not None:
        return {"tag_names": list(corpus.tag_names)}
    if corpus.train_contexts is None:
        return {"tag_names": None}
    contexts = corpus.train_contexts + corpus.test_contexts
    answers = [[text for text, _ in a] for a in corpus.train_answers + corpus.test_answers]
    ids = sorted({int(i) for d in sets for i in d.aux["example_ids"].tolist()})
    return {"contexts": {i: contexts[i] for i in ids}, "answers": {i: answers[i] for i in ids}}


class NotSetUp(RuntimeError):
    """A node asked to train or evaluate before it answered the roll call."""


class Node:
    """A client's side of the protocol: ``fit`` and ``evaluate`` on its own data.

    Flower starts a fresh process for every message, so everything a node must remember
    lives in ``state_dir``: its encoded data and the federation's class list (written at
    the roll call), the method's join message once applied, and its personal state. A
    warm node's worker (:mod:`fedpeft.flower.worker`) keeps the object itself.
    """

    models_built = 0  # in this process: a warm node builds its model once

    def __init__(
        self,
        cfg: ExperimentConfig,
        cid: int,
        *,
        state_dir: Path | None,
        class_names: list[str] | None = None,
        data_file: Path | None = None,
    ):
        self.cfg, self.cid = cfg, cid
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if data_file is None and not 0 <= cid < cfg.partition.num_clients:
            raise ValueError(
                f"node config partition-id={cid}: outside 0..{cfg.partition.num_clients - 1} "
                f"(partition.num_clients={cfg.partition.num_clients})"
            )
        self.state_dir = None if state_dir is None else Path(state_dir)
        self._seen: dict[str, tuple[int, int] | None] = {}  # each file as this object last read or wrote it
        self.tag = f"{fingerprint(cfg)}:{data_file or 'partition'}:{cid}"
        data = self._load("data")
        if data is None:
            if class_names is None:
                raise NotSetUp(
                    f"client {cid}: no data set up in {self.state_dir}; it answers the roll call first"
                )
            data = self._prepare_data(class_names, data_file)
            self._save("data", data)
        self.class_names: list[str] = data["class_names"]
        self.client = ClientData(self.cid, unpack(data["train"]), unpack(data["test"]))
        self.global_test = unpack(data["global_test"]) if data["global_test"] else None
        self.scoring: dict = data.get("scoring", {})  # what the task's scorer needs besides the model
        self._scorer: Scorer | None = None
        self._join = self._load("join")  # the method's join message, once received
        self._learner: tuple[TaskModel, Method, Tensors] | None = None  # built on first use
        self.snapshots: dict[int, Tensors] = self._load("personal") or {}
        self.forgotten: int = self._load("forgotten") or 0  # the newest round whose state was dropped

    def accountant(self) -> privacy.Accountant | None:
        """The run's privacy accountant, as the server computes it (None without privacy)."""
        if not hasattr(self, "_accountant"):
            self._accountant = privacy.accountant_for(self.cfg)
        return self._accountant

    def dp_sgd(self, sigma: float | None) -> SampleDP | None:
        """``privacy.mode sample``: DP-SGD's settings at the server's ``sigma``, once this
        client's own plan is checked against the budget; None in any other mode."""
        p, train = self.cfg.privacy, self.cfg.train
        if p.mode != "sample":
            return None
        if sigma is None:
            raise ValueError(
                "privacy.mode sample: the training message carries no noise multiplier (dp_sigma)"
            )
        rows = len(self.client.train)
        privacy.check_client_plan(
            p, rows, self.method.private_steps(rows, train), train.batch_size, sigma, train.rounds
        )
        return SampleDP(p.clip, sigma, train.batch_size)

    @property
    def joined(self) -> bool:
        return self._join is not None

    def learner(self) -> tuple[TaskModel, Method, Tensors]:
        """The model, the method and the initial trainable tensors, built on first use (a
        roll call needs none of them): the same seeded construction as the in-process
        engine's, so the same initial adapters; the join message applied if held. The model
        and the data go to this node's own ``train.device`` (``auto``: its GPU if it has one)."""
        if self._learner is None:
            tags = self.scoring.get("tag_names")  # NER: one output per tag, as in-process
            outputs = len(tags) if tags is not None else len(self.class_names)
            device = str(resolve_device(self.cfg.train.device))  # a quantised backbone loads in place
            with bitsandbytes_unless(uses_bitsandbytes(self.cfg)):
                model, _ = build_model(self.cfg.model, outputs, self.cfg.seed, self.cfg.data.task, device)
                method, initial = attach_method(self.cfg, model)
            device = place(model, self.cfg.train)
            self.client = ClientData(self.cid, self.client.train.to(device), self.client.test.to(device))
            if self.global_test is not None:
                self.global_test = self.global_test.to(device)
            if self._join is not None:
                method.join(model, self._join)
            self._learner = model, method, initial
            Node.models_built += 1
        return self._learner

    @property
    def model(self) -> TaskModel:
        return self.learner()[0]

    @property
    def method(self) -> Method:
        return self.learner()[1]

    @property
    def initial(self) -> Tensors:
        return self.learner()[2]

    def _prepare_data(self, class_names: list[str], data_file: Path | None) -> dict:
        """This client's encoded train and local-test splits (and the global test set when
        the node mirrors a simulation): the same rows and padding as the in-process engine."""
        cfg = self.cfg
        tokenizer = load_tokenizer(cfg.model)
        scoring: dict = {}
        if data_file is None:  # partition ``cid`` of the experiment's corpus
            corpus = load_corpus(cfg.data, cfg.seed)
            if corpus.class_names != class_names:
                raise ValueError(
                    f"client {self.cid}: the server's class list differs from this node's corpus"
                )
            split = make_split(cfg, corpus)
            pool, global_test = encode_corpus(corpus, tokenizer, cfg.data)
            client = ClientData(
                self.cid, pool.examples(split.train[self.cid]), pool.examples(split.test[self.cid])
            )
            scoring = scoring_facts(corpus, [client.train, client.test, global_test])
        else:
            if cfg.data.task != "classification":
                raise ValueError(
                    f"node config data-file={data_file}: a node's own file holds classification rows so "
                    f"far; data.task {cfg.data.task} deploys with partitions of the experiment's corpus "
                    "(no data-file)"
                )
            texts, labels = load_client_file(data_file, cfg.data, class_names)
            rng = np.random.default_rng([cfg.seed, self.cid])
            (train,), (test,) = P.split_local_test(
                [np.arange(len(labels))], cfg.partition.local_test_fraction, rng
            )
            enc = encode(texts, labels, tokenizer, cfg.data.max_length)
            client, global_test = ClientData(self.cid, enc.subset(train), enc.subset(test)), None
        return {
            "class_names": list(class_names),
            "train": pack(client.train),
            "test": pack(client.test),
            "global_test": pack(global_test) if global_test is not None else [],
            "scoring": scoring,
        }

    @property
    def scorer(self) -> Scorer:
        """The task's scorer (``metrics.scorers``), as the in-process engine's: the same
        scores of the same model on the same examples."""
        if self._scorer is None:
            cfg, facts, ev = self.cfg, self.scoring, self.cfg.eval
            if cfg.data.task == "extractive_qa":  # the passages and answers of this node's examples
                self._scorer = SpanScorer(
                    facts["contexts"], facts["answers"], ev.batch_size, ev.max_answer_tokens, ev.batch_tokens
                )
            else:
                tokenizer = load_tokenizer(cfg.model) if cfg.data.task == "causal_lm" else None
                self._scorer = scorer_for(cfg.data.task, tokenizer, ev, SimpleNamespace(**facts))
        return self._scorer

    # ---------------------------------------------------------------- the node's disk
    def _path(self, what: str) -> Path:
        assert self.state_dir is not None
        return self.state_dir / f"client-{self.cid}-{what}.pt"

    def _stamp(self, what: str) -> tuple[int, int] | None:
        """When ``what``'s file last changed, and its size (None: no such file)."""
        try:
            st = self._path(what).stat()
        except FileNotFoundError:
            return None
        return st.st_mtime_ns, st.st_size

    def changed_on_disk(self) -> bool:
        """Whether a file of this node's changed since this object last read or wrote it
        (e.g. its state directory was cleared between runs): a kept object is stale then."""
        return self.state_dir is not None and any(self._stamp(w) != s for w, s in self._seen.items())

    def _load(self, what: str):
        if self.state_dir is not None:
            self._seen[what] = self._stamp(what)
        if self.state_dir is None or not self._path(what).is_file():
            return None
        saved = torch.load(self._path(what), weights_only=True, map_location="cpu")
        return saved["value"] if saved.get("tag") == self.tag else None  # another experiment's: ignore

    def _save(self, what: str, value) -> None:
        """Write atomically: a node killed mid-write keeps the previous file."""
        if self.state_dir is None:
            return
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self._path(what)
        tmp = path.with_suffix(".tmp")
        torch.save({"tag": self.tag, "value": value}, tmp)
        os.replace(tmp, path)
        self._seen[what] = self._stamp(what)

    # ---------------------------------------------------------------- personal state
    def personal_before(self, rnd: int) -> Tensors | None:
        """The personal state as it was after the newest local round before ``rnd``."""
        return self.kept_before(rnd)[0]

    def kept_before(self, rnd: int) -> tuple[Tensors | None, Tensors]:
        """What the client kept after its newest local round before ``rnd``: its personal
        state (None before its first round) and its compressed uplink's residual."""
        done = [r for r in self.snapshots if r < rnd]
        if not done and 0 < self.forgotten < rnd:  # its state before rnd was dropped: do not guess
            raise ValueError(
                f"client {self.cid}: round {rnd} would start from its state after round {self.forgotten} "
                f"or earlier, which this node no longer keeps (it keeps its last {self.keep} rounds' "
                "states: checkpoint.keep); resume from a later round"
            )
        if not done:
            return None, {}
        return compress.residual_of(self.snapshots[max(done)])

    @property
    def keep(self) -> int:
        """How many of its rounds' states the node keeps: as many as the server keeps checkpoints."""
        return max(KEEP_SNAPSHOTS, self.cfg.checkpoint.keep)

    @property
    def last_round(self) -> int:
        return max(self.snapshots, default=0)

    # ---------------------------------------------------------------- protocol
    def join(self, message: Tensors) -> None:
        self.method.join(self.model, message)
        self._join = message
        self._save("join", message)

    def fit(
        self, received: Tensors, orders: Orders, control: Tensors | None = None
    ) -> tuple[FitResult, Tensors]:
        """Local round ``orders.round``, seeded exactly as the in-process engine seeds it
        (``control``: SCAFFOLD's server control, when the run corrects drift; the client's
        own control is part of its personal state). Returns the result and its uplink as it
        is sent: clipped to ``orders.clip`` and, in local mode, noised (``privacy.mode``),
        then encoded by ``comm.uplink`` (the update from ``received``, plus the residual
        this client kept; the result's own uplink stays the trained tensors). Under adaptive
        clipping the result's metrics say whether the update fitted within the bound
        (``fitted``: the report the server counts with noise; user-level DP trusts the
        server). ``orders.lr``: the round's rate (``train.lr_schedule``; None: ``train.lr``).
        ``orders.control_applied``: with SCAFFOLD, the last round whose control update of
        this client the server applied (its new control is held back until then:
        :func:`fedpeft.engines.scaffold.confirmed`). ``orders.sigma``: DP-SGD's noise
        multiplier (``privacy.mode sample``: every local step clips each example's gradient
        and adds noise, as in-process), which the server calibrated; the client first checks
        it (:meth:`dp_sgd`)."""
        rnd, clip, lr = orders.round, orders.clip, orders.lr
        seed = derive_seed(self.cfg.seed, rnd, self.cid)
        torch.manual_seed(seed)
        personal, residual = self.kept_before(rnd)
        if personal is None:
            personal = self.method.init_client(self.model, self.initial, self.client)
        if control is not None:  # SCAFFOLD: the control the server's c counts
            personal = scaffold.confirmed(personal, orders.control_applied or 0)
        train = self.cfg.train if lr is None else self.cfg.train.model_copy(update={"lr": lr})
        context = RoundContext(train, self.dp_sgd(orders.sigma))
        job = Job(received, personal, self.client, seed, rnd, control or {}, context=context)
        (result,) = self.method.fit_cohort(self.model, [job])  # a cohort of one
        result.cid = self.cid
        kept = result.personal if control is None else scaffold.held(personal, result.personal, rnd)
        if guard.nonfinite_reason(result) is not None:  # the server drops it; keep the last finite state
            return result, result.uplink
        if (dp := self.accountant()) is not None and clip is None:
            raise ValueError(f"privacy.mode {dp.mode}: round {rnd}'s training message carries no clip bound")
        sigma = dp.sigma if dp is not None else 0.0
        sent = send(self.method, self.cfg.privacy, self.cfg.comm.uplink, received, result.uplink, residual,
                    clip=clip if clip is not None else float("inf"), sigma=sigma, seed=seed)  # fmt: skip
        if (
            dp is not None and self.cfg.privacy.adaptive_clip
        ):  # the report adaptive clipping counts (user mode)
            result.metrics["fitted"] = float(sent.fitted)
        self.snapshots = {r: t for r, t in self.snapshots.items() if r < rnd}
        self.snapshots[rnd] = compress.with_residual(kept, sent.residual)
        dropped = sorted(self.snapshots)[: -self.keep]
        if dropped:
            self.forgotten = max(dropped[-1], self.forgotten)
            self._save("forgotten", self.forgotten)
        self.snapshots = {r: t for r, t in self.snapshots.items() if r not in dropped}
        self._save("personal", self.snapshots)
        return result, sent.message

    def evaluate(self, received: Tensors, rnd: int, on_global_test: bool) -> Evaluation:
        """Scores of this client's model (after round ``rnd``) on its local test split and,
        if asked and held, on the global test set. A client that has not trained yet is
        scored too, with its initial personal state, as in-process."""
        personal = self.personal_before(rnd + 1)
        trained = personal is not None
        if personal is None:
            personal = self.method.init_client(self.model, self.initial, self.client)
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}

        def score(state: Tensors, data: Encoded) -> dict[str, float]:
            """The client's model ``state`` on ``data``, scored as in-process (a cohort of one)."""
            return self.scorer.score_clients(self.model, [state], data, partial(load_tensors, self.model))[0]

        extra = {}
        for name, state in self.method.extra_eval_states(self.model, received, personal, self.client).items():
            if len(self.client.test):
                extra[name] = score(state, self.client.test)
        tensors = self.method.eval_state(self.model, received, personal, self.client)
        if missing := sorted(trainable - set(tensors))[:3]:  # frozen ones besides: FedEx-LoRA's
            raise RuntimeError(f"method {self.method.name}: eval state lacks {missing}")
        local = score(tensors, self.client.test) if len(self.client.test) else {}
        global_ = {}
        if on_global_test and self.global_test is not None:
            global_ = score(tensors, self.global_test)
        return Evaluation(trained, local, global_, extra)
