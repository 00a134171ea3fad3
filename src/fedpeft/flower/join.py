"""``fedpeft join``: one client's SuperNode, kept joined while a SuperLink is there.

On its own, ``flower-supernode`` retries an unreachable SuperLink forever, printing only
"Connection attempt failed", and dies with a 401 traceback when the SuperLink it reaches
was restarted (a new SuperLink does not know the node). :func:`run_node` runs it as a
child and:

1. checks the address first (:func:`~fedpeft.flower.connect.wait_for_superlink`): a lasting
   problem (TLS against ``--insecure``, a CA that does not vouch for the certificate) ends
   the command at once, nothing listening is retried for up to ``max_wait`` seconds, and
   either way the one line says the address and the cause;
2. echoes the node's output (all of it also goes to ``STATE_DIR/supernode.log``) without
   the retry chatter and the 401 traceback;
3. watches the SuperLink while the node runs: unreachable for ``max_wait`` seconds, the
   node is stopped with one line that says so;
4. when the node stops because the SuperLink no longer knows it (``fedpeft serve`` without
   ``--superlink`` starts a new SuperLink for every run), starts a new one for the same
   client and state directory: the node outlives runs, as long as the next run starts
   within ``max_wait`` seconds of the last;
5. when another program took the node's local port between choosing and binding it
   (several nodes started at once on one machine), starts it again on a new port (a port
   the user chose with --port is not retried: the error names it).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from fedpeft.flower import connect, processes
from fedpeft.flower.deploy import stop
from fedpeft.flower.tls import DeployError, Tls

WATCH_SECONDS = 2.0  # how often a running node's SuperLink is checked
QUICK_EXIT_SECONDS = 30.0  # a node that stops sooner than this after starting stopped "at once"
MAX_QUICK_EXITS = 3  # rejoins in a row that stop at once before giving up
MAX_PORT_TRIES = 3  # starts in a row whose local port was taken before giving up
PORT_TAKEN = "address already in use"
NOT_ADMITTED = "Failed to activate SuperNode"  # Flower's words when the SuperLink does not admit a node
ADMITTED = "SuperNode ID:"  # Flower's line once the SuperLink admitted the node
#: A node the SuperLink does not admit is retried this long (at most --max-wait) before it
#: gives up: its operator may still be enrolling the keys (`fedpeft superlink --enrolled`
#: and `fedpeft serve --enrolled` enrol them once the SuperLink answers, and a node, or a
#: rejoining one, may come up first). Admitted again, the count starts afresh.
REFUSAL_GRACE = 60.0
REFUSAL_RETRY_SECONDS = 3.0
EXIT_CODE, EXIT_END = (
    "Exit Code:",
    "For more information, visit",
)  # Flower's exit message, first and last line
RETRY_CHATTER = "Connection attempt failed"
# a log record of Flower (coloured level, then ":") or of uvicorn ("INFO:     ...")
LOG_LINE = re.compile(r"^(\x1b\[[0-9;]*m)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b[^:]*:")
# a traceback's last line: the exception, e.g. "httpx.HTTPStatusError: ..." or "KeyboardInterrupt"
EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?::\s|:?$)")
TRACEBACK_HEADS = (
    "Traceback (most recent call last):",
    "Exception in thread",
    "Exception ignored in",
    "During handling of the above exception",
    "The above exception was the direct cause",
)


class Echo:
    """The node's output for the terminal: everything goes to the log file; Flower's retry
    chatter, the tracebacks of a node the SuperLink forgot (401) and its exit noise do not
    reach the terminal (the supervisor says what happened in one line instead). Log lines
    other threads print in the middle of a traceback are told apart from it, and so are the
    halves of a traceback line another thread's output split (Python writes a traceback in
    pieces): a traceback ends at its exception's line only."""

    def __init__(self, out: IO[str], log: IO[str]):
        self.out, self.log = out, log
        self.block: list[str] = []  # a traceback being read
        self.forgotten = False  # the SuperLink answered 401: it does not know this node
        self.after_swallowed = False  # just after a hidden traceback (its notes, chained ones)
        self.port_taken = False  # the node could not bind its local port
        self.refused = False  # the SuperLink would not admit the node (its key is not enrolled)
        self.admitted = False  # the SuperLink admitted the node (it has a node id)
        self.exit_block: list[str] | None = None  # Flower's exit message being read ("Exit Code: N" ...)

    def feed(self, line: str) -> None:
        self.log.write(line)
        self.log.flush()
        if PORT_TAKEN in line.lower():
            self.port_taken = True
        if NOT_ADMITTED in line:
            self.refused = True
        if ADMITTED in line:
            self.admitted = True
        if self.exit_block is not None or (LOG_LINE.match(line.lstrip()) and EXIT_CODE in line):
            self._exit_message(line)
            return
        if LOG_LINE.match(line.lstrip()):  # a log record, even in the middle of a traceback
            if RETRY_CHATTER not in line:
                self._write(line.lstrip())
            return
        if self.block:
            self.block.append(line)
            if EXCEPTION_LINE.match(line):
                self._end_block(line)
            return
        if line.startswith(TRACEBACK_HEADS):
            self.block = [line]
            return
        if self.after_swallowed and (not line.strip() or line.startswith("For more information check")):
            return  # httpx's second line of the 401 message, blank lines between tracebacks
        self.after_swallowed = False
        if "401 Unauthorized" in line:
            self.forgotten = True
        self._write(line)

    def _exit_message(self, line: str) -> None:
        """Flower's exit message (its code, what failed, a link) is held until its end: a
        refusal to admit the node is left to the supervisor's one line, any other shown."""
        block = [*(self.exit_block or []), line]
        self.exit_block = block
        if line.startswith(EXIT_END) or len(block) > 20:
            self.exit_block = None
            if not any(NOT_ADMITTED in b for b in block):
                self._write("".join(block))

    def _end_block(self, last: str) -> None:
        text, self.block = "".join(self.block), []
        chained = text.startswith(("During handling", "The above exception"))
        if "401 Unauthorized" in text:
            self.forgotten = True
        exiting = last.startswith(("SystemExit: 0", "KeyboardInterrupt"))
        if "401 Unauthorized" in text or (chained and self.after_swallowed) or exiting:
            self.after_swallowed = True  # Flower stopping itself: the supervisor says why
        else:
            self.after_swallowed = False
            self._write(text)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def close(self) -> None:
        if self.exit_block and not any(NOT_ADMITTED in b for b in self.exit_block):
            self._write("".join(self.exit_block))
        self.exit_block = None
        if self.block:
            self._write("".join(self.block))
            self.block = []


