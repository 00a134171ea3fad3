"""The whole experiment config, :class:`ExperimentConfig`: one section per layer, and the
checks that read more than one section.

The ``method`` key is validated by the method config registry
(:mod:`fedpeft.config.methods.registry`) when a config is validated: its ``name`` picks
the class of its options; an unknown name is refused naming the known ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from fedpeft.config.comm import CommConfig
from fedpeft.config.common import Strict
from fedpeft.config.data import DataConfig, PartitionConfig
from fedpeft.config.deploy import DeployConfig
from fedpeft.config.evaluation import EvalConfig
from fedpeft.config.methods.registry import MethodOptions
from fedpeft.config.model import ModelConfig
from fedpeft.config.output import CheckpointConfig, ExportConfig, LogConfig
from fedpeft.config.privacy import PrivacyConfig
from fedpeft.config.server import FaultsConfig, ServerConfig
from fedpeft.config.train import TrainConfig


class ExperimentConfig(BaseModel):
    """One federated experiment, end to end."""

    model_config = Strict

    name: str = "experiment"
    seed: int = Field(0, ge=0)
    output_dir: Path = Path("runs/experiment")
    data: DataConfig = DataConfig()
    partition: PartitionConfig = PartitionConfig()
    model: ModelConfig = ModelConfig()
    method: MethodOptions = Field(  # its JSON schema titled as the union's was
        default_factory=lambda: {"name": "fedlr"}, validate_default=True, title="Method"
    )
    train: TrainConfig = TrainConfig()
    server: ServerConfig = ServerConfig()
    faults: FaultsConfig = FaultsConfig()
    comm: CommConfig = CommConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    eval: EvalConfig = EvalConfig()
    export: ExportConfig = ExportConfig()
    deploy: DeployConfig = DeployConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _checkpoint_switch(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _consistent(self) -> ExperimentConfig:
        if self.data.silos is not None:
            self._check_silos()
        m, s = self.partition.num_clients, self.train.clients_per_round
        if s > m:
            raise ValueError(
                f"train.clients_per_round: {s} clients per round but partition.num_clients is {m}"
            )
        if self.deploy.min_results > s:
            raise ValueError(
                f"deploy.min_results: {self.deploy.min_results} results needed but only "
                f"train.clients_per_round={s} clients are asked"
            )
        if self.partition.scheme == "natural" and not self.data.group_column and self.data.silos is None:
            raise ValueError("data.group_column is required when partition.scheme is 'natural'")
        if self.partition.scheme == "groups" and not self.data.group_by:
            raise ValueError(
                "data.group_column is required when partition.scheme is 'groups' (the column whose values "
                "bind the groups of clients, e.g. a language column)"
            )
        if self.eval.drift:
            self._check_drift()
        if self.train.correction == "scaffold":
            self._check_scaffold()
        if self.deploy.secure_aggregation and self.comm.uplink.codec != "none":
            raise ValueError(
                f"comm.uplink {self.comm.uplink.codec}: deploy.secure_aggregation quantises and masks "
                "the update itself (SecAgg+ sums integers); a compressed update's codes cannot be summed. "
                "Use one or the other"
            )
        if self.privacy.mode == "sample" and self.model.quantization != "none":
            raise ValueError(
                f"privacy.mode sample: per-example gradients are a vmap over the rows, which "
                f"model.quantization {self.model.quantization}'s kernels cannot run under; use user or local"
            )
        if self.privacy.mode == "sample" and self.model.gradient_checkpointing:
            raise ValueError(
                "privacy.mode sample: per-example gradients are a vmap over the rows, which "
                "model.gradient_checkpointing cannot run under; turn one off"
            )
        if self.privacy.mode == "sample" and self.data.task == "causal_lm":
            raise ValueError(
                "privacy.mode sample: not for data.task causal_lm yet (a batch's scored positions are "
                "counted over the batch, not per example); use privacy.mode user or local"
            )
        if self.deploy.secure_aggregation and self.server.aggregation != "mean":
            raise ValueError(
                f"server.aggregation {self.server.aggregation}: deploy.secure_aggregation hides the "
                "individual updates a robust rule reads; use one or the other"
            )
        per_round = min(self.train.clients_per_round, self.partition.num_clients)
        if self.server.aggregation in ("krum", "multi_krum") and per_round <= 2 * self.server.byzantine + 2:
            raise ValueError(
                f"server.aggregation {self.server.aggregation}: server.byzantine {self.server.byzantine} "
                f"needs more than 2f + 2 = {2 * self.server.byzantine + 2} updates a round (Blanchard et al. "
                f"2017), and a round asks {per_round} clients; lower server.byzantine or raise "
                "train.clients_per_round"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _silo_defaults(cls, data: Any) -> Any:
        """data.silos: one client per silo, all of them each round, split 6:2:2, unless set."""
        if not isinstance(data, dict):
            return data
        section = data.get("data")
        silos = section.get("silos") if isinstance(section, dict) else getattr(section, "silos", None)
        if not silos:
            return data
        partition = dict(data.get("partition") or {})
        partition.setdefault("scheme", "natural")
        partition.setdefault("num_clients", len(silos))
        partition.setdefault("val_fraction", 0.2)
        train = dict(data.get("train") or {})
        train.setdefault("clients_per_round", len(silos))
        return {**data, "partition": partition, "train": train}

    def _check_scaffold(self) -> None:
        if self.train.optimizer != "sgd":
            raise ValueError(
                f"train.correction scaffold: train.optimizer is {self.train.optimizer}; SCAFFOLD's client "
                "control (x - y) / (K lr) is the mean of the local gradients only under plain SGD steps "
                "(Karimireddy et al. 2020, option II): set train.optimizer: sgd"
            )
        if self.deploy.secure_aggregation:
            raise ValueError(
                "train.correction scaffold: deploy.secure_aggregation sums the model updates alone, not "
                "the clients' control updates SCAFFOLD's server needs; use one or the other"
            )

    def _check_drift(self) -> None:
        if self.data.task != "classification":
            raise ValueError(
                f"eval.drift: client drift compares the logits of the classification head, and data.task "
                f"{self.data.task} has none (use data.task classification)"
            )
        if self.data.silos is not None:
            raise ValueError(
                "eval.drift: the probe batch comes from the global test set, which data.silos has not"
            )

    def _check_silos(self) -> None:
        p, silos = self.partition, self.data.silos
        if p.scheme != "natural":
            raise ValueError(
                f"partition.scheme {p.scheme}: with data.silos every silo is one client (natural)"
            )
        if p.num_clients != len(silos):
            raise ValueError(
                f"partition.num_clients {p.num_clients}: with data.silos there is one client per silo "
                f"({len(silos)})"
            )
