"""``fedpeft run --nproc N``: N local ranks started by torch's elastic launcher (torchrun).

The launcher starts ``python -m fedpeft run ...`` N times with the rank's place in its
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, the rendezvous); each joins the
process group as it starts (:func:`fedpeft.engines.distributed.joined`). Across machines, run
``torchrun`` yourself: ``torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d
--rdzv-endpoint HOST:PORT -m fedpeft run CONFIG`` on each.
"""

from __future__ import annotations

import os

#: set by torch's elastic agent in each rank: how many times it restarted the ranks
RESTARTS = "TORCHELASTIC_RESTART_COUNT"


def launched() -> bool:
    """Whether this process is one of several ranks a launcher started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def restarted() -> bool:
    """Whether the launcher restarted the ranks after one failed (they then resume)."""
    return int(os.environ.get(RESTARTS, "0")) > 0


def launch(nproc: int, max_restarts: int, args: list[str]) -> str | None:
    """Run ``fedpeft <args>`` as ``nproc`` local ranks, restarting them up to
    ``max_restarts`` times after a failure; None when every rank finished, else one line
    naming the rank that failed and how."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    launcher = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            "-m",
            "fedpeft",
            *args,
        ]
    )
    try:
        run(launcher)
    except ChildFailedError as err:
        rank, first = err.get_first_failure()
        how = f"exit code {first.exitcode}" if first.exitcode >= 0 else f"killed by signal {-first.exitcode}"
        return f"rank {rank} failed ({how}) after {max_restarts} restart(s)"
    return None
