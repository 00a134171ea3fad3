"""Exports reproduce the trained models, loaded exactly as the README says.

For every LoRA method: run a tiny experiment with ``export.personal``, then, in a fresh
Python process, load ``adapter/`` (and each ``adapter/clients/<cid>/``) with
``AutoModel.from_pretrained(backbone)`` + ``PeftModel.from_pretrained`` + the head from
``head.safetensors``, pool as ``fedpeft_model.json`` says, and compare the logits with
the trained model's (the global model; each client's own model) on a batch.
Tolerance: ``atol 1e-5, rtol 1e-4`` in float32 (FeDeRA's export adds ``-s B0 A0`` where
training subtracted it from ``W0``, a different rounding order; all else is exact math).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fedpeft.engines.checkpoint import load_checkpoint
from fedpeft.experiment import build, fingerprint, run
from fedpeft.methods.base import load_tensors

# The README's recipe, run in a fresh interpreter: nothing of the training process is reused.
LOADER = r"""
import json, sys
from pathlib import Path
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModel

backbone, batch_file, out_file, *dirs = sys.argv[1:]
batch = torch.load(batch_file)
logits = {}
for d in dirs:
    d = Path(d)
    info = json.loads((d / "fedpeft_model.json").read_text())
    model = PeftModel.from_pretrained(AutoModel.from_pretrained(backbone), d).eval()
    head = load_file(str(d / "head.safetensors"))
    with torch.no_grad():
        states = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        assert info["pooling"] == "mean"
        pooled = (states * mask).sum(1) / mask.sum(1)
        logits[str(d)] = pooled @ head["weight"].T + head["bias"]
