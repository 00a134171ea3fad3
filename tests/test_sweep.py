"""Sweeps: grid expansion, resumable runs, mean ± std over seeds, plots."""

import json

import pytest
from typer.testing import CliRunner

from fedpeft import sweep as S
from fedpeft.cli import app
from fedpeft.config import dump_config


def test_parse_grid():
    assert S.parse_grid(["partition.alpha=0.1,0.5", "seed=0,1", "method.lora.r=4,8"]) == {
        "partition.alpha": [0.1, 0.5],
        "seed": [0, 1],
        "method.lora.r": [4, 8],
    }
    with pytest.raises(ValueError, match="expected KEY=V1,V2"):
        S.parse_grid(["seed"])


def test_aggregate_mean_and_std_over_seeds():
    def summary(acc):
        return {
            "params": {"trainable": 10},
            "total_bytes": 100,
            "final_global": {"accuracy": acc, "macro_f1": acc / 2, "mcc": acc / 4},
        }

    done = [
        ({"method.lora.r": 4, "seed": 0}, summary(0.5)),
        ({"method.lora.r": 4, "seed": 1}, summary(0.7)),
        ({"method.lora.r": 8, "seed": 0}, summary(0.9)),
    ]
    rows = S.aggregate(done)
    assert [r["point"] for r in rows] == [{"method.lora.r": 4}, {"method.lora.r": 8}]
    assert rows[0]["runs"] == 2
    assert rows[0]["accuracy_mean"] == pytest.approx(0.6) and rows[0]["accuracy_std"] == pytest.approx(0.1)
    assert rows[1]["accuracy_std"] == 0.0


@pytest.mark.slow  # 10-18 s: out of the default tier for its 10 minutes (CI's slow tier runs it)
def test_sweep_command_runs_grid_and_resumes(tiny_config, tmp_path):
    cfg = tiny_config(output_dir=str(tmp_path / "sw"))
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(cfg))
    args = ["sweep", str(path), "--grid", "method.lora.r=2,4", "--grid", "seed=0,1"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rows = json.loads((tmp_path / "sw" / "sweep_summary.json").read_text())["rows"]
    assert [r["point"] for r in rows] == [{"method.lora.r": 2}, {"method.lora.r": 4}]
    assert rows[0]["trainable"] < rows[1]["trainable"]  # rank -> parameter budget
    assert (tmp_path / "sw" / "sweep_accuracy.png").stat().st_size > 1000
    finished = tmp_path / "sw" / "r=2_seed=0" / "summary.json"
    stamp = finished.stat().st_mtime_ns
    res = CliRunner().invoke(app, args)  # everything done: nothing re-runs
    assert res.exit_code == 0 and finished.stat().st_mtime_ns == stamp


def test_sweep_bad_point_fails_before_running(tiny_config, tmp_path):
    cfg = tiny_config(output_dir=str(tmp_path / "bad"))
    path = tmp_path / "exp.yaml"
    path.write_text(dump_config(cfg))
    res = CliRunner().invoke(app, ["sweep", str(path), "--grid", "partition.alpha=0.5,-1"])
    assert res.exit_code == 2 and "partition.alpha" in res.output
    assert not (tmp_path / "bad").exists()
