"""One client of a deployment: its own data, its own model copy, its personal state on
its own disk. Transport-free: the Flower ClientApp turns messages into these calls.

A node is identified by its client id (Flower's ``partition-id`` node config). Its data
is either that partition of the experiment's corpus (a deployment that mirrors a
simulation, e.g. the integration tests) or a file of its own (``data-file``: a real
deployment), whose labels are mapped onto the federation's class list.

Personal state never leaves the node. After each local round it is saved per round
(``state_dir/client-<cid>.pt``, written atomically, the last two rounds kept), so a
restarted node rejoins with its state and a resumed server that repeats round ``t``
gets exactly what an uninterrupted run would: a fit for round ``t`` starts from the
newest snapshot older than ``t``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedpeft.config import ExperimentConfig
from fedpeft.data import partition as P
from fedpeft.data.sources import load_client_file
from fedpeft.data.task import encode
from fedpeft.engines.inprocess import derive_seed
from fedpeft.experiment import attach_method, build, fingerprint
from fedpeft.methods.base import ClientData, FitResult, Method, Tensors, load_tensors
from fedpeft.metrics.classification import predict, scores
from fedpeft.models.backbone import TaskModel, build_model

KEEP_SNAPSHOTS = 2


@dataclass
class Evaluation:
    trained: bool
    local: dict[str, float]
    global_: dict[str, float]


class Node:
    """A client's side of the protocol: ``fit`` and ``evaluate`` on its own data."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        cid: int,
        class_names: list[str],
        *,
        data_file: Path | None = None,
        state_dir: Path | None = None,
    ):
        self.cfg, self.cid = cfg, cid
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        if data_file is None:  # partition ``cid`` of the experiment's own corpus
            if not 0 <= cid < cfg.partition.num_clients:
                raise ValueError(
                    f"node config partition-id={cid}: outside 0..{cfg.partition.num_clients - 1} "
                    f"(partition.num_clients={cfg.partition.num_clients})"
                )
            setup = build(cfg)
            self.model, self.method, self.initial = setup.model, setup.method, setup.initial
            self.client, self.global_test = setup.clients[cid], setup.global_test
        else:
            self.model, tokenizer = build_model(cfg.model, len(class_names), cfg.seed)
            self.client = self._own_data(data_file, class_names, tokenizer)
            self.global_test = None  # a real client holds only its own data
            self.method, self.initial = attach_method(cfg, self.model)
        self.model: TaskModel
        self.method: Method
        self.joined = False  # the method's join message applied to this node's backbone
        self.state_path = None if state_dir is None else Path(state_dir) / f"client-{cid}.pt"
        self.tag = f"{fingerprint(cfg)}:{data_file or 'partition'}"
        self.snapshots: dict[int, Tensors] = self._load_snapshots()

    def _own_data(self, path: Path, class_names: list[str], tokenizer) -> ClientData:
        texts, labels = load_client_file(path, self.cfg.data, class_names)
        rng = np.random.default_rng([self.cfg.seed, self.cid])
        (train,), (test,) = P.split_local_test([np.arange(len(labels))], self.cfg.partition.local_test_fraction, rng)
        enc = encode(texts, labels, tokenizer, self.cfg.data.max_length)
        return ClientData(self.cid, enc.subset(train), enc.subset(test))

    # ---------------------------------------------------------------- personal state
    def _load_snapshots(self) -> dict[int, Tensors]:
        if self.state_path is None or not self.state_path.is_file():
            return {}
        saved = torch.load(self.state_path, weights_only=True)
        if saved.get("tag") != self.tag:  # another experiment's state: start afresh
            return {}
        return saved["snapshots"]

    def _save_snapshots(self) -> None:
        if self.state_path is None:
            return
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_path.with_suffix(".tmp")
        torch.save({"tag": self.tag, "snapshots": self.snapshots}, tmp)
        os.replace(tmp, self.state_path)

    def personal_before(self, rnd: int) -> Tensors | None:
        """The personal state as it was after the newest local round before ``rnd``."""
        done = [r for r in self.snapshots if r < rnd]
        return self.snapshots[max(done)] if done else None

    @property
    def last_round(self) -> int:
        return max(self.snapshots, default=0)

    # ---------------------------------------------------------------- protocol
    def join(self, message: Tensors) -> None:
        self.method.join(self.model, message)
        self.joined = True

    def fit(self, received: Tensors, rnd: int) -> FitResult:
        """Local round ``rnd``, seeded exactly as the in-process engine seeds it."""
        seed = derive_seed(self.cfg.seed, rnd, self.cid)
        torch.manual_seed(seed)
        personal = self.personal_before(rnd)
        if personal is None:
            personal = self.method.init_client(self.model, self.initial, self.client)
        result = self.method.fit(self.model, received, personal, self.client, torch.Generator().manual_seed(seed))
        result.cid = self.cid
        self.snapshots = {r: t for r, t in self.snapshots.items() if r < rnd}
        self.snapshots[rnd] = result.personal
        self.snapshots = dict(sorted(self.snapshots.items())[-KEEP_SNAPSHOTS:])
        self._save_snapshots()
        return result

    def evaluate(self, received: Tensors, rnd: int, on_global_test: bool, batch_size: int) -> Evaluation:
        """Scores of this client's model (after round ``rnd``) on its local test split and,
        if asked and held, on the global test set. A client with personal state that has
        not trained yet has no model of its own to score."""
        personal = self.personal_before(rnd + 1)
        if personal is None:
            if self.method.personal_names:
                return Evaluation(False, {}, {})
            personal = self.method.init_client(self.model, self.initial, self.client)
        tensors = self.method.eval_state(self.model, received, personal, self.client)
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        if set(tensors) != trainable:
            raise RuntimeError(f"method {self.method.name}: eval state lacks {sorted(trainable - set(tensors))[:3]}")
        load_tensors(self.model, tensors)
        local = {}
        if len(self.client.test):
            local = scores(predict(self.model, self.client.test, batch_size), self.client.test.labels.numpy())
        global_ = {}
        if on_global_test and self.global_test is not None:
            global_ = scores(predict(self.model, self.global_test, batch_size), self.global_test.labels.numpy())
        return Evaluation(True, local, global_)

