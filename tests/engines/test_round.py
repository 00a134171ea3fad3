"""The round pipeline (``fedpeft.engines.round``): one server round for every engine.

The in-process engine and the Flower server both run their rounds through
:class:`~fedpeft.engines.round.ServerRound`; the settings whose handling once differed
between them (a scheduled rate, SCAFFOLD's control, user-level DP's noise) give the
same records and the same server state on both."""

from __future__ import annotations

import pytest
import torch

from fedpeft.config import CodecConfig, PrivacyConfig, ServerConfig, TrainConfig
from fedpeft.engines.checkpoint import load_checkpoint
from fedpeft.engines.guard import DivergedError
from fedpeft.engines.lr_schedule import round_lr
from fedpeft.engines.round import Returned, ServerRound, receive, send
from fedpeft.experiment import fingerprint
from fedpeft.methods.base import FitResult, Method, ServerState
from tests.helpers.configs import SCAFFOLD, USER_DP
from tests.helpers.flower import in_process_and_deployed

SCHEDULED = {"train.lr_schedule": "linear", "train.lr_min": 0.002}


@pytest.mark.parametrize(
    "over",
    [SCHEDULED, SCAFFOLD, USER_DP],
    ids=["lr_schedule", "scaffold", "user-dp"],
)
def test_in_process_and_over_flowers_grid_give_the_same_records(tiny_config, tmp_path, over):
    """Each round's clients, rate, privacy record, loss, scores and bytes alike, and the
    same server state at the end (SCAFFOLD's control included): the pipeline decides
    them, not the engine. The deployed server alone marks which control updates it
    applied (a node's reply can be lost); a node reports whether its update fitted only
    when adaptive clipping counts it, so ``clipped`` is the simulation's alone."""
    a, b, _, (local, flower) = in_process_and_deployed(tiny_config, tmp_path, **over, **{"train.rounds": 3})
    for ra, rb in zip(a, b, strict=True):
        assert rb["clients"] == ra["clients"] and "dropped" not in rb and "skipped" not in rb
        assert rb.get("lr") == ra.get("lr")
        expected = {k: v for k, v in ra.get("privacy", {}).items() if k != "clipped"}
        assert rb.get("privacy", {}) == pytest.approx(expected, rel=1e-9)
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-6)
        assert rb["local"] == pytest.approx(ra["local"], rel=1e-6)
        assert rb["payload_bytes_up"] == ra["bytes_up"] and rb["payload_bytes_down"] == ra["bytes_down"]
    if "train.lr_schedule" in over:
        assert [r["lr"] for r in a] == pytest.approx([round_lr(local.train, k) for k in (1, 2, 3)])
        assert len({r["lr"] for r in a}) == 3  # the rate moved every round
    if "privacy" in over:
        assert all(r["privacy"]["noise_multiplier"] == 0.7 for r in b)
    ours = load_checkpoint(local.output_dir / "checkpoint.pt", fingerprint(local)).server
    theirs = load_checkpoint(flower.output_dir / "checkpoint.pt", fingerprint(flower)).server
    for name, value in ours.tensors.items():
        torch.testing.assert_close(theirs.tensors[name], value, rtol=1e-5, atol=1e-6)
    marks = {k for k in theirs.extras if k.startswith("scaffold.applied.")}
    assert {k: v for k, v in theirs.extras.items() if k not in marks}.keys() == ours.extras.keys()
    for name, value in ours.extras.items():
        torch.testing.assert_close(theirs.extras[name], value, rtol=1e-5, atol=1e-6)
    assert bool(marks) == ("train.correction" in over)


# ---------------------------------------------------------------- the pipeline by itself


class Mean:
    """A stand-in method: the example-weighted mean of the uplinks, as FedAvg's."""

    name, shared_names = "mean", ["w"]
    train = TrainConfig()

    def aggregate(self, server, results, rnd):
        total = sum(r.num_examples for r in results)
        mean = sum(r.uplink["w"].double() * r.num_examples for r in results) / total
        return ServerState({"w": mean.float()}, dict(server.extras))

    # no messages of its own: Method's defaults
    uplink_messages, uplink_as_shared = Method.uplink_messages, Method.uplink_as_shared


def returned(value: float, cid: int, examples: int = 1) -> Returned:
    result = FitResult({"w": torch.full((3,), value)}, {}, examples, {"loss": 0.0}, cid)
    return Returned(result, {"w": torch.zeros(3)}, True)


def test_a_round_aggregates_steps_and_records_in_order():
    method, server = Mean(), ServerState({"w": torch.zeros(3)}, {})
    rounds = ServerRound(method, method.train, ServerConfig(), PrivacyConfig(), seed=0, clients=2)
    step = rounds.begin(1, server)
    record: dict = {"clients": [0, 1]}
    new = rounds.finish(step, server, [returned(1.0, 0, 1), returned(4.0, 1, 3)], record, [])
    torch.testing.assert_close(new.tensors["w"], torch.full((3,), 3.25))
    assert "lr" not in record and "privacy" not in record and "skipped" not in record


def test_a_skipped_round_keeps_the_state_and_says_why():
    method, server = Mean(), ServerState({"w": torch.ones(3)}, {})
    seen = []
    rounds = ServerRound(method, method.train, ServerConfig(), PrivacyConfig(), seed=0, clients=2,
                         analyzers={"seen": lambda old, new: seen.append(1) or {}})  # fmt: skip
    record: dict = {"clients": []}
    new = rounds.finish(rounds.begin(1, server), server, [], record, [], skip="no client drawn")
    assert new is server and record["skipped"] == "no client drawn" and not seen


def test_a_non_finite_aggregate_stops_the_round_naming_its_rate():
    method, server = Mean(), ServerState({"w": torch.zeros(3)}, {})
    train = TrainConfig(lr=0.5, lr_schedule="linear", lr_min=0.1, rounds=3)
    rounds = ServerRound(method, train, ServerConfig(), PrivacyConfig(), seed=0, clients=2)
    step = rounds.begin(3, server)
    assert step.lr == pytest.approx(0.1)  # the round's own rate, the last of a linear schedule
    with pytest.raises(DivergedError, match="round 3"):
        rounds.finish(step, server, [returned(float("inf"), 0)], {"clients": [0]}, [])


def test_the_clients_side_clips_then_encodes_and_the_server_decodes_it():
    method = Mean()
    received = {"w": torch.zeros(4)}
    trained = {"w": torch.tensor([3.0, 4.0, 0.0, 0.0])}  # an update of norm 5
    user = PrivacyConfig(mode="user", noise_multiplier=1.0, clip=1.0)
    out = send(method, user, _codec("fp16"), received, trained, {}, clip=1.0, sigma=1.0, seed=7)
    assert not out.fitted  # clipped: the report adaptive clipping counts
    decoded = receive(out.message, received, _codec("fp16"), seed=7)
    torch.testing.assert_close(decoded["w"], torch.tensor([0.6, 0.8, 0.0, 0.0]), rtol=1e-3, atol=1e-3)
    plain = send(method, PrivacyConfig(), _codec("none"), received, trained, {}, clip=1.0, sigma=0.0, seed=7)
    assert plain.fitted and torch.equal(
        receive(plain.message, received, _codec("none"), 7)["w"], trained["w"]
    )


def _codec(name: str) -> CodecConfig:
    return CodecConfig(codec=name)
