"""``fedpeft.load_export`` reproduces every method's trained models, and says what is wrong
with a directory that does not load.

For every registered method that classifies: run a tiny experiment with
``export.personal``, move the run directory elsewhere (an export must carry what it
needs), then, in one fresh Python process, load the global export and one client's export
with ``fedpeft.load_export`` as the README says and compare their logits for texts with
those of the models the run scored, computed here through the engine's own path (the
tensors of :meth:`Method.global_state` / :meth:`Method.eval_state` loaded into the run's
model, :func:`fedpeft.metrics.classification.logits`). Tolerance: ``atol 1e-5, rtol 1e-4``
in float32 (as ``tests/test_export.py``: FeDeRA's LoRA export folds ``-s B0 A0`` back in
another rounding order).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import fedpeft
from fedpeft.engines.checkpoint import load_checkpoint
from fedpeft.experiment import build, fingerprint, run
from fedpeft.methods import REGISTRY
from fedpeft.methods.base import load_tensors, restrict_heads
from fedpeft.methods.capabilities import refusal
from fedpeft.metrics.classification import logits as engine_logits

# The README's snippet, in a fresh interpreter: nothing of the training process is reused.
LOADER = r"""
import json, sys
import torch
import fedpeft

spec = json.load(open(sys.argv[1]))
out = {}
for d, partial in spec["dirs"]:
    loaded = fedpeft.load_export(d, partial=partial)
    out[d] = (loaded.logits(spec["texts"]), loaded.predict(spec["texts"]), loaded.filled)
