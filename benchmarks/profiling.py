"""Where a training step's time goes: ``torch.profiler`` over a few steps, summarised as
device kernels, copies, kernel launches, synchronisation and the rest of the host's work
(issue 64, item 1).

On a GPU the step is a stream of kernels the host launches; it runs at the kernels' speed
only when the host keeps ahead of them. The summary puts side by side, per step:

- ``device kernels``: the time the device spends in compute kernels, and ``device copies``
  in memcpy / memset; ``device busy`` is their share of the wall time;
- ``launches``: the host's time in the CUDA runtime's launch calls (a few microseconds
  each: thousands of small kernels make a host-bound step), with their count;
- ``synchronisation``: the host waiting for the device (``cuda*Synchronize``, a ``.item()``
  or ``.cpu()`` in the step), and ``host copies`` the host's side of memcpy calls;
- ``host ops``: the rest of the host's own time (PyTorch's dispatcher, autograd, Python);
  on the CPU this is the whole compute;

and the operators and kernels that take the most time. :func:`category` decides where an
event goes, from its name and where it ran.

    python benchmarks/gpu_throughput.py --profile 64   # a cohort of 64, profiled
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LAUNCHES = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
    "cudaGraphLaunch",
    "cudaLaunchCooperativeKernel",
)
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaStreamWaitEvent")
HOST_COPIES = ("cudaMemcpy", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemset")


def category(name: str, on_device: bool) -> str:
    """Where an event of the profile goes: a device event is a kernel or a copy; a host
    event is a launch, a synchronisation, the host's side of a copy, or one of its ops."""
    if on_device:
        return "device copies" if name.startswith(("Memcpy", "Memset")) else "device kernels"
    if name.startswith(LAUNCHES):
        return "launches"
    if name.startswith(SYNCS):
        return "synchronisation"
    if name.startswith(HOST_COPIES):
        return "host copies"
    return "host ops"


@dataclass
class Summary:
    """A profiled block's time per step, by :func:`category` (seconds), and its top entries."""

    steps: int
    wall: float
    unit: str = "step"
    seconds: dict[str, float] = field(default_factory=dict)
    launches: int = 0
    top_host: list[tuple[str, float, int]] = field(default_factory=list)  # (op, s per step, calls)
    top_device: list[tuple[str, float, int]] = field(default_factory=list)

    @property
    def device_busy(self) -> float:
        """The share of the wall time the device spends in kernels and copies."""
        busy = self.seconds.get("device kernels", 0.0) + self.seconds.get("device copies", 0.0)
        return busy / self.wall if self.wall else 0.0

    def table(self) -> str:
        """The summary as markdown: one row per category, then the top operators and kernels."""
        lines = [
            "| per step | ms | share of wall |",
            "|---|---|---|",
            f"| wall | {self.wall * 1e3:.2f} | 1.00 |",
        ]
        for name in (
            "device kernels",
            "device copies",
            "launches",
            "synchronisation",
            "host copies",
            "host ops",
        ):
            s = self.seconds.get(name, 0.0)
            extra = (
                f" ({self.launches / self.steps:.0f} calls)" if name == "launches" and self.launches else ""
            )
            lines.append(f"| {name}{extra} | {s * 1e3:.2f} | {s / self.wall:.2f} |")
        lines.append(f"| device busy | | {self.device_busy:.2f} |")
        for title, rows in (("host operator", self.top_host), ("device kernel", self.top_device)):
            if rows:
                lines += ["", f"| {title} (self time) | ms per step | calls per step |", "|---|---|---|"]
                lines += [f"| `{n[:90]}` | {s * 1e3:.3f} | {c / self.steps:.0f} |" for n, s, c in rows]
        return "\n".join(lines)


def summarise(events, wall: float, steps: int, top: int = 8, unit: str = "step") -> Summary:
    """The summary of ``events`` (``profile.key_averages()``: entries with ``key``,
    ``count``, ``device_type``, ``self_cpu_time_total`` and ``self_device_time_total`` in
    microseconds; a kernel is an entry of its own, on the device), over ``steps`` steps
    that took ``wall`` seconds."""
    out = Summary(steps, wall / steps, unit)
    host, device = [], []
    for e in events:
        on_device = e.device_type != torch.autograd.DeviceType.CPU
        per_step = (e.self_device_time_total if on_device else e.self_cpu_time_total) / 1e6 / steps
        name = category(e.key, on_device)
        out.seconds[name] = out.seconds.get(name, 0.0) + per_step
        if name == "launches":
            out.launches += e.count
        (device if on_device else host).append((e.key, per_step, e.count))
    out.top_host = sorted(host, key=lambda r: -r[1])[:top]
    out.top_device = sorted(device, key=lambda r: -r[1])[:top]
    return out


def profile(
    step: Callable[[], None], device: torch.device, steps: int = 3, warmup: int = 1, unit: str = "step"
) -> Summary:
    """``step`` (one ``unit``) run ``warmup`` times, then ``steps`` times under
    ``torch.profiler``: its summary."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(warmup):
        step()
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        wall = time.perf_counter() - start
    return summarise(prof.key_averages(), wall, steps, unit=unit)
