"""Exported adapters load with HF PEFT; the CLI's commands write what they promise."""

import json

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModel
from typer.testing import CliRunner

from fedpeft.cli import app
from fedpeft.experiment import build, run


def test_fedlr_export_loads_with_peft(tiny_config, tiny_backbone):
    cfg = tiny_config(**{"method": {"name": "fedlr", "lora": {"r": 4, "alpha": 8}}})
    setup = build(cfg)
    summary = run(cfg, setup=setup)
    adapter_dir = cfg.output_dir / "adapter"
    assert summary["exported"] == str(adapter_dir)
    assert (adapter_dir / "adapter_config.json").is_file()

    loaded = PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_backbone), adapter_dir).eval()
    ours = setup.model.eval()
    ids = setup.global_test.ids[:4, :10]
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = ours.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        got = loaded(input_ids=ids, attention_mask=mask).last_hidden_state
        lora_b = [p for n, p in ours.named_parameters() if "lora_B" in n]
    assert any(b.abs().sum() > 0 for b in lora_b)  # trained: the adapter is not the identity
    torch.testing.assert_close(got, expected)
    head = load_file(str(adapter_dir / "head.safetensors"))
    torch.testing.assert_close(head["weight"], ours.head.weight)


def test_cli_run_partition_report_methods(tiny_config, tmp_path):
    cfg = tiny_config()
    path = tmp_path / "exp.yaml"
    from fedpeft.config import dump_config

    path.write_text(dump_config(cfg))
    runner = CliRunner()

    res = runner.invoke(app, ["run", str(path), "--set", f"output_dir={tmp_path / 'a'}"])
    assert res.exit_code == 0, res.output
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "accuracy_vs_round.png",
        "accuracy_vs_bytes.png",
        "partition_heatmap.png",
        "checkpoint.pt",
    ):
        assert (tmp_path / "a" / name).is_file(), name
    lines = (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2]

    res = runner.invoke(
        app,
        [
            "run",
            str(path),
            "--set",
            f"output_dir={tmp_path / 'b'}",
            "--set",
            "method={name: fedbf}",
        ],
    )
    assert res.exit_code == 0, res.output

    res = runner.invoke(
        app, ["report", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")]
    )
    assert res.exit_code == 0, res.output
    assert "fedlr" in res.output and "fedbf" in res.output
    assert (tmp_path / "cmp" / "accuracy_vs_bytes.png").stat().st_size > 1000

    res = runner.invoke(app, ["partition", str(path), "--set", f"output_dir={tmp_path / 'p'}"])
    assert res.exit_code == 0, res.output
    assert "Jensen-Shannon" in res.output
    assert (tmp_path / "p" / "partition_heatmap.png").is_file()

    res = runner.invoke(app, ["methods", str(path)])
    assert res.exit_code == 0, res.output
    for name in ("fedft", "fedbf", "fedap", "fedlr", "local", "centralized"):
        assert name in res.output


def test_cli_bad_config_names_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  rounds: 0\n")
    res = CliRunner().invoke(app, ["run", str(path)])
    assert res.exit_code == 2
    assert "train.rounds" in res.output