torch.save(out, sys.argv[2])
"""

CLASSIFIERS = sorted(name for name, cls in REGISTRY.items() if not refusal(cls, "classification"))


def trained_logits(model, tensors, data) -> torch.Tensor:
    load_tensors(model, tensors)
    return engine_logits(model, data)


@pytest.mark.slow  # about a minute: every classifying method trains and exports
def test_load_export_reproduces_every_method(tiny_config, tmp_path):
    """Global and client exports of every classifying method, loaded with
    ``fedpeft.load_export`` from a moved run directory in one fresh interpreter, give the
    logits of the models the run scored."""
    runs, moved = tmp_path / "runs", tmp_path / "moved"
    expected, partial_dir = {}, None
    for name in CLASSIFIERS:
        cfg = tiny_config(**{
            "method": {"name": name}, "export.personal": True, "partition.num_clients": 3,
            "output_dir": str(runs / name),
        })  # fmt: skip
        setup = build(cfg)
        run(cfg, setup=setup)
        method, model = setup.method, setup.model
        ckpt = load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
        texts = setup.corpus.test_texts[:6]
        data = setup.global_test.subset(torch.arange(6))
        adapter = cfg.output_dir / "adapter"
        info = json.loads((adapter / "clients" / "0" / "fedpeft_model.json").read_text())
        assert info["part"] == "client" and info["method"] == info["config"]["method"]["name"] == name
        if method.shared_names:  # a global export: the server's shared tensors
            shared = {n: ckpt.server.tensors[n] for n in method.shared_names}
            state = method.global_state(ckpt.server)
            # no global model the engine scores and personal parameters (not in the export):
            # those at their initial values (FedAMP's export, the mean of uploads, is whole)
            partial = state is None and bool(method.personal_names)
            if state is None:
                state = {**setup.initial, **shared}
            if partial:
                partial_dir = partial_dir or adapter
            expected[str(adapter)] = (trained_logits(model, state, data), partial)
        # a client that has trained (its own model, as the engine scores it)
        cid = next((c.cid for c in setup.clients if c.cid in ckpt.personal), 0)
        client = setup.clients[cid]
        personal = (
            ckpt.personal[cid]
            if cid in ckpt.personal
            else restrict_heads(method.init_client(model, setup.initial, client), client.classes)
        )
        tensors = method.eval_state(model, method.downlink(ckpt.server, cid), personal, client)
        expected[str(adapter / "clients" / str(cid))] = (trained_logits(model, tensors, data), False)
        before = trained_logits(model, setup.initial, data)  # the client's model is a trained one
        assert (expected[str(adapter / "clients" / str(cid))][0] - before).abs().max() > 1e-3, name

    # without partial=True, a global export that is not a whole model is refused
    assert partial_dir is not None
    with pytest.raises(fedpeft.ExportError, match="not a whole model.*partial=True"):
        fedpeft.load_export(partial_dir)

    shutil.move(runs, moved)  # the exports must not need their run directory where it was
    relocated = {key.replace(str(runs), str(moved)): value for key, value in expected.items()}
    spec = {"texts": list(texts), "dirs": [[d, partial] for d, (_, partial) in relocated.items()]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-c", LOADER, str(tmp_path / "spec.json"), str(tmp_path / "out.pt")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    labels = setup.corpus.class_names
    for key, (want, partial) in relocated.items():
        logits, predicted, filled = got[key]
        torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}")
        assert predicted == [labels[i] for i in want.argmax(-1).tolist()], key
        assert bool(filled) == partial, key


def test_bad_exports_name_the_file_and_tensor(tiny_config, tmp_path):
    """A missing, corrupt or mismatched file is an ExportError naming the file and tensor."""
    cfg = tiny_config(**{"method": {"name": "fedbf"}, "export.personal": True, "partition.num_clients": 3,
                         "train.rounds": 1})  # fmt: skip
    run(cfg)
    good = cfg.output_dir / "adapter" / "clients" / "0"
    assert fedpeft.load_export(good).filled == []

    def broken(case: str):
        d = tmp_path / case
        shutil.copytree(good, d)
        return d, d / "trainable.safetensors"

    d, file = broken("missing")
    file.unlink()
    with pytest.raises(fedpeft.ExportError, match=r"trainable\.safetensors: missing"):
        fedpeft.load_export(d)

    d, file = broken("corrupt")
    file.write_bytes(b"not a safetensors file")
    with pytest.raises(fedpeft.ExportError, match=r"trainable\.safetensors: not a readable safetensors"):
        fedpeft.load_export(d)

    tensors = load_file(str(good / "trainable.safetensors"))
    name = next(n for n in tensors if n.endswith("query.bias"))
    d, file = broken("shape")
    save_file({**tensors, name: torch.zeros(3)}, str(file))
    with pytest.raises(fedpeft.ExportError) as err:
        fedpeft.load_export(d)
    assert str(file) in str(err.value) and repr(name) in str(err.value) and "(3,)" in str(err.value)

    d, file = broken("lacking")
    save_file({n: t for n, t in tensors.items() if n != name}, str(file))
    with pytest.raises(fedpeft.ExportError, match=rf"lacks tensor '{name}'"):
        fedpeft.load_export(d)

    d, file = broken("unknown")
    save_file({**tensors, "backbone.no.such.bias": torch.zeros(3)}, str(file))
    with pytest.raises(fedpeft.ExportError, match="'backbone.no.such.bias' names no trainable tensor"):
        fedpeft.load_export(d)

    d, _ = broken("no-info")
    (d / "fedpeft_model.json").unlink()
    with pytest.raises(fedpeft.ExportError, match=r"fedpeft_model\.json: missing"):
        fedpeft.load_export(d)

    # an export written before fedpeft_model.json carried the config: the run's config.yaml
    info = json.loads((good / "fedpeft_model.json").read_text())
    del info["config"], info["part"]
    (good / "fedpeft_model.json").write_text(json.dumps(info))
    assert fedpeft.load_export(good).filled == []
    d, _ = broken("old-copied")
    with pytest.raises(fedpeft.ExportError, match="holds no 'config'.*config.yaml"):
        fedpeft.load_export(d)


def test_bad_lora_export_names_the_file_and_tensor(tiny_config, tmp_path):
    """The HF PEFT form: a LoRA matrix of another shape, or a head that lacks its bias."""
    cfg = tiny_config(**{"method": {"name": "fedlr", "lora": {"r": 4}}, "train.rounds": 1})
    run(cfg)
    good = cfg.output_dir / "adapter"
    assert fedpeft.load_export(good).filled == []
    d = tmp_path / "shape"
    shutil.copytree(good, d)
    weights = load_file(str(d / "adapter_model.safetensors"))
    name = sorted(weights)[0]
    save_file({**weights, name: weights[name][:2]}, str(d / "adapter_model.safetensors"))
    with pytest.raises(fedpeft.ExportError) as err:
        fedpeft.load_export(d)
    assert str(d / "adapter_model.safetensors") in str(err.value)
    assert name.replace(".weight", ".default.weight") in str(err.value)  # PEFT's name for it
    d = tmp_path / "head"
    shutil.copytree(good, d)
    save_file({"weight": load_file(str(good / "head.safetensors"))["weight"]}, str(d / "head.safetensors"))
    with pytest.raises(fedpeft.ExportError, match=r"head\.safetensors: lacks tensor 'bias'"):
        fedpeft.load_export(d)