def _pump(stream: IO[bytes], echo: Echo) -> None:
    with contextlib.suppress(ValueError):  # the log closed under a straggling app process
        for raw in iter(stream.readline, b""):
            echo.feed(raw.decode(errors="replace"))


def run_node(
    command: Callable[[], list[str]],
    env: dict[str, str],
    address: str,
    tls: Tls | None,
    *,
    cid: int,
    max_wait: float,
    log_path: Path,
    fixed_port: int | None = None,
    say: Callable[[str], None] = print,
    out: IO[str] = sys.stdout,
) -> None:
    """Keep client ``cid``'s SuperNode (``command()``: its command line, asked afresh for
    every start) joined to the SuperLink at ``address`` until stopped (KeyboardInterrupt)
    or until :class:`DeployError`, whose message is the one line to show. ``fixed_port``:
    the local port the user chose (``--port``); taken, it is not retried."""
    quick_exits = port_tries = 0
    refused_since: float | None = None  # when the SuperLink started refusing the node
    while True:
        connect.wait_for_superlink(address, tls, max_wait, say)
        say(f"client {cid}: joining the SuperLink at {address} (node log: {log_path})")
        started = time.monotonic()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a") as log:
            echo = Echo(out, log)
            proc = processes.popen(command(), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            reader = threading.Thread(target=_pump, args=(proc.stdout, echo), daemon=True)
            reader.start()
            try:
                _watch(proc, address, tls, max_wait, say)
            finally:
                if proc.poll() is None:
                    stop(proc)
                reader.join(10)
                proc.stdout.close()
                echo.close()
        # the node stopped by itself
        if echo.port_taken:  # another program took its port between choosing and binding it
            port_tries += 1
            if fixed_port is not None:
                raise DeployError(
                    f"flower-supernode could not bind its local port {fixed_port} (--port): address "
                    f"already in use (log: {log_path}); pass another, or leave --port out"
                )
            if port_tries >= MAX_PORT_TRIES:
                raise DeployError(
                    f"flower-supernode could not bind its local port, {port_tries} times in a row: "
                    f"address already in use (log: {log_path}); pass a free one with --port"
                )
            say(f"client {cid}: the node's local port was taken meanwhile; starting it on another")
            continue
        port_tries = 0
        if echo.admitted:
            refused_since = None
        if echo.refused:  # not enrolled (yet?), or revoked: retried a while, then the one line
            grace = min(REFUSAL_GRACE, max_wait)
            if refused_since is None:
                refused_since = time.monotonic()
                say(f"client {cid}: the SuperLink does not admit this node; retrying for up to {grace:g} s")
            if time.monotonic() - refused_since < grace:
                time.sleep(REFUSAL_RETRY_SECONDS)
                continue
            raise DeployError(
                f"the SuperLink at {address} refused this node: it admits enrolled nodes only, and this "
                "node's key is not enrolled there (never enrolled, or revoked; without --key the node has "
                f"none). Its operator enrols the public key with `fedpeft enrol KEY.pub` (log: {log_path})"
            )
        if not (echo.forgotten or proc.returncode == 0):
            raise DeployError(f"flower-supernode exited with code {proc.returncode} (log: {log_path})")
        quick_exits = quick_exits + 1 if time.monotonic() - started < QUICK_EXIT_SECONDS else 0
        if quick_exits >= MAX_QUICK_EXITS:
            raise DeployError(
                f"flower-supernode stopped right after joining {address}, {quick_exits} times in a "
                f"row (log: {log_path})"
            )
        say(
            f"client {cid}: the SuperLink at {address} no longer knows this node (it was restarted, "
            "e.g. by a new `fedpeft serve`); rejoining"
        )


def _watch(proc: subprocess.Popen, address: str, tls: Tls | None, max_wait: float, say) -> None:
    """Return when ``proc`` ends; :class:`DeployError` once the SuperLink has not answered
    for ``max_wait`` seconds (the caller stops the node)."""
    lost_since: float | None = None
    while proc.poll() is None:
        time.sleep(WATCH_SECONDS)
        if proc.poll() is not None:
            return
        problem = connect.probe(address, tls)
        if problem is None:
            if lost_since is not None:
                say(f"the SuperLink at {address} answers again")
            lost_since = None
            continue
        now = time.monotonic()
        if lost_since is None:
            lost_since = now
            say(f"lost the SuperLink at {address}: {problem.why}; waiting up to {max_wait:g} s (--max-wait)")
        elif now - lost_since >= max_wait:
            raise DeployError(
                f"lost the SuperLink at {address} for {max_wait:g} s (--max-wait): {problem.why}. "
                "`fedpeft serve` without --superlink stops its SuperLink when its run ends; to keep "
                "nodes up across runs, start one with `fedpeft superlink` and submit runs to it with "
                "`fedpeft serve CONFIG --superlink HOST:PORT`"
            )
