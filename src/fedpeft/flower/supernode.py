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

With TLS (``--root-certificates CA``) the node also runs **only apps its operator signed**
(:func:`run_signed_apps_only`): before a run's first message is handed to any code, the
run's app must be a fedpeft app (no code of its own, fedpeft's components) whose run
config the operator signed with a certificate that CA issued
(:func:`fedpeft.flower.operator.check_app`), and the run may not override that config.
Any other run gets an error reply for each of its messages and runs nothing here.

    python -m fedpeft.flower.supernode --superlink HOST:PORT ...   (flower-supernode's flags)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from logging import ERROR
from pathlib import Path
from types import SimpleNamespace

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode
from flwr.supercore import log
from flwr.supernode import start_client_internal
from flwr.supernode.cli import flower_supernode

from fedpeft.flower.operator import Untrusted, check_app, load_ca
from fedpeft.flower.tls import flag_value

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


def run_signed_apps_only(ca_path: str | None) -> None:
    """Have the SuperNode refuse every run whose app the operator of the deployment whose
    CA is ``ca_path`` did not sign (nothing to check against without TLS). Flower hands
    its pull step the functions that fetch a run and its app: they are wrapped so that an
    unsigned app, or a run that overrides the signed config, is refused before Flower
    stores it, and the message is answered with an error (the server drops that client)."""
    if ca_path is None:
        return
    ca = load_ca(Path(ca_path))
    pull = start_client_internal._pull_and_store_message

    def checked_pull(*, receive, get_run, get_fab, state, object_store, **rest):
        received: list = []

        def receiving():
            got = receive()
            received[:] = [] if got is None else [got[0]]
            return got

        def checked_run(run_id):
            run = get_run(run_id)
            if run.override_config:
                overridden = sorted(run.override_config)[:3]
                raise Untrusted(f"the run overrides its signed run config ({overridden})")
            return run

        def checked_fab(fab_hash, run_id):
            fab = get_fab(fab_hash, run_id)
            check_app(fab.content, ca)
            return fab

        try:
            return pull(
                receive=receiving, get_run=checked_run, get_fab=checked_fab, state=state,
                object_store=object_store, **rest,
            )  # fmt: skip
        except Untrusted as err:
            if not received:
                raise
            message = received[0]
            why = f"fedpeft node: refused run {message.metadata.run_id}: {err}"
            log(ERROR, why)
            reply = Message(Error(ErrorCode.INVALID_FAB, why), reply_to=message)
            start_client_internal._insert_message(reply, state, object_store)
            return message.metadata.run_id

    start_client_internal._pull_and_store_message = checked_pull


def main() -> None:
    shorten_waits(poll_interval())
    start_superexec_warm()
    run_signed_apps_only(None if "--insecure" in sys.argv else flag_value(sys.argv, "--root-certificates"))
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
