"""``flower-supernode``, asking the SuperLink for messages more often than every 3 s and
starting its ClientApps warm.

Flower 1.41's SuperNode waits a fixed 3 s whenever the SuperLink has no message for it,
and 0.5 s at a time for its ClientApp's reply: a message sent just after a poll waits up
to 3 s before the node sees it, twice a round (training, then evaluation), and its reply
another half second. This entry point runs Flower's own SuperNode with those waits cut
to ``FEDPEFT_NODE_POLL`` seconds (default :data:`DEFAULT_POLL`); its command line is
``flower-supernode``'s. Each poll is one small HTTP request to the SuperLink. The
SuperExec it starts is :mod:`fedpeft.flower.superexec` (a ClientApp process per message
forked with Flower already imported) rather than ``flower-superexec``.

    python -m fedpeft.flower.supernode --superlink HOST:PORT ...   (flower-supernode's flags)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

from flwr.supernode import start_client_internal
from flwr.supernode.cli import flower_supernode

DEFAULT_POLL = 0.25  # seconds
POLL_ENV = "FEDPEFT_NODE_POLL"


def poll_interval() -> float:
    raw = os.environ.get(POLL_ENV, str(DEFAULT_POLL))
    try:
        poll = float(raw)
    except ValueError:
        poll = -1.0
    if not 0.01 <= poll <= 3:
        raise SystemExit(f"{POLL_ENV}={raw!r}: seconds between 0.01 and 3 expected")
    return poll


def shorten_waits(poll: float) -> None:
    """Give Flower's SuperNode loop a ``time`` whose ``sleep`` lasts at most ``poll`` s
    (its waits are all polls: for a message, for a reply, for an object)."""
    if start_client_internal.time is not time:  # a Flower that no longer sleeps this way
        return
    functions = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    functions["sleep"] = lambda seconds: time.sleep(min(seconds, poll))
    start_client_internal.time = SimpleNamespace(**functions)


def _popen(args, **kwargs):
    """``subprocess.Popen``, with ``flower-superexec`` run as fedpeft's."""
    if args and os.path.basename(str(args[0])) == "flower-superexec":
        args = [sys.executable, "-m", "fedpeft.flower.superexec", *args[1:]]
    return subprocess.Popen(args, **kwargs)


def start_superexec_warm() -> None:
    """Have the SuperNode start :mod:`fedpeft.flower.superexec` as its SuperExec."""
    if start_client_internal.subprocess is subprocess:  # else a Flower that starts it otherwise
        start_client_internal.subprocess = SimpleNamespace(Popen=_popen)


def main() -> None:
    shorten_waits(poll_interval())
    start_superexec_warm()
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
