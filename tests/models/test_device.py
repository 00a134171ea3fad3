"""Devices and precision: ``train.device`` and ``train.precision``.

This machine has no GPU, so the CPU cases carry the suite: a checkpoint holds only CPU
float32 tensors and a run resumes under another device setting to the same figures; a
GPU-to-CPU round trip runs where CUDA is present. Precision: autocast really computes
in the chosen dtype while parameters and optimizer state stay float32.
"""

from __future__ import annotations

import pytest
import torch

from fedpeft.config import ConfigError
from fedpeft.engines import checkpoint as C
from fedpeft.experiment import build, fingerprint, run
from fedpeft.models.device import DeviceError, resolve_device
from fedpeft.report.results import read_records
from tests.helpers.runs import Killed, round_scores


def test_resolve_device():
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(DeviceError, match=rf"train\.device 'cuda:{count}': .*has {count} CUDA"):
        resolve_device(f"cuda:{count}")
    with pytest.raises(DeviceError, match="expected auto, cpu"):
        resolve_device("tpu")


def test_bad_device_names_the_key(tiny_config):
    with pytest.raises(ConfigError, match="train.device"):
        tiny_config(**{"train.device": "gpu0"})


def test_device_is_not_part_of_the_run_identity(tiny_config, tmp_path):
    a = tiny_config(**{"train.device": "cpu"}, output_dir=str(tmp_path / "a"))
    b = tiny_config(**{"train.device": "auto"}, output_dir=str(tmp_path / "a"))
    c = tiny_config(**{"train.precision": "bf16"}, output_dir=str(tmp_path / "a"))
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)


def _interrupt_then_resume(tiny_config, tmp_path, first: str, second: str, method: dict) -> None:
    """Run to completion under ``first``; run again under ``first``, killed in round 3, and
    resume under ``second``; the records must match."""
    common = {"method": method, "train.rounds": 4, "train.optimizer_state": "keep"}
    straight = tiny_config(**common, **{"train.device": first}, output_dir=str(tmp_path / "straight"))
    broken = tiny_config(**common, **{"train.device": first}, output_dir=str(tmp_path / "broken"))
    run(straight)
    setup = build(broken)
    real_fit_cohort, calls = setup.method.fit_cohort, []

    def dying_fit_cohort(*args, **kwargs):  # a cohort of one client (train.cohort_size 1)
        calls.append(1)
        if len(calls) == 2 * 2 + 2:  # die on round 3's second client
            raise Killed
        return real_fit_cohort(*args, **kwargs)

    setup.method.fit_cohort = dying_fit_cohort
    with pytest.raises(Killed):
        run(broken, setup=setup)
    ckpt = C.load_checkpoint(broken.output_dir / "checkpoint.pt", fingerprint(broken))
    states = [ckpt.server.tensors, ckpt.server.extras, *ckpt.personal.values()]
    tensors = [t for state in states for t in state.values()]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert any(k.startswith("opt.") for p in ckpt.personal.values() for k in p)  # kept Adam state too

    resumed = tiny_config(**common, **{"train.device": second}, output_dir=str(tmp_path / "broken"))
    run(resumed, resume=True)
    a, b = read_records(straight.output_dir), read_records(broken.output_dir)
    if first == second or "cuda" not in first + second:
        assert round_scores(a) == round_scores(b)
    else:  # different kernels: equal to float tolerance
        for ra, rb in zip(a, b, strict=True):
            assert ra["clients"] == rb["clients"]
            assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-4)


@pytest.mark.parametrize(
    "method",
    [
        {"name": "fedlr"},
        pytest.param({"name": "pf2lora", "lora": {"r": 4, "alpha": 8}}, marks=pytest.mark.slow),
    ],
)  # PF2LoRA (~9 s) in the slow tier: the default tier's 10 minutes
def test_checkpoint_is_device_independent_and_resumes_under_another_setting(tiny_config, tmp_path, method):
    _interrupt_then_resume(tiny_config, tmp_path, "cpu", "auto", method)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_run_resumes_on_cpu(tiny_config, tmp_path):
    _interrupt_then_resume(tiny_config, tmp_path, "cuda", "cpu", {"name": "fedlr"})


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_computes_in_the_precision_and_keeps_float32_masters(
    tiny_config, tmp_path, precision, dtype
):
    cfg = tiny_config(
        **{"train.precision": precision, "train.optimizer_state": "keep"}, output_dir=str(tmp_path)
    )
    setup = build(cfg)
    seen = []
    query = next(m for n, m in setup.model.named_modules() if n.endswith("attention.self.query.base_layer"))
    query.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    summary = run(cfg, setup=setup)
    assert seen and set(seen) == {dtype}  # training and scoring, one client or a cohort
    params = list(setup.model.parameters())
    assert all(p.dtype == torch.float32 for p in params if p.requires_grad)  # the masters
    assert all(p.dtype == dtype for p in params if not p.requires_grad)  # frozen: stored in it
    ckpt = C.load_checkpoint(cfg.output_dir / "checkpoint.pt", fingerprint(cfg))
    kept = [t for p in ckpt.personal.values() for k, t in p.items() if k.startswith("opt.exp_avg")]
    assert kept and all(t.dtype == torch.float32 for t in kept)
    fp32 = run(tiny_config(**{"train.optimizer_state": "keep"}, output_dir=str(tmp_path / "fp32")))
    # Same training in another precision: close to, but not exactly, the float32 run.
    assert summary["final_global"]["accuracy"] == pytest.approx(fp32["final_global"]["accuracy"], abs=0.1)
    losses = [r["loss"] for r in read_records(cfg.output_dir)]
    assert losses != [r["loss"] for r in read_records(tmp_path / "fp32")]
    assert losses == pytest.approx([r["loss"] for r in read_records(tmp_path / "fp32")], rel=0.05)


def test_fp16_refused_for_a_method_that_takes_its_own_gradients(tiny_config, tmp_path):
    cfg = tiny_config(method={"name": "pf2lora"}, **{"train.precision": "fp16"}, output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="train.precision: fp16 .* pf2lora"):
        build(cfg)
