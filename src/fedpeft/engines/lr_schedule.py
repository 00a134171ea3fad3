"""The clients' learning rate across rounds (``train.lr_schedule``, issue 36).

A pure function of the round, so the schedule is server state without being stored: a
resumed run hands every round the rate an uninterrupted run would. With ``W`` warm-up
rounds and ``R`` rounds, round ``k`` (from 1) gets

    k <= W:     lr k / W                                  (a linear warm-up to lr)
    k >  W:     p = (k - W - 1) / (R - W - 1)             (0 in the first round after, 1 in the last)
                constant  lr
                linear    lr + (lr_min - lr) p
                cosine    lr_min + (lr - lr_min) (1 + cos(pi p)) / 2

(``p`` is 0 when only one round follows the warm-up.) FlowerTune's recipe anneals by the
cosine from its maximum to its minimum rate over the rounds in the same way. Both engines
hand a client the round's rate with its training job: the in-process engine sets the
method's ``train.lr`` for the round, a deployed server sends it in the training message.
"""

from __future__ import annotations

import math

from fedpeft.config import TrainConfig


def round_lr(train: TrainConfig, rnd: int) -> float:
    """The clients' rate in round ``rnd`` (1-based) of ``train.rounds``."""
    lr, warm = train.lr, train.warmup_rounds
    if rnd <= warm:
        return lr * rnd / warm
    if train.lr_schedule == "constant":
        return lr
    after = train.rounds - warm - 1
    p = (rnd - warm - 1) / after if after > 0 else 0.0
    if train.lr_schedule == "linear":
        return lr + (train.lr_min - lr) * p
    return train.lr_min + (lr - train.lr_min) * (1 + math.cos(math.pi * p)) / 2


def scheduled(train: TrainConfig) -> bool:
    """Whether the rate changes from round to round."""
    return train.lr_schedule != "constant" or train.warmup_rounds > 0


def for_round(train: TrainConfig, rnd: int) -> TrainConfig:
    """``train`` with round ``rnd``'s rate (itself when the rate never changes)."""
    return train.model_copy(update={"lr": round_lr(train, rnd)}) if scheduled(train) else train
