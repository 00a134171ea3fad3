"""The run loop written once (:mod:`fedpeft.engines.run_loop`): what one engine's runs can
do, the other's can: a deployment resumes from any kept checkpoint (``--resume-from``),
its nodes keeping their state of as many rounds; a simulation skips a round with fewer
than ``deploy.min_results`` updates and stops after ``deploy.max_skipped_rounds``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fedpeft.engines import checkpoint as C
from fedpeft.engines.run_loop import SkippedRoundsError
from fedpeft.experiment import build, run
from fedpeft.flower.node import Node
from fedpeft.report.results import read_records
from tests.helpers.flower import deploy, serve
from tests.helpers.runs import round_scores

pytestmark = pytest.mark.xdist_group("flower")

#: a personalised method (its heads stay on the nodes), every client every round
PERSONAL = {
    "method": {"name": "fedrep"},
    "train.rounds": 3,
    "train.clients_per_round": 4,
    "checkpoint.keep": 3,
}


def test_a_deployed_run_resumes_from_a_kept_checkpoint(tiny_config, tmp_path, monkeypatch):
    """A 3-round deployment, then ``--resume-from 1``: rounds 2 and 3 again, from round 1's
    checkpoint on the server and each node's state after round 1 (it keeps three rounds'),
    end exactly where the uninterrupted run ended."""
    cfg = tiny_config(**PERSONAL)
    grid = deploy(cfg, tmp_path)
    serve(grid)
    whole = read_records(cfg.output_dir)
    assert [r["round"] for r in whole] == [1, 2, 3]
    serve(grid, resume_from=1)
    again = read_records(cfg.output_dir)
    assert round_scores(again) == round_scores(whole)
    kept = sorted(p.name for p in (tmp_path / "run").glob("checkpoint*.pt"))
    assert kept == ["checkpoint.pt", "checkpoint.round1.pt", "checkpoint.round2.pt"]
    with pytest.raises(C.ResumeError, match="--resume-from 7: no kept checkpoint of round 7"):
        serve(grid, resume_from=7)


def test_a_node_refuses_a_round_whose_state_it_no_longer_keeps():
    """Its state before round 3 was dropped (it keeps rounds 3 and 4): round 3 is refused,
    never trained from its initial state; round 4 goes on from round 3's."""
    node = SimpleNamespace(cid=0, snapshots={3: {"a": 1}, 4: {"a": 2}}, forgotten=2, keep=2)
    with pytest.raises(ValueError, match="round 3 would start from its state after round 2 or earlier"):
        Node.kept_before(node, 3)
    assert Node.kept_before(node, 4) == ({"a": 1}, {})
    assert Node.kept_before(SimpleNamespace(cid=0, snapshots={}, forgotten=0, keep=2), 1) == (None, {})


def test_a_simulated_run_skips_rounds_with_too_few_updates(tiny_config):
    """One of each round's two clients diverges (its loss is NaN: dropped), one update is
    fewer than ``deploy.min_results: 2``: the round is skipped, the global state kept, and
    ``deploy.max_skipped_rounds`` of them in a row stop the run, as in a deployment."""
    cfg = tiny_config(**{"train.rounds": 4, "deploy.min_results": 2, "deploy.max_skipped_rounds": 2})
    setup = build(cfg)
    real, seen = setup.method.fit_cohort, []

    def one_diverges(model, jobs):  # the first of each round's two clients
        results = real(model, jobs)
        for result in results:
            if len(seen) % 2 == 0:
                result.metrics["loss"] = float("nan")
            seen.append(result)
        return results

    setup.method.fit_cohort = one_diverges
    with pytest.raises(SkippedRoundsError, match=r"2 consecutive rounds skipped .*1 of deploy.min_results=2"):
        run(cfg, setup=setup)
    records = read_records(cfg.output_dir)
    assert [r["round"] for r in records] == [1, 2]
    assert all(r["skipped"] == "1 of deploy.min_results=2 updates" for r in records)
    assert all(len(r["dropped"]) == 1 and r["bytes_up"] > 0 for r in records)  # one client sent
    assert records[0]["global"] == records[1]["global"]  # and the server kept its state


@pytest.mark.parametrize("bad", [0, -2, True, "1"])
def test_a_run_config_resume_from_that_is_not_a_round_is_refused(tiny_config, tmp_path, bad):
    grid = deploy(tiny_config(**PERSONAL), tmp_path)
    with pytest.raises(ValueError, match=r"run config: 'resume_from' must be a round \(an integer >= 1\)"):
        serve(grid, resume_from=bad)
