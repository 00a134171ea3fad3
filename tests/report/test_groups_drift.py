"""The C2A paper's analysis tools: the group (language) partition, client drift as the CKA
of local and global logits, and rounds to a target accuracy with speed-ups (Table 4)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedpeft.config import ConfigError
from fedpeft.data.partition import (
    PartitionError,
    client_groups,
    group_client_counts,
    label_histograms,
    mean_pairwise_js,
    partition_groups,
)

# --------------------------------------------------------------------------- #
# Group partition: pure numpy
# --------------------------------------------------------------------------- #

#: 3 groups of uneven sizes (a: 600, b: 400, c: 200), interleaved; 10 classes everywhere.
_RNG = np.random.default_rng(7)
GROUPS = _RNG.permutation(np.array(["a"] * 600 + ["b"] * 400 + ["c"] * 200, dtype=object))
LABELS = _RNG.integers(0, 10, size=len(GROUPS))


def groups_partition(seed: int = 0, **kw) -> list[np.ndarray]:
    args = {"num_clients": 9, "alpha": 0.5, "min_size": 5} | kw
    return partition_groups(LABELS, GROUPS, rng=np.random.default_rng(seed), **args)


def test_groups_bind_each_client_to_one_value_and_assign_every_example_once():
    parts = groups_partition()
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(LABELS)))
    assert all(part.dtype == np.int64 and np.all(np.diff(part) > 0) for part in parts)
    for part in parts:
        assert len(set(GROUPS[part])) == 1  # one group value per client
    # equal split, consecutive clients per group, groups in order of first appearance
    first_seen = list(dict.fromkeys(GROUPS))
    assert client_groups(GROUPS, parts) == [g for g in first_seen for _ in range(3)]
    for value in first_seen:  # a group's examples all go to its own clients
        members = np.concatenate(
            [p for p, g in zip(parts, client_groups(GROUPS, parts), strict=True) if g == value]
        )
        np.testing.assert_array_equal(np.sort(members), np.flatnonzero(np.equal(GROUPS, value)))


def test_groups_are_seeded():
    first, again, other = groups_partition(1), groups_partition(1), groups_partition(2)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def within_group_js(alpha: float, seed: int) -> float:
    """Mean over groups of the mean pairwise JS divergence of the label histograms of its clients."""
    parts = groups_partition(seed, alpha=alpha, num_clients=12, min_size=2)
    owner = client_groups(GROUPS, parts)
    hist = label_histograms(LABELS, parts, 10)
    return float(np.mean([mean_pairwise_js(hist[[i for i, g in enumerate(owner) if g == v]]) for v in "abc"]))


def test_label_skew_within_groups_follows_alpha():
    skewed = np.mean([within_group_js(0.05, seed) for seed in range(3)])
    mild = np.mean([within_group_js(100.0, seed) for seed in range(3)])
    assert skewed > 0.5 > 0.1 > mild


def test_clients_per_group_equal_and_proportional_by_hand():
    # equal: 10 // 3 = 3 each, the one left over to the largest group (index 1)
    assert group_client_counts([200, 600, 400], 10, "equal").tolist() == [3, 4, 3]
    # proportional: 1 each, the other 7 as 7 * (200, 600, 400) / 1200 = (1.17, 3.5, 2.33):
    # floors (1, 3, 2), the last one to the largest remainder (3.5)
    assert group_client_counts([200, 600, 400], 10, "proportional").tolist() == [2, 5, 3]
    parts = groups_partition(num_clients=10, clients_per_group="proportional")
    assert [client_groups(GROUPS, parts).count(v) for v in "abc"] == [5, 3, 2]  # a: 600, b: 400, c: 200


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_clients": 2}, "3 groups but num_clients=2"),
        ({"min_size": 70}, "group 'c' has 200 examples, too few for its 3 client(s) of min_size=70"),
        ({"clients_per_group": "random"}, "clients_per_group"),
    ],
)
def test_group_partition_errors(kwargs, message):
    with pytest.raises(PartitionError) as err:
        groups_partition(**kwargs)
    assert message in str(err.value)


def test_group_partition_refuses_a_missing_value():
    groups = GROUPS.copy()
    groups[5] = None
    with pytest.raises(PartitionError, match="group value of example 5"):
        partition_groups(LABELS, groups, 9, 0.5, np.random.default_rng(0))


# --------------------------------------------------------------------------- #
# Group partition: through the config, on the built-in WordNet data and a file
# --------------------------------------------------------------------------- #


def test_groups_on_wordnet_bind_clients_to_a_part_of_speech(tiny_config):
    from fedpeft.data.sources import load_corpus
    from fedpeft.data.split import make_split

    cfg = tiny_config(
        partition__scheme="groups", partition__num_clients=8, partition__min_size=3, data__max_samples=1200
    )
    corpus = load_corpus(cfg.data, cfg.seed)
    split = make_split(cfg, corpus)
    values = []
    for train, test in zip(split.train, split.test, strict=True):
        pos = set(corpus.train_groups[np.concatenate([train, test])])
        assert len(pos) == 1
        values.append(pos.pop())
    assert values == ["noun"] * 2 + ["verb"] * 2 + ["adj"] * 2 + ["adv"] * 2  # WordNet's file order
    everything = np.concatenate([split.train.rows, split.test.rows])
    np.testing.assert_array_equal(np.sort(everything), np.arange(len(corpus.train_labels)))
    assert split.histograms(corpus.train_labels, corpus.num_classes).sum() == len(corpus.train_labels)


def test_groups_errors_name_the_keys(tiny_config, tmp_path):
    from fedpeft.data.sources import DataError, load_corpus
    from fedpeft.data.split import make_split

    cfg = tiny_config(partition__scheme="groups", partition__num_clients=3, train__clients_per_round=2)
    with pytest.raises(PartitionError) as err:
        make_split(cfg, load_corpus(cfg.data, cfg.seed))
    for key in ("partition.num_clients=3", "data.group_column 'pos'", "4 groups"):
        assert key in str(err.value)

    table = tmp_path / "t.csv"
    table.write_text("text,label\n" + "".join(f"text {i},{i % 2}\n" for i in range(40)))
    file_data = {"source": "file", "path": str(table)}
    with pytest.raises(ConfigError, match=r"data\.group_column.*partition\.scheme.*groups"):
        tiny_config(data=file_data, partition__scheme="groups")
    cfg = tiny_config(data={**file_data, "group_column": "lang"}, partition__scheme="groups")
    with pytest.raises(DataError, match=r"t\.csv: no column 'lang' \(data\.group_column;"):
        load_corpus(cfg.data, cfg.seed)


# --------------------------------------------------------------------------- #
# Client drift
# --------------------------------------------------------------------------- #


def test_drift_config_errors(tiny_config):
    with pytest.raises(ConfigError, match="eval.drift: .* data.task causal_lm"):
        tiny_config(eval__drift=True, data__task="causal_lm")


def test_drift_is_recorded_plotted_and_uses_one_probe(tiny_config, monkeypatch):
    """A real run with groups and drift: every round records each sampled client's CKA, below
    1 after real training, always on the same probe rows of the global test set."""
    from transformers import AutoTokenizer

    from fedpeft.data.sources import load_corpus
    from fedpeft.data.task import encode
    from fedpeft.engines.drift import DriftProbe, drift_probe_rows
    from fedpeft.experiment import run

    probes = []
    original = DriftProbe.logits

    def spy(self, tensors):
        probes.append(self.probe.ids.clone())
        return original(self, tensors)

    monkeypatch.setattr(DriftProbe, "logits", spy)
    cfg = tiny_config(
        partition__scheme="groups",
        partition__min_size=2,
        eval__drift=True,
        eval__drift_probe=16,
        train__lr=0.05,
        log__plots=True,
    )
    summary = run(cfg)
    out = Path(cfg.output_dir)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        drift = r["drift"]
        assert set(drift) == {"mean", "min", "clients", "probe"} and drift["probe"] == 16
        assert sorted(drift["clients"]) == sorted(str(c) for c in r["clients"])
        values = list(drift["clients"].values())
        assert drift["mean"] == pytest.approx(np.mean(values)) and drift["min"] == min(values)
        assert all(0.0 <= v < 0.999 for v in values)  # the clients moved away from the global model
    # one global and one local forward per sampled client per round, all on the same probe
    assert len(probes) == sum(len(r["clients"]) + 1 for r in records)
    assert all(torch_equal(p, probes[0]) for p in probes)
    # the probe: 16 rows of the global test set, drawn from the seed
    corpus = load_corpus(cfg.data, cfg.seed)
    rows = drift_probe_rows(cfg.seed, len(corpus.test_labels), 16)
    assert len(set(rows.tolist())) == 16
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.backbone)
    expected = encode(
        [corpus.test_texts[i] for i in rows], corpus.test_labels[rows], tokenizer, cfg.data.max_length
    )
    width = int(expected.lengths.max())
    assert torch_equal(probes[0][:, :width], expected.ids[:, :width])
    assert (out / "drift_vs_round.png").stat().st_size > 1000
    assert (out / "partition_heatmap.png").is_file()
    assert summary["client_groups"] == {"noun": [0], "verb": [1], "adj": [2], "adv": [3]}


def torch_equal(a, b) -> bool:
    return a.shape == b.shape and bool((a == b).all())


def test_drift_is_one_when_the_local_model_is_the_global_one(tiny_config):
    """lr 1e-12: the clients' models equal the global model to float precision, so CKA is 1."""
    from fedpeft.experiment import build, make_engine

    cfg = tiny_config(eval__drift=True, eval__drift_probe=16, train__lr=1e-12, checkpoint=False)
    Path(cfg.output_dir).mkdir(parents=True)
    engine = make_engine(build(cfg), None)
    records = engine.run()
    for r in records:
        assert all(v == pytest.approx(1.0, abs=1e-9) for v in r["drift"]["clients"].values())
    # the same by construction: a client that returns exactly what it received
    from fedpeft.methods.base import FitResult

    server = engine.method.init_server(engine.model)
    still = FitResult(dict(server.tensors), {}, 10, cid=1)
    assert engine.drift(server, [still])["mean"] == pytest.approx(1.0, abs=1e-12)


