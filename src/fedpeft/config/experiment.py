"""The whole experiment config, :class:`ExperimentConfig`: one section per layer, and the
checks of counts and names that read more than one section; what composes with what is
decided by :mod:`fedpeft.composition`, whose rules of the config alone it refuses.

The ``method`` key is validated by the method config registry
(:mod:`fedpeft.config.methods.registry`) when a config is validated: its ``name`` picks
the class of its options; an unknown name is refused naming the known ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from fedpeft import composition
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
        if why := composition.refusal(self):  # what composes with what: fedpeft.composition
            raise ValueError(why)
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
