"""The ``deploy`` section: how a networked (Flower) run treats slow, failing and missing clients."""

from __future__ import annotations

from pydantic import BaseModel, Field

from fedpeft.config.common import Strict


class DeployConfig(BaseModel):
    """How a networked (Flower) run treats slow, failing and missing clients."""

    model_config = Strict

    min_nodes: int | None = Field(
        None, ge=1, description="Nodes to wait for before round 1 (None: train.clients_per_round)."
    )
    connect_timeout: float = Field(300, gt=0, description="Seconds to wait for min_nodes to connect.")
    query_timeout: float = Field(
        120, gt=0, description="Seconds a new node has to answer the roll call (it prepares its data then)."
    )
    round_timeout: float = Field(
        600, gt=0, description="Seconds a sampled client has to return its update; later ones are dropped."
    )
    min_results: int = Field(
        1,
        ge=1,
        description="Fewest valid updates a round aggregates; with fewer the round is skipped (the global "
        "state kept). A simulation (fedpeft run) honours it too, where only a diverged client sends none.",
    )
    max_skipped_rounds: int = Field(
        3,
        ge=1,
        description="Consecutive rounds skipped for want of min_results after which the run stops with an "
        "error (deployed or simulated; --resume goes on). A round Poisson sampling drew nobody for does "
        "not count.",
    )
    max_weight_share: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Under server.weighting examples, the largest share of a round's weight one client "
        "may hold: weights above it are lowered to a common cap so that none exceeds this share of the "
        "total (all equal when no cap can). A node's size is its own claim at the roll call, so a node "
        "that lies about it gains this share and no more; 1: no cap beyond the size its node gave at "
        "the roll call (a training reply claiming more is refused). Not with secure_aggregation.",
    )
    secure_aggregation: bool = Field(
        False,
        description="Train through Flower's SecAgg+ protocol: the server sees only the mean update "
        "(methods whose aggregate is the example-weighted mean; needs 2+ clients per round).",
    )
    warm_nodes: bool = Field(
        True,
        description="Each node keeps one long-lived worker that holds its model, data and personal "
        "state across rounds and runs; Flower's per-message ClientApp process only relays the message "
        "to it over a Unix socket. false: every message builds the node's model afresh.",
    )
