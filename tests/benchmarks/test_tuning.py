"""The benchmarks' tuner (``benchmarks/tuning.py``): the grid grows past any end where a
best rate sits, tied rates included, and ties are settled by a stated rule."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from tuning import tune_method  # noqa: E402


def _scorer(table: dict[tuple[float, str], float]):
    asked = []

    def score(setting: dict) -> float:
        key = (setting["lr"], setting["optimizer_state"])
        asked.append(key)
        return table.get(key, 0.0)

    return score, asked


def test_a_tie_at_the_top_end_extends_the_grid():
    """C2A's case: 0.01 and 0.02 tie at the top of the grid; 0.04 must be tried."""
    score, asked = _scorer({(0.01, "reset"): 0.5, (0.02, "reset"): 0.5, (0.04, "reset"): 0.6})
    best, _ = tune_method(score, grid=[5e-3, 1e-2, 2e-2], extend=2, keep=False)
    assert (0.04, "reset") in asked and (0.08, "reset") in asked  # 0.04 won at the new end
    assert best["lr"] == 0.04


def test_ties_at_both_ends_extend_both_and_the_lowest_rate_wins_a_tie():
    score, asked = _scorer({(1e-3, "reset"): 0.5, (5e-3, "reset"): 0.5})
    best, report = tune_method(score, grid=[1e-3, 2e-3, 5e-3], extend=1, keep=True)
    assert (5e-4, "reset") in asked and (1e-2, "reset") in asked
    assert (1e-3, "keep") in asked and (5e-3, "keep") in asked  # keep at every tied rate
    assert (best["lr"], best["optimizer_state"]) == (1e-3, "reset")  # lowest rate, reset first
    assert "-> lr 0.001, reset" in report


def test_a_bracketed_best_stops_the_grid_and_keep_can_win():
    score, asked = _scorer({(2e-3, "reset"): 0.7, (2e-3, "keep"): 0.8, (1e-3, "reset"): 0.6})
    best, _ = tune_method(score, grid=[1e-3, 2e-3, 5e-3])
    assert sorted({lr for lr, _ in asked}) == [1e-3, 2e-3, 5e-3]  # nothing added
    assert (best["lr"], best["optimizer_state"]) == (2e-3, "keep")


@pytest.mark.parametrize("extend", [0, 2])
def test_extension_is_bounded(extend):
    asked = []

    def score(setting: dict) -> float:  # the higher the rate the better: the top end grows each time
        asked.append(setting["lr"])
        return setting["lr"]

    tune_method(score, grid=[1e-3, 2e-3], extend=extend, keep=False)
    assert len(asked) == 2 + extend


def test_a_flat_grid_is_neither_extended_nor_kept():
    """Every rate at chance (a run drowned in DP noise): nothing to follow; the lowest rate."""
    score, asked = _scorer({})
    best, _ = tune_method(score, grid=[1e-3, 2e-3, 5e-3], extend=3, keep=True)
    assert asked == [(1e-3, "reset"), (2e-3, "reset"), (5e-3, "reset")]
    assert (best["lr"], best["optimizer_state"]) == (1e-3, "reset")


def test_a_fdlora_run_recorded_before_the_uniform_mean_is_not_reused(tiny_config, tmp_path):
    """Its fingerprint matches (the new option is at its default), its behaviour does not."""
    from records import put, row
    from tuning import run_or_reuse

    from fedpeft.experiment import run

    cfg = tiny_config(method={"name": "fdlora"}, output_dir=str(tmp_path / "fd"))
    run(cfg)
    assert run_or_reuse(cfg) == json.loads((cfg.output_dir / "summary.json").read_text())  # reused
    older = row(cfg.output_dir)
    del older["config"]["method"]["average"]  # as a run of before issue 30 recorded it
    put(cfg.output_dir, older)
    with pytest.raises(SystemExit, match="FDLoRA's server mean became uniform"):
        run_or_reuse(cfg)


@pytest.mark.slow  # a few runs: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_the_tuning_score_is_the_accuracy_on_the_clients_pooled_validation_data(tiny_config, tmp_path):
    """``val.accuracy_pooled`` (what the benchmarks tune on) is the global model's accuracy
    on the union of the clients' validation splits: each client weighed by its examples,
    where ``accuracy_mean`` weighs clients alike. Recomputed here on the concatenated data."""
    from records import locate, put
    from tuning import validation_accuracy

    from fedpeft.data.task import Encoded
    from fedpeft.experiment import build, make_engine
    from fedpeft.report.results import read_records

    cfg = tiny_config(**{"partition.val_fraction": 0.3, "eval.local": True})
    setup = build(cfg)
    cfg.output_dir.mkdir(parents=True)
    engine = make_engine(setup, None)
    engine.run()
    scores = engine.evaluate(engine.server)["val"]
    engine.load(setup.method.global_state(engine.server))
    union = Encoded.concat([c.val for c in setup.clients if c.val is not None and len(c.val)])
    assert scores["accuracy_pooled"] == pytest.approx(engine.scorer.score(engine.model, union)["accuracy"])
    sizes = {len(c.val) for c in setup.clients}
    assert len(sizes) > 1  # clients of different sizes: the pooled and the mean accuracy differ in kind
    ran = {"run": locate(cfg.output_dir)[1], "summary": {}, "records": read_records(cfg.output_dir)}
    put(cfg.output_dir, ran)  # the benchmark's records, which the score reads
    assert validation_accuracy(cfg.output_dir) == pytest.approx(scores["accuracy_pooled"])


