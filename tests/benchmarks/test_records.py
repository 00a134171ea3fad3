"""The benchmarks' run records (``benchmarks/records.py``): one JSON-lines file per
benchmark, read by ``tuning.run_or_reuse`` and by the tables as the run directories were."""

from __future__ import annotations

import gzip
import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import records  # noqa: E402
import tuning  # noqa: E402

from fedpeft.config import dump_config  # noqa: E402
from fedpeft.report.results import write_json, write_records  # noqa: E402


def unpacked(store: Path) -> list[str]:
    """The lines of a records file, as gzip holds them."""
    return gzip.decompress(store.read_bytes()).decode().splitlines()


def finish(cfg, accuracy: float = 0.5) -> dict:
    """Write a finished run of ``cfg`` into its directory, as ``fedpeft.experiment.run``
    lays one out (two rounds of records); its summary."""
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    write_records(out / "metrics.jsonl", [{"round": r, "global": {"accuracy": accuracy / r}} for r in (1, 2)])
    summary = {"name": cfg.name, "final_global": {"accuracy": accuracy}}
    write_json(out / "summary.json", summary)
    return summary


@pytest.fixture
def fake_run(monkeypatch):
    """``tuning.run`` writing a finished run without training; the configs it ran."""
    trained = []

    def run(cfg, resume=False):
        trained.append(cfg)
        return finish(cfg)

    monkeypatch.setattr(tuning, "run", run)
    return trained


@pytest.fixture
def results(tmp_path, monkeypatch) -> Path:
    """An empty ``benchmarks/results``."""
    monkeypatch.setattr(records, "RESULTS", (tmp_path / "results").resolve())
    return records.RESULTS


def test_a_run_round_trips_through_its_benchmarks_file(tiny_config, results):
    cfg = tiny_config(output_dir=str(results / "bench" / "tune" / "lora-s0"))
    summary = finish(cfg)
    lines = (cfg.output_dir / "metrics.jsonl").read_text().splitlines()
    assert records.convert([results / "bench"]) == 1
    store = results / "bench.jsonl.gz"
    assert records.locate(cfg.output_dir) == (store, "bench/tune/lora-s0")
    (row,) = [json.loads(line) for line in unpacked(store)]
    assert row["run"] == "bench/tune/lora-s0" and row["fingerprint"] == tuning.fingerprint(cfg)
    assert tuning.fingerprint(tuning.parse_config(row["config"])) == tuning.fingerprint(cfg)
    assert records.read_summary(cfg.output_dir) == summary
    assert records.read_records(cfg.output_dir) == [json.loads(line) for line in lines]
    assert tuning.run_or_reuse(cfg) == summary  # reused, not trained
    records.drop(cfg.output_dir)
    assert records.row(cfg.output_dir) is None and not cfg.output_dir.exists()
    records.put(cfg.output_dir, row)
    records.unpack(cfg.output_dir)  # the directory written back, as fedpeft report reads one
    assert records.finished_row(cfg.output_dir) == row
    with pytest.raises(FileNotFoundError, match="bench.jsonl.gz: no finished run bench/tune/other"):
        records.read_records(results / "bench" / "tune" / "other")


def test_a_finished_run_of_another_config_is_an_error_naming_the_file_and_run(tiny_config, results, fake_run):
    out = str(results / "bench" / "lora-s0")
    tuning.run_or_reuse(tiny_config(output_dir=out))
    with pytest.raises(SystemExit, match=r"bench\.jsonl\.gz: bench/lora-s0: .*another"):
        tuning.run_or_reuse(tiny_config(output_dir=out, **{"train.lr": 0.5}))
    assert records.drop(Path(out)) and not Path(out).exists()  # what the error says to do
    assert tuning.run_or_reuse(tiny_config(output_dir=out, **{"train.lr": 0.5}))["name"]
    assert [cfg.train.lr for cfg in fake_run][-1] == 0.5


def test_a_missing_run_is_run_and_recorded_once(tiny_config, results, fake_run):
    first, second = (tiny_config(output_dir=str(results / "bench" / f"s{s}"), seed=s) for s in (0, 1))
    tuning.run_or_reuse(first)
    assert tuning.run_or_reuse(second) == records.read_summary(second.output_dir)
    assert tuning.run_or_reuse(second) == tuning.run_or_reuse(first)  # both reused
    assert [cfg.seed for cfg in fake_run] == [0, 1]
    rows = unpacked(results / "bench.jsonl.gz")
    assert [json.loads(line)["run"] for line in rows] == ["bench/s0", "bench/s1"]


def test_a_run_finished_but_not_recorded_is_recorded_not_trained(tiny_config, results, fake_run):
    cfg = tiny_config(output_dir=str(results / "bench" / "cut"))
    summary = finish(cfg)  # the process stopped between the run's end and its row
    assert tuning.run_or_reuse(cfg) == summary and not fake_run
    assert records.row(cfg.output_dir)["records"][-1]["round"] == 2


def test_rows_are_written_one_writer_at_a_time(results):
    store = results / "bench.jsonl.gz"
    records.put(results / "bench" / "a", {"run": "bench/a", "summary": {}})
    second = (results / "bench" / "b", {"run": "bench/b", "summary": {}})
    wrote = threading.Thread(target=records.put, args=second)
    with records._lock(store):  # another writer holds the file
        wrote.start()
        time.sleep(0.3)
        assert wrote.is_alive() and records.row(results / "bench" / "b") is None
    wrote.join(5)
    assert [json.loads(line)["run"] for line in unpacked(store)] == ["bench/a", "bench/b"]


def test_a_run_outside_the_results_keeps_its_row_beside_it(tiny_config, tmp_path, fake_run):
    cfg = tiny_config(output_dir=str(tmp_path / "elsewhere" / "lora-s0"))
    tuning.run_or_reuse(cfg)
    store = (tmp_path / "elsewhere" / "records.jsonl.gz").resolve()
    assert records.locate(cfg.output_dir) == (store, "lora-s0")
    assert records.read_summary(cfg.output_dir)["name"] == cfg.name


def test_every_stored_run_keeps_its_configs_fingerprint():
    """A change to the config's schema or defaults that moved a fingerprint would orphan the
    stored runs of that config (``tuning.run_or_reuse`` would train them again, and a table
    would mix runs of two meanings): each stored row's config parses, with this fedpeft, to
    the fingerprint it was stored under. A diverged run keeps only its fingerprint."""
    from fedpeft.config import parse_config
    from fedpeft.experiment import fingerprint

    moved, checked = [], 0
    for store in sorted(records.RESULTS.rglob("*.jsonl.gz")):
        for run, line in records._lines(store).items():
            row = json.loads(line)
            if "config" not in row:
                continue
            checked += 1
            if fingerprint(parse_config(row["config"], f"{store.name}: {run}")) != row["fingerprint"]:
                moved.append(f"{store.relative_to(records.RESULTS)}: {run}")
    assert checked > 1000, checked  # the stored runs were read
    assert not moved, f"{len(moved)} stored runs' configs no longer give their fingerprints: {moved[:5]}"
