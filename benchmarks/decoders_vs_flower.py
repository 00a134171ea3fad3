"""A decoder's federated LoRA fine-tuning: fedpeft's cohorts against one client at a time
and against Flower's simulation engine (one ClientApp per client, as FlowerTune runs
it), the same job on the same device, in one run (issue 64, item 4).

The job: FedLR, LoRA r 16 (alpha 32) on every linear layer of ``--backbone`` (on a GPU
the random 1B Llama-shaped decoder of ``decoders.py``, ``random-1b``), in bf16 (or nf4:
``--precision``), every client drawn every round, ``--steps`` local steps of ``--batch``
instruction rows of about ``--length`` tokens (random made-up words written into an
Alpaca-style JSONL file: nothing downloaded, no third-party text), ``--rounds`` rounds,
scored once at the end (perplexity and one short generation). Contenders, each in a
fresh process:

- ``fedpeft-auto``: ``fedpeft run`` with ``train.cohort_size: auto`` (the probe's cohort);
- ``fedpeft-1``: one client at a time (``train.cohort_size: 1``);
- ``flower-sim``: fedpeft's ServerApp/ClientApp on ``flwr.simulation.run_simulation``
  (Ray), a virtual SuperNode per client, ``--workers`` of them at once, each given a
  ``1 / workers`` share of the GPU (FlowerTune's templates train one client a GPU).

Printed side by side: training tokens per second (the tokens the clients trained on over
all rounds, from the records, over the rounds' training time), end to end, the peak
device memory (on a GPU ``nvidia-smi``'s used memory above the start, every process on
the device, sampled every 0.2 s; on a CPU the process tree's resident memory) against
the device's, the cohort the probe chose and how it trained (round 1's ``setup``), and
fedpeft's speed-up over Flower's (goal: >= 2x).

``--method`` trains another method on the same job (its ``lora`` r 16 on every linear,
its other options at their defaults): item 4's PF2LoRA (a bilevel cohort: two adapters,
hypergradients) and HETLoRA (ranks that differ per client, masked to the server's) with
``--only fedpeft-auto``: does the probe's cohort fit, and how close to the device's memory.

    python benchmarks/decoders_vs_flower.py --backbone random-1b --length 512   # a GPU
    .venv/bin/python benchmarks/decoders_vs_flower.py --backbone PATH --length 32 --clients 2  # a CPU, tiny
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decoders import backbone_path  # noqa: E402

CONTENDERS = ("fedpeft-auto", "fedpeft-1", "flower-sim")
PRECISIONS = {"bf16": ("bfloat16", "none"), "nf4": ("float32", "nf4"), "fp32": ("float32", "none")}


def write_rows(path: Path, count: int, words: int, seed: int = 0) -> Path:
    """``count`` instruction rows of about ``words`` made-up words each (half prompt, half
    response), as Alpaca-style JSONL."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "di", "fu"]

    def text(n: int) -> str:
        return " ".join("".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(n))

    with path.open("w") as f:
        for _ in range(count):
            f.write(json.dumps({"instruction": text(words // 2), "output": text(words - words // 2)}) + "\n")
    return path


def job_config(args, out: Path, cohort_size):
    from fedpeft.config import load_config

    dtype, quantization = PRECISIONS[args.precision]
    return load_config(None, {
        "name": "decoders-vs-flower",
        "output_dir": str(out),
        "data": {"task": "causal_lm", "source": "file", "path": str(args.data), "max_length": args.length,
                 "max_test_samples": 8},
        "model": {"backbone": args.backbone_path, "dtype": dtype, "quantization": quantization},
        "method": {"name": args.method, "lora": {"r": 16, "alpha": 32, "target_modules": ["all-linear"]}},
        "partition": {"scheme": "iid", "num_clients": args.clients, "min_size": 1},
        "train": {"rounds": args.rounds, "clients_per_round": args.clients, "local_steps": args.steps,
                  "batch_size": args.batch, "lr": 1e-4, "cohort_size": cohort_size},
        "eval": {"every": args.rounds, "local": False, "generation": {"samples": 1, "max_new_tokens": 4}},
        "checkpoint": False,
    })  # fmt: skip


def child(name: str, args, out: Path) -> None:
    """One contender's run, in this process (``--child``)."""
    if name == "flower-sim":
        import torch
        from vs_flower_sim import run_flower_sim

        share = 1 / args.workers if torch.cuda.is_available() else 0.0
        run_flower_sim(job_config(args, out, 1), args.workers, gpus_per_client=share)
    else:
        from fedpeft.experiment import run

        run(job_config(args, out, "auto" if name == "fedpeft-auto" else 1))


class DeviceMemory:
    """The peak memory of a process tree's run: the GPU's used memory above its level at
    the start (``nvidia-smi``), or the tree's resident memory on a CPU."""

    def __init__(self, gpu: bool):
        self.gpu, self.peak = gpu, 0
        self.base = self.used() if gpu else 0

    @staticmethod
    def smi(field: str) -> int:
        """``nvidia-smi``'s ``memory.used`` or ``memory.total`` of the first GPU, in bytes."""
        query = ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"]
        return int(subprocess.run(query, capture_output=True, text=True).stdout.split()[0]) * 2**20

    @classmethod
    def total(cls, gpu: bool) -> int:
        """The device's memory: the GPU's, or this machine's RAM."""
        return cls.smi("memory.total") if gpu else psutil.virtual_memory().total

    def used(self, proc: psutil.Process | None = None) -> int:
        if self.gpu:
            return self.smi("memory.used")
        total = 0
        for p in [proc, *proc.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
                total += p.memory_info().rss
        return total

    def sample(self, proc: psutil.Process) -> None:
        self.peak = max(self.peak, self.used(proc) - self.base)


def measure(name: str, argv: list[str], out: Path, gpu: bool) -> dict:
    """``name``'s run in a fresh process: its records' training tokens and time, its wall
    time and peak memory."""
    from fedpeft.report.results import read_records

    memory = DeviceMemory(gpu)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--out", str(out), *argv])
    tree = psutil.Process(proc.pid)
    while proc.poll() is None:
        memory.sample(tree)
        time.sleep(0.2)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed with exit code {proc.returncode}")
    records = read_records(out)
    tokens = sum(r["fit"]["tokens"] * len(r["clients"]) for r in records)
    train = sum(r["time_train"] for r in records)
    setup = records[0].get("setup", {})
    return {"name": name, "tokens_s": tokens / train, "wall": wall, "peak": memory.peak,
            "cohort": setup.get("cohort_size"), "mode": setup.get("cohort_mode")}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backbone", default="random-1b", help="random-1b, bundled-smollm2 or a path")
    ap.add_argument("--method", default="fedlr", help="the method trained (its lora: r 16, every linear)")
    ap.add_argument("--precision", choices=PRECISIONS, default="bf16")
    ap.add_argument("--length", type=int, default=512, help="tokens a row (about)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1, help="Flower's clients at once (a GPU share each)")
    ap.add_argument("--only", default=",".join(CONTENDERS))
    ap.add_argument("--work", type=Path, default=Path("benchmarks/results/decoders"))
    ap.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.backbone_path = backbone_path(args)
    if args.child:
        child(args.child, args, args.out)
        return
    import torch

    gpu = torch.cuda.is_available()
    root = Path(tempfile.mkdtemp(prefix="decoders-vs-flower-"))
    rows_needed = (
        args.clients * args.steps * args.batch * 2 + 16
    )  # a client's rows for its steps, and a test set
    args.data = write_rows(root / "rows.jsonl", rows_needed, max(2, args.length // 2))
    argv = [f"--backbone={args.backbone}", f"--method={args.method}", f"--precision={args.precision}",
            f"--length={args.length}",
            f"--clients={args.clients}", f"--rounds={args.rounds}", f"--steps={args.steps}",
            f"--batch={args.batch}", f"--workers={args.workers}", f"--work={args.work}",
            f"--data={args.data}"]  # fmt: skip
    results, failures = [], []
    for name in args.only.split(","):  # one contender's failure does not cost the others theirs
        try:
            results.append(measure(name, argv, root / name, gpu))
        except RuntimeError as err:
            failures.append(str(err))
            continue
        print(results[-1], flush=True)
    where = torch.cuda.get_device_name() if gpu else "CPU"
    total = DeviceMemory.total(gpu)
    print(f"\n{where} ({total / 2**20:,.0f} MiB); {args.backbone} {args.precision}, {args.method}, LoRA r 16 "
          f"on every linear; {args.clients} clients a round x {args.steps} steps x {args.batch} rows of "
          f"~{args.length} tokens, {args.rounds} rounds; Flower: {args.workers} at once\n")  # fmt: skip
    print("| contender | training tokens/s | end to end (s) | peak memory (MiB) | of the device's | cohort |")
    print("|---|---|---|---|---|---|")
    for r in results:
        cohort = "-" if r["cohort"] is None else f"{r['cohort']:.0f}" + (f" {r['mode']}" if r["mode"] else "")
        print(f"| {r['name']} | {r['tokens_s']:,.0f} | {r['wall']:.1f} | {r['peak'] / 2**20:,.0f} "
              f"| {r['peak'] / total:.2f} | {cohort} |")  # fmt: skip
    by_name = {r["name"]: r for r in results}
    if "flower-sim" in by_name and "fedpeft-auto" in by_name:
        ratio = by_name["fedpeft-auto"]["tokens_s"] / by_name["flower-sim"]["tokens_s"]
        print(
            f"\nfedpeft (cohort_size auto) / Flower's simulation: {ratio:.2f}x training tokens/s (goal >= 2x)"
        )
    shutil.rmtree(root, ignore_errors=True)
    if failures:
        raise SystemExit("; ".join(failures))


if __name__ == "__main__":
    main()
