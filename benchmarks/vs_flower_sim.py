"""fedpeft's in-process engine versus Flower's own simulation engine (Ray), same job.

One FedLR job (bundled MiniLM + LoRA, the same clients, local steps, batch and
evaluation) run three ways, each in a fresh Python process so that end-to-end time
includes imports and set-up and peak memory is that process tree's alone:

- ``plain``: a plain training loop: the same model, data, optimizer steps on the very
  same mini-batches and the same evaluations, with nothing federated around them;
- ``fedpeft``: ``fedpeft.experiment.run`` (the in-process engine);
- ``flower-sim``: fedpeft's ServerApp/ClientApp on ``flwr.simulation.run_simulation``
  (Ray backend, one virtual SuperNode per client).

Printed: end-to-end wall time, steady-round time (median over rounds 2..R of each
round's train + aggregate + evaluate time) and peak resident memory (summed over the
process tree, sampled every 0.1 s), with ratios to the plain loop. Target: fedpeft end
to end at most 1.1x the plain loop.

    .venv/bin/python benchmarks/vs_flower_sim.py [--clients 4] [--rounds 4] [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

CONTENDERS = ("plain", "fedpeft", "flower-sim")


def job_config(args, out: Path, name: str = "vs-flower-sim"):
    """The FedLR job both sides run (``benchmarks/distributed.py`` runs it too, named its own)."""
    from fedpeft.config import load_config

    return load_config(None, {
        "name": name,
        "method": {"name": "fedlr"},
        "output_dir": str(out),
        "data.max_samples": args.samples,
        "data.max_test_samples": 500,
        "partition": {"scheme": "dirichlet", "num_clients": args.clients, "alpha": 0.5},
        "train": {"rounds": args.rounds, "clients_per_round": args.clients, "local_steps": args.steps,
                  "batch_size": args.batch, "threads": args.threads},
        "eval.every": 1,
        "checkpoint": False,
    })  # fmt: skip


# ---------------------------------------------------------------- the three contenders
def run_plain(cfg) -> list[float]:
    """The same steps and evaluations as the engine, as one plain loop."""
    import torch
    from plain_loop import plain_optimizer, plain_steps

    from fedpeft.data.task import take_steps
    from fedpeft.engines.inprocess import derive_seed, sample_clients
    from fedpeft.experiment import build
    from fedpeft.metrics.classification import predict, scores

    setup = build(cfg)
    model, train = setup.model, cfg.train
    opt, params = plain_optimizer(model, train.lr)
    times = []
    for rnd in range(1, train.rounds + 1):
        t0 = time.perf_counter()
        for cid in sample_clients(cfg.seed, rnd, len(setup.clients), train.clients_per_round):
            seed = derive_seed(cfg.seed, rnd, cid)
            torch.manual_seed(seed)
            batches = take_steps(setup.clients[cid].train, train.batch_size, train.local_steps,
                                 torch.Generator().manual_seed(seed))  # fmt: skip
            plain_steps(model, batches, opt, params, train.max_grad_norm)
        bs = cfg.eval.batch_size
        scores(predict(model, setup.global_test, bs), setup.global_test.labels.cpu().numpy())
        for client in setup.clients:
            scores(predict(model, client.test, bs), client.test.labels.cpu().numpy())
        times.append(time.perf_counter() - t0)
    return times


def run_fedpeft(cfg) -> list[float]:
    from fedpeft.experiment import run

    run(cfg)
    return round_times(cfg.output_dir)


def run_flower_sim(cfg, workers: int = 2, gpus_per_client: float = 0.0) -> list[float]:
    """fedpeft's apps on Flower's simulation runtime, ``workers`` clients at once (Ray
    workers of one CPU each, and ``gpus_per_client`` of a GPU each where there is one).
    ``run_simulation`` takes no run config, so thin wrappers hand each app the experiment
    (and each node a state dir)."""
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedpeft.config import dump_config
    from fedpeft.flower import apps

    experiment = dump_config(cfg)
    state_root = str(Path(cfg.output_dir) / "nodes")
    server, client = ServerApp(), ClientApp()

    def with_experiment(context: Context, **node_config) -> Context:
        return Context(context.run_id, context.node_id, {**context.node_config, **node_config},
                       context.state, {"experiment": experiment})  # fmt: skip

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        apps.server_app(grid, with_experiment(context))

    def forward(msg: Message, context: Context) -> Message:
        state_dir = f"{state_root}/{context.node_config['partition-id']}"
        return apps.client_app(msg, with_experiment(context, **{"state-dir": state_dir}))

    client.train()(forward)
    client.evaluate()(forward)
    client.query()(forward)
    run_simulation(
        server,
        client,
        num_supernodes=cfg.partition.num_clients,
        backend_config={
            "client_resources": {"num_cpus": 1, **({"num_gpus": gpus_per_client} if gpus_per_client else {})},
            "init_args": {"num_cpus": workers, "include_dashboard": False},
        },
    )
    return round_times(cfg.output_dir)


def round_times(out) -> list[float]:
    from fedpeft.report.results import read_records

    return [r["time_train"] + r["time_aggregate"] + r["time_eval"] for r in read_records(Path(out))]


def child(name: str, args, out: Path) -> None:
    cfg = job_config(args, out)
    times = {"plain": run_plain, "fedpeft": run_fedpeft, "flower-sim": run_flower_sim}[name](cfg)
    (out / "times.json").write_text(json.dumps(times))


# ---------------------------------------------------------------- measuring
def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a process that ended meanwhile
            total += p.memory_info().rss
    return total


def measure(name: str, argv: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--out", str(out), *argv])
    ps, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps))
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed with exit code {proc.returncode}")
    rounds = json.loads((out / "times.json").read_text())
    return {"wall": wall, "steady": statistics.median(rounds[1:] or rounds), "rounds": rounds, "peak": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=",".join(CONTENDERS))
    ap.add_argument("--child", choices=CONTENDERS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.child, args, args.out)
        return
    argv = [f"--clients={args.clients}", f"--rounds={args.rounds}", f"--steps={args.steps}",
            f"--batch={args.batch}", f"--samples={args.samples}", f"--threads={args.threads}"]  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="vs-flower-sim-"))
    results = {}
    for name in args.only.split(","):
        results[name] = measure(name, argv, root / name)
        r = results[name]
        print(f"{name}: {r['wall']:.1f} s end to end, rounds {' '.join(f'{t:.1f}' for t in r['rounds'])} s, "
              f"peak {r['peak'] / 2**20:.0f} MiB", flush=True)  # fmt: skip
    print(f"\nFedLR, bundled MiniLM, {args.clients} clients x {args.steps} steps x batch {args.batch}, "
          f"{args.rounds} rounds, torch threads {args.threads}, {psutil.cpu_count()} cores\n")  # fmt: skip
    base = results.get("plain")
    print("| | end to end (s) | steady round (s) | peak memory (MiB) | end to end / plain | round / plain |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ratios = (
            ("-", "-")
            if base is None
            else (f"{r['wall'] / base['wall']:.2f}x", f"{r['steady'] / base['steady']:.2f}x")
        )
        cells = [f"{r['wall']:.1f}", f"{r['steady']:.2f}", f"{r['peak'] / 2**20:.0f}", *ratios]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if base is not None and "fedpeft" in results:
        ratio = results["fedpeft"]["wall"] / base["wall"]
        print(f"\nfedpeft end to end / plain loop: {ratio:.2f}x (target <= 1.1x)")


if __name__ == "__main__":
    main()
