"""``benchmarks/decoders.py``'s random decoder (its 1 B row runs on a GPU only): the same
code path at a tiny shape writes a decoder that fedpeft loads and trains."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from decoders import SHAPE_1B, random_decoder  # noqa: E402

from fedpeft.experiment import run  # noqa: E402
from fedpeft.report.results import read_records  # noqa: E402
from tests.helpers.configs import lm_config


@pytest.mark.slow  # writes and trains a decoder with SmolLM2's tokenizer: about 10 s
def test_a_random_decoder_of_any_shape_loads_and_trains(tiny_config, tmp_path):
    tiny = {**SHAPE_1B, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    path = random_decoder(tmp_path / "random", tiny)
    assert random_decoder(tmp_path / "random", tiny) == path  # written once
    cfg = lm_config(tiny_config, path, **{"train.rounds": 1, "eval.every": 1, "data.max_length": 160})
    run(cfg)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    # random weights: the next-token loss of a near-uniform guess over SmolLM2's vocabulary
    assert read_records(cfg.output_dir)[-1]["loss"] == pytest.approx(math.log(vocab), abs=1.0)


@pytest.mark.slow  # three runs of a tiny decoder, one on Flower's simulation engine: about a minute
# Ray's dozen processes load both cores while they start: never beside the stop tests' deadlines
@pytest.mark.xdist_group("flower_stop")
def test_the_decoder_job_runs_on_fedpeft_and_on_flowers_simulation(tiny_decoder):
    """``benchmarks/decoders_vs_flower.py`` end to end at a tiny size: every contender's
    records give its training tokens per second (the GPU's figures come from a lent machine)."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decoders_vs_flower.py"
    command = [sys.executable, str(script),
               "--backbone", str(tiny_decoder), "--precision", "fp32", "--length", "32", "--clients", "2",
               "--rounds", "1", "--steps", "2", "--batch", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith(("| fedpeft-", "| flower-sim"))]
    assert [r.split(" | ")[0] for r in rows] == ["| fedpeft-auto", "| fedpeft-1", "| flower-sim"]
    assert all(float(r.split(" | ")[1].replace(",", "")) > 0 for r in rows)
    assert "fedpeft (cohort_size auto) / Flower's simulation:" in out


@pytest.mark.slow  # PF2LoRA's bilevel cohort of a tiny decoder, by the probe's cohort size: about 30 s
def test_another_method_runs_the_decoders_job_with_the_probes_cohort(tiny_decoder):
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decoders_vs_flower.py"
    command = [sys.executable, str(script), "--backbone", str(tiny_decoder), "--method", "pf2lora",
               "--only", "fedpeft-auto", "--precision", "fp32", "--length", "32", "--clients", "2",
               "--rounds", "1", "--steps", "2", "--batch", "2"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, check=True).stdout
    (row,) = [line for line in out.splitlines() if line.startswith("| fedpeft-auto")]
    cells = row.split(" | ")
    assert float(cells[1].replace(",", "")) > 0 and 0 < float(cells[4]) < 1  # a share of the device's memory
    assert ", pf2lora, LoRA r 16" in out
