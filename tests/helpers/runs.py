"""Runs killed on purpose and resumed: the exception, the kill switches, and the figures
a resumed run must repeat."""

from __future__ import annotations

import pytest

from fedpeft.experiment import build, run
from fedpeft.report.results import read_records


class Killed(Exception):
    pass


def die_on_fit(setup, fit: int = 2 * 2 + 2) -> None:
    """Make ``setup``'s method raise :class:`Killed` on its ``fit``-th client fit (cohorts of
    one client). The default, with two clients a round: round 3's second client, after
    rounds 1-2 were checkpointed."""
    real, calls = setup.method.fit_cohort, []

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == fit:
            raise Killed
        return real(*args, **kwargs)

    setup.method.fit_cohort = dying


def round_scores(records):
    return [
        (r["round"], r["clients"], r["loss"], r.get("global"), r.get("local"), r["cum_bytes"])
        for r in records
    ]


def kill_in_round(cfg, rnd: int) -> None:
    """Run ``cfg`` and kill it on the second client of round ``rnd`` (2 clients a round)."""
    setup, calls = build(cfg), []
    real = setup.method.fit_cohort

    def dying(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 * (rnd - 1) + 2:
            raise Killed
        return real(*args, **kwargs)

    setup.method.fit_cohort = dying
    with pytest.raises(Killed):
        run(cfg, setup=setup)


def whole_and_resumed(tiny_config, tmp_path, rnd: int = 3, **extra) -> tuple[list[dict], list[dict], tuple]:
    """The same run twice: uninterrupted (``whole/``), and killed on round ``rnd``'s second
    client then resumed (``cut/``); their records, and their configs (whole, cut)."""
    whole = tiny_config(output_dir=str(tmp_path / "whole"), **extra)
    cut = tiny_config(output_dir=str(tmp_path / "cut"), **extra)
    run(whole)
    kill_in_round(cut, rnd)
    run(cut, resume=True)
    return read_records(whole.output_dir), read_records(cut.output_dir), (whole, cut)
