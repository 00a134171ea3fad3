"""The clients' learning rate across rounds (issue 36, item 3): the schedule's values by
hand, the rate each round's clients train at, a resumed run, and the Flower path."""

from __future__ import annotations

import math

import pytest

from fedpeft.config import TrainConfig
from fedpeft.engines.lr_schedule import round_lr
from fedpeft.experiment import build, run
from fedpeft.report.results import read_records
from tests.helpers.flower import deploy, serve
from tests.helpers.runs import Killed

pytestmark = pytest.mark.usefixtures("forget_nodes")  # tests/conftest.py: the fake federation's nodes


def rates(**train) -> list[float]:
    cfg = TrainConfig(**train)
    return [round_lr(cfg, k) for k in range(1, cfg.rounds + 1)]


def test_the_schedules_by_hand():
    assert rates(rounds=4, lr=0.1) == [0.1] * 4
    assert rates(rounds=5, lr=1.0, lr_schedule="linear") == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    # one warm-up round, then cosine from 1 to 0.1 over the remaining four
    cosine = rates(rounds=5, lr=1.0, lr_min=0.1, lr_schedule="cosine", warmup_rounds=1)
    expected = [
        1.0,
        1.0,
        0.1 + 0.9 * (1 + math.cos(math.pi / 3)) / 2,
        0.1 + 0.9 * (1 + math.cos(2 * math.pi / 3)) / 2,
        0.1,
    ]
    assert cosine == pytest.approx(expected)
    assert cosine[2] == pytest.approx(0.775) and cosine[3] == pytest.approx(0.325)
    assert rates(rounds=4, lr=1.0, warmup_rounds=2) == pytest.approx([0.5, 1.0, 1.0, 1.0])
    assert rates(rounds=3, lr=1.0, lr_schedule="cosine", warmup_rounds=2) == pytest.approx([0.5, 1.0, 1.0])


@pytest.mark.slow  # three runs, one killed and resumed
def test_each_rounds_clients_train_at_its_rate_and_a_resumed_run_too(tiny_config, tmp_path):
    extra = {
        "train.rounds": 4,
        "train.lr_schedule": "cosine",
        "train.lr_min": 0.001,
        "train.warmup_rounds": 1,
    }
    whole = tiny_config(output_dir=str(tmp_path / "whole"), **extra)
    setup, seen = build(whole), []
    real = setup.method.fit_cohort

    def spying(model, jobs):
        seen.extend(job.context.train.lr for job in jobs)  # the rate the cohort's optimizer steps at
        return real(model, jobs)

    setup.method.fit_cohort = spying
    run(whole, setup=setup)
    records = read_records(whole.output_dir)
    expected = [round_lr(whole.train, k) for k in range(1, 5)]
    assert [r["lr"] for r in records] == pytest.approx(expected)
    assert seen == pytest.approx([lr for lr in expected for _ in range(2)])  # two clients a round
    assert setup.method.train == whole.train  # the method's own setting, untouched
    # killed in round 3 and resumed: every round at the uninterrupted run's rate, the same results
    cut = tiny_config(output_dir=str(tmp_path / "cut"), **extra)
    setup, calls = build(cut), []
    real_cut = setup.method.fit_cohort

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 6:  # round 3's second client
            raise Killed
        return real_cut(*args, **kwargs)

    setup.method.fit_cohort = dying
    with pytest.raises(Killed):
        run(cut, setup=setup)
    run(cut, resume=True)
    resumed = read_records(cut.output_dir)
    assert [r["lr"] for r in resumed] == [r["lr"] for r in records]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in records]
    # a constant rate records none
    plain = tiny_config(output_dir=str(tmp_path / "plain"))
    run(plain)
    assert all("lr" not in r for r in read_records(plain.output_dir))


@pytest.mark.slow  # two runs, one through Flower's apps
def test_the_flower_path_hands_each_round_its_rate(tiny_config, tmp_path):
    extra = {"train.rounds": 3, "train.lr_schedule": "linear", "train.lr_min": 0.002}
    local = tiny_config(output_dir=str(tmp_path / "inproc"), **extra)
    flower = tiny_config(output_dir=str(tmp_path / "flower"), **extra)
    run(local)
    grid = deploy(flower, tmp_path)
    serve(grid)
    a, b = read_records(local.output_dir), read_records(flower.output_dir)
    trains = [m for m in grid.sent if m.metadata.message_type == "train"]
    sent = sorted({(int(m.content["config"]["round"]), float(m.content["config"]["lr"])) for m in trains})
    assert sent == [(k, pytest.approx(round_lr(local.train, k))) for k in (1, 2, 3)]
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["global"] == pytest.approx(ra["global"], rel=1e-6)
