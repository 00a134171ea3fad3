"""Experiment trackers (``log.to``): every completed round's numbers and the resolved
config, sent through TensorBoard, MLflow or W&B themselves.

The ids of a run's tracked runs are kept in ``output_dir/tracking.json``, so that
``--resume`` continues the same tracked run instead of opening a new one. A resumed
run repeats the rounds after its checkpoint, which the interrupted run may already have
logged: TensorBoard drops its events from the first repeated round on (``purge_step``);
MLflow and W&B keep whatever they were sent, so they are sent only the rounds after the
last one they hold (a repeated round reproduces the interrupted one: see
docs/reliability.md).

No tracker is given a credential to record: the config they get is redacted
(:func:`fedpeft.config.public_config`), W&B's copy of the command line too, and an MLflow
server's credentials reach MLflow through the environment variables it reads them from
(:func:`mlflow_target`).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fedpeft.config import ConfigError, ExperimentConfig, public_config, scrub
from fedpeft.config.secrets import (
    from_environment,
    redact_uri,
    redacted_params,
    uri_credentials,
    with_credentials,
)

STATE_FILE = "tracking.json"

#: Record keys that are not one number a round: client ids, per-client values (kept in
#: metrics.jsonl), LoRA update-variation series and one-off set-up figures.
NOT_SCALARS = frozenset(
    {"round", "clients", "clients_returned", "local_by_client", "update_variation", "setup"}
)


def scalars(record: dict) -> dict[str, float]:
    """A round's numbers by slash-joined key: ``loss``, ``global/accuracy``,
    ``local/accuracy_p10``, ``bytes_up``, ``time_train``, ``privacy/epsilon``,
    ``drift/mean``, ... (whatever the record holds)."""
    out: dict[str, float] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key not in NOT_SCALARS:
                    walk(f"{prefix}/{key}" if prefix else str(key), item)
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[prefix] = float(value)

    walk("", record)
    return out


def flat_config(cfg: ExperimentConfig) -> dict[str, str]:
    """The resolved config as dotted keys (``train.lr``, ``method.name``, ...) and text values,
    its secrets redacted (:func:`fedpeft.config.public_config`)."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            out[prefix] = json.dumps(value) if isinstance(value, list | dict) else str(value)

    walk("", public_config(cfg))
    return out


def _package(module: str, tracker: str):
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(
            f"log.to {tracker}: the package it needs is not installed ({err}); "
            f"pip install 'fedpeft[{tracker}]'"
        ) from err


class TensorBoard:
    """Event files under ``output_dir/tensorboard`` (``tensorboard --logdir`` them); the
    config as a text summary."""

    name = "tensorboard"

    def __init__(self, cfg: ExperimentConfig, state: dict | None, done: int) -> None:
        writer_cls = _package("torch.utils.tensorboard", self.name).SummaryWriter
        log_dir = Path(cfg.output_dir) / "tensorboard"
        if state is None:  # a fresh run: no earlier run's events in its directory
            shutil.rmtree(log_dir, ignore_errors=True)
        # Events from round done + 1 on belong to the interrupted run: they are dropped
        self.writer = writer_cls(str(log_dir), purge_step=done + 1 if state is not None else None)
        if state is None:
            text = "\n".join(f"    {k}: {v}" for k, v in flat_config(cfg).items())
            self.writer.add_text("config", text, 0)
        self.state = {"log_dir": str(log_dir)}

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


#: The environment variables MLflow reads a tracking server's HTTP basic auth from
#: (mlflow.environment_variables; a bearer token it reads from MLFLOW_TRACKING_TOKEN)
MLFLOW_USERNAME, MLFLOW_PASSWORD = "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"


def mlflow_target(uri: str) -> tuple[str, dict[str, str]]:
    """The tracking URI to give MLflow for ``log.mlflow_uri`` and the environment variables to
    set while it runs. A server's (http, https) credentials leave the URI for the variables
    MLflow reads them from (so that no MLflow message or record can hold them); a database's
    stay in the URI, its driver's only way to get them. A credential that a written config
    redacted (``***``) is the environment's: MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD."""
    key = "log.mlflow_uri"
    if params := redacted_params(uri):
        raise ConfigError(
            f"{key}: the value of its query parameter {params[0]!r} was redacted (***) in the config this "
            f"run read; give the URI in full again (--set {key}=...), or the credential through the "
            "environment"
        )
    bare, user, password = uri_credentials(uri)
    user = from_environment(user, key, "user", MLFLOW_USERNAME)
    password = from_environment(password, key, "password", MLFLOW_PASSWORD)
    if urlsplit(bare).scheme.lower() not in ("http", "https"):
        return with_credentials(bare, user, password), {}
    env = {MLFLOW_USERNAME: user, MLFLOW_PASSWORD: password}
    return bare, {name: value for name, value in env.items() if value is not None}


