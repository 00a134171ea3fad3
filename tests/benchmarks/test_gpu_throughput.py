"""``benchmarks/gpu_throughput.py`` and its profile summary (``benchmarks/profiling.py``),
on the CPU: where events go, what the targets read from the rows, and a whole run at a
tiny size (its figures on a GPU come from a lent machine, never from a test)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from gpu_throughput import bf16_peak, check_targets  # noqa: E402
from profiling import category, profile, summarise  # noqa: E402

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


def event(key: str, device: torch.autograd.DeviceType, us: float, count: int = 1) -> SimpleNamespace:
    on_device = device != CPU
    return SimpleNamespace(key=key, device_type=device, count=count,
                           self_cpu_time_total=0 if on_device else us,
                           self_device_time_total=us if on_device else 0)  # fmt: skip


def test_each_event_goes_where_its_time_was_spent():
    assert category("cudaLaunchKernel", False) == "launches"
    assert category("cudaStreamSynchronize", False) == "synchronisation"
    assert category("cudaMemcpyAsync", False) == "host copies"
    assert category("aten::addmm", False) == "host ops"
    assert category("Memcpy HtoD (Pageable -> Device)", True) == "device copies"
    assert category("ampere_bf16_s16816gemm_bf16_128x64", True) == "device kernels"


def test_a_summary_is_per_step_and_says_how_busy_the_device_was():
    events = [
        event("aten::addmm", CPU, 3000, 30),
        event("cudaLaunchKernel", CPU, 1500, 300),
        event("cudaDeviceSynchronize", CPU, 4000, 2),
        event("sm90_gemm_kernel", CUDA, 5000, 200),
        event("Memset (Device)", CUDA, 1000, 100),
    ]
    summary = summarise(events, wall=0.02, steps=2)  # 10 ms a step
    assert summary.wall == pytest.approx(0.01)
    assert summary.seconds["device kernels"] == pytest.approx(0.0025)
    assert summary.seconds["launches"] == pytest.approx(0.00075) and summary.launches == 300
    assert summary.device_busy == pytest.approx((0.0025 + 0.0005) / 0.01)
    assert summary.top_device[0][0] == "sm90_gemm_kernel"
    assert summary.top_host[0][0] == "cudaDeviceSynchronize"
    table = summary.table()
    assert "| launches (150 calls) | 0.75 | 0.07 |" in table and "`sm90_gemm_kernel`" in table


def test_a_cpu_step_profiles_as_host_work_with_matmuls_on_top():
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(512, 256)
    summary = profile(lambda: layer(x).sum().backward(), torch.device("cpu"), steps=3)
    assert summary.steps == 3 and summary.seconds["host ops"] > 0
    assert summary.seconds.get("device kernels", 0) == 0 and summary.device_busy == 0
    assert any(name in ("aten::addmm", "aten::mm") for name, _, _ in summary.top_host[:3])


def test_the_targets_are_read_from_the_rows():
    rows = [
        ("one at a time", "fp32", 1, 50.0, None),
        ("vmap 64", "fp32", 64, 900.0, None),  # not bf16's raw step
        ("vmap 64", "bf16", 64, 2800.0, None),
        ("hand-written 64", "bf16", 64, 2000.0, None),
        ("hand-written 128", "bf16", 128, 2700.0, None),
        ("engine round, vmap 64", "bf16", 64, 2600.0, None),
        ("engine round, folded 64", "bf16", 64, 1000.0, None),
        ("8 processes, a model copy each", "bf16", 8, 600.0, None),
    ]
    lines = check_targets(rows, 8)
    assert lines[0] == "engine round bf16 >= 2,500 client-steps/s: 2,600 (engine round, vmap 64): met"
    assert lines[1].endswith("52.0x: met")
    hand = "engine round >= the hand-written step (hand-written 128, bf16, this run): 0.96x: NOT met"
    assert lines[2] == hand
    assert lines[3].endswith("4.3x: NOT met")
    assert lines[4].endswith("1.08x: met")  # 2,800 raw against 2,600 in the engine
    assert check_targets(rows[:1], 8) == ["no bf16 engine round measured: the targets are bf16's"]
    assert bf16_peak("NVIDIA H200", None) == 989e12 and bf16_peak("NVIDIA H100 PCIe", None) == 756e12
    assert bf16_peak("CPU, 2 threads", None) is None and bf16_peak("anything", 100.0) == 100e12


@pytest.mark.slow  # a MiniLM-shaped model trained every way at a tiny size: about half a minute
def test_the_benchmark_runs_every_layout_and_prints_one_table():
    command = [sys.executable, str(BENCHMARKS / "gpu_throughput.py"), "--device", "cpu", "--cohorts", "2",
               "--processes", "2", "--steps", "1", "--sequential-clients", "2", "--profile", "2",
               "--threads", "1", "--peak-tflops", "1", "--modes", "vmap,folded,hand-written"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=600, check=True).stdout
    for layout in ("one at a time", "vmap 2", "folded 2", "hand-written 2", "engine round, vmap 2",
                   "engine round, folded 2", "2 processes, a model copy each"):  # fmt: skip
        assert sum(line.startswith(f"| {layout} | ") for line in out.splitlines()) == 2, layout  # fp32, bf16
    assert "GFLOP a client-step" in out and "**Profile: folded 2, fp32**" in out
    assert "- engine round bf16 >= 2,500 client-steps/s" in out and "**Profile: hand-written 2, fp32**" in out
    assert "- engine round >= the hand-written step (hand-written 2, bf16, this run)" in out


@pytest.mark.slow  # the MiniLM-shaped model at a tiny size: about 15 s
def test_a_layout_that_fails_costs_its_rows_not_the_table(monkeypatch, capsys):
    """A GPU's minutes are few: a mode that fails (out of memory, a compiler error) is
    reported at the end and not tried at larger sizes; the other rows still print."""
    import gpu_throughput

    real = gpu_throughput.cohort_rows

    def failing(model, method, initial, clients, device, precision, mode, size, args):
        if mode == "folded":
            raise RuntimeError("CUDA out of memory (a stand-in)\nthe rest of its message")
        return real(model, method, initial, clients, device, precision, mode, size, args)

    monkeypatch.setattr(gpu_throughput, "cohort_rows", failing)
    argv = ["gpu_throughput.py", "--device", "cpu", "--cohorts", "2,3", "--processes", "1", "--steps", "1",
            "--sequential-clients", "2", "--threads", "1", "--precisions", "fp32", "--modes",
            "folded,hand-written"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    gpu_throughput.main()
    out = capsys.readouterr().out
    assert "- failed: fp32 folded 2: RuntimeError: CUDA out of memory (a stand-in)\n" in out
    assert "folded 3" not in out and "| hand-written 3 | fp32 | 3 |" in out
