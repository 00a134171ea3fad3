"""The ``privacy`` section: differential privacy of what leaves a client."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from fedpeft.config.common import Strict


class PrivacyConfig(BaseModel):
    """Differential privacy of what leaves a client (``fedpeft.engines.privacy``)."""

    model_config = Strict

    mode: Literal["none", "user", "local", "sample"] = Field(
        "none",
        description="user: each client clips its update, the server adds Gaussian noise to their sum "
        "(DP-FedAvg, McMahan et al. 2018); local: each client noises its own clipped update before it "
        "leaves; sample: DP-SGD in every local step (each example's gradient clipped, noise on their "
        "sum; Abadi et al. 2016); none: no clipping, no noise.",
    )
    clip: float = Field(
        1.0, gt=0, description="C: the L2 bound of a client's update (sample: of one example's gradient)."
    )
    noise_multiplier: float | None = Field(
        None, ge=0, description="sigma: the noise's std over C; unset: calibrated to target_epsilon."
    )
    target_epsilon: float | None = Field(
        None,
        gt=0,
        description="The budget: sigma is calibrated to spend it in train.rounds; a run never exceeds it.",
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="The delta of (epsilon, delta)-DP.")
    adaptive_clip: bool = Field(
        False,
        description="user mode: move C towards the target_quantile of the update norms (Andrew et al. 2021).",
    )
    target_quantile: float = Field(
        0.5, gt=0, lt=1, description="adaptive_clip: the share of updates within C."
    )
    clip_lr: float = Field(
        0.2, gt=0, description="adaptive_clip: C *= exp(-clip_lr (fitted share - quantile))."
    )
    count_noise: float | None = Field(
        None,
        gt=0,
        description="adaptive_clip: std of the noise on the count of fitted updates (default S/20).",
    )

    @model_validator(mode="after")
    def _consistent(self) -> PrivacyConfig:
        if self.mode != "none" and self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError(
                f"privacy.mode {self.mode}: set privacy.noise_multiplier or privacy.target_epsilon "
                "(from which the noise multiplier is calibrated)"
            )
        if self.adaptive_clip and self.mode != "user":
            raise ValueError(
                f"privacy.adaptive_clip: user mode only (privacy.mode is {self.mode}); local mode's clients "
                "would have to noise their own counts"
            )
        return self