def test_drift_is_skipped_without_a_global_model(tiny_config):
    from fedpeft.experiment import build, make_engine

    cfg = tiny_config(
        eval__drift=True, method={"name": "fedlr", "head": "personal"}, train__rounds=1, checkpoint=False
    )
    Path(cfg.output_dir).mkdir(parents=True)
    (record,) = make_engine(build(cfg), None).run()
    assert record["drift"] == {
        "skipped": "method fedlr has no single global model (Method.global_state is None)"
    }


# --------------------------------------------------------------------------- #
# Rounds to target (C2A Table 4)
# --------------------------------------------------------------------------- #


def curve(accuracies: list[float | None]) -> list[dict]:
    """Records of a run whose global accuracy in round t is ``accuracies[t - 1]`` (None: not evaluated)."""
    out, cum = [], 0
    for rnd, acc in enumerate(accuracies, 1):
        cum += 2_000
        record = {
            "round": rnd,
            "clients": [0, 1],
            "loss": 1.0,
            "bytes_down": 1_000,
            "bytes_up": 1_000,
            "cum_bytes_down": cum // 2,
            "cum_bytes_up": cum // 2,
            "cum_bytes": cum,
            "time_train": 1.0,
            "time_aggregate": 0.0,
            "time_eval": 0.0,
        }
        if acc is not None:
            record["global"] = {"accuracy": acc, "macro_f1": acc, "mcc": acc}
        out.append(record)
    return out


