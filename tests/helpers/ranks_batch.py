"""Several ``fedpeft run CONFIG`` in one set of ranks: run by torch's launcher, one process a
rank, e.g. ``python -m torch.distributed.run --standalone --nproc-per-node 2
tests/helpers/ranks_batch.py A.yaml B.yaml ...`` (:func:`launch_batch`).

Each rank runs the command ``fedpeft run CONFIG`` (the CLI, as a rank that a launcher
started runs it) for each config in turn, in the one process group the first run joins
(``fedpeft.engines.distributed.joined`` keeps a group already joined), so that a batch of
configs pays once for starting the ranks and importing torch. After each config a rank
writes ``CONFIG`` with the suffix ``.rank<R>`` (:func:`status_path`): empty when the run
finished, else why it did not. A rank whose run fails leaves at once (exit 1) and the
launcher stops the other ranks, which may be waiting for it in a collective; the configs
after it are then not run (:func:`launch_batch` starts the ranks again for them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path


def status_path(config: Path, rank: int) -> Path:
    """Where rank ``rank`` says how its run of ``config`` ended."""
    return config.with_suffix(f".rank{rank}")


def outcome(config: Path, world: int) -> str | None:
    """How ``config``'s run ended over ``world`` ranks: "" when every rank finished it, the
    first rank's reason when one failed, None when no rank failed but some did not finish."""
    said = [p.read_text() if p.is_file() else None for p in (status_path(config, r) for r in range(world))]
    if failed := [f"rank {r}: {why}" for r, why in enumerate(said) if why]:
        return "; ".join(failed)
    return "" if all(why == "" for why in said) else None


def launch_batch(configs: list[Path], nproc: int = 2, timeout: float = 1800) -> dict[Path, str]:
    """Run every config of ``configs`` over ``nproc`` local ranks, in as few launches as
    their failures allow; for each config "" when it finished on every rank, else why not
    (a failed or hung run names the launch's output's tail). After a failure the ranks are
    started again for the configs after it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results: dict[Path, str] = {}
    todo = list(configs)
    while todo:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={nproc}", __file__, *map(str, todo)]  # fmt: skip
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
            output, code = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as err:
            output, code = f"timed out after {timeout:.0f}s: {err.stdout or ''}{err.stderr or ''}", None
        while todo and (said := outcome(todo[0], nproc)) == "":
            results[todo.pop(0)] = ""
        if not todo:
            break
        # the first config not finished on every rank: what stopped the launch (or never
        # reached where the launch failed before any run, e.g. at the rendezvous)
        why = said or f"not finished (launcher exit {code})"
        errors = "".join(f"{line}\n" for line in output.splitlines() if line.startswith("error:"))
        results[todo.pop(0)] = f"{why}\n{errors}--- the launch's output, its tail:\n{output[-3000:]}"
    return results


def main(configs: list[str]) -> None:
    from fedpeft.cli import app

    rank = int(os.environ["RANK"])
    for config in map(Path, configs):
        try:
            app(["run", str(config)], prog_name="fedpeft")
            code = 0
        except SystemExit as err:  # the CLI leaves through sys.exit, 0 when the run finished
            code = err.code if isinstance(err.code, int) else 1
        except BaseException:  # noqa: BLE001 -- said in the status file, then this rank stops
            status_path(config, rank).write_text(traceback.format_exc())
            sys.stdout.flush()
            os._exit(1)
        status_path(config, rank).write_text("" if code == 0 else f"fedpeft run exited {code}")
        if code:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # another rank may wait for this one in a collective: the launcher ends it


if __name__ == "__main__":
    main(sys.argv[1:])