def test_a_run_directory_has_one_writer_and_a_failed_run_can_leave_the_others_going(tiny_config, tmp_path):
    """Two processes writing one run directory would corrupt it: the second stops, named.
    ``run_all(keep_going=True)`` runs every config and hands back the failures."""
    import fcntl

    from tuning import only_writer, run_all

    out = tmp_path / "runs" / "a"
    with only_writer(out):
        lock = out.parent / ".a.lock"
        with open(lock) as other, pytest.raises(BlockingIOError):  # held: another process is refused
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(lock) as other:  # released when the run ends
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)

    good = tiny_config(output_dir=str(tmp_path / "runs" / "good"), **{"train.rounds": 1})
    missing = tmp_path / "no-backbone"  # an empty folder: fails once the run loads its model
    missing.mkdir()
    bad = tiny_config(
        output_dir=str(tmp_path / "runs" / "bad"), **{"train.rounds": 1, "model.backbone": str(missing)}
    )
    with pytest.raises(Exception, match="no-backbone"):
        run_all([bad, good])
    failed = run_all([bad, good], keep_going=True)
    assert list(failed) == [bad.output_dir] and "no-backbone" in failed[bad.output_dir]
    assert (good.output_dir / "summary.json").is_file()

    from tuning import Busy, run_or_reuse

    with only_writer(good.output_dir):  # a finished run is read beside a process holding it
        assert run_or_reuse(good)["name"] == good.name
    with only_writer(bad.output_dir), pytest.raises(Busy, match="another process"):
        run_or_reuse(bad)  # an unfinished one is not trained twice at once


def test_a_diverged_run_is_recorded_scored_zero_and_not_trained_again(tiny_config, tmp_path, monkeypatch):
    """A rate whose run diverges (no finite update) is the worst of its grid, not the end
    of the tuning; the benchmark's records say so, and a rerun of the benchmark does not train
    it again (the record is of its config: another config there would be trained)."""
    import tuning
    from records import row

    from fedpeft.config import dump_config
    from fedpeft.engines.guard import DivergedError
    from fedpeft.report.results import write_json, write_records

    trained = []

    def run(cfg, resume=False):  # diverges above lr 0.01
        trained.append(cfg.train.lr)
        cfg.output_dir.mkdir(parents=True, exist_ok=True)
        if cfg.train.lr > 0.01:
            raise DivergedError("round 2: every sampled client's update is not finite", 2, None)
        (cfg.output_dir / "config.yaml").write_text(dump_config(cfg))
        write_records(cfg.output_dir / "metrics.jsonl", [{"round": 1}])
        write_json(cfg.output_dir / "summary.json", {})
        return {}

    monkeypatch.setattr(tuning, "run", run)
    make = lambda lr, **over: tiny_config(output_dir=str(tmp_path / f"lr{lr:g}"), **{"train.lr": lr, **over})  # noqa: E731

    def score(setting: dict) -> float:  # a higher rate scores higher, unless it diverged
        tuning.run_or_reuse(make(setting["lr"]))
        return setting["lr"]

    best, report = tuning.tune_method(score, grid=[0.005, 0.01, 0.02], extend=0, keep=False)
    assert best["lr"] == 0.01 and "0.02/reset: diverged" in report
    assert "round 2" in row(tmp_path / "lr0.02")["diverged"]
    with pytest.raises(tuning.Diverged, match="round 2"):
        tuning.run_or_reuse(make(0.02))
    assert trained == [0.005, 0.01, 0.02]
    with pytest.raises(tuning.Diverged):
        tuning.run_or_reuse(make(0.02, **{"train.rounds": 3}))  # another config: trained
    assert trained == [0.005, 0.01, 0.02, 0.02]


def test_when_every_rate_diverges_the_grid_goes_down_and_stops_if_none_trains():
    from tuning import Diverged

    def score(setting: dict) -> float:  # trains at 1e-3 and below only
        if setting["lr"] > 1e-3:
            raise Diverged(f"lr {setting['lr']:g}: diverged")
        return 0.5

    best, report = tune_method(score, grid=[2e-3, 4e-3], extend=1, keep=False)
    assert best["lr"] == 1e-3 and report.startswith("0.001/reset: 0.500, 0.002/reset: diverged")
    with pytest.raises(SystemExit, match="every setting diverged"):
        tune_method(score, grid=[8e-3, 16e-3], extend=1, keep=False)