BASE = curve([0.2, 0.3, 0.4, 0.5, 0.55, 0.61, 0.7, 0.7, 0.7, 0.7])  # 0.6 first in round 6
FAST = curve([0.3, 0.5, 0.65, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7, 0.7])  # round 3
SPARSE = curve([None, None, None, 0.62, None, None, None, 0.7])  # evaluated every 4: round 4
SLOW = curve([0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5])  # never, in 11 rounds


def test_rounds_to_target_by_hand():
    from fedpeft.report.efficiency import rounds_to_target

    runs = {"adapter": BASE, "c2a": FAST, "sparse": SPARSE, "prompt": SLOW}
    rows = {r["run"]: r for r in rounds_to_target(runs, 0.6, "adapter")}
    assert rows["adapter"] == {"run": "adapter", "round": 6, "rounds_run": 10, "speedup": 1.0, "bound": "="}
    assert rows["c2a"] == {"run": "c2a", "round": 3, "rounds_run": 10, "speedup": 2.0, "bound": "="}
    assert rows["sparse"]["round"] == 4 and rows["sparse"]["speedup"] == 1.5
    # not reached in 11 rounds: it needs 12 at least, a speed-up of 6 / 12 at most
    assert rows["prompt"] == {"run": "prompt", "round": None, "rounds_run": 11, "speedup": 0.5, "bound": "<="}

    # a baseline that never reaches the target: the others' speed-ups are lower bounds
    rows = {r["run"]: r for r in rounds_to_target(runs, 0.6, "prompt")}
    assert rows["c2a"]["speedup"] == 4.0 and rows["c2a"]["bound"] == ">="  # (11 + 1) / 3
    assert rows["prompt"]["speedup"] is None and rows["prompt"]["round"] is None
    with pytest.raises(KeyError, match="baseline 'fedap'"):
        rounds_to_target(runs, 0.6, "fedap")


