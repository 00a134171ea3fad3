"""``flower-superexec``, whose ClientApp processes start with Flower already imported.

Flower 1.41's SuperExec runs every message a node receives in a new ``flwr-clientapp``
process, and each of those spends about 2 s importing Flower before it asks its SuperNode
for the message (twice a round: training, then evaluation). This entry point runs Flower's
own SuperExec, but starts those processes from a fork server (:mod:`multiprocessing`'s
``forkserver``) that imported Flower's ClientApp runtime and fedpeft's relay once: a
message's process is a fork of it, running ``flwr-clientapp``'s own ``main`` with the same
command line. Any other command the SuperExec starts is started as before.

    python -m fedpeft.flower.superexec ...   (flower-superexec's flags)

The fork server is a child of the SuperExec and exits with it; a ClientApp process's
parent is the fork server (fedpeft's relay hands its node's worker that process to watch).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from types import SimpleNamespace

from flwr.supercore.cli import flower_superexec
from flwr.supercore.superexec.executor import subprocess_executor

from fedpeft.flower.relay import FORKED_CLIENTAPP

CLIENTAPP = "flwr-clientapp"
# what every ClientApp process needs, imported once by the fork server; this module too,
# which a forked process runs again as multiprocessing's main (its imports then all cached)
PRELOAD = [
    "flwr.supernode.cli",
    "flwr.supernode.runtime.run_clientapp",
    "fedpeft.flower.relay",
    "fedpeft.flower.superexec",
]


def _run_clientapp(argv: list[str], quiet: bool) -> None:
    """A forked ClientApp process: ``flwr-clientapp`` with ``argv`` as its command line."""
    if quiet:  # what Popen(stdout=DEVNULL, stderr=DEVNULL) would have done
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    from flwr.supernode.cli import flwr_clientapp

    sys.argv = argv
    flwr_clientapp()


class WarmStarts:
    """``Popen`` for Flower's SubprocessExecutor: a ClientApp is forked from the fork
    server, every other command started as ``subprocess.Popen`` would."""

    def __init__(self) -> None:
        self._forks = multiprocessing.get_context("forkserver")
        self._forks.set_forkserver_preload(PRELOAD)

    def Popen(self, args, **kwargs):  # noqa: N802 (subprocess's name)
        if os.path.basename(str(args[0])) != CLIENTAPP:
            return subprocess.Popen(args, **kwargs)
        multiprocessing.active_children()  # reaps the processes of earlier messages
        quiet = kwargs.get("stdout") is subprocess.DEVNULL
        # daemonic: ends with the SuperExec, as Flower's ClientApp ends with its parent
        process = self._forks.Process(
            target=_run_clientapp, args=(list(args), quiet), name=FORKED_CLIENTAPP, daemon=True
        )
        process.start()
        return process


def start_clientapps_warm() -> bool:
    """Make Flower's SubprocessExecutor start ClientApps from the fork server; False (and
    Flower's own way kept) where this Flower no longer starts them with ``subprocess``."""
    if getattr(subprocess_executor, "subprocess", None) is not subprocess:
        return False
    subprocess_executor.subprocess = SimpleNamespace(Popen=WarmStarts().Popen, DEVNULL=subprocess.DEVNULL)
    return True


def main() -> None:
    start_clientapps_warm()
    sys.argv[0] = "flower-superexec"
    flower_superexec()


if __name__ == "__main__":
    main()
