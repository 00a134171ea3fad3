"""The ``export``, ``checkpoint`` and ``log`` sections: what a run leaves behind besides its
metrics, an adapter export, checkpoints to resume from, and experiment trackers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from fedpeft.config.common import Strict


class ExportConfig(BaseModel):
    """What a finished run writes under ``output_dir/adapter``."""

    model_config = Strict

    personal: bool = Field(
        False,
        description="Also write each client's own model (global part + its personal part, head "
        "included) under adapter/clients/<cid>/, each loadable on its own.",
    )


class CheckpointConfig(BaseModel):
    """What a run keeps on disk to resume from (``checkpoint: false`` is short for
    ``checkpoint: {enabled: false}``)."""

    model_config = Strict

    enabled: bool = Field(True, description="Save the server's and the clients' state every round.")
    keep: int = Field(
        2,
        ge=1,
        description="Checkpoints kept: the newest (checkpoint.pt) and keep - 1 earlier ones "
        "(checkpoint.round<N>.pt). A resume whose newest cannot be read falls back to an earlier one; "
        "--resume-from N resumes from round N's.",
    )


class LogConfig(BaseModel):
    """Where every round's metrics go besides ``metrics.jsonl``: experiment trackers."""

    model_config = Strict

    to: list[Literal["tensorboard", "mlflow", "wandb"]] = Field(
        default_factory=list,
        description="Trackers fed every completed round (scores, loss, bytes, times, epsilon, drift) and "
        "the resolved config: tensorboard (event files under output_dir/tensorboard), mlflow, wandb. "
        "A resumed run continues the same tracked run. Each needs its extra: pip install 'fedpeft[NAME]'.",
    )
    plots: bool = Field(
        True,
        description="Draw the run's figures at its start (the partition heatmap) and end (score against "
        "rounds and bytes, update variation, client readouts, drift). Off for many short runs (sweeps, "
        "tests), where drawing takes longer than training; `fedpeft report RUN` draws the scores, update "
        "variation and drift later, `fedpeft partition CONFIG` the heatmap.",
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (a server such as http://host:5000, or a database such as "
        "sqlite:///mlflow.db); unset: a local store, output_dir/mlflow.db. Credentials are better left to "
        "the environment MLflow reads them from (MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or "
        "MLFLOW_TRACKING_TOKEN); given in the URI (https://user:TOKEN@host), they are used but never "
        "written or sent: config.yaml, exports, trackers, logs and the run config `fedpeft serve` sends "
        "read https://user:***@host. A *** read back (a resume, a deployment's server) is taken from "
        "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD: on a deployment, in the environment of the "
        "SuperLink's machine, where the ServerApp and its tracker run.",
    )
    mlflow_experiment: str = Field("fedpeft", description="The MLflow experiment the runs are filed under.")
    wandb_project: str = Field("fedpeft", description="The W&B project.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline",
        description="offline: W&B writes under output_dir/wandb and sends nothing (wandb sync uploads it "
        "later); online: logs to the W&B server your login names.",
    )

    @field_validator("to")
    @classmethod
    def _once_each(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"log.to: {value} names a tracker twice")
        return value