def fake_run(root: Path, name: str, method: str, records: list[dict]) -> Path:
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from fedpeft.report.results import summarize

    summary = summarize(records, {"name": name, "method": method})
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_report_prints_rounds_to_target_with_speedups(tmp_path, monkeypatch):
    from fedpeft.cli import app, common

    monkeypatch.setattr(common.console, "width", 200)
    with_drift = [dict(r, drift={"mean": 0.9, "min": 0.8, "clients": {"0": 0.8, "1": 1.0}}) for r in FAST]
    dirs = [
        fake_run(tmp_path, "ap", "fedap", BASE),
        fake_run(tmp_path, "c2a", "c2a", with_drift),
        fake_run(tmp_path, "pt", "prompt", SLOW),
    ]
    args = ["report", *map(str, dirs), "--out", str(tmp_path / "cmp"), "--target", "0.6", "--target", "0.7"]
    res = CliRunner().invoke(app, [*args, "--baseline", "fedap"])
    assert res.exit_code == 0, res.output
    rows = [line for line in res.output.splitlines() if line.count("│") == 5]
    by_run = {}
    for line in rows:
        cells = [c.strip() for c in line.split("│")[1:-1]]
        by_run.setdefault(cells[0], []).append(cells[1:])
    # target 0.6: fedap round 6; c2a 3 (x2); prompt never in 11 rounds (at most 6 / 12)
    # target 0.7: fedap round 7; c2a 4 (x1.75); prompt at most 7 / 12 = 0.58
    assert by_run["ap (ap)"] == [["fedap", "6", "×1.00"], ["fedap", "7", "×1.00"]]
    assert by_run["c2a (c2a)"] == [["c2a", "3", "×2.00"], ["c2a", "4", "×1.75"]]
    assert by_run["pt (pt)"] == [
        ["prompt", "not reached (> 11)", "≤ ×0.50"],
        ["prompt", "not reached (> 11)", "≤ ×0.58"],
    ]
    assert (tmp_path / "cmp" / "drift_vs_round.png").stat().st_size > 1000

    res = CliRunner().invoke(app, [*args, "--baseline", "fedlr"])
    assert res.exit_code == 2 and "--baseline fedlr: no run is of that method" in res.output
    twin = fake_run(tmp_path, "ap2", "fedap", BASE)
    res = CliRunner().invoke(app, [*args, str(twin), "--baseline", "fedap"])
    assert res.exit_code == 2 and "2 runs are of method fedap" in res.output
    res = CliRunner().invoke(app, [*args, str(twin), "--baseline", "ap2"])  # a directory name
    assert res.exit_code == 0, res.output
