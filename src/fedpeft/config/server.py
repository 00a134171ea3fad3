"""The ``server`` and ``faults`` sections: the server's step after aggregation, the
aggregation rule, and simulated faulty clients."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from fedpeft.config.common import Strict


class ServerConfig(BaseModel):
    """The server's step after a method aggregates (``fedpeft.engines.server_opt``): the
    aggregate as it is (FedAvg), or a server optimiser fed the pseudo-gradient
    (aggregate - current). Composes with any method whose server keeps one set of
    shared tensors that it averages; a method with a server step of its own refuses it."""

    model_config = Strict

    optimizer: Literal["fedavg", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = Field(
        "fedavg",
        description="fedavg: x += lr D (D = aggregate - x); fedavgm: server momentum (Hsu et al. 2019); "
        "fedadam, fedyogi, fedadagrad: Reddi et al. 2021.",
    )
    lr: float | None = Field(
        None,
        gt=0,
        description="Server learning rate; default 1 for fedavg and fedavgm; required for the adaptive "
        "optimisers (their rate depends on the model and task: tune it).",
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="fedavgm's momentum.")
    betas: tuple[float, float] = Field(
        (0.9, 0.99), description="b1, b2 of fedadam, fedyogi (b2) and fedadagrad (b1)."
    )
    tau: float = Field(
        1e-3, gt=0, description="The adaptive optimisers' degree of adaptivity (and sqrt of v's start)."
    )
    aggregation: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"] = Field(
        "mean",
        description="How the clients' uplinks combine (fedpeft.engines.robust): the weighted mean, or a "
        "rule robust to faulty clients (coordinate-wise median or trimmed mean, Krum, Multi-Krum).",
    )
    trim: float = Field(0.1, ge=0, lt=0.5, description="trimmed_mean: the share dropped at each end.")
    byzantine: int = Field(1, ge=0, description="krum, multi_krum: f, the faulty clients to tolerate.")
    weighting: Literal["examples", "uniform"] = Field(
        "examples",
        description="A client's weight in a method's mean: its training examples, or 1 each (a method "
        "that weighs otherwise, e.g. HETLoRA by update norms, keeps its own rule).",
    )

    @field_validator("betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"server.betas: each in [0, 1), got {list(value)}")
        return value

    @model_validator(mode="after")
    def _rate_given(self) -> ServerConfig:
        if self.lr is None and self.optimizer in ("fedadam", "fedyogi", "fedadagrad"):
            raise ValueError(
                f"server.lr: server.optimizer {self.optimizer} needs a server learning rate (none suits "
                "every model; Reddi et al. tune it per task, e.g. on a grid 1e-3 ... 1)"
            )
        return self

    @property
    def rate(self) -> float:
        return self.lr if self.lr is not None else 1.0


class FaultsConfig(BaseModel):
    """Simulated faulty clients (``fedpeft.engines.faults``), in-process runs only."""

    model_config = Strict

    byzantine_clients: int = Field(0, ge=0, description="How many clients (drawn from the seed) are faulty.")
    attack: Literal["sign_flip", "scale", "gaussian", "label_flip"] = Field(
        "sign_flip",
        description="sign_flip: the update reversed; scale: times faults.scale; gaussian: replaced by noise "
        "of std faults.noise_std; label_flip: the client trains on flipped class labels.",
    )
    scale: float = Field(10.0, description="The scale attack's factor.")
    noise_std: float = Field(1.0, gt=0, description="The gaussian attack's standard deviation.")