class MLflow:
    """One MLflow run (``log.mlflow_uri``, by default a local store in
    ``output_dir/mlflow.db``): the config as params, the rounds as metrics by step. A
    server's credentials in the URI reach MLflow through its own environment variables
    (:func:`mlflow_target`), set while the run is open."""

    name = "mlflow"

    def __init__(self, cfg: ExperimentConfig, state: dict | None, done: int) -> None:
        mlflow = _package("mlflow", self.name)
        from mlflow.entities import Metric

        self.Metric = Metric
        # MLflow 3 refuses its old file store by default: a SQLite file is its local store now
        uri = cfg.log.mlflow_uri or f"sqlite:///{(Path(cfg.output_dir) / 'mlflow.db').resolve()}"
        target, env = mlflow_target(uri)
        self.saved_env = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            self._open(mlflow, cfg, state, target)
        except BaseException:
            self._restore_env()
            raise
        self.state = {"tracking_uri": redact_uri(uri), "run_id": self.run_id, "last_round": self.last}

    def _open(self, mlflow, cfg: ExperimentConfig, state: dict | None, target: str) -> None:
        from mlflow.entities import Param

        self.client = mlflow.MlflowClient(tracking_uri=target)
        if state is None:
            name = cfg.log.mlflow_experiment
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found else self.client.create_experiment(name)
            self.run_id = self.client.create_run(experiment, run_name=cfg.name).info.run_id
            params = [Param(k, v[:6000]) for k, v in flat_config(cfg).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
            self.last = 0
        else:
            self.run_id, self.last = state["run_id"], state["last_round"]
            self.client.update_run(self.run_id, status="RUNNING")

    def log(self, step: int, values: dict[str, float]) -> None:
        if step <= self.last:  # already logged before the interruption
            return
        now = int(time.time() * 1000)
        metrics = [self.Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        self.last = self.state["last_round"] = step

    def close(self, failed: bool) -> None:
        try:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")
        finally:
            self._restore_env()

    def _restore_env(self) -> None:
        """The credentials set for this run leave the environment with it."""
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class WandB:
    """One W&B run, offline by default (``log.wandb_mode``): files under
    ``output_dir/wandb`` that ``wandb sync`` uploads later."""

    name = "wandb"

    def __init__(self, cfg: ExperimentConfig, state: dict | None, done: int) -> None:
        wandb = _package("wandb", self.name)
        out = Path(cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        argv = sys.argv
        # W&B files the command line with the run (its metadata's "args"): a credential given
        # there (--set log.mlflow_uri=https://user:TOKEN@host) would be filed with it
        sys.argv = [scrub(arg) for arg in argv]
        try:
            self.run = wandb.init(
                project=cfg.log.wandb_project,
                name=cfg.name,
                id=state["run_id"] if state else None,  # None: W&B makes one
                resume="allow",
                dir=str(out),
                mode=cfg.log.wandb_mode,
                config=public_config(cfg),
                settings=wandb.Settings(quiet=True),  # no run summary printed at its end
            )
        finally:
            sys.argv = argv
        self.last = state["last_round"] if state else 0
        self.state = {"run_id": self.run.id, "last_round": self.last}

    def log(self, step: int, values: dict[str, float]) -> None:
        if step <= self.last:
            return
        self.run.log(values, step=step)
        self.last = self.state["last_round"] = step

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


TRACKERS = {cls.name: cls for cls in (TensorBoard, MLflow, WandB)}


class Tracking:
    """The trackers ``cfg.log.to`` names, for one run of ``cfg`` on either engine: the
    engine's ``on_start`` opens them with the records the run continues from, its
    ``on_round`` logs each completed round, ``close`` ends them."""

    def __init__(self, cfg: ExperimentConfig, resume: bool) -> None:
        self.cfg, self.resume = cfg, resume
        self.path = Path(cfg.output_dir) / STATE_FILE
        self.open: list = []
        for name in cfg.log.to:  # fail now, not after the first round, on a missing package
            _package(name, name)  # each tracker's package is named as the tracker
        if "mlflow" in cfg.log.to and cfg.log.mlflow_uri:  # or a credential the environment lacks
            mlflow_target(cfg.log.mlflow_uri)

    def start(self, done: list[dict]) -> None:
        """Open (or, resuming, reopen) the trackers; ``done``: the records kept from before."""
        if not self.cfg.log.to or self.open:
            return
        kept = json.loads(self.path.read_text()) if self.resume and self.path.is_file() else {}
        last = done[-1]["round"] if done else 0
        self.open = [TRACKERS[name](self.cfg, kept.get(name), last) for name in self.cfg.log.to]
        self._save()

    def round(self, record: dict) -> None:
        if self.open:
            values = scalars(record)
            for tracker in self.open:
                tracker.log(record["round"], values)
            self._save()

    def close(self, failed: bool = False) -> None:
        for tracker in self.open:
            tracker.close(failed)
        self.open = []

    def __enter__(self) -> Tracking:
        return self

    def __exit__(self, kind, *_) -> None:
        self.close(failed=kind is not None)

    def _save(self) -> None:
        state = {tracker.name: tracker.state for tracker in self.open}
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.path)