torch.save(logits, out_file)
"""

#: LoRA methods exported, and whether every client's model is its own
LORA_METHODS = {"fedlr": False, "federa": False, "pf2lora": True, "perfedavg": False, "hetlora": True,
                "fdlora": True, "ditto": True, "fedamp": True, "local": True,
                "centralized": False}  # fmt: skip
PERSONALISED = {name for name, own in LORA_METHODS.items() if own}


def load_in_fresh_process(backbone, dirs, batch, tmp_path) -> dict[str, torch.Tensor]:
    batch_file, out_file = tmp_path / "batch.pt", tmp_path / "logits.pt"
    torch.save(batch, batch_file)
    cmd = [sys.executable, "-c", LOADER, str(backbone), str(batch_file), str(out_file), *map(str, dirs)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return torch.load(out_file)


def trained_logits(model, tensors, batch) -> torch.Tensor:
    load_tensors(model, tensors)
    model.eval()
    with torch.no_grad():
        return model(**batch)


@pytest.mark.slow  # the heaviest default test (30-45 s): to the slow tier for the default's 10 minutes
def test_exports_reproduce_the_trained_models(tiny_config, tiny_backbone, tmp_path):
    """Every LoRA method's global and per-client exports, loaded as the README says in one
    fresh interpreter, give the logits of the models the run trained and scored."""
    expected, dirs = {}, []
    for name in LORA_METHODS:
        cfg = tiny_config(**{
            "method": {"name": name, "lora": {"r": 4, "alpha": 8}},
            "export.personal": True, "partition.num_clients": 3, "output_dir": str(tmp_path / name),
        })  # fmt: skip
        setup = build(cfg)
        summary = run(cfg, setup=setup)
        method, model = setup.method, setup.model
        ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
        adapter = cfg.output_dir / "adapter"
        batch = {"input_ids": setup.global_test.ids[:6, :12]}
        batch["attention_mask"] = (batch["input_ids"] != 0).long()
        clients = []
        if method.shared_names:  # a global model exists: the server's shared tensors
            assert summary["exported"]["global"] == str(adapter), name
            global_state = method.global_state(ckpt.server)
            if global_state is not None:
                expected[str(adapter)] = trained_logits(model, global_state, batch)
                dirs.append(adapter)
        else:  # Local-only has no global model, hence no global export
            assert not (adapter / "adapter_config.json").exists()
        for client in setup.clients:  # each client's own model, as it is scored
            personal = ckpt.personal.get(client.cid) or method.init_client(model, setup.initial, client)
            received = method.downlink(ckpt.server, client.cid)
            tensors = method.eval_state(model, received, personal, client)
            client_dir = adapter / "clients" / str(client.cid)
            expected[str(client_dir)] = trained_logits(model, tensors, batch)
            clients.append(expected[str(client_dir)])
            dirs.append(client_dir)
        if name in PERSONALISED:
            assert all(not torch.allclose(a, b) for i, a in enumerate(clients) for b in clients[i + 1 :]), (
                name
            )

    got = load_in_fresh_process(tiny_backbone, dirs, batch, tmp_path)
    for key, want in expected.items():
        torch.testing.assert_close(got[key], want, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")
        assert json.loads((Path(key) / "fedpeft_model.json").read_text())["id2label"]


@pytest.mark.parametrize("name", {"pf2lora": "a personal adapter", "hetlora": "own ranks", "fedlr": "none"})
@pytest.mark.parametrize("head", ["shared", "personal"])
def test_global_export_holds_no_personal_tensor(name, head, tiny_config):
    cfg = tiny_config(**{"method": {"name": name, "head": head, "lora": {"r": 4}}})
    setup = build(cfg)
    run(cfg, setup=setup)
    adapter = cfg.output_dir / "adapter"
    saved = load_file(str(adapter / "adapter_model.safetensors"))
    files = sorted(p.relative_to(adapter).as_posix() for p in adapter.rglob("*") if p.is_file())
    # only the global adapter: no per-adapter subdirectory (PF2LoRA's client adapter) and
    # no head when the head is personal
    expected = {"adapter_config.json", "adapter_model.safetensors", "fedpeft_model.json"}
    assert set(files) == expected | ({"head.safetensors"} if head == "shared" else set())
    # every saved tensor is a shared one (PEFT's key = our name without "backbone." and ".default")
    peft_key = lambda n: n.removeprefix("backbone.").replace(".default.", ".")  # noqa: E731
    shared_keys = {peft_key(n) for n in setup.method.shared_names}
    personal_keys = {peft_key(n) for n in setup.method.personal_names}
    assert set(saved) <= shared_keys and set(saved).isdisjoint(personal_keys)
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 4  # the common adapter alone (PF2LoRA: its client rank is not in it)
    # and the values are the server's, not a client's (PF2LoRA's client adapter is rank 2)
    ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    server = {peft_key(n): t for n, t in ckpt.server.tensors.items() if "lora_" in n}
    assert set(saved) == set(server)
    for key, value in saved.items():
        assert torch.equal(value, server[key]), key


def test_federa_export_is_rank_2r_and_not_the_plain_adapter(tiny_config, tiny_backbone, tmp_path):
    """The plain ``A, B`` on the pretrained backbone count the principal part twice; the
    export is the rank-2r form ``[A; A0]``, ``[B, -B0]`` and equals the trained model."""
    from peft import PeftModel
    from transformers import AutoModel

    cfg = tiny_config(**{"method": {"name": "federa", "lora": {"r": 4, "alpha": 4}}})
    setup = build(cfg)
    run(cfg, setup=setup)
    adapter = cfg.output_dir / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["lora_alpha"] == 8  # scale alpha'/r' = 1 = beta/r
    # the plain adapter (what save_pretrained wrote before): far from the trained model
    plain = PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_backbone), adapter).eval()
    ids = setup.global_test.ids[:4, :10]
    mask = torch.ones_like(ids)
    model = setup.model.eval()
    with torch.no_grad():
        trained = model.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        exported = plain(input_ids=ids, attention_mask=mask).last_hidden_state
        for layer in plain.base_model.model.modules():  # keep only the first r components: A, B
            if hasattr(layer, "lora_A") and "default" in getattr(layer, "lora_A", {}):
                layer.lora_A["default"].weight[4:] = 0
        doubled = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(exported, trained, atol=1e-5, rtol=1e-4)
    assert (doubled - trained).abs().max() > 1e-3
